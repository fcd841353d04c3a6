"""FanStore's multi-process FUSE frontend on the protocol engine (:mod:`fanstore.fuse.engine`).

- :mod:`.handler`: ``KernelHandler``, FanStore's answers to FUSE requests (through
  :mod:`fanstore.fuse.fsops` and the read core);
- :mod:`.process`: the frontend process (``python -m fanstore.fuse.kernelfs.process``):
  mounts, answers INIT, forks its workers or lets a node's worker ranks join;
- :mod:`.frontend`: the daemon's side, ``KernelFrontend``, which starts and stops it;
- :mod:`.start`: ``FrontendStart``, what the frontend process is started with (the node's
  ``NodeShare`` of the mount spec, and its wiring to the daemon);
- :mod:`.stats`: the workers' counter columns by name;
- :mod:`.spill`: decoded chunks of partial reads pushed into the page cache;
- prefetch mode: :mod:`.orders` (the readers' orders, relayed to every worker),
  :mod:`.prefetcher` (each worker's prefetch thread), :mod:`.slab` (its share of the
  buffer for files the kernel would not take).
"""
