"""Per-node daemons over MPI: placement, staging, the peer protocol and its transport."""
