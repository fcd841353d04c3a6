"""Tar headers, parsed by hand: the 512-byte ustar/GNU/v7 block, pax records, numbers.

Python's ``tarfile`` in stream mode costs tens of microseconds per member (it reads in
10 KiB records, builds a ``TarInfo`` with every field decoded, and keeps all of them in
``members``: a list that grows with the archive). The packer needs only a member's name,
type, mode, mtime, size and link target, so this module reads just those, from the bytes
as they are (names stay bytes: no decoding and encoding back).

What is understood (POSIX.1-1988 ustar, GNU and pax as GNU tar and Python write them):

- a header's checksum (the unsigned sum, or the signed one some old tars wrote);
- numbers in octal, or in base-256 (GNU, for sizes over 8 GiB and negative times);
- the ustar ``prefix`` (POSIX magic only; in GNU headers that field holds other data);
- GNU long names and long link targets (``L``, ``K``), which apply to the next header;
- pax extended headers (``x``, Solaris ``X``) for the next member and global ones (``g``)
  for all that follow: ``path``, ``linkpath``, ``size``, ``mtime`` are used;
- a v7 directory (type NUL with a name ending in ``/``).

Sparse members (GNU type ``S``, pax ``GNU.sparse.*``) are recognised so that they can be
refused by name and skipped; everything else is left to the caller.
"""

from __future__ import annotations

import struct

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
#: A pax header larger than this is not read: the archive is refused (a pax header may
#: change the size of the member after it, so it cannot be skipped). Real ones hold a
#: path, a few times, xattrs: kilobytes.
MAX_PAX = 1 << 20
#: Extended headers (pax, GNU long names and links) in a row before a member, at most.
MAX_META_RUN = 64
#: The pax keys the packer uses; every other record is dropped as it is parsed (a hostile
#: header of a million tiny records costs no memory). ``GNU.sparse.*`` keys other than
#: ``GNU.sparse.name`` are kept as one marker key: they only say "sparse".
PAX_KEYS = frozenset((b"path", b"linkpath", b"size", b"mtime", b"GNU.sparse.name"))
SPARSE_MARK = b"GNU.sparse."
#: Digits of a pax number (size, whole seconds) read at most; more is out of any range
#: (and Python refuses to convert more than 4300 digits).
MAX_DIGITS = 40

POSIX_MAGIC = b"ustar\x0000"

# Type flags (one byte). Regular files; hard link; symlink; devices; directory; FIFO.
REGULAR = (b"0", b"\0", b"7")  # "7": contiguous file, a regular file everywhere
HARDLINK = b"1"
SYMLINK = b"2"
CHARDEV = b"3"
BLOCKDEV = b"4"
DIRECTORY = b"5"
FIFO = b"6"
GNU_LONGNAME = b"L"
GNU_LONGLINK = b"K"
GNU_SPARSE = b"S"
PAX_LOCAL = (b"x", b"X")
PAX_GLOBAL = b"g"
#: Types whose size field counts no data (as Python's tarfile and GNU tar read them).
NO_DATA = (HARDLINK, SYMLINK, CHARDEV, BLOCKDEV, DIRECTORY, FIFO)

_SIGNED = struct.Struct("148b8x356b")


class TarFormatError(ValueError):
    """A header that is not a valid tar header (bad checksum, bad number, bad pax record)."""


def number(field: bytes) -> int:
    """A numeric header field: octal digits (NUL or space terminated), or base-256."""
    if field[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:
            n -= 256 ** (len(field) - 1)
        return n
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarFormatError(f"invalid number {text[:20]!r} in a header") from None


def checksum_ok(block: bytes) -> bool:
    """Whether the stored checksum matches the block (the checksum field counted as 8
    spaces), by the unsigned sum or, as some old tars computed it, the signed one."""
    want = number(block[148:156])
    if want == sum(block) - sum(block[148:156]) + 256:
        return True
    return want == sum(_SIGNED.unpack_from(block)) + 256


def cstring(field: bytes) -> bytes:
    """The bytes of a NUL-terminated (or full-width) field."""
    i = field.find(b"\0")
    return field if i < 0 else field[:i]


class Header:
    """The fields of one header block the packer uses."""

    __slots__ = ("type", "name", "linkname", "mode", "size", "mtime", "extended")

    def __init__(self, block: bytes) -> None:
        self.type = block[156:157]
        name = cstring(block[0:100])
        if block[257:265] == POSIX_MAGIC:
            prefix = cstring(block[345:500])
            if prefix:
                name = prefix + b"/" + name
        self.name = name
        self.linkname = cstring(block[157:257])
        self.mode = number(block[100:108])
        self.size = number(block[124:136])
        self.mtime = number(block[136:148])
        #: GNU sparse: more sparse-map blocks follow the header
        self.extended = self.type == GNU_SPARSE and block[482] != 0
        if self.size < 0:
            raise TarFormatError(f"negative size {self.size} in a header")


def parse_header(block: bytes) -> Header:
    """The header in ``block`` (512 bytes, not all zeros); TarFormatError if it is none."""
    if not checksum_ok(block):
        raise TarFormatError("bad header checksum")
    return Header(block)


def parse_pax(data: bytes) -> dict[bytes, bytes]:
    """The records of a pax extended header that the packer uses (``PAX_KEYS``, the
    sparse marker): ``"%d %s=%s\\n"``, the length counting the whole record. Values stay
    bytes (pax says UTF-8; ``hdrcharset=BINARY`` says raw)."""
    out: dict[bytes, bytes] = {}
    pos = 0
    end = len(data)
    while pos < end and data[pos] != 0:
        sp = data.find(b" ", pos, pos + 21)
        try:
            length = int(data[pos:sp]) if sp > pos else 0
        except ValueError:
            length = 0
        if length < 5 or pos + length > end or data[pos + length - 1] != 0x0A:
            raise TarFormatError("malformed pax extended header")
        eq = data.find(b"=", sp + 1, pos + length - 1)
        if eq <= sp + 1:
            raise TarFormatError("malformed pax extended header")
        key = data[sp + 1:eq]
        if key in PAX_KEYS:
            out[key] = data[eq + 1:pos + length - 1]
        elif key.startswith(SPARSE_MARK):
            out[SPARSE_MARK] = b""
        pos += length
    return out


def pax_number(value: bytes, key: str) -> int:
    try:
        if len(value.strip()) > MAX_DIGITS:
            raise ValueError
        n = int(value)
    except ValueError:
        raise TarFormatError(f"invalid pax {key} {value[:30]!r}") from None
    if n < 0:
        raise TarFormatError(f"invalid pax {key} {value[:30]!r}")
    return n


def pax_mtime_ns(value: bytes) -> int | None:
    """A pax time (decimal seconds, maybe negative, maybe with a fraction) in ns,
    truncated; None if it is not a number (the header's own mtime is used then). A time
    of more than MAX_DIGITS digits comes back as +-10**(MAX_DIGITS + 9): beyond any
    range, for the caller to clamp."""
    text = value.decode("ascii", "replace").strip()
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text[1:].partition(".") if text[:1] in "+-" and text else \
        text.partition(".")
    if not (whole or frac) or (whole and not whole.isdigit()) or \
            (frac and not frac.isdigit()):
        return None
    whole = whole.lstrip("0")
    if len(whole) > MAX_DIGITS:
        return sign * 10 ** (MAX_DIGITS + 9)
    return sign * (int(whole or "0") * 1_000_000_000 + int((frac[:9] + "000000000")[:9]))


def is_sparse_pax(pax: dict[bytes, bytes]) -> bool:
    return SPARSE_MARK in pax or b"GNU.sparse.name" in pax
