"""How the daemon's pollers wait: paced sleeps instead of blocking calls (no MPI here).

MPICH's blocking calls busy-poll a core (measured: 2 s of CPU per 3 s wait), so no blocking
MPI call is ever used after start-up: every wait is a ``Test`` and a sleep. These helpers
choose the sleeps. :class:`Backoff` grows them while nothing happens (an idle rank costs
well under 1% of a core); :class:`Pacer` sleeps about as long as the thing waited for took
the last times (a reply's latency, the gap between requests); :func:`wait_request` polls
anything with a ``Test()`` (an MPI request) until it completes or a deadline passes.
"""

from __future__ import annotations

import time


class Backoff:
    """Sleep between polls: short while busy, growing to ``longest`` when idle, and to
    ``coldest`` once idle for ``cold_after`` seconds.

    For ``hot`` seconds after the last activity the sleep stays at ``shortest`` (a stream
    of requests is answered without delay); then it grows by half each time up to
    ``longest``, so a pause of a second costs little; after ``cold_after`` seconds without
    activity it may grow to ``coldest``: an idle mounted job has a node's every rank
    polling, and the node's idle budget is a few per cent of one core (measured: ~1.6% of
    a core per process at 2 ms, ~0.1% at 50 ms). The first request after a long pause
    then waits up to ``coldest``.
    """

    __slots__ = ("cold_after", "coldest", "current", "hot", "last", "longest", "shortest")

    def __init__(self, shortest: float = 20e-6, longest: float = 2e-3, hot: float = 0.0,
                 coldest: float | None = None, cold_after: float = 1.0) -> None:
        self.shortest = shortest
        self.longest = longest
        self.current = shortest
        self.hot = hot
        self.last = time.monotonic()
        self.coldest = longest if coldest is None else max(longest, coldest)
        self.cold_after = cold_after

    def reset(self) -> None:
        self.current = self.shortest
        self.last = time.monotonic()

    def sleep(self) -> None:
        time.sleep(self.current)
        idle = time.monotonic() - self.last
        if not self.hot or idle > self.hot:
            cap = self.coldest if idle > self.cold_after else self.longest
            self.current = min(cap, self.current * 1.5)


def wait_request(req, deadline: float | None, backoff: Backoff | None = None,
                 status=None) -> bool:
    """Poll an MPI request until it completes (True) or ``deadline`` passes (False)."""
    backoff = backoff or Backoff(longest=250e-6)
    while True:
        done = req.Test(status) if status is not None else req.Test()
        if done:
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        backoff.sleep()


_PR_SET_TIMERSLACK = 29
#: A server that answered a request within this many seconds polls fast (Pacer.quarter);
#: after that it backs off (Backoff) and, idle for a second, cools to ``cold_sleep``.
HOT_SECONDS = 0.05


def precise_sleeps(slack_ns: int = 1000) -> None:
    """Make this thread's short sleeps precise (PR_SET_TIMERSLACK): by default the kernel
    may stretch a 20 us sleep to 100 us; a polling thread then answers later for nothing.
    Each wake-up costs ~20 us of CPU on a VM whatever the length, so the pollers below
    choose their sleeps from what they expect instead (see Pacer)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, slack_ns, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Pacer:
    """How long to sleep between polls for something whose timing repeats: an EWMA of the
    last observed intervals (a reply's latency, the gap between requests). A poller sleeps
    ``share`` of the expected interval first and shorter steps after, so a reply that takes
    as long as the last ones costs two or three wake-ups instead of one per 20-50 us (each
    wake-up costs ~20 us of CPU here: measured)."""

    __slots__ = ("ewma", "hi", "lo", "share")

    def __init__(self, start: float = 200e-6, lo: float = 20e-6, hi: float = 2e-3,
                 share: float = 0.6) -> None:
        self.ewma = start
        self.lo = lo
        self.hi = hi
        self.share = share

    def observe(self, seconds: float) -> None:
        self.ewma += 0.2 * (min(seconds, 20 * self.hi) - self.ewma)

    def first(self) -> float:
        return min(self.hi, max(self.lo, self.share * self.ewma))

    def step(self) -> float:
        return min(self.hi, max(self.lo, 0.25 * self.ewma))

    def quarter(self) -> float:
        return min(self.hi, max(self.lo, 0.25 * self.ewma))

