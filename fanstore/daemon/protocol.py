"""The peer protocol: fixed struct headers and raw bytes, never pickled objects.

Every message travels on the daemon's private communicator (a ``Dup()`` of the world).

    tag TAG_REQUEST   request  REQ_HEADER (48 bytes)
        magic "FSRQ", version u16, op u16, part u32, reply_tag u32, offset u64, length u64,
        request id u64, piece u32, reserved u32
    tag <reply_tag>   response RESP_HEADER (24 bytes) followed by ``length`` payload bytes,
        magic "FSRS", version u16, status u16, length u64, request id u64; with ``piece``
        > 0 the reply is split into messages of at most ``piece`` bytes: the header and the
        first ``piece - 24`` payload bytes, then the rest ``piece`` bytes at a time (all
        on the reply tag, so they match the asker's receives in order)
    tag TAG_CONTROL   control  CTRL_HEADER (16 bytes) + UTF-8 reason, at most CTRL_MAX bytes
        magic "FSCT", version u16, kind u16, rank u32, reason length u32

A request asks for ``length`` stored (still compressed) bytes of partition ``part`` at
``offset``; the response carries exactly those bytes, or a non-zero status and no payload
(one message). Why pieces: MPI sends a message above its eager limit (8 KB with MPICH's
shared memory here) only while the sender keeps calling into MPI, so a 100 kB reply kept
the serving rank polling until the asker took it (measured: ~300 us per reply with the
asker 200 us late); pieces under the limit are copied out at once and the server is free.
Decoders here validate everything: a malformed message is a ProtocolError, never a crash.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from fanstore.errors import FanStoreError
from fanstore.settings import DEFAULT_MPI_PIECE, MIN_MPI_PIECE

VERSION = 2
TAG_REQUEST = 11
TAG_CONTROL = 12
#: Reply tags are drawn from [REPLY_TAG_BASE, tag upper bound).
REPLY_TAG_BASE = 1000

REQ = struct.Struct("<4sHHIIQQQII")
RESP = struct.Struct("<4sHHQQ")
CTRL = struct.Struct("<4sHHII")
REQ_MAGIC, RESP_MAGIC, CTRL_MAGIC = b"FSRQ", b"FSRS", b"FSCT"
CTRL_MAX = 512
#: Largest payload one request may ask for (a file's stored run is read in pieces of this).
MAX_REQUEST = 1 << 30


class Op(IntEnum):
    READ = 1
    PING = 2


class Status(IntEnum):
    OK = 0
    BAD_REQUEST = 1
    NOT_HERE = 2
    IO_ERROR = 3
    STOPPING = 4


class Control(IntEnum):
    SHUTDOWN = 1  # stop and unmount everywhere (e.g. SIGTERM at the time limit)
    DONE = 2  # the sender has unmounted; it keeps serving until everyone is done
    ALL_DONE = 3  # from node 0: every node has unmounted (or is dead); drains may end


class ProtocolError(FanStoreError):
    """A message that does not follow the protocol."""


@dataclass(frozen=True)
class Request:
    op: int
    part: int
    reply_tag: int
    offset: int
    length: int
    req_id: int
    piece: int = 0  # split the reply into messages of at most this many bytes (0: one)


#: Where a response header's status (u16) is: a reply whose first message says other
#: than OK (0) is that message alone.
RESP_STATUS_AT = 6
#: Reply messages under MPICH's eager limit on shared memory (``$FANSTORE_MPI_PIECE``,
#: fanstore.settings, which refuses a value this protocol cannot use).
DEFAULT_PIECE = DEFAULT_MPI_PIECE
assert MIN_MPI_PIECE > RESP.size  # a piece carries the reply header and data


def pieces(length: int, piece: int) -> list[tuple[int, int]]:
    """(start, end) of each message of a reply carrying ``length`` payload bytes, as
    offsets into header + payload; one message when ``piece`` is 0."""
    total = RESP.size + length
    if piece <= RESP.size or piece >= total:
        return [(0, total)]
    return [(o, min(total, o + piece)) for o in range(0, total, piece)]


@dataclass(frozen=True)
class Response:
    status: int
    length: int
    req_id: int


@dataclass(frozen=True)
class ControlMsg:
    kind: int
    rank: int
    reason: str


def encode_request(r: Request) -> bytes:
    return REQ.pack(REQ_MAGIC, VERSION, r.op, r.part, r.reply_tag, r.offset, r.length, r.req_id,
                    r.piece, 0)


def decode_request(buf) -> Request:
    if len(buf) != REQ.size:
        raise ProtocolError(f"request of {len(buf)} bytes, expected {REQ.size}")
    magic, version, op, part, reply_tag, offset, length, req_id, piece, _ = REQ.unpack(buf)
    if magic != REQ_MAGIC or version != VERSION:
        raise ProtocolError("request with a bad magic or version")
    if op not in (Op.READ, Op.PING):
        raise ProtocolError(f"request with unknown op {op}")
    if reply_tag < REPLY_TAG_BASE:
        raise ProtocolError(f"request with reserved reply tag {reply_tag}")
    if length > MAX_REQUEST:
        raise ProtocolError(f"request for {length} bytes (at most {MAX_REQUEST})")
    if piece and piece <= RESP.size:
        raise ProtocolError(f"request with a reply piece of {piece} bytes")
    return Request(op, part, reply_tag, offset, length, req_id, piece)


def encode_response_header(status: int, length: int, req_id: int) -> bytes:
    return RESP.pack(RESP_MAGIC, VERSION, status, length, req_id)


def decode_response_header(buf, piece: int = 0) -> Response:
    """The header of a response whose first message is ``buf`` (of a request that asked
    for replies in ``piece``-byte messages)."""
    if len(buf) < RESP.size:
        raise ProtocolError(f"response of {len(buf)} bytes is shorter than its header")
    magic, version, status, length, req_id = RESP.unpack_from(buf)
    if magic != RESP_MAGIC or version != VERSION:
        raise ProtocolError("response with a bad magic or version")
    if status not in Status.__members__.values():
        raise ProtocolError(f"response with unknown status {status}")
    if status == Status.OK:
        start, end = pieces(length, piece)[0]
        if len(buf) != end - start:
            raise ProtocolError(f"response says {length} bytes but its first message carries "
                                f"{len(buf) - RESP.size}")
    return Response(status, length, req_id)


def encode_control(kind: int, rank: int, reason: str = "") -> bytes:
    text = reason.encode("utf-8", "replace")[: CTRL_MAX - CTRL.size]
    return CTRL.pack(CTRL_MAGIC, VERSION, kind, rank, len(text)) + text


def decode_control(buf) -> ControlMsg:
    if len(buf) < CTRL.size:
        raise ProtocolError("control message shorter than its header")
    magic, version, kind, rank, n = CTRL.unpack_from(buf)
    if magic != CTRL_MAGIC or version != VERSION:
        raise ProtocolError("control message with a bad magic or version")
    if kind not in (Control.SHUTDOWN, Control.DONE, Control.ALL_DONE):
        raise ProtocolError(f"control message of unknown kind {kind}")
    if CTRL.size + n != len(buf):
        raise ProtocolError("control message length mismatch")
    reason = bytes(buf[CTRL.size : CTRL.size + n]).decode("utf-8", "replace")
    return ControlMsg(kind, rank, reason)
