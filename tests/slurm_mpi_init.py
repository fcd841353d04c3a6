"""One launch for test_slurm_e2e: FanStore's MPI start-up under srun, with a dirty heap.

Freed heap memory full of ';', newlines and random bytes is what a daemon has after its
imports; with the PyPI MPICH's default UCX netmod, MPI_Init under ``srun --mpi=pmi2``
then intermittently sends stale bytes in its PMI messages (see
fanstore.daemon.jobenv.choose_netmod). The launch must start, exchange a message and exit 0.
"""

import os
import random
import sys

junk = [os.urandom(random.randint(64, 8192)) + b";\n=cmd" for _ in range(20000)]
del junk

from fanstore.daemon.world import World  # noqa: E402

world = World.from_mpi()  # (with several ranks per node: grouped into nodes)
comm = world.MPI.COMM_WORLD
buf = bytearray(1 << 20)
if comm.Get_rank() == 0:
    buf[:] = b"\x07" * len(buf)
    comm.Send([buf, world.MPI.BYTE], dest=comm.Get_size() - 1)  # the other node
elif comm.Get_rank() == comm.Get_size() - 1:
    comm.Recv([buf, world.MPI.BYTE], source=0)
    if buf != b"\x07" * len(buf):
        sys.exit("wrong bytes")
comm.Barrier()
world.MPI.Finalize()
