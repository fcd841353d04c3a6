"""Per-node daemons: placement, staging, the peer protocol and its transports, the node.

The package has two layers, and imports only go from the second to the first:

- **Daemon services (no MPI)**: ``jobenv`` (what the launcher's environment says: node
  names, ranks grouped into nodes, the world size), ``placement`` (which nodes hold a
  partition), ``protocol`` (the peer messages' structs), ``pacing`` (how pollers sleep),
  ``transport`` (the ``Transport`` interface, its errors, the in-process
  ``LocalTransport``), ``routing`` (reads of other nodes' partitions with failover),
  ``peerwatch`` (probes of peers and the drain), ``replicas`` (how many copies fit),
  ``service`` (the control requests), ``staging``, ``stagecopy``, ``stagefetch``,
  ``stagecheck`` (the stage-in). None imports mpi4py or a module of the MPI world, not
  even inside a function, so all of them run and are tested in one process without
  mpiexec.
- **The MPI world**: ``world`` (MPI_Init, the communicators and their collectives; a world
  of one without MPI), ``mpitransport`` (the MPI ``Transport``), ``nodegroup`` (a node's
  leader and its worker ranks), ``mpipack`` (parallel pack), ``launcher`` (living with
  MPICH's hydra), and ``node`` (the node's life cycle, which wires the two layers).
  mpi4py is imported only inside functions, once MPI is to be initialised.
"""
