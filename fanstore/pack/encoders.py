"""Worker processes that checksum and compress chunks, for the streaming packer.

The packer's main process reads the source and is the only writer of the partitions (so
the store does not depend on how many workers there are); the CPU work of a chunk, its
XXH3-64 and its compression, runs in ``jobs`` worker processes, not threads: the per-chunk
Python around the codecs would otherwise hold the GIL the reader needs.

Bytes never travel through a pipe:

- **One ring of shared memory** (a ``memfd`` that every worker maps: the workers are
  fresh interpreters, started by fork-and-exec, which is safe from this threaded process). The packer reserves a contiguous region for each chunk (``reserve``), reads
  the chunk's bytes straight into it, and submits it. Regions are handed out and given
  back in order (FIFO), so the ring needs only a head and a tail.
- **A worker compresses in place**: it hashes the region, compresses it, and when the
  result is smaller (the only case where it is kept) copies it over the start of the same
  region. The packer then writes the region's first ``stored`` bytes and frees it.
- **Pipes carry only fixed headers** (``struct``): packer -> worker ``ENCODE(slot, n,
  pos)`` or ``CODEC(slot, config)``; worker -> packer ``DONE(used slot, stored, checksum)``
  or ``ERROR(message)``. At most ``MAX_QUEUED`` chunks are queued per worker, so neither
  pipe can fill and no write ever blocks.

A collector thread in the packer's process reads the results and passes them to the
packer's ``sink`` (which appends to the partitions) exactly in the order the chunks were
submitted, whatever worker did them and whenever it finished; the ring is freed behind
it. Writing thus overlaps reading the source. A chunk of codec slot 0 ("none") is only
hashed by its worker.

Workers run only this module's loop (``python -m fanstore.pack.encoders``: codecs,
xxhash, the ring, two pipes); they ignore SIGINT (the packer handles ^C), die with the
packer (a death signal), end when their command pipe closes, and are killed by ``close``
if they do not. A worker that dies closes its result pipe: the collector raises at once,
naming it and the signal that ended it.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import struct
import subprocess
import sys
import threading
from collections import deque
from typing import Any, Callable

import xxhash

from compressors import CodecError, DeclinedError, get_codec
from fanstore.errors import PackError
from fanstore.pack.pool import death_message
from fanstore.process import become_worker, spawn_piped

# packer -> worker: kind, slot, n, pos
_CMD = struct.Struct("<BxHIQ")
_ENCODE, _CODEC = 1, 2
# worker -> packer: kind, used slot, stored (or message length), checksum
_RES = struct.Struct("<BxHIQ")
_DONE, _ERROR = 1, 2

#: Chunks queued per worker at most: 16-byte headers, far below a pipe's 64 KiB either way.
MAX_QUEUED = 1024


def _worker_main(ring: mmap.mmap, cmd_fd: int, res_fd: int) -> None:
    view = memoryview(ring)
    codecs: dict[int, Any] = {}
    pending = b""
    out = bytearray()
    hash64 = xxhash.xxh3_64_intdigest
    while True:
        data = os.read(cmd_fd, 1 << 16)
        if not data:
            return
        buf = pending + data if pending else data
        i = 0
        end = len(buf)
        while end - i >= _CMD.size:
            kind, slot, n, pos = _CMD.unpack_from(buf, i)
            if kind == _ENCODE:
                i += _CMD.size
                region = view[pos:pos + n]
                csum = hash64(region)
                try:
                    slot, stored = _encode_chunk(codecs[slot] if slot else None, slot,
                                                 region)
                except CodecError as exc:
                    _send_error(res_fd, out, str(exc))
                    return
                if slot:
                    region[:len(stored)] = stored
                out += _RES.pack(_DONE, slot, len(stored), csum)
                # Hand results back soon (the packer frees the ring in order), but not one
                # write per tiny chunk.
                if n >= 65536 or len(out) >= 32 * _RES.size:
                    _write_all(res_fd, out)
                    out.clear()
            elif kind == _CODEC:
                if end - i - _CMD.size < n:
                    break
                cfg = json.loads(bytes(buf[i + _CMD.size:i + _CMD.size + n]))
                codecs[slot] = get_codec(cfg)
                i += _CMD.size + n
            else:
                _send_error(res_fd, out, f"unknown command {kind}")
                return
        pending = bytes(buf[i:]) if i < end else b""
        if out:
            _write_all(res_fd, out)
            out.clear()


def _encode_chunk(codec: Any, slot: int, region: memoryview) -> tuple[int, Any]:
    """(slot, stored bytes) of a chunk: ``codec``'s encoding under ``slot``, or the chunk
    itself under slot 0 (no codec; the codec declined it; or its encoding does not shrink
    it). The one place the worker and the inline path decide it. Raises CodecError."""
    if codec is None:
        return 0, region
    try:
        stored = codec.encode(region)
    except DeclinedError:
        return 0, region
    return (slot, stored) if len(stored) < len(region) else (0, region)


def _compression_failed(label: str, msg: str) -> PackError:
    return PackError(f"{label}: compression failed: {msg}" if label
                     else f"compression failed: {msg}")


def _send_error(fd: int, out: bytearray, msg: str) -> None:
    text = msg.encode("utf-8", "replace")[:4000]
    out += _RES.pack(_ERROR, 0, len(text), 0) + text
    _write_all(fd, out)
    out.clear()


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _run_worker(argv: list[str]) -> int:
    """A worker process's body: ``python -m fanstore.pack.encoders CMD RES RING SIZE``."""
    become_worker()
    cmd_fd, res_fd, ring_fd, size = (int(a) for a in argv)
    try:
        ring = mmap.mmap(ring_fd, size)
        os.close(ring_fd)
        _worker_main(ring, cmd_fd, res_fd)
    except BaseException as exc:  # noqa: BLE001 - reported to the packer, then exit
        try:
            _send_error(res_fd, bytearray(), f"{type(exc).__name__}: {exc}")
        except OSError:
            pass
        return 1
    return 0


class _Worker:
    __slots__ = ("proc", "cmd", "res", "buf", "queue", "sent", "done", "number")

    def __init__(self, number: int, proc, cmd: int, res: int) -> None:
        self.number = number
        self.proc = proc
        self.cmd = cmd
        self.res = res
        self.buf = bytearray()
        self.queue: deque[_Task] = deque()  # submitted to this worker, result not yet read
        self.sent = 0  # bytes submitted (changed by the packer's thread only)
        self.done = 0  # bytes whose result came back (by the collector only)


class _Task:
    __slots__ = ("pos", "n", "end", "token", "done", "used", "stored", "csum")

    def __init__(self, pos: int, n: int, end: int, token: Any) -> None:
        self.pos = pos  # absolute position in the ring (offset = pos % size)
        self.n = n
        self.end = end  # ring tail once this task is passed on
        self.token = token
        self.done = False
        self.used = 0
        self.stored = 0
        self.csum = 0


#: sink(token, stored bytes (a view valid during the call), used codec slot, raw length,
#: XXH3-64 of the raw chunk); called by the collector thread, in submission order.
Sink = Callable[[Any, memoryview, int, int, int], None]


class EncoderPool:
    """``jobs`` worker processes, a shared ring of ``ring_size`` bytes and a collector
    thread; see the module docstring.

    Use, from one thread: ``start()``; per chunk ``reserve(n)``, fill the view,
    ``submit(n, slot, token)``; ``finish()`` (every result has been through ``sink``);
    always ``close()``. The collector thread reads the workers' results and calls
    ``sink`` in submission order (there the packer writes the partitions, so writing
    overlaps reading the source); a failure there (a worker's error, a failed write) is
    raised by the packer's next call.
    """

    def __init__(self, jobs: int, ring_size: int, sink: Sink, label: str = "") -> None:
        self.jobs = max(1, jobs)
        self.label = label  # what messages name (the source)
        self.size = ring_size
        self.sink = sink
        self._ring_fd = os.memfd_create("fanstore-pack-ring", os.MFD_CLOEXEC)
        os.ftruncate(self._ring_fd, ring_size)
        self.ring = mmap.mmap(self._ring_fd, ring_size)
        self.view = memoryview(self.ring)
        self.head = 0  # next free byte (absolute; the packer's thread)
        self.tail = 0  # first byte still in use (absolute; the collector)
        self.tasks: deque[_Task] = deque()  # appended by the packer, popped by the collector
        self.workers: list[_Worker] = []
        self.configs: dict[int, dict[str, Any]] = {}
        self.error: BaseException | None = None
        self._reserved: tuple[int, int] | None = None
        self._poll = select.poll()
        self._by_fd: dict[int, _Worker] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._wake_r = self._wake_w = -1
        self._collector: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self, configs: dict[int, dict[str, Any]]) -> None:
        """Start the workers, telling them the codecs of ``configs`` (slot -> config),
        then the collector thread."""
        for k in range(self.jobs):
            proc, cmd_w, res_r = spawn_piped("fanstore.pack.encoders", [self._ring_fd],
                                             [self.size])
            self.workers.append(_Worker(k, proc, cmd_w, res_r))
        os.close(self._ring_fd)  # the workers have their own
        self._ring_fd = -1
        for slot, config in sorted(configs.items()):
            self.add_codec(slot, config)
        for w in self.workers:
            self._poll.register(w.res, select.POLLIN)
            self._by_fd[w.res] = w
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.POLLIN)
        self._collector = threading.Thread(target=self._collect, name="pack-collect",
                                           daemon=True)
        self._collector.start()

    def add_codec(self, slot: int, config: dict[str, Any]) -> None:
        """Tell every worker about a codec slot (before chunks of it are submitted)."""
        if slot in self.configs:
            return
        self.configs[slot] = config
        payload = json.dumps(config, sort_keys=True).encode()
        for w in self.workers:
            self._send(w, _CMD.pack(_CODEC, slot, len(payload), 0) + payload)

    def close(self) -> None:
        """Stop the collector, end the workers (closing their command pipes; killing any
        that lingers), free the ring. Results not passed on yet are dropped: workers with
        chunks still queued (a failed or interrupted pack) are killed at once rather than
        left to compress what nobody will write (a worker's death ended a zstd:19 pack
        of a tar only once the other had drained its queue, 10 s later)."""
        abandoned = bool(self.tasks) or self.error is not None
        self._stop = True
        if self._collector is not None:
            os.write(self._wake_w, b"x")
            self._collector.join()
            self._collector = None
        for w in self.workers:
            try:
                os.close(w.cmd)
            except OSError:
                pass
            if abandoned and w.proc.poll() is None:
                w.proc.kill()  # holds only its share of the ring and its pipes
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            os.close(w.res)
        if self._ring_fd >= 0:
            os.close(self._ring_fd)
            self._ring_fd = -1
        self.workers = []
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        try:
            self.view.release()
            self.ring.close()
        except BufferError:
            pass  # views still held (by a traceback, say): unmapped when they go

    # ------------------------------------------------------------------ the packer's side
    def reserve(self, n: int) -> memoryview:
        """A writable view of ``n`` contiguous bytes of the ring; waits until there is
        room. Valid until ``submit``."""
        if n > self.size // 2:
            raise ValueError("chunk larger than half the ring")
        off = self.head % self.size
        start = self.head if off + n <= self.size else self.head + self.size - off
        if start + n - self.tail > self.size:
            with self._cond:
                while start + n - self.tail > self.size:
                    self._check()
                    self._cond.wait(1.0)
        self._check()
        self._reserved = (start, n)
        off = start % self.size
        return self.view[off:off + n]

    def submit(self, n: int, slot: int, token: Any) -> None:
        """Hand the first ``n`` bytes of the reserved view to a worker; its result reaches
        ``sink`` in submission order."""
        start, cap = self._reserved
        self._reserved = None
        task = _Task(start, n, start + cap, token)
        self.head = start + cap
        w = min(self.workers, key=lambda x: x.sent - x.done)
        if len(w.queue) >= MAX_QUEUED:
            with self._cond:
                while len(w.queue) >= MAX_QUEUED:
                    self._check()
                    self._cond.wait(1.0)
        self.tasks.append(task)
        w.queue.append(task)  # before the command: the result cannot come first
        w.sent += n
        self._send(w, _CMD.pack(_ENCODE, slot, n, start % self.size))

    def finish(self) -> None:
        """Wait until every submitted chunk has been through ``sink``."""
        with self._cond:
            while self.tasks:
                self._check()
                self._cond.wait(1.0)
        self._check()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        if self._collector is None or not self._collector.is_alive():
            raise PackError("internal error: the pack's collector thread is gone")

    def _send(self, w: _Worker, data: bytes) -> None:
        try:
            _write_all(w.cmd, data)
        except BrokenPipeError:
            self._check()  # the collector has seen why
            raise PackError(f"compression worker {w.number} is gone") from None

    # ------------------------------------------------------------------ the collector
    def _collect(self) -> None:
        try:
            while not self._stop:
                for fd, _ in self._poll.poll():
                    if fd == self._wake_r:
                        os.read(fd, 512)
                    else:
                        self._read(self._by_fd[fd])
                self._flush()
                with self._cond:
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised by the packer's thread
            self.error = exc
            with self._cond:
                self._cond.notify_all()

    def _flush(self) -> None:
        tasks = self.tasks
        size = self.size
        while tasks and tasks[0].done:
            t = tasks[0]
            off = t.pos % size
            self.sink(t.token, self.view[off:off + t.stored], t.used, t.n, t.csum)
            self.tail = t.end
            tasks.popleft()

    def _read(self, w: _Worker) -> None:
        """Read what ``w`` has sent and mark its tasks done."""
        data = os.read(w.res, 1 << 16)
        if not data:
            raise self._gone(w)
        w.buf += data
        buf = w.buf
        i = 0
        while len(buf) - i >= _RES.size:
            kind, used, stored, csum = _RES.unpack_from(buf, i)
            if kind == _ERROR:
                if len(buf) - i - _RES.size < stored:
                    break
                msg = bytes(buf[i + _RES.size:i + _RES.size + stored]).decode("utf-8",
                                                                            "replace")
                raise _compression_failed(self.label, msg)
            i += _RES.size
            t = w.queue.popleft()
            t.used, t.stored, t.csum = used, stored, csum
            t.done = True
            w.done += t.n
        del buf[:i]

    def _gone(self, w: _Worker) -> PackError:
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its pipe but lives on: end it
            w.proc.kill()
            code = w.proc.wait()
        what = f"compressing {self.label}" if self.label else None
        return PackError(death_message(f"compression worker {w.number} (pid {w.proc.pid})",
                                       code, what))


class InlineFirst:
    """An :class:`EncoderPool` started only once ``inline_bytes`` have been submitted: a
    small source (``worker.INLINE_BYTES``, what a directory's pack compresses without
    workers too) is hashed and compressed here, chunk by chunk as it is read, and no worker
    process starts (each is an interpreter's start: 0.15-0.3 s of CPU, more than a small
    tar's compression). The same interface and the same bytes: a chunk that does not
    shrink is kept raw, a codec's refusal is kept raw, its error ends the pack; the results
    reach ``sink`` in submission order, those made here at ``submit``. ``inline_bytes`` 0:
    the pool from the start (an explicit ``--jobs``)."""

    def __init__(self, jobs: int, ring_size: int, sink: Sink, label: str = "",
                 inline_bytes: int = 0) -> None:
        self._pool_args = (jobs, ring_size, sink, label)
        self.sink = sink
        self.label = label
        self.inline_left = inline_bytes
        self.pool: EncoderPool | None = None
        self.configs: dict[int, dict[str, Any]] = {}
        self._codecs: dict[int, Any] = {}  # slot -> codec, for the chunks done here
        self._buf = bytearray()

    def start(self, configs: dict[int, dict[str, Any]]) -> None:
        for slot, config in sorted(configs.items()):
            self.add_codec(slot, config)
        if self.inline_left <= 0:
            self._start_pool()

    def _start_pool(self) -> None:
        self.pool = EncoderPool(*self._pool_args)
        self.pool.start(self.configs)  # spawned by fork-and-exec: safe from threads

    def add_codec(self, slot: int, config: dict[str, Any]) -> None:
        if slot in self.configs:
            return
        self.configs[slot] = config
        if self.pool is not None:
            self.pool.add_codec(slot, config)
        elif slot:
            self._codecs[slot] = get_codec(config)

    def reserve(self, n: int) -> memoryview:
        if self.pool is None and n > self.inline_left:
            self._start_pool()
        if self.pool is not None:
            return self.pool.reserve(n)
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]

    def submit(self, n: int, slot: int, token: Any) -> None:
        if self.pool is not None:
            self.pool.submit(n, slot, token)
            return
        self.inline_left -= n
        region = memoryview(self._buf)[:n]
        csum = xxhash.xxh3_64_intdigest(region)
        try:
            slot, stored = _encode_chunk(self._codecs.get(slot), slot, region)
        except CodecError as exc:
            raise _compression_failed(self.label, str(exc)) from None
        self.sink(token, memoryview(stored), slot, n, csum)

    def finish(self) -> None:
        if self.pool is not None:
            self.pool.finish()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


if __name__ == "__main__":
    try:
        sys.exit(_run_worker(sys.argv[1:]))
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(1)
