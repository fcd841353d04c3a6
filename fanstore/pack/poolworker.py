"""The body of a pack worker process: ``python -m fanstore.pack.poolworker CMD_FD RES_FD``.

Started by :class:`fanstore.pack.pool.WorkerPool`. It says hello, then runs the tasks it
reads from its command pipe one at a time, answering each with progress reports and a
result (or the error that ended it), until the pipe closes. See ``fanstore.pack.pool``.
"""

from __future__ import annotations

import os
import sys
import time

from fanstore.process import become_worker

#: Bytes packed between two progress reports, at most (and at most 0.25 s apart).
_REPORT_BYTES = 4 << 20
_REPORT_SECONDS = 0.25


class _Out:
    """The result pipe: whole frames, written with blocking writes (the pool reads it all
    the time)."""

    def __init__(self, fd: int) -> None:
        from fanstore.pack.pool import PROGRESS, PROGRESS_BODY
        from fanstore.pack.wire import FRAME

        self.fd = fd
        self._frame = FRAME
        self._progress_kind = PROGRESS
        self._progress_body = PROGRESS_BODY
        self.pending = 0
        self.last = time.monotonic()

    def send(self, kind: int, body: bytes = b"") -> None:
        data = memoryview(self._frame.pack(kind, len(body)) + body)
        while data:
            data = data[os.write(self.fd, data):]

    def progress(self, n: int) -> None:
        self.pending += n
        now = time.monotonic()
        if self.pending >= _REPORT_BYTES or now - self.last >= _REPORT_SECONDS:
            self.flush_progress(now)

    def flush_progress(self, now: float | None = None) -> None:
        if self.pending:
            self.send(self._progress_kind, self._progress_body.pack(self.pending))
            self.pending = 0
        self.last = time.monotonic() if now is None else now


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``; None at EOF before the first byte (the pool is done)."""
    parts, got = [], 0
    while got < n:
        data = os.read(fd, min(n - got, 1 << 20))
        if not data:
            if got:
                raise EOFError("the command pipe closed inside a message")
            return None
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _run(kind: int, body: bytes, out: _Out) -> bytes | None:
    from fanstore.pack import pool, wire

    if kind == pool.SETUP:
        import json

        from fanstore import storage

        storage.set_default_options(json.loads(body)["storage"])
        return None
    if kind == pool.PART:
        from fanstore.pack import worker

        task, _ = wire.decode_task(body)
        return wire.encode_result(worker.pack_partition(task, out.progress))
    if kind == pool.DIGEST:
        from fanstore.pack import dedup

        paths, limit = wire.decode_paths(body)
        return wire.encode_digests(dedup.digest_all(paths, limit))
    raise ValueError(f"unknown task kind {kind}")


def main(argv: list[str]) -> int:
    become_worker()
    cmd_fd, res_fd = int(argv[0]), int(argv[1])
    from fanstore.errors import FanStoreError
    from fanstore.pack.pool import FAILED, HELLO, RESULT
    from fanstore.pack.wire import FRAME

    out = _Out(res_fd)
    out.send(HELLO)
    while True:
        head = _read_exact(cmd_fd, FRAME.size)
        if head is None:
            return 0
        kind, n = FRAME.unpack(head)
        body = _read_exact(cmd_fd, n) if n else b""
        if body is None:
            return 1
        try:
            reply = _run(kind, body, out)
        except FanStoreError as exc:
            out.flush_progress()
            out.send(FAILED, str(exc).encode("utf-8", "replace"))
            continue
        except Exception as exc:  # noqa: BLE001 - reported as one line by the pool
            out.send(FAILED, f"internal error in a pack worker: {type(exc).__name__}: "
                             f"{exc}".encode("utf-8", "replace"))
            continue
        if reply is not None:
            out.flush_progress()
            out.send(RESULT, reply)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(1)  # the pool is gone: nothing to tell it
