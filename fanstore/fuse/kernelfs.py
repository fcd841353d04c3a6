"""The kernel-protocol frontend: K worker processes serve the kernel's FUSE requests directly.

Process model (one node)::

    node daemon (MPI rank, or a world of one)      frontend process (never touches MPI)
    ─────────────────────────────────────────      ─────────────────────────────────────
    index, placement, staging, peers, control  ──▶ spawned fresh (``python -m``, exec'd:
    socket; read_stored for other nodes' chunks      nothing of MPI is inherited); loads the
                                                     index copy, mounts /dev/fuse, answers
                                                     INIT, forks K workers
                                                   worker 1..K: read requests from the same
                                                     connection, pread + decode this node's
                                                     chunks inline, ask the daemon's socket
                                                     for other nodes' chunks (NodeSource)

The daemon never forks after MPI_Init: it starts the frontend with ``subprocess`` (fork +
exec at once), and the frontend process, which never initialises MPI, forks the workers.
The frontend process and its workers die with the daemon (PR_SET_PDEATHSIG: SIGKILL of the
daemon leaves a stale mount that the next ``fanstore mount`` or ``umount`` cleans, exactly
as with the pyfuse3 frontend); SIGTERM to the frontend process unmounts and stops every
worker; an unmount from outside ends them all.

What the kernel is offered (see :mod:`fanstore.fuse.kernel`): zero-message open and opendir,
cached directory listings, readdirplus, cached symlinks, parallel directory operations,
max_pages so one READ covers a 1 MiB chunk, entry and attribute timeouts of 10^6 s (the
data never changes while mounted) and negative entries cached as long, no automatic data
invalidation: a file read once is served by the page cache with no request at all.

Counters: every worker counts its requests by opcode and its reads (local/remote reads,
bytes, decode time, cache hits, errors) in its own row of a shared table in the runtime
directory; the daemon sums the rows for ``fanstore stats``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from fanstore.errors import FanStoreError, MountError, NotFoundError
from fanstore.format.index import KIND_DIR, KIND_FILE
from fanstore.frontend import MountContext
from fanstore.fuse.fsops import BLKSIZE, TIMEOUT, FsOps
from fanstore.process import read_ready

log = logging.getLogger(__name__)

# fuse_attr: ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid
# gid rdev blksize flags (88 bytes); fuse_entry_out prefixes nodeid generation entry_valid
# attr_valid entry_valid_nsec attr_valid_nsec (40 bytes); fuse_attr_out prefixes attr_valid
# attr_valid_nsec dummy (16 bytes).
_ENTRY_OUT = struct.Struct("=QQQQII" + "QQQQQQIIIIIIIIII")
_ATTR_OUT = struct.Struct("=QII" + "QQQQQQIIIIIIIIII")

#: Reader counters kept in each worker's row of the shared table (after the engine's).
READ_COUNTERS = ("reads", "bytes_returned", "local_reads", "local_bytes", "remote_reads",
                 "remote_bytes", "refetched", "chunks_decoded", "errors", "decode_ns",
                 "cache_hits", "cache_misses", "cache_bytes", "cache_budget",
                 "served_requests", "served_bytes", "remote_failovers", "peers_marked_dead")
READ_COL0 = 96


class KernelHandler:
    """FanStore's answers to the kernel's requests, in one worker process.

    Thin: the logic is :class:`~fanstore.fuse.fsops.FsOps` (shared with the pyfuse3
    frontend) and the read core; this class packs the answers in the kernel's byte layout.
    Directory listings are packed once per directory (vectorised) and kept in a small LRU.
    """

    def __init__(self, fs: FsOps, reader, listing_budget: int = 32 << 20,
                 publish=None, prefetch=None) -> None:
        from fanstore.fuse.kernel import proto, records

        self.fs = fs
        #: prefetch mode: fanstore.fuse.prefetch.PrefetchHooks (READs may be answered from
        #: the buffer; LOOKUPs and IOCTLs tell where the readers are)
        self.prefetch = prefetch
        self._prefetched = prefetch.read if prefetch is not None else None
        if prefetch is not None:
            self.ioctl = self._ioctl  # the engine forwards IOCTLs only to handlers that ask
        self.ns = fs.ns
        self.reader = reader
        self.stats = reader.stats
        self.publish = publish or (lambda: None)  # counters to the shared table
        self.proto = proto
        self.records = records
        self._n = fs.n_entries
        self._kind = fs._kind
        self._count = self.ns.index.e["count"]  # a directory's number of children
        self._uid, self._gid = fs.uid, fs.gid
        self._negative = proto.negative_entry(TIMEOUT)
        self._listings: OrderedDict[int, Any] = OrderedDict()
        self._listing_bytes = 0
        self._listing_budget = listing_budget
        self._names = np.frombuffer(self.ns.index.names, dtype=np.uint8)
        self._name_off = self.ns.index.e["name_off"]
        self._name_len = self.ns.index.e["name_len"]
        self._statfs = None

    # ------------------------------------------------------------------ attributes
    def _attr_fields(self, entry: int) -> tuple:
        ino, mode, nlink, size, blocks, mtime = self.fs.attr(entry)
        sec, nsec = divmod(mtime, 1_000_000_000)
        sec &= 0xFFFF_FFFF_FFFF_FFFF  # a u64 field the kernel reads as signed: before 1970
        return (ino, size, blocks, sec, sec, sec, nsec, nsec, nsec, mode, nlink, self._uid,
                self._gid, 0, BLKSIZE, 0)

    def _entry_out(self, entry: int) -> bytes:
        return _ENTRY_OUT.pack(entry + 1, 0, TIMEOUT, TIMEOUT, 0, 0, *self._attr_fields(entry))

    def _entry(self, nodeid: int) -> int:
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            raise self.proto_errno(errno.ENOENT)
        return entry

    @staticmethod
    def proto_errno(code: int):
        from fanstore.fuse.kernel import FuseErrno

        return FuseErrno(code)

    # ------------------------------------------------------------------ requests
    def lookup(self, parent: int, name: bytes):
        try:
            entry = self.fs.lookup(parent, name)
        except NotFoundError:
            return self._negative  # the kernel remembers the absence as long as a name
        except FanStoreError as exc:
            return exc.errno
        if self.prefetch is not None:
            self.prefetch.seen(entry)
        return self._entry_out(entry)

    def _ioctl(self, nodeid: int) -> None:
        self.prefetch.seen(nodeid - 1)

    def getattr(self, nodeid: int):
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        return _ATTR_OUT.pack(TIMEOUT, 0, 0, *self._attr_fields(entry))

    def readlink(self, nodeid: int):
        try:
            return self.fs.readlink(self._entry(nodeid))
        except FanStoreError as exc:
            return exc.errno

    def read(self, nodeid: int, offset: int, size: int):
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        if int(self._kind[entry]) != KIND_FILE:
            return errno.EISDIR if int(self._kind[entry]) == KIND_DIR else errno.EINVAL
        try:
            # from the prefetch buffer, else the read core; whole-file reads land in the
            # page cache: no second copy in the chunk LRU
            data = self.reader.serve(entry, offset, size, keep_whole=False,
                                     first=self._prefetched)
        except FanStoreError as exc:
            log.error("%s", exc)
            self.publish()
            return exc.errno
        self.publish()
        return data

    def readdirplus(self, nodeid: int, offset: int, size: int):
        if self._past_end(nodeid, offset):
            return b""  # the end of a listing another worker packed: nothing to build
        listing = self._listing(nodeid)
        return listing if isinstance(listing, int) else listing.plus(offset, size)

    def readdir(self, nodeid: int, offset: int, size: int):
        if self._past_end(nodeid, offset):
            return b""
        listing = self._listing(nodeid)
        return listing if isinstance(listing, int) else listing.plain(offset, size)

    def _past_end(self, nodeid: int, offset: int) -> bool:
        entry = nodeid - 1
        return (0 <= entry < self._n and int(self._kind[entry]) == KIND_DIR
                and offset >= int(self._count[entry]))

    def statfs(self):
        if self._statfs is None:
            s = self.fs.statfs()
            self._statfs = self.proto.pack_statfs_out(
                blocks=s["blocks"], bfree=0, bavail=0, files=s["files"], ffree=0,
                bsize=s["bsize"], namelen=s["namemax"], frsize=s["frsize"])
        return self._statfs

    def access(self, nodeid: int, mask: int):
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        return errno.EROFS if mask & os.W_OK else None

    # ------------------------------------------------------------------ listings
    def _listing(self, nodeid: int):
        entry = nodeid - 1
        if not 0 <= entry < self._n:
            return errno.ENOENT
        listing = self._listings.get(entry)
        if listing is not None:
            self._listings.move_to_end(entry)
            return listing
        try:
            children = self.fs.children(entry)
        except FanStoreError as exc:
            return exc.errno
        listing = self._build_listing(children)
        cost = len(children) * 200 + 64
        self._listings[entry] = listing
        self._listing_bytes += cost
        while self._listing_bytes > self._listing_budget and len(self._listings) > 1:
            _, old = self._listings.popitem(last=False)
            self._listing_bytes -= len(old) * 200 + 64
        return listing

    def _build_listing(self, children: range):
        records = self.records
        entries = np.arange(children.start, children.stop, dtype=np.int64)
        n = len(entries)
        out = np.zeros(n, dtype=records.ENTRY_OUT_DTYPE)
        if n:
            a = self.fs.attrs(entries)
            out["nodeid"] = a["ino"]
            out["entry_valid"] = TIMEOUT
            out["attr_valid"] = TIMEOUT
            attr = out["attr"]
            attr["ino"] = a["ino"]
            attr["size"] = a["size"]
            attr["blocks"] = a["blocks"]
            sec, nsec = np.divmod(a["mtime_ns"], 1_000_000_000)
            for f in ("atime", "mtime", "ctime"):
                attr[f] = sec
                attr[f + "nsec"] = nsec
            attr["mode"] = a["mode"]
            attr["nlink"] = a["nlink"]
            attr["uid"] = self._uid
            attr["gid"] = self._gid
            attr["blksize"] = BLKSIZE
            out["attr"] = attr
            off = self._name_off[entries].astype(np.int64)
            ln = self._name_len[entries].astype(np.int64)
            if n == 1 or np.array_equal(off[1:], off[:-1] + ln[:-1]):
                concat = self._names[off[0] : off[-1] + ln[-1]]
            else:  # names not back to back in the blob: gather them
                starts = np.repeat(off - np.concatenate(([0], np.cumsum(ln)[:-1])), ln)
                concat = self._names[starts + np.arange(int(ln.sum()))]
            return records.DirListing((concat, ln), out, types=a["dtype"])
        return records.DirListing([], out)


# --------------------------------------------------------------------------- shared stats


class RowPublisher:
    """Copies a worker's read counters (a plain :class:`ReadStats`, cheap to increment)
    into its row of the shared counters table (columns READ_COL0..), where the daemon sums
    every worker's; called after each request that read data (a dozen 8-byte stores)."""

    def __init__(self, row, stats, cache, served=None) -> None:
        self.row = row
        self.stats = stats
        self.cache = cache
        self.served = served  # a worker rank's MPI transport: what it served other nodes

    def publish(self) -> None:
        s, c, row = self.stats, self.cache, self.row
        row[READ_COL0] = s.reads
        row[READ_COL0 + 1] = s.bytes_returned
        row[READ_COL0 + 2] = s.local_reads
        row[READ_COL0 + 3] = s.local_bytes
        row[READ_COL0 + 4] = s.remote_reads
        row[READ_COL0 + 5] = s.remote_bytes
        row[READ_COL0 + 6] = s.refetched
        row[READ_COL0 + 7] = s.chunks_decoded
        row[READ_COL0 + 8] = s.errors
        row[READ_COL0 + 9] = int(s.decode_seconds * 1e9)
        row[READ_COL0 + 10] = c.hits
        row[READ_COL0 + 11] = c.misses
        row[READ_COL0 + 12] = c.used
        row[READ_COL0 + 13] = c.budget
        row[READ_COL0 + 16] = s.remote_failovers
        row[READ_COL0 + 17] = s.peers_marked_dead
        if self.served is not None:
            self.publish_served()

    def publish_served(self) -> None:
        row, t = self.row, self.served
        row[READ_COL0 + 14] = t.served_requests
        row[READ_COL0 + 15] = t.served_bytes


_COL = {name: READ_COL0 + i for i, name in enumerate(READ_COUNTERS)}


def summed_stats(counters, prefetch: bool = False) -> dict[str, Any]:
    """What ``fanstore stats`` reports for the kernel frontend, from the shared table
    (with the prefetch counters in prefetch mode)."""
    from fanstore.fuse.kernel.counters import OP_COLS

    sums = counters.column_sums()
    out: dict[str, Any] = {name: sums[col] for name, col in _COL.items()}
    if prefetch:
        from fanstore.fuse import prefetch as pf

        for name, col in pf.COL.items():
            out[name] = counters.column_max(col) if name in pf.MAX_COLUMNS else sums[col]
    out["decode_seconds"] = round(out.pop("decode_ns") / 1e9, 6)
    out["refetched_from_replica"] = out.pop("refetched")
    out["worker_served_requests"] = out.pop("served_requests")
    out["worker_served_bytes"] = out.pop("served_bytes")
    out["requests"] = sum(sums[:OP_COLS])
    out["requests_by_op"] = counters.requests_by_op
    out["fuse_events"] = {k: v for k, v in counters.events.items()
                          if not k.startswith("event")}
    return out


# --------------------------------------------------------------------------- the frontend process


def _make_handler_factory(spec: dict[str, Any], index, fs: FsOps, session, window=None):
    """The per-worker set-up: this node's partitions opened here, other nodes' chunks
    through the daemon's socket, counters in the worker's row; in prefetch mode, the
    worker's prefetch thread (``window``: the shared window, made before the fork)."""

    def factory(wctx):
        from fanstore.control import ControlClient, NodeSource
        from fanstore.read import ChunkReader, LocalPartitions, RoutedSource

        local = [int(p) for p in spec["local_parts"]]
        parts = LocalPartitions(spec["data_dir"], index, local)
        remote = set(range(len(index.partitions))) - set(local)
        client = ControlClient(spec["mountpoint"], timeout=spec["remote_timeout"] + 30,
                               path=spec["socket_path"])
        source = RoutedSource(parts, NodeSource(client, remote,
                                                {int(p) for p in spec["replicated"]}))
        reader = ChunkReader(index, source, cache_bytes=spec["cache_bytes"])
        # (serve() made the counters table before forking this worker)
        row = session.counters.row(wctx.slot)
        publisher = RowPublisher(row, reader.stats, reader.cache)
        publisher.publish()
        hooks = None
        if window is not None:
            from fanstore.fuse.prefetch import Prefetcher

            pf = Prefetcher(window, reader, fs.ns, wctx.slot, wctx.workers, wctx.fd,
                            wctx.channel, spec["mountpoint"], row, publish=publisher.publish)
            pf.start()
            hooks = pf.hooks
        return KernelHandler(fs, reader, publish=publisher.publish, prefetch=hooks)

    return factory


def serve_worker(socket_path: str, index, reader, timeout: float = 300.0,
                 alive=lambda: True, served=None) -> str:
    """An external worker (an MPI worker rank of a node, :mod:`fanstore.noderank`): join
    the kernel frontend at ``socket_path`` (:mod:`fanstore.fuse.kernel.handoff`), serve
    FUSE requests with ``reader`` (this node's partitions from disk, other nodes' over
    MPI) until the mount goes away, then tell the frontend. Returns why it stopped."""
    from fanstore.fuse.kernel import RequestCounters, handoff
    from fanstore.fuse.kernel import Dispatcher
    from fanstore.namespace import Namespace

    grant, sock = handoff.join(socket_path, timeout, alive)
    counters = RequestCounters.attach(grant.counters, writable=True) if grant.counters \
        else None
    row = counters.row(grant.slot) if counters is not None else None
    publisher = RowPublisher(row, reader.stats, reader.cache, served) if row is not None \
        else None
    if publisher is not None:
        publisher.publish()
        if served is not None:
            served.on_served = publisher.publish_served
    fs = FsOps(Namespace(index))
    prefetcher = window = None
    spec = (grant.info or {}).get("prefetch")
    if spec and len(grant.extra_fds) >= 2 and row is not None:
        from fanstore.fuse.prefetch import Prefetcher
        from fanstore.read.window import SharedWindow

        window = SharedWindow(grant.extra_fds[0], grant.extra_fds[1])
        prefetcher = Prefetcher(window, reader, fs.ns, grant.slot, grant.workers, grant.fd,
                                sock, spec["mountpoint"], row,
                                publish=publisher.publish if publisher else None)
        prefetcher.start()
    handler = KernelHandler(fs, reader, publish=publisher.publish if publisher else None,
                            prefetch=prefetcher.hooks if prefetcher else None)
    try:
        Dispatcher(grant.fd, handler, bufsize=grant.bufsize, row=row).run()
    finally:
        if prefetcher is not None:
            prefetcher.stop()
        if publisher is not None:
            publisher.publish()
        os.close(grant.fd)
        handoff.say_gone(sock)
        for fd in grant.extra_fds:
            os.close(fd)
    return "unmounted"


def read_spec(fd: int, limit: int = 64 << 20) -> dict[str, Any]:
    """The frontend's spec, a JSON object read to EOF from the pipe ``fd`` the daemon
    wrote it to (never a file another user could swap)."""
    data = bytearray()
    with open(fd, "rb", closefd=True) as f:
        while len(data) <= limit:
            chunk = f.read(1 << 16)
            if not chunk:
                break
            data += chunk
    spec = json.loads(bytes(data)) if len(data) <= limit else None
    if not isinstance(spec, dict):
        raise MountError("the kernel frontend's spec is not a JSON object")
    return spec


def frontend_main(spec_fd: int) -> int:
    """``python -m fanstore.fuse.kernelfs --spec-fd N``: the frontend process (see the
    module docstring). Reads its spec from the pipe ``spec_fd``; reports "ready" or
    "error: ..." on the pipe fd named in the spec."""
    import ctypes

    from fanstore.format.index import map_index_body
    from fanstore.fuse import kernel
    from fanstore.namespace import Namespace
    from fanstore.process import setup_logging

    spec = read_spec(spec_fd)
    ready_fd = int(spec["ready_fd"])
    setup_logging(spec.get("debug", False), sys.stderr,
                  fmt=spec.get("log_format") or None)
    # Die with the daemon: its SIGKILL must not leave an unsupervised mount behind.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(spec["daemon_pid"]):
        return 1

    def report(text: str) -> None:
        try:
            os.write(ready_fd, text.encode(errors="replace")[:4000])
        except OSError:
            pass

    session = None
    try:
        index = map_index_body(spec["index_path"], owner=os.geteuid())
        ns = Namespace(index)
        fs = FsOps(ns)
        mopts = kernel.MountOptions(fsname=spec["fsname"], subtype="fanstore", read_only=True,
                                    allow_other=bool(spec["allow_other"]))
        from fanstore.fuse.kernel.handshake import DEFAULT_INIT_FLAGS, parse_flags

        # The engine's defaults, READDIRPLUS included: listing then reading 300,000 files (a
        # first epoch) took 26.5 s with it and 38.2 s with plain READDIR, which costs a
        # LOOKUP per file; only a bare cold `find` is faster without it (docs/benchmarks.md,
        # fuse_bench-small300k-dirs). FANSTORE_FUSE_FLAGS="+NAME,-NAME" edits the flags
        # (-DO_READDIRPLUS for metadata-only work; experiments and benchmarks).
        init = kernel.InitOptions(flags=parse_flags(spec.get("init_flags", ""),
                                                    DEFAULT_INIT_FLAGS))
        session = kernel.KernelSession(spec["mountpoint"], mopts, init,
                                       counters_path=spec["counters_path"])
        session.mount()

        def on_ready(s) -> None:
            report("ready\n")
            os.close(ready_fd)  # the daemon stops reading here; EOF if we die before

        external = int(spec.get("external_workers") or 0)
        window = relay = None
        watch: dict[int, Any] = {}
        if spec.get("mode") == "prefetch":
            import socket

            from fanstore.fuse.prefetch import OrderRelay
            from fanstore.read.window import SharedWindow

            state_fd, arena_fd = (int(x) for x in spec["window_fds"])
            window = SharedWindow(state_fd, arena_fd)
            orders = socket.socket(fileno=int(spec["order_fd"]))
            relay = OrderRelay(session, orders, window, int(spec["prefetch_bytes"]))
            watch[orders.fileno()] = relay.on_readable
        if external:
            # MPI worker ranks serve (noderank.py): they connect and get the connection
            extra = {} if window is None else {
                "extra_fds": [window.state_fd, window.arena_fd],
                "grant_info": {"prefetch": {"mountpoint": spec["mountpoint"]}}}
            reason = session.serve_external(spec["worker_socket"], external,
                                            on_ready=on_ready, watch=watch, **extra)
        else:
            factory = _make_handler_factory(spec, index, fs, session, window)
            reason = session.serve(factory, workers=int(spec["workers"]),
                                   on_ready=on_ready, channels=window is not None,
                                   watch=watch,
                                   on_worker_start=relay.resend if relay else None)
        log.info("kernel frontend: %s", reason)
        return 0
    except FanStoreError as exc:
        log.error("%s", exc)
        report(f"error: {exc}")
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - report, never vanish
        log.exception("kernel frontend failed")
        report(f"error: internal error in the kernel frontend ({type(exc).__name__}: {exc})")
        return 70
    finally:
        if session is not None:
            session.close()


class KernelFrontend:
    """The node daemon's side of the kernel frontend: starts the frontend process, waits
    for it to be ready, stops it, reads its counters."""

    def __init__(self, ctx: MountContext) -> None:
        self.ctx = ctx
        self.proc: subprocess.Popen | None = None
        rt = ctx.runtime  # made and checked once by the node (fanstore.runtime)
        if rt is None:
            raise ValueError("the kernel frontend needs the mount's runtime directory")
        self.counters_path = rt.counters_path
        self.worker_socket = os.path.join(rt.path, "workers.sock")
        self._counters = None
        self._reason: str | None = None
        # Every read is served by the workers, whose caches share --cache-mb; the daemon's
        # own reader keeps none of its own.
        ctx.reader.cache.budget = 0
        self._orders = None  # prefetch mode: the daemon's end of the order channel
        self.window = None  # prefetch mode: the shared window (fanstore.read.window)
        self._order_lock = threading.Lock()
        self._clients: OrderedDict[str, int] = OrderedDict()  # client name -> slot
        self._generation = 0

    # ------------------------------------------------------------------ Frontend
    def mount(self) -> None:
        ctx = self.ctx
        opts = ctx.options
        r, w = os.pipe()
        spec_r, spec_w = os.pipe()
        theirs = None
        if opts.mode == "prefetch":
            from fanstore.read.window import SharedWindow

            self._orders, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            slots = ctx.external_workers or opts.worker_count()
            # made here, handed down: the daemon gives the state to the node's API readers
            self.window = SharedWindow.create(
                ctx.index.n_entries, slots,
                prefetch_buffer_bytes(opts.prefetch_mb << 20, slots))
        spec = {
            "mountpoint": ctx.mountpoint, "index_path": ctx.index_path, "store": ctx.store,
            "data_dir": ctx.data_dir, "local_parts": ctx.local_parts,
            "replicated": ctx.replicated, "socket_path": ctx.socket_path,
            "counters_path": self.counters_path,
            "workers": opts.worker_count(),
            "external_workers": ctx.external_workers,
            "worker_socket": self.worker_socket,
            "cache_bytes": (opts.cache_mb << 20) // max(1, opts.worker_count()),
            "allow_other": opts.allow_other, "fsname": opts.fsname,
            "remote_timeout": ctx.remote_timeout, "ready_fd": w, "daemon_pid": os.getpid(),
            "debug": logging.getLogger().level <= logging.DEBUG,
            "log_format": _log_format(),
            "init_flags": os.environ.get("FANSTORE_FUSE_FLAGS", ""),
            "mode": opts.mode,
        }
        if theirs is not None:
            spec.update(order_fd=theirs.fileno(), prefetch_bytes=opts.prefetch_mb << 20,
                        window_fds=[self.window.state_fd, self.window.arena_fd])
        if ctx.runtime is not None:
            ctx.runtime.new_counters_file()  # the frontend creates it anew, exclusively
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "OMPI_"))}
        fds = (w, spec_r) if theirs is None else (w, spec_r, theirs.fileno(),
                                                  self.window.state_fd, self.window.arena_fd)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fanstore.fuse.kernelfs", "--spec-fd", str(spec_r)],
                pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(w)
            os.close(spec_r)
            if theirs is not None:
                theirs.close()
        try:  # the spec goes through a pipe: nothing on disk for anyone to read or swap
            with open(spec_w, "wb", closefd=True) as f:
                f.write(json.dumps(spec).encode())
        except BrokenPipeError:
            pass  # the frontend died at once: the ready pipe below says so
        try:
            text = read_ready(r)
        finally:
            os.close(r)
        if text != "ready":
            self._wait(10)
            raise MountError(text[len("error: "):] if text.startswith("error: ") else
                             f"{ctx.mountpoint}: the kernel frontend exited before the mount "
                             f"was ready (status {self.proc.returncode})")

    def unmount(self) -> None:
        self.stop("another rank failed")
        self._wait(30)

    def serve(self) -> str:
        proc = self.proc
        assert proc is not None
        code = proc.wait()
        self._cleanup_mount()
        if self._reason is not None:
            return self._reason
        if code == 0:
            return "unmounted from outside"
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        log.error("%s: the kernel frontend ended with %s", self.ctx.mountpoint, why)
        return f"the kernel frontend failed ({why})"

    def stop(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)  # async-signal-safe
            except ProcessLookupError:
                pass

    def stats(self) -> dict[str, Any]:
        from fanstore.fuse.kernel import RequestCounters

        if self._counters is None:
            try:
                self._counters = RequestCounters.attach(self.counters_path)
            except (OSError, ValueError):
                return {}
        out = summed_stats(self._counters, prefetch=self._orders is not None)
        out["workers"] = self.ctx.options.worker_count()
        if self._orders is not None:
            out["prefetch_budget"] = self.ctx.options.prefetch_mb << 20
            out["prefetch_clients"] = len(self._clients)
        return out

    def prefetch_window(self) -> int:
        """The descriptor of the shared window's state (prefetch mode), for the node's API
        readers: they read it to know what was pushed and mark what they decode
        themselves."""
        if self.window is None:
            raise MountError("this mount is in sync mode; mount it with --mode prefetch")
        return self.window.state_fd

    def set_order(self, entries: list[int], client: str) -> int:
        """A client's order for its next epoch (replacing its last one): its regular files,
        with their sizes, in an order file handed to the frontend process."""
        from fanstore.fuse import prefetch as pf
        from fanstore.read.window import CLIENTS, write_order

        if self._orders is None:
            raise MountError("this mount is in sync mode; mount it with --mode prefetch")
        index = self.ctx.index
        arr = np.asarray(entries, dtype=np.int64)
        if len(arr):
            arr = arr[(arr >= 0) & (arr < index.n_entries)]
            arr = arr[index.e["kind"][arr] == KIND_FILE]
        with self._order_lock:
            slot = self._clients.pop(client, None)
            if slot is None and len(self._clients) >= CLIENTS:
                # forget the client heard from longest ago
                _old, slot = self._clients.popitem(last=False)
                self._send(pf.encode(pf.DROP, slot, 0))
            if slot is None:
                used = set(self._clients.values())
                slot = next(i for i in range(CLIENTS) if i not in used)
            self._clients[client] = slot
            self._generation += 1
            fd = write_order(slot, self._generation, arr, index.e["size"][arr])
            try:
                self._send(pf.encode(pf.ORDER, slot, self._generation, len(arr)), [fd])
            finally:
                os.close(fd)
        log.info("prefetch order of %d files from %s", len(arr), client or "a reader")
        return len(arr)

    def _send(self, msg: bytes, fds: list[int] | None = None) -> None:
        try:
            socket.send_fds(self._orders, [msg], fds or [])
        except OSError as exc:
            raise MountError(f"{self.ctx.mountpoint}: the kernel frontend is not taking "
                             f"orders ({exc.strerror})") from None

    # ------------------------------------------------------------------ internals
    def _wait(self, timeout: float) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._cleanup_mount()

    def _cleanup_mount(self) -> None:
        """A frontend that died without unmounting leaves a stale mount: remove it."""
        from fanstore import mounttable

        mnt = self.ctx.mountpoint
        if mounttable.mount_status(mnt) != "none":
            ok, msg = mounttable.fusermount_unmount(mnt, lazy=True)
            if not ok:
                log.error("%s: could not unmount: %s", mnt, msg)


def prefetch_buffer_bytes(budget: int, slots: int) -> int:
    """The shared buffer's share of ``--prefetch-mb``: what is left once every worker's
    prefetch thread holds one piece decoded before pushing it (at least half)."""
    from fanstore.fuse.prefetch import PUSH_PIECE

    return max(budget // 2, budget - slots * PUSH_PIECE)


def _log_format() -> str | None:
    """The daemon's log line format, so the frontend's lines look the same (rank prefix)."""
    for h in logging.getLogger().handlers:
        if h.formatter is not None:
            return h.formatter._fmt
    return None


def create(ctx: MountContext) -> KernelFrontend:
    return KernelFrontend(ctx)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--spec-fd":
        sys.exit("usage: python -m fanstore.fuse.kernelfs --spec-fd N (started by the daemon)")
    sys.exit(frontend_main(int(sys.argv[2])))
