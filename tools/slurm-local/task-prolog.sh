#!/bin/sh
# TaskProlog of the local test cluster (tools/slurm-local.sh): lines "export NAME=VALUE"
# printed here are set in every task's environment.
#
# The two emulated nodes are one host. MPICH (the PyPI wheel) places the shared memory of
# each node's ranks by what PMI says is a node, and with more than one rank per emulated
# node the two nodes' start-ups collide on the shared host: MPI_Init then hangs in 3-5 of 30
# launches of 2 nodes x 3 ranks (measured; 0 of 30 with 1 node x 6 ranks, and 0 of 30 with
# the setting below). Real nodes are separate hosts, so this is the emulation's problem,
# not FanStore's: ranks here talk through the network module (TCP on loopback) instead.
echo "export MPIR_CVAR_NOLOCAL=1"
