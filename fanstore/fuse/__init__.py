"""FUSE: the kernel's protocol and FanStore's two file-system frontends on top of it.

- :mod:`fanstore.fuse.engine`: the kernel's FUSE protocol spoken directly (mount, INIT,
  the opcode table, dispatch, replies, notifications, worker hand-off); it knows nothing of
  FanStore beyond its error types.
- :mod:`fanstore.fuse.kernelfs`: FanStore's multi-process frontend on that engine (the
  default): the request handler, the frontend process and its workers, the daemon's side,
  what it is started with (the node's share of the mount spec), counters, the chunk spill,
  prefetch mode.
- :mod:`fanstore.fuse.pyfuse3`: the frontend on libfuse through pyfuse3 and trio (one
  process; sync mode only).
- :mod:`fanstore.fuse.fsops`: the file-system logic both frontends share (lookups,
  attributes, listings, permissions), answered from the namespace.
"""
