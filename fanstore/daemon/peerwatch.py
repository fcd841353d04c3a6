"""A node's watch on the other nodes: probes while it serves, and the drain after (no MPI).

While the node serves, :meth:`PeerWatch.watch` re-probes the ranks marked dead every
``PROBE_INTERVAL`` seconds, probes every peer when the launcher reports a dead process
(SIGUSR1 under hydra: :meth:`PeerWatch.alarm`), and stops the node when the launcher is
gone. Once the node has unmounted, :meth:`PeerWatch.drain` keeps it serving the other nodes
until each is done (node 0 collects every node's DONE and then sends ALL_DONE) or dead;
when the whole job stops it waits at most ``DRAIN_GRACE`` for them (under scancel Slurm sends SIGKILL KillWait seconds after SIGTERM,
often 5 s or less). Everything goes through a
:class:`~fanstore.daemon.transport.Transport` and a
:class:`~fanstore.daemon.routing.PeerSource`, so it is testable without mpiexec.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fanstore.daemon import protocol as P

log = logging.getLogger(__name__)

#: How long a stopping job's daemon waits for its peers to say they are done (see drain).
DRAIN_GRACE = 2.0
#: Seconds between probes of peers marked dead while serving.
PROBE_INTERVAL = 5.0
#: Seconds between the serving node's checks of what died (its shim, its worker ranks,
#: peers marked dead): a death is acted on within this plus a ping's timeout.
CHECK_INTERVAL = 1.0


class PeerWatch:
    """Node ``node``'s view of the ``nodes`` nodes of the job.

    ``others``: the transport ranks of the other nodes' daemons (where SHUTDOWN and DONE
    go); ``timeout``: the remote timeout (a ping waits at most 5 s of it); ``alive()``:
    whether the MPI launcher is still there. The transport and the peer source are
    attached once the node has them (:meth:`attach`); until then probes do nothing.
    """

    def __init__(self, node: int, nodes: int, others: list[int], timeout: float, who: str,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self.node = node
        self.nodes = nodes
        self.others = others
        self.timeout = timeout
        self.who = who
        self.alive = alive
        self.transport = None
        self.peers = None
        #: set to probe at once (a signal); ``everyone``: probe every peer, not only the dead
        self.now = threading.Event()
        #: DONE was sent to every node directly (node 0 is dead: nobody relays)
        self.direct = False
        self.everyone = False
        #: ranks a ping of ours found dead (not only a read that timed out): no need to
        #: ping them again before acting on their death
        self.pinged_dead: set[int] = set()

    def attach(self, transport, peers) -> None:
        self.transport = transport
        self.peers = peers

    def alarm(self, everyone: bool = False) -> None:
        """Probe now (thread-safe); ``everyone``: the launcher reports a dead process."""
        if everyone:
            self.everyone = True
        self.now.set()

    def watch(self, serving: threading.Event, request_stop: Callable[[str], None],
              check: Callable[[], None] = lambda: None) -> None:
        """While ``serving``: re-probe unreachable peers every few seconds, probe every peer
        when the launcher reports a dead process, stop if the launcher is gone; ``check()``
        (the node's verdict on what died: fanstore.daemon.node) runs every
        ``CHECK_INTERVAL`` seconds and after every probe."""
        last_probe = time.monotonic()
        while serving.is_set():
            if not self.alive():
                request_stop("the MPI launcher is gone")
                return
            check()
            alarmed = self.now.wait(CHECK_INTERVAL)
            if not serving.is_set():
                return
            if not alarmed and time.monotonic() - last_probe < PROBE_INTERVAL:
                continue
            everyone = self.now.is_set() and self.everyone
            self.now.clear()
            self.everyone = False
            self.probe(only_dead=not everyone)
            last_probe = time.monotonic()

    def probe(self, only_dead: bool = False, deadline: float | None = None) -> None:
        """Ping the ranks of the other nodes (only those marked dead, or all); no ping
        waits past ``deadline`` (monotonic), and an expired one is not a death."""
        if self.transport is None or self.peers is None:
            return
        timeout = min(5.0, self.timeout)
        for node in range(self.nodes):
            if node == self.node or node in self.peers.done:
                continue
            for r in self.peers.ranks_of(node):
                if only_dead and r not in self.peers.dead:
                    continue
                wait = timeout
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return
                if self.transport.ping(r, wait):
                    self.peers.revive(r)
                    self.pinged_dead.discard(r)
                elif node in self.peers.done:
                    # it said DONE while we waited: its ranks stopped serving on purpose
                    # (a rank that ends its service does not answer pings; not a death)
                    break
                elif wait < timeout:
                    return  # cut short by the deadline: no verdict
                else:
                    self.peers.mark_dead(r, f"no answer to a ping within {timeout:g} s")
                    self.pinged_dead.add(r)

    def say_done(self) -> None:
        """Tell node 0 that this node has unmounted (DONE); node 0 tells every node once
        all are (ALL_DONE, :meth:`drain`): 2N messages for the job's end, not N² (at
        4,096 nodes, 16.8 million). Node 0 itself has nobody to tell yet."""
        if self.node != 0 and self.others:
            self.transport.send_control(P.Control.DONE, self.others[:1], "unmounted")

    def _done_directly(self) -> None:
        """Node 0 is dead: nobody relays, so tell every node ourselves (once)."""
        if not self.direct:
            self.direct = True
            self.transport.send_control(P.Control.DONE, self.others, "unmounted")

    def drain(self, stopped: Callable[[], bool], job_stopping: Callable[[], bool]) -> list[int]:
        """After unmounting (and :meth:`say_done`): wait, serving the peers, until every
        other node is done or dead, ``stopped()`` (a signal) or the launcher is gone. When
        ``job_stopping()`` (every node stops) the wait ends ``DRAIN_GRACE`` seconds after it
        began: returns the nodes still waited for then (the caller must then exit without
        MPI_Finalize, which could wait on them past SIGKILL), else []."""
        others = [n for n in range(self.nodes) if n != self.node]
        grace_end = time.monotonic() + DRAIN_GRACE
        last_probe = 0.0  # probe at once: a peer may have died while nobody asked it
        announced = False
        while not stopped() and self.alive():
            waiting = {n for n in others if n not in self.peers.done
                       and not self.peers.node_dead(n)}
            if not waiting:
                if self.node == 0:  # everyone is done: let them all go, naming the dead
                    self.transport.send_control(P.Control.ALL_DONE, self.others,
                                                all_done_reason(self.peers.dead_nodes()))
                break
            if self.node != 0 and self.peers.node_dead(0):
                self._done_directly()
            if job_stopping() and time.monotonic() > grace_end:
                incomplete = sorted(waiting)
                log.info("%s: the job is stopping; not waiting longer for nodes %s",
                         self.who, incomplete)
                return incomplete
            if not announced:
                log.info("%s: unmounted; serving peers until nodes %s are done", self.who,
                         sorted(waiting))
                announced = True
            if self.now.is_set() or time.monotonic() - last_probe > PROBE_INTERVAL:
                self.now.clear()
                # Once the whole job stops, no probe may outlast the grace: Slurm's
                # SIGKILL follows SIGTERM by KillWait seconds, and a ping to a node that
                # finished meanwhile goes unanswered (CI: 5 s ping, staged data left).
                self.probe(deadline=grace_end if job_stopping() else None)
                last_probe = time.monotonic()
            time.sleep(0.05)
        return []


def all_done_reason(dead: list[int]) -> str:
    """ALL_DONE's text: the nodes node 0 found dead (a node that is told "done" about a
    dead peer must still know it is dead: MPI_Finalize with a dead peer hangs)."""
    return "dead " + " ".join(str(n) for n in dead) if dead else "all done"


def dead_in(reason: str) -> list[int]:
    """The dead nodes an ALL_DONE names (:func:`all_done_reason`)."""
    if not reason.startswith("dead "):
        return []
    return [int(x) for x in reason[5:].split() if x.isdigit()]


def lost_partitions(table, dead: set[int]) -> list[int]:
    """The partitions of placement ``table`` (partition -> the nodes holding it) whose
    every holder is in ``dead``: data no live node can serve."""
    return [p for p, holders in enumerate(table) if holders and set(holders) <= dead]


#: how a SHUTDOWN's reason says that a process of the job died (relays prefix "node N: ")
DEATH = "a process of the job died: "


def death_reason(text: str) -> str:
    """A SHUTDOWN reason saying a process of the job died (the ranks that get it exit
    without MPI_Finalize, which would wait for the dead one)."""
    return DEATH + text


def is_death(reason: str) -> bool:
    return DEATH in reason
