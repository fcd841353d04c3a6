"""Assemble a single-node daemon: store on disk -> chunk store -> FUSE mount."""

from __future__ import annotations

import logging
import os

from fanstore.errors import MountError
from fanstore.format.index import read_index
from fanstore.namespace import Namespace
from fanstore.store import Decoder, LocalPartitions

log = logging.getLogger(__name__)


def mount_local(store_path: str, mountpoint: str, options, on_ready=None):
    """Mount a store (all partitions read in place) at ``mountpoint``; blocks until unmounted."""
    from fanstore.asyncstore import ChunkStore
    from fanstore.fuse import mount as fmount

    fmount.prepare_mountpoint(mountpoint)
    index = read_index(store_path)
    ns = Namespace(index)
    decoder = Decoder(index)
    parts = LocalPartitions(store_path, index)
    store = ChunkStore(ns, decoder, parts, cache_bytes=options.cache_mb << 20,
                       threads=options.decode_threads())
    attach_prefetcher(store, options)
    options.store_path = os.path.abspath(store_path)
    log.info("serving %s (%d entries, %d partitions) at %s", store_path, index.n_entries,
             len(index.partitions), mountpoint)
    try:
        return fmount.run(ns, store, mountpoint, options, on_ready=on_ready)
    finally:
        parts.close()


def attach_prefetcher(store, options) -> None:
    """In prefetch mode, give the chunk store a prefetcher with the --prefetch-mb budget."""
    if options.mode == "prefetch":
        from fanstore.prefetch import Prefetcher

        store.prefetcher = Prefetcher(store, budget=options.prefetch_mb << 20,
                                      inflight=options.decode_threads())


def check_fuse_available() -> None:
    try:
        import pyfuse3  # noqa: F401
        import trio  # noqa: F401
    except ImportError as exc:
        raise MountError(
            f"FUSE support is not installed ({exc.name} missing): pip install 'fanstore[fuse]' "
            "(needs libfuse3-dev, fuse3 and pkg-config)"
        ) from None
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse does not exist: FUSE is not available on this machine")
