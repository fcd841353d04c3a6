"""Process plumbing: going to the background with a ready pipe, pid checks, malloc tuning,
logging set-up. No FUSE, MPI or CLI imports; nothing here prints to the user.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import struct
import subprocess
import sys
from typing import Callable

from fanstore.errors import FanStoreError, MountError

log = logging.getLogger(__name__)

#: glibc's mallopt() parameter number for M_ARENA_MAX (malloc.h).
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Bound glibc's malloc arenas for a daemon; call before any thread starts.

    glibc gives each allocating thread its own arena (up to 8 per core) and keeps freed
    memory in it, so a daemon with a few dozen decode and fetch threads grew from 53 MB to
    300 MB under load while holding a 16 MB cache (docs/reliability.md). Two arenas keep it
    flat at no measurable cost. ``MALLOC_ARENA_MAX`` in the environment wins; other C
    libraries are left alone. Returns whether the limit was set.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_ARENA_MAX, int(arenas)))
    except (OSError, AttributeError):  # not glibc
        return False


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``).

    Loading the index allocates and frees far more than the process keeps (the compressed
    bytes, the decompressed body, validation's temporaries: about 2 GiB at ten million
    files); glibc then keeps freed heap pages mapped (its mmap threshold rises after the
    first large free, so later temporaries come from the heap). A daemon calls this once
    after start-up: measured on 1.28 million files, 35 MB of its 64 MB PSS was such pages.
    A C library without it is left alone."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pid_alive(pid: int | None) -> bool:
    """True if ``pid`` names a live process (a zombie is not alive for our purposes)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, to the clock tick), or None.
    A pid is reused once the machine wraps its pid counter (32768 by default): a process
    that started after a record naming its pid was written is not the one it names."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rpartition(b")")[2].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (a mount's daemon, its frontend process and
    workers), from ``/proc/PID/task/TID/children``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (all their threads); gone ones count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)
    return total / _CLK_TCK


#: What every FanStore process runs with. FanStore multiplies no matrices, yet numpy's
#: OpenBLAS starts a thread per core when numpy is imported: 63 in each rank, pool worker,
#: select reader and FUSE worker of a 64-core node, and every process threaded before it
#: may fork. On this 2-core machine the one extra thread costs 0.1 s of CPU per process
#: (an import of numpy: 0.19 s with it, 0.09 s without), a fifth of a small pack's.
PROCESS_ENV = {"OPENBLAS_NUM_THREADS": "1"}


def own_environment(base: dict | None = None) -> dict:
    """``base`` (default: ours) with :data:`PROCESS_ENV`: a FanStore child's environment."""
    env = dict(os.environ if base is None else base)
    env.update(PROCESS_ENV)
    return env


#: prctl(2) option: the signal a process gets when its parent thread ends.
_PR_SET_PDEATHSIG = 1
#: The environment variable a spawned worker finds its parent's pid in.
_PARENT_ENV = "FANSTORE_WORKER_PARENT"


def spawn_worker(module: str, fds: list[int], args: list = ()) -> subprocess.Popen:
    """Start ``python -m module FD... ARG...``: a fresh interpreter that inherits only
    ``fds`` (their numbers are its first arguments).

    The child is created by fork-and-exec in C (``subprocess``: vfork where it can), which
    is safe from a process with threads, unlike ``os.fork`` or multiprocessing's fork and
    forkserver start methods: a fork copies a lock some other thread holds (in malloc, in
    a codec, in the logging module, in s3fs' event loop) and the child blocks on it
    forever. Nothing of the parent's ``__main__`` is run again (as multiprocessing's
    spawn would). The child calls :func:`become_worker` first. Standard input is
    /dev/null; output goes where ours goes."""
    env = own_environment()
    env[_PARENT_ENV] = str(os.getpid())
    argv = [sys.executable, "-m", module, *map(str, fds), *map(str, args)]
    return subprocess.Popen(argv, pass_fds=fds,
                            stdin=subprocess.DEVNULL, close_fds=True, env=env)


def spawn_piped(module: str, fds: list[int] = (), args: list = ()
                ) -> tuple[subprocess.Popen, int, int]:
    """:func:`spawn_worker` with a pipe each way: the worker's first two arguments are the
    read end of its command pipe and the write end of its result pipe (then ``fds``, then
    ``args``). Returns the process, our write end of the commands and our read end of the
    results; the worker's ends are closed here, so its death is the result pipe's EOF."""
    cmd_r, cmd_w = os.pipe()
    res_r, res_w = os.pipe()
    try:
        proc = spawn_worker(module, [cmd_r, res_w, *fds], args)
    except BaseException:
        for fd in (cmd_w, res_r):
            os.close(fd)
        raise
    finally:
        os.close(cmd_r)
        os.close(res_w)
    return proc, cmd_w, res_r


def die_with_parent(parent: int | None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent ends
    (``PR_SET_PDEATHSIG``; ``sig`` 0 disarms it). Returns False when the parent is not
    ``parent`` any more (it ended before the signal was armed: the caller must end now);
    True when armed, or when this is not Linux (nothing armed)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return True
    return parent is None or sig == 0 or os.getppid() == parent


def become_worker() -> None:
    """The first call of a worker started by :func:`spawn_worker`: die with the parent
    (``PR_SET_PDEATHSIG``: SIGKILL of the parent ends the worker at once, whatever it is
    doing; a parent already gone before the call is caught by the pid check after it),
    leave ^C to the parent. Codec libraries run on one thread (the parent runs one worker
    per core) by their codecs' own arguments: ``compressors.blosc2`` passes ``nthreads=1``
    to every call, so blosc2 is not imported here (0.2-0.3 s of CPU, half of a pack worker's
    start, for a library few stores use)."""
    parent = os.environ.pop(_PARENT_ENV, "")
    # not Linux: the command pipe's EOF ends the worker
    if not die_with_parent(int(parent) if parent.isdigit() else None):
        os._exit(1)  # the parent died before the death signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)


#: A message between a process and a worker it started: ``<B Q`` (kind, body length), then
#: the body (whose encoding is the caller's: never pickle).
FRAME = struct.Struct("<BQ")


def write_frame(fd: int, kind: int, body: bytes = b"") -> None:
    """One whole frame to the pipe ``fd`` (blocking)."""
    view = memoryview(FRAME.pack(kind, len(body)) + body)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int) -> tuple[int, bytes] | None:
    """The next frame from the pipe ``fd`` (blocking); None at EOF (the writer is gone)."""
    head = _read_exact(fd, FRAME.size)
    if head is None:
        return None
    kind, n = FRAME.unpack(head)
    body = _read_exact(fd, n) if n else b""
    return None if body is None else (kind, body)


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        data = os.read(fd, min(n - got, 1 << 20))
        if not data:
            return None
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def setup_logging(debug: bool = False, stream=None, fmt: str | None = None) -> None:
    """Log to ``stream`` (stderr) at INFO, or DEBUG with ``debug``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(
        fmt or "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


class Detached:
    """What :func:`daemonize` returns: in the parent ``child`` is False (the daemon is
    ready); in the daemon it is True and ``code`` is the daemon's exit status."""

    def __init__(self, child: bool, code: int = 0) -> None:
        self.child = child
        self.code = code


def daemonize(log_fd: int, body: Callable[[ReadySignal], object],
              debug: bool = False, log_name: str = "the daemon's log",
              timeout: float | None = None) -> Detached:
    """Run ``body(ready)`` in a background child; the parent returns once the child
    called ``ready()`` (or raises MountError with the child's error, or when the child
    made no progress for ``timeout`` seconds: it is then stopped).

    The child starts a new session, sends its output to ``log_fd`` (an open file the caller
    made private, named ``log_name`` in messages), and reports a FanStoreError (or an
    internal error, logged with its traceback) through the ready pipe before it returns;
    both processes then return to the caller, which exits.
    """
    log_file = log_name
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            os.setsid()
            fd = log_fd
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.close(null)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            setup_logging(debug, sys.stderr)

            result = body(ReadySignal(w))
            code = int(result) if isinstance(result, int) else 0
        except FanStoreError as exc:
            log.error("%s", exc)
            _pipe_write(w, f"error: {exc}")
            code = exc.exit_code
        except BaseException as exc:  # noqa: BLE001 - the daemon must report, not vanish
            log.exception("daemon failed")
            _pipe_write(w, f"error: internal error ({type(exc).__name__}: {exc}); "
                           f"see {log_file}")
            code = 70
        finally:
            try:
                os.close(w)
            except OSError:
                pass
        return Detached(True, code)
    os.close(w)
    os.close(log_fd)
    try:
        text = read_ready(r, timeout, f"the daemon (pid {pid})")
    except ReadyTimeout as exc:
        _pipe_kill(pid)
        raise MountError(f"{exc} (--start-timeout): stopped it; see {log_file}") from None
    finally:
        os.close(r)
    if text == "ready":
        return Detached(False)
    status = wait_exit(pid, 30.0)  # it reported and is leaving
    if text.startswith("error: "):
        err = MountError(text[len("error: "):])
        err.exit_code = (os.waitstatus_to_exitcode(status) if status is not None else 0) or 1
        raise err
    raise MountError(f"the daemon exited before the mount was ready; see {log_file}")


class ReadySignal:
    """What a background daemon's body is given: call it once serving (the waiting
    command returns); :meth:`progress` after each step of a long start (a partition
    staged): each restarts the waiting command's deadline."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.done = False

    def __call__(self) -> None:
        self.done = True
        _pipe_write(self.fd, "ready\n")

    def progress(self) -> None:
        if not self.done:
            _pipe_write(self.fd, PROGRESS.decode())


def _pipe_kill(pid: int) -> None:
    """SIGTERM to a daemon that stayed silent (it cleans up as on any stop), reaped within
    10 s, else SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
        if wait_exit(pid, 10.0) is None:
            os.kill(pid, signal.SIGKILL)
            wait_exit(pid, 5.0)
    except ProcessLookupError:
        pass


class ReadyTimeout(MountError):
    """A ready pipe stayed silent past its deadline (the other side still runs)."""


#: what a ready pipe carries besides its last word: one byte per step of progress
PROGRESS = b"."


def read_ready(fd: int, timeout: float | None = None, what: str = "the daemon",
               alive: Callable[[], bool] | None = None) -> str:
    """Read a ready pipe: "ready" once the other side wrote ``ready\n``, else what it wrote
    before closing its end (an ``error: ...`` line, or nothing if it died).

    ``timeout``: seconds the other side may stay silent; each progress byte it writes
    (:data:`PROGRESS`, e.g. one per partition staged) starts the wait again, so a long
    but moving start is never cut while a stuck one is. Past it, :class:`ReadyTimeout`
    names ``what`` did not arrive. ``alive``: checked twice a second; once it is false
    (what the other side waits for is gone) the wait ends with :class:`ReadyTimeout`."""
    import select
    import time

    data = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not poller.poll(500 if alive is not None or deadline is not None else -1):
            if alive is not None and not alive():
                raise ReadyTimeout(f"{what} was not ready when what it waits for went away "
                                   "(the MPI launcher or a worker rank)")
            if deadline is not None and time.monotonic() > deadline:
                raise ReadyTimeout(f"{what} did not report ready or progress within "
                                   f"{timeout:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data = (data + chunk).lstrip(PROGRESS)
        if data.startswith(b"ready\n"):
            return "ready"
    return data.decode(errors="replace").strip()


def wait_exit(pid: int, timeout: float) -> int | None:
    """Reap child ``pid`` within ``timeout`` seconds: its wait status, or None if it is
    still running then (it is left to end by itself; never a wait without end)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _pipe_write(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode(errors="replace")[:4000])
    except OSError:
        pass
