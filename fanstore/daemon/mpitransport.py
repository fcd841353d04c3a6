"""The MPI transport: a server thread that answers peers, and blocking client calls for
readers (the :class:`~fanstore.daemon.transport.Transport` of an MPI job).

Design (see docs/architecture.md, "A node is a group of MPI ranks"):

- One private communicator, a ``Dup()`` of the world, so nothing the user's code does on
  COMM_WORLD can match FanStore's messages.
- Bulk bytes travel as buffers with uppercase ``Isend``/``Irecv`` and ``struct`` headers
  (:mod:`fanstore.daemon.protocol`); nothing is pickled.
- The server thread keeps one ``Irecv`` posted for requests and one for control messages,
  answers each request from the local partitions (pread into a buffer, then the header
  and the stored bytes in pieces under MPI's eager limit when the asker names a piece
  size), and tracks its pending sends until they complete.
- Client calls run in reader threads (FUSE workers, remote-fetch threads; never on an
  event loop): they post the receives for the reply first, then send the request, then
  wait with ``Test`` and a paced sleep (:class:`Pacer`), up to a deadline. MPICH's
  blocking calls busy-poll a core (measured: 2 s of CPU per 3 s wait), so no blocking MPI
  call is ever used after start-up; an idle rank sleeps between tests and costs well
  under 1% of a core.
- Several threads call MPI at once, so MPI_THREAD_MULTIPLE is required (checked at start).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

from fanstore.daemon import protocol as P
from fanstore.daemon.mpirequests import AllOf, Posted, Reply, done, mpi_error
from fanstore.daemon.pacing import HOT_SECONDS, Backoff, Pacer, precise_sleeps, wait_request
from fanstore.daemon.transport import STOP_GRACE, PeerUnreachable, ReadsEnd, RemoteTimeout
from fanstore.errors import FanStoreError, RemoteError

log = logging.getLogger(__name__)


class MpiTransport:
    """Peer-to-peer fetches of stored bytes over a private communicator.

    ``parts`` answers requests for local partitions (``size_of``, ``read_into``);
    ``on_control(msg)`` is called from the server thread for SHUTDOWN/DONE messages.
    """

    def __init__(self, comm, parts, on_control: Callable[[P.ControlMsg], None],
                 idle_sleep: float = 2e-3, cold_sleep: float = 50e-3,
                 piece: int = P.DEFAULT_PIECE) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.parts = parts
        self.on_control = on_control
        self.idle_sleep = idle_sleep
        self.cold_sleep = cold_sleep
        tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
        self._tags = itertools.cycle(range(P.REPLY_TAG_BASE, min(int(tag_ub), 1 << 30)))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Requests we gave up on must keep their buffers alive: MPI may still write there.
        self._abandoned: list[tuple[object, object]] = []
        self.served_requests = 0
        self.served_bytes = 0
        self.server_errors = 0
        #: called after each request served (a worker rank copies its counts to the
        #: node's shared counters table)
        self.on_served: Callable[[], None] | None = None
        self._latency = Pacer(start=300e-6, lo=20e-6, hi=5e-3)  # of replies, seen here
        #: replies are asked for in messages of at most this many bytes (protocol.pieces)
        self.piece = piece if piece == 0 or piece > P.RESP.size else P.DEFAULT_PIECE
        #: when this rank's own reads give up (:meth:`interrupt`)
        self.reads_end = ReadsEnd()

    # ------------------------------------------------------------------ server
    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="fanstore-mpi-server",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _serve(self) -> None:
        MPI = self.MPI
        requests = Posted(self.comm, MPI, P.REQ.size, P.TAG_REQUEST, "request")
        controls = Posted(self.comm, MPI, P.CTRL_MAX, P.TAG_CONTROL, "control")
        pending: list[tuple[object, object]] = []
        precise_sleeps()
        gaps = Pacer(start=400e-6, lo=40e-6, hi=250e-6, share=0.25)
        last_request = time.monotonic()
        backoff = Backoff(50e-6, self.idle_sleep, coldest=self.cold_sleep, cold_after=1.0)
        try:
            while not self._stop.is_set():
                active = False
                raw = requests.take()
                if raw is not None:
                    active = True
                    now = time.monotonic()
                    gaps.observe(now - last_request)
                    last_request = now
                    reply = self._answer(raw, requests.source)
                    if reply is not None:
                        pending.append(reply)
                raw = controls.take()
                if raw is not None:
                    active = True
                    self._control(raw, controls.source)
                if pending:
                    pending = [(rq, buf) for rq, buf in pending if not done(rq)]
                    if pending:
                        active = True
                if active:
                    backoff.reset()
                    if not pending:
                        continue
                if pending:
                    time.sleep(gaps.lo)  # a reply on its way out needs our progress
                    continue
                idle = time.monotonic() - last_request
                if idle < HOT_SECONDS:
                    # Requests are coming: poll a quarter of the usual gap between them,
                    # within [40 us, 250 us]. Not half the gap or more: a reader waiting for
                    # this answer asks again only after it, so a slow answer stretches the
                    # gap and a poller that follows the gap keeps slowing down (measured:
                    # 0.32x a local read with one reader at half the gap).
                    time.sleep(gaps.quarter())
                    continue
                backoff.sleep()
        finally:
            self._drain(requests, controls, pending)

    def _control(self, raw: bytes, src: int) -> None:
        """Decode one control message and hand it to ``on_control``."""
        try:
            msg = P.decode_control(raw)
        except P.ProtocolError as exc:
            log.warning("ignoring a malformed control message from rank %d: %s", src, exc)
            return
        try:
            self.on_control(msg)
        except Exception:  # pragma: no cover - defensive
            log.exception("control handler failed")

    def _drain(self, requests: Posted, controls: Posted,
               pending: list[tuple[object, object]]) -> None:
        """On the way out: cancel the posted receives, give replies 2 s to leave, keep the
        buffers of those that did not (MPI may still read them)."""
        for posted in (requests, controls):
            self._cancel(posted.request, None)
        deadline = time.monotonic() + 2.0
        for rq, buf in pending:
            try:
                if not wait_request(rq, deadline):
                    self._abandoned.append((rq, buf))
            except self.MPI.Exception:
                pass

    def _answer(self, raw: bytes, src: int):
        """Build and send the reply to one request; returns (request, buffer) or None."""
        MPI = self.MPI
        try:
            req = P.decode_request(raw)
        except P.ProtocolError as exc:
            self.server_errors += 1
            log.warning("malformed request from rank %d: %s", src, exc)
            return None  # no valid reply tag to answer on
        if req.op == P.Op.PING:
            buf, status = P.encode_response_header(P.Status.OK, 0, req.req_id), None
        else:
            buf, status = self._read(req)
            if status != P.Status.OK:
                self.server_errors += 1
                buf = P.encode_response_header(status, 0, req.req_id)
        spans = P.pieces(req.length, req.piece) if status == P.Status.OK else [(0, len(buf))]
        view = memoryview(buf)
        sends = []
        try:
            for start, end in spans:
                sends.append(self.comm.Isend([view[start:end], MPI.BYTE], dest=src,
                                             tag=req.reply_tag))
        except MPI.Exception as exc:  # the asker is gone
            log.warning("cannot answer rank %d: %s", src, mpi_error(exc))
            if not sends:
                return None
        rq = sends[0] if len(sends) == 1 else AllOf(sends)
        return rq, buf

    def _read(self, req: P.Request):
        parts = self.parts
        if parts is None or not parts.has(req.part):
            return None, P.Status.NOT_HERE
        size = parts.size_of(req.part)
        if req.offset + req.length > size or req.length == 0:
            return None, P.Status.BAD_REQUEST
        buf = bytearray(P.RESP.size + req.length)
        P.RESP.pack_into(buf, 0, P.RESP_MAGIC, P.VERSION, P.Status.OK, req.length, req.req_id)
        try:
            parts.read_into(req.part, req.offset, memoryview(buf)[P.RESP.size:])
        except (OSError, FanStoreError) as exc:
            log.error("serving partition %d offset %d: %s", req.part, req.offset, exc)
            return None, P.Status.IO_ERROR
        self.served_requests += 1
        self.served_bytes += req.length
        if self.on_served is not None:
            self.on_served()
        return buf, P.Status.OK

    # ------------------------------------------------------------------ client
    def interrupt(self, reason: str, grace: float = STOP_GRACE) -> None:
        """This rank's node stops serving its mount: its reads of other ranks (waiting or
        new) end ``grace`` seconds from now at the latest, with :class:`Interrupted`
        (ENOTCONN). A live peer answers well within it; a reply from one that died would
        otherwise be waited for until the remote timeout, holding the reader and the
        node's end. Pings (the drain's probes), control messages and serving the peers go
        on. Safe in a signal handler."""
        self.reads_end.set(reason, grace)

    def _gave_up(self, owner: int, timeout: float, reads: bool = True) -> RemoteError:
        if reads and self.reads_end.passed():
            return self.reads_end.error(owner)
        return RemoteTimeout(f"rank {owner} did not answer within {timeout:g} s")

    def _next(self) -> tuple[int, int]:
        with self._lock:
            return next(self._tags), next(self._ids)

    def fetch(self, owner: int, part: int, offset: int, length: int, timeout: float,
              op: int = P.Op.READ) -> memoryview:
        """Stored bytes [offset, offset+length) of ``part`` from rank ``owner``.

        Raises RemoteTimeout if no answer arrives within ``timeout`` seconds (PeerUnreachable
        when MPI reports the peer gone) and RemoteError if the peer answers with an error.
        Blocking: call it from a worker thread.
        """
        try:
            return self._fetch(owner, part, offset, length, timeout, op)
        except self.MPI.Exception as exc:
            raise PeerUnreachable(f"rank {owner} is unreachable ({mpi_error(exc)})") \
                from None

    def _fetch(self, owner: int, part: int, offset: int, length: int, timeout: float,
               op: int) -> memoryview:
        reads = op == P.Op.READ  # (a ping is not a read: the drain's probes go on)
        if reads and self.reads_end.passed():
            raise self.reads_end.error(owner)
        reply = self._post(owner, part, offset, length, op)
        if not self._wait_reply(reply.complete, time.monotonic() + timeout, reads):
            reply.abandon()
            raise self._gave_up(owner, timeout, reads)
        return reply.result()

    def fetch_many(self, owner: int, ranges: list[tuple[int, int, int]], timeout: float
                   ) -> list[memoryview | RemoteError]:
        """Several ranges ``(part, offset, length)`` from rank ``owner`` at once: every
        request is sent before any reply is waited for, and all replies are waited for
        together (one paced wait for the batch, not one per range). Returns, per range,
        its bytes or the RemoteError it got; RemoteTimeout (PeerUnreachable) when the batch
        is not all answered within ``timeout``; Interrupted (see :meth:`interrupt`)."""
        if self.reads_end.passed():
            raise self.reads_end.error(owner)
        try:
            replies = [self._post(owner, p, off, n, P.Op.READ) for p, off, n in ranges]
        except self.MPI.Exception as exc:
            raise PeerUnreachable(f"rank {owner} is unreachable ({mpi_error(exc)})") \
                from None
        pending = list(replies)

        def complete() -> bool:
            pending[:] = [r for r in pending if not r.complete()]
            return not pending

        try:
            done = self._wait_reply(complete, time.monotonic() + timeout)
        except self.MPI.Exception as exc:
            raise PeerUnreachable(f"rank {owner} is unreachable ({mpi_error(exc)})") \
                from None
        if not done:
            for r in replies:
                r.abandon()
            raise self._gave_up(owner, timeout)
        out: list[memoryview | RemoteError] = []
        for r in replies:
            try:
                out.append(r.result())
            except RemoteError as exc:
                out.append(exc)
        return out

    def _post(self, owner: int, part: int, offset: int, length: int, op: int) -> Reply:
        """Post the receives of a reply, then send the request (see Reply)."""
        MPI = self.MPI
        tag, req_id = self._next()
        piece = self.piece if op == P.Op.READ else 0
        buf = bytearray(P.RESP.size + length)
        view = memoryview(buf)
        # one receive per piece of the reply (they match in order: same source and tag)
        recvs = [self.comm.Irecv([view[start:end], MPI.BYTE], source=owner, tag=tag)
                 for start, end in P.pieces(length, piece)]
        header = P.encode_request(P.Request(op, part, tag, offset, length, req_id, piece))
        r_send = self.comm.Isend([header, MPI.BYTE], dest=owner, tag=P.TAG_REQUEST)
        return Reply(self, owner, part, length, req_id, piece, buf, recvs, r_send, header)

    def _wait_reply(self, test: Callable[[], bool], deadline: float,
                    interruptible: bool = True) -> bool:
        """Poll ``test()`` (a reply complete?): a few tests at once (a fast peer), then
        sleep most of the latency the last replies had, then shorter steps (see Pacer);
        never past ``deadline``, nor past an :meth:`interrupt` (False: gave up). Records
        how long the reply took (what was slept through at the first wake-up is counted
        short, so the estimate can only fall to the truth, not feed on its own naps)."""
        t0 = time.monotonic()
        for _ in range(3):
            if test():
                self._latency.observe(time.monotonic() - t0)
                return True
        pace = self._latency
        nap = pace.first()
        wakes = 0
        while True:
            now = time.monotonic()
            left = deadline - now
            end = self.reads_end.left(now) if interruptible else None
            if end is not None:
                left = min(left, end)
            if left <= 0:
                return False
            time.sleep(min(nap, left))
            wakes += 1
            if test():
                took = time.monotonic() - t0
                pace.observe(took * 0.5 if wakes == 1 else took)
                return True
            nap = pace.step()

    def ping(self, owner: int, timeout: float) -> bool:
        try:
            self.fetch(owner, 0, 0, 0, timeout, op=P.Op.PING)
        except RemoteError:
            return False
        return True

    def send_control(self, kind: int, ranks, reason: str = "", timeout: float = 2.0) -> None:
        MPI = self.MPI
        msg = P.encode_control(kind, self.rank, reason)
        reqs = []
        for r in ranks:
            if r == self.rank:
                continue
            try:
                reqs.append(self.comm.Isend([msg, MPI.BYTE], dest=r, tag=P.TAG_CONTROL))
            except MPI.Exception as exc:
                log.info("cannot tell rank %d: %s", r, mpi_error(exc))
        deadline = time.monotonic() + timeout
        for rq in reqs:
            try:
                done = wait_request(rq, deadline)
            except MPI.Exception:
                continue
            if not done:
                self._abandoned.append((rq, msg))

    def _cancel(self, req, buf) -> None:
        try:
            req.Cancel()
            if not wait_request(req, time.monotonic() + 1.0):
                self._abandoned.append((req, buf))
        except Exception as exc:  # noqa: BLE001 - MPI errors on a dying job
            log.debug("cancel failed: %s", exc)
            self._abandoned.append((req, buf))
