"""Living with MPICH's hydra launcher when a peer dies.

When one rank dies, hydra's proxy signals the process group of every other rank: SIGUSR1
(a notification) and then, depending on a race inside hydra even with
``-disable-auto-cleanup``, SIGKILL. A daemon killed that way takes its node's mount with
it, which defeats replicas. Measured here (MPICH 5.0.2): survivors lived through a peer's
SIGKILL in about half of the runs without this shim and in all runs with it.

So under hydra the process hydra started (the "shim") forks the real daemon into a process
group of its own, forwards every signal it gets to it (SIGUSR1 included: the daemon
probes its peers), and exits with the daemon's status. A broadcast SIGKILL then ends only
the shim. The daemon watches the launcher (hydra's proxy) and stops its node if the
launcher goes away, so it cannot outlive the job; while serving it also watches its shim
(:func:`shim_gone`): once hydra has ended the shim no signal of the launcher reaches the
daemon any more, so its node probes every peer and ends the job unless replicas carry it
(``Node.check_deaths``). The daemon does MPI_Init itself: the
shim never touches MPI, so the PMI connection it inherits is unused until then.

``srun`` tracks a step's processes by itself (cgroups or the process tree), so no shim is
needed there.
"""

from __future__ import annotations

import os
import signal
import stat

from fanstore.process import die_with_parent

HYDRA_ENV = "HYDI_CONTROL_FD"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)

#: pid of the launcher process to watch (hydra's proxy), set in the daemon by ``shim()``.
launcher_pid: int | None = None
#: in the shim, once the daemon has exited: why it failed, when the daemon could not say
shim_error: str | None = None
#: in the daemon: the shim's pid (hydra kills the shims of every rank when one rank dies)
shim_pid: int | None = None


def shim_gone() -> bool:
    """The shim this rank was forked from has ended: hydra killed it because a process of
    the job died (a starting node gives up: its gates cannot pass)."""
    return shim_pid is not None and os.getppid() != shim_pid


def under_hydra() -> bool:
    """Started by hydra: as a launched rank (its control fd) or as a rank spawned by
    MPI_Comm_spawn (a spawned process has no control fd, only its PMI fd)."""
    return bool(os.environ.get(HYDRA_ENV)) or (
        os.environ.get("PMI_SPAWNED") == "1" and bool(os.environ.get("PMI_FD")))


def shim() -> int | None:
    """Under hydra, fork the daemon into its own process group.

    Returns None in the daemon (and when not under hydra: nothing to do); in the shim it
    returns, once the daemon has exited, the status the shim must exit with at once (the
    caller exits without running anything else: this process never touched MPI).
    """
    global launcher_pid
    if not under_hydra():
        return None
    global shim_pid
    proxy = os.getppid()
    me = os.getpid()
    # The shim dies with hydra's proxy (a proxy killed by signal leaves it waiting),
    # and until MPI_Init has returned the daemon dies with its shim (see mpi_started).
    if not die_with_parent(proxy):
        return 1
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)
        launcher_pid = proxy
        shim_pid = me
        if not die_with_parent(me):
            os._exit(1)
        return None
    for s in FORWARDED:
        signal.signal(s, lambda signum, _frame: _forward(child, signum))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            return 1
    global shim_error
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
        # the alarm around MPI_Init (fanstore.daemon.world._init_mpi) went off
        shim_error = ("MPI_Init did not complete within --start-timeout (60 s at least): a "
                      "rank of the job did not start, or the launcher is stuck")
    return (os.waitstatus_to_exitcode(status) if os.WIFEXITED(status)
            else 128 + os.WTERMSIG(status))


def mpi_started() -> None:
    """MPI_Init has returned: from now on this rank's own waits and its :class:`Lifeline`
    watch the launcher, so it no longer dies with its shim (hydra kills every shim when a
    process of the job dies, which must not take a serving node down: replicas).

    Until then nothing of ours can run: MPI_Init holds the interpreter while it waits for
    every rank, and with the launcher gone it spins there (measured: ``mpiexec -n 32``
    SIGKILLed 5-6 s into the start left 1-29 daemons spinning in MPI_Init, in 4 runs of
    12, until their 300 s start-up alarm), so the kernel's parent-death signal, armed in
    :func:`shim`, ends it."""
    if shim_pid is not None:
        die_with_parent(None, 0)
    if _lifeline is not None and _lifeline.start_deadline is not None:
        _lifeline.arm(*_lifeline.start_deadline)


#: the MPI library's shared-memory segments in /dev/shm, one per host and job (MPICH, UCX)
MPI_SHM_PREFIXES = ("mpich_shm_", "ucx_shm_")


def release_mpi_shm() -> list[str]:
    """Before leaving without MPI_Finalize (a process of the job died): unlink the MPI
    library's shared-memory segments this rank maps, which only MPI_Finalize unlinks. A
    job that ended with a death left each host's segment in /dev/shm, in RAM, for good
    (16-135 MB each here, measured; a full /dev/shm then fails the next mount). The host's
    other ranks keep their mappings: they are past MPI_Init, the only time a segment is
    opened by name. Only this uid's regular files, never through a symlink (/dev/shm is
    sticky: nobody else can swap them). Returns the paths removed."""
    removed: list[str] = []
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return removed
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = os.fsdecode(fields[5])
        where, name = os.path.split(path)
        if where != "/dev/shm" or not name.startswith(MPI_SHM_PREFIXES) or path in removed:
            continue
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(path)
        except OSError:  # gone already (another rank of the host), or replaced
            pass
    return removed


def _forward(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


def launcher_alive() -> bool:
    if launcher_pid is None:
        return True
    try:
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() != 1 or _is_running(launcher_pid)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


#: seconds a rank whose launcher is gone has to end by itself before its lifeline ends it
LIFELINE_GRACE = 15.0


class Lifeline:
    """A thread that ends this rank when the launcher is gone, whatever the rank is blocked
    in (MPI_Init, a collective, a C call that never returns): the rank's own waits notice
    first and stop it cleanly; if it is still here ``LIFELINE_GRACE`` seconds later, the
    lifeline calls ``on_gone`` (the node's emergency clean-up: unmount, index copy, staged
    data) and leaves with ``os._exit(1)``. Nothing to watch outside hydra (``srun``'s
    step ends its tasks itself)."""

    def __init__(self, alive, interval: float = 1.0, grace: float = LIFELINE_GRACE) -> None:
        import threading

        self.alive = alive
        self.interval = interval
        self.grace = grace
        self.on_gone = None
        self.deadline: tuple[float, str] | None = None
        self.start_deadline: tuple[float, str] | None = None
        self.thread = threading.Thread(target=self._run, name="fanstore-lifeline",
                                       daemon=True)

    def arm(self, seconds: float, what: str) -> None:
        """A backstop for a start step whose own waits did not end it: if ``what`` has
        not been :meth:`disarm`-ed within ``seconds``, this rank exits (a rank hung in
        a C call or before its first wait keeps its launcher, and so the whole job,
        waiting for it: measured, a worker rank hung before its hello)."""
        import time

        self.deadline = (time.monotonic() + seconds, what)

    def disarm(self) -> None:
        self.deadline = None

    def _run(self) -> None:
        import logging
        import time

        log = logging.getLogger("fanstore.launcher")
        while self.alive():
            time.sleep(self.interval)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline[0]:
                log.error("%s did not end in time: this rank is stuck; exiting", deadline[1])
                self._leave()
        log.error("the MPI launcher is gone; ending within %g s", self.grace)
        time.sleep(self.grace)
        log.error("still running %g s after the launcher left: cleaning up and exiting",
                  self.grace)
        self._leave()

    def _leave(self) -> None:
        try:
            if self.on_gone is not None:
                self.on_gone()
            release_mpi_shm()
        finally:
            os._exit(1)


#: this rank's lifeline, once :func:`watch_launcher` made it
_lifeline: Lifeline | None = None


def watch_launcher(start_deadline: tuple[float, str] | None = None) -> Lifeline:
    """Start this rank's :class:`Lifeline` (a no-op thread outside hydra);
    ``start_deadline`` (seconds, what) is armed once MPI_Init has returned (it has its own
    alarm, and no thread runs while it holds the interpreter)."""
    global _lifeline
    line = _lifeline = Lifeline(launcher_alive)
    line.start_deadline = start_deadline
    if launcher_pid is not None:
        line.thread.start()
    return line
