"""The body of a pack worker process: ``python -m fanstore.pack.poolworker CMD_FD RES_FD``.

Started by :class:`fanstore.pack.pool.WorkerPool`. It says hello, then runs the tasks it
reads from its command pipe one at a time, answering each with progress reports and a
result (or the error that ended it), until the pipe closes. See ``fanstore.pack.pool``.
"""

from __future__ import annotations

import os
import sys
import time

from fanstore.process import become_worker, read_frame, write_frame

#: Bytes packed between two progress reports, at most (and at most 0.25 s apart).
_REPORT_BYTES = 4 << 20
_REPORT_SECONDS = 0.25


class _Out:
    """The result pipe: whole frames, written with blocking writes (the pool reads it all
    the time)."""

    def __init__(self, fd: int) -> None:
        from fanstore.pack.pool import PROGRESS, PROGRESS_BODY

        self.fd = fd
        self._progress_kind = PROGRESS
        self._progress_body = PROGRESS_BODY
        self.pending = 0
        self.last = time.monotonic()

    def send(self, kind: int, body: bytes = b"") -> None:
        write_frame(self.fd, kind, body)

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

    out = _Out(res_fd)
    out.send(HELLO)
    while True:
        got = read_frame(cmd_fd)
        if got is None:
            return 0  # the pool is done (or gone)
        kind, body = got
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
