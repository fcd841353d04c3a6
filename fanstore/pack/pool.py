"""The worker processes of a pack, and how their death is noticed.

A :class:`WorkerPool` starts ``jobs`` fresh interpreters (``python -m
fanstore.pack.poolworker``, by fork-and-exec: :func:`fanstore.process.spawn_worker`), so
it is safe to start from a process that has threads (a progress bar, s3fs' event loop,
MPI, the caller's own). Each worker has a pipe of its own each way; nothing is shared
between processes that a worker could leave locked by dying (no lock, no semaphore, no
shared counter), and bytes travel as ``fanstore.pack.wire`` messages, never pickled.

Each worker holds one task at a time: the pool sends a task to a worker that has said
hello and is idle, in the order given (the biggest partitions first, so the workers finish
together). A worker reports progress (bytes packed) as it goes, then the task's result or
the error that ended it. The pool polls the result pipes; a worker that dies, whatever
killed it (SIGKILL, the out-of-memory killer, a crash inside a codec), closes its pipe,
and the pool raises at once a :class:`~fanstore.errors.PackError` naming the worker, its
signal or status and the task it held. A worker that does not say hello within
:data:`START_TIMEOUT` is named the same way. Workers die with the pool's process (a
death signal): a pack killed outright leaves no worker behind.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

from fanstore import storage
from fanstore.errors import PackError
from fanstore.process import FRAME, spawn_piped

#: Task kinds (pool -> worker); SETUP comes first, once: the settings a worker cannot
#: inherit (a fresh interpreter has our environment, not what the command line set).
PART, DIGEST, SETUP = 1, 2, 3
#: Message kinds (worker -> pool).
HELLO, PROGRESS, RESULT, FAILED = 11, 12, 13, 14
PROGRESS_BODY = struct.Struct("<Q")
#: Seconds a worker may take from its start to its hello (an interpreter and the codecs'
#: imports: 0.2-0.5 s here; a loaded login node or a cold NFS home can take far longer).
START_TIMEOUT = 120.0
#: Seconds the pool waits for a worker to exit once its command pipe is closed.
EXIT_TIMEOUT = 10.0
_POLL_MS = 200
_READ = 1 << 20


@dataclass
class _Worker:
    number: int
    proc: object  # subprocess.Popen
    cmd: int  # write end of the command pipe
    res: int  # read end of the result pipe (non-blocking)
    started: float
    hello: bool = False
    task: int | None = None  # index of the task in flight
    buf: bytearray = field(default_factory=bytearray)


class WorkerPool:
    """``jobs`` worker processes; see the module docstring. Use as a context manager (or
    call :meth:`close`): the workers end with it, even on an error."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self.workers: list[_Worker] = []
        self._poll = select.poll()
        self._by_fd: dict[int, _Worker] = {}

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def started(self) -> bool:
        """Whether :meth:`start` (or :meth:`run`) has started the workers."""
        return bool(self.workers)

    def start(self) -> None:
        """Start the workers (once): they import while the caller goes on."""
        while len(self.workers) < self.jobs:
            self._spawn(len(self.workers))

    def _spawn(self, number: int) -> None:
        proc, cmd_w, res_r = spawn_piped("fanstore.pack.poolworker")
        os.set_blocking(res_r, False)
        w = _Worker(number, proc, cmd_w, res_r, time.monotonic())
        self.workers.append(w)
        self._poll.register(res_r, select.POLLIN)
        self._by_fd[res_r] = w
        # object-storage options may hold credentials: a pipe, not argv or the environment
        setup = json.dumps({"storage": storage.explicit_options()}).encode()
        self._write(w, FRAME.pack(SETUP, len(setup)) + setup, "starting")

    def run(self, kind: int, tasks: list[bytes], labels: list[str],
            progress: Callable[[int], None] | None = None) -> list[bytes]:
        """Run ``tasks`` (bodies of ``kind``) on the workers and return their results in
        the same order. ``labels[i]`` says what task i is in an error ("compressing
        partition 3"); ``progress(n)`` is called with the bytes each report adds. Raises
        :class:`PackError` for a task's own error (the first) or a worker lost."""
        self.start()
        results: list[bytes | None] = [None] * len(tasks)
        todo = list(range(len(tasks)))
        todo.reverse()  # popped from the end: the given order
        left = len(tasks)
        while left:
            for w in self.workers:
                if w.hello and w.task is None and todo:
                    i = todo.pop()
                    self._send(w, kind, tasks[i], labels[i], i)
            for fd, _ in self._poll.poll(_POLL_MS):
                w = self._by_fd[fd]
                for mkind, body in self._receive(w, labels):
                    if mkind == HELLO:
                        w.hello = True
                    elif mkind == PROGRESS:
                        if progress is not None:
                            progress(PROGRESS_BODY.unpack(body)[0])
                    elif mkind == RESULT and w.task is not None:
                        results[w.task] = body
                        w.task = None
                        left -= 1
                    elif mkind == FAILED:
                        raise PackError(bytes(body).decode("utf-8", "replace"))
                    else:
                        raise PackError(f"internal error: pack worker {w.number} sent "
                                        f"message {mkind}")
            self._check_starts()
        return [bytes(r) for r in results]  # type: ignore[arg-type]

    def _send(self, w: _Worker, kind: int, body: bytes, label: str, i: int) -> None:
        w.task = i
        self._write(w, FRAME.pack(kind, len(body)) + body, label)

    def _write(self, w: _Worker, data: bytes, label: str) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(w.cmd, view):]
        except BrokenPipeError:
            raise self._lost(w, label) from None

    def _receive(self, w: _Worker, labels: list[str]) -> list[tuple[int, memoryview]]:
        """The whole messages ``w`` has sent so far; raises when it is gone."""
        while True:
            try:
                data = os.read(w.res, _READ)
            except BlockingIOError:
                break
            if not data:
                raise self._lost(w, None if w.task is None else labels[w.task])
            w.buf += data
            if len(data) < _READ:
                break
        out = []
        pos = 0
        buf = w.buf
        while len(buf) - pos >= FRAME.size:
            kind, n = FRAME.unpack_from(buf, pos)
            if len(buf) - pos - FRAME.size < n:
                break
            start = pos + FRAME.size
            out.append((kind, bytes(buf[start:start + n])))
            pos = start + n
        del buf[:pos]
        return out

    def _check_starts(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if not w.hello and now - w.started > START_TIMEOUT:
                raise PackError(f"pack worker {w.number} (pid {w.proc.pid}) did not start "
                                f"within {START_TIMEOUT:g} s: is the machine overloaded? "
                                "try fewer --jobs")

    def _lost(self, w: _Worker, label: str | None) -> PackError:
        """The error for worker ``w``, whose pipe closed: it is gone (or going)."""
        try:
            code = w.proc.wait(timeout=EXIT_TIMEOUT)
        except Exception:  # noqa: BLE001 - closed its pipe but lives on: end it
            w.proc.kill()
            code = w.proc.wait()
        return PackError(death_message(f"pack worker {w.number} (pid {w.proc.pid})", code,
                                       label))

    def close(self) -> None:
        """End every worker: close its command pipe (it exits), kill it if it has not
        within :data:`EXIT_TIMEOUT` (or at once when the pool failed), reap it."""
        workers, self.workers = self.workers, []
        busy = any(w.task is not None for w in workers)
        for w in workers:
            os.close(w.cmd)
            if busy:  # an error ended the pool: nothing the others do is wanted now
                _kill(w.proc)
        deadline = time.monotonic() + EXIT_TIMEOUT
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                _kill(w.proc)
                w.proc.wait()
            self._poll.unregister(w.res)
            os.close(w.res)
        self._by_fd.clear()


def _kill(proc) -> None:
    try:
        proc.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass


def death_message(who: str, code: int | None, label: str | None) -> str:
    """One line for a worker that ended under a task: what ended it, and what to try."""
    while_ = f" while {label}" if label else ""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL:
            return (f"{who} was killed by SIGKILL{while_} (what the kernel's out-of-memory "
                    "killer sends): try fewer --jobs")
        return f"{who} died of {name}{while_}: try fewer --jobs or another --codec"
    return f"{who} exited with status {code}{while_}: try fewer --jobs"
