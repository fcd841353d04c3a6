"""The JPEG XL header parser (``compressors.jxlsize``) on crafted headers: every size form
and ratio, bare codestreams and containers (``jxlc``, ``jxlp`` split anywhere), the APPn and
COM bytes a ``jbrd`` bundle declares, and the streams it must refuse. The headers are
written here by an independent bit writer that follows ISO/IEC 18181-1 (A.2, SizeHeader)
and libjxl's JPEGData bundle; real libjxl streams are in test_jpegxl.py."""

from __future__ import annotations

import pytest

from compressors import CorruptDataError
from compressors.jxlsize import (
    JXL_CONTAINER,
    MAX_BOXES,
    declared,
    declared_size,
    marker_bytes,
    parse_size_header,
)

#: ratio code -> (numerator, denominator) of xsize / ysize (the standard's table).
RATIOS = {1: (1, 1), 2: (12, 10), 3: (4, 3), 4: (3, 2), 5: (16, 9), 6: (5, 4), 7: (2, 1)}
U32_BITS = (9, 13, 18, 30)
FTYP = b"\x00\x00\x00\x14ftypjxl \x00\x00\x00\x00jxl "


class BitWriter:
    """Fields written from each byte's least significant bit, as JPEG XL reads them."""

    def __init__(self) -> None:
        self.value = self.n = 0

    def put(self, value: int, bits: int) -> None:
        assert 0 <= value < 1 << bits
        self.value |= value << self.n
        self.n += bits

    def dim(self, value: int, small: bool) -> None:
        if small:
            assert value % 8 == 0 and 8 <= value <= 256
            self.put(value // 8 - 1, 5)
            return
        selector = next(i for i, b in enumerate(U32_BITS) if value - 1 < 1 << b)
        self.put(selector, 2)
        self.put(value - 1, U32_BITS[selector])

    def bytes(self) -> bytes:
        return self.value.to_bytes((self.n + 7) // 8, "little")


def header(height: int, width: int | None = None, ratio: int = 0, small: bool = False,
           tail: bytes = b"") -> tuple[bytes, int]:
    """A bare codestream: FF 0A, the SizeHeader, then ``tail``; and the header's bits."""
    w = BitWriter()
    w.put(int(small), 1)
    w.dim(height, small)
    w.put(ratio, 3)
    if ratio == 0:
        w.dim(width, small)
    return b"\xff\x0a" + w.bytes() + tail, w.n


def box(kind: bytes, body: bytes, form: str = "u32") -> bytes:
    if form == "u64":
        return (1).to_bytes(4, "big") + kind + (len(body) + 16).to_bytes(8, "big") + body
    if form == "to-end":
        return b"\x00\x00\x00\x00" + kind + body
    return (len(body) + 8).to_bytes(4, "big") + kind + body


def jxlp(index: int, piece: bytes, last: bool = False) -> bytes:
    return box(b"jxlp", (index | (last << 31)).to_bytes(4, "big") + piece)


def container(*boxes: bytes) -> bytes:
    return JXL_CONTAINER + FTYP + b"".join(boxes)


SIZES = [(1, 1), (8, 8), (256, 256), (512, 512), (513, 513), (8192, 8193), (8193, 8192),
         (262144, 262145), (1 << 30, 1 << 30), (65535, 65535), (17, 3), (3, 17)]


@pytest.mark.parametrize("width,height", SIZES)
def test_explicit_sizes_at_every_selector_boundary(width, height) -> None:
    stream, bits = header(height, width, tail=b"\x5a" * 4)
    assert declared_size(stream) == (width, height)
    assert parse_size_header(stream)[2] == bits


@pytest.mark.parametrize("ratio", sorted(RATIOS))
@pytest.mark.parametrize("height", [1, 7, 8, 10, 9, 256, 1000, 8193, (1 << 30) - 1, 1 << 30])
def test_every_ratio(ratio, height) -> None:
    num, den = RATIOS[ratio]
    assert declared_size(header(height, ratio=ratio)[0]) == (height * num // den, height)
    if height % 8 == 0 and height <= 256:
        small = header(height, ratio=ratio, small=True)[0]
        assert declared_size(small) == (height * num // den, height)


@pytest.mark.parametrize("width,height", [(8, 8), (256, 8), (8, 256), (256, 256), (64, 200)])
def test_small_headers(width, height) -> None:
    stream, bits = header(height, width, small=True)
    assert bits == 14 and declared_size(stream) == (width, height)


def test_a_container_with_one_jxlc_box_in_every_form() -> None:
    cs = header(4000, 3000)[0] + b"frame data"
    for form in ("u32", "u64", "to-end"):
        stream = container(box(b"jxll", b"\x05"), box(b"jxlc", cs, form))
        assert declared_size(stream) == (3000, 4000), form
    # boxes of other kinds before and after are skipped, a 64-bit sized one too
    stream = container(box(b"Exif", b"x" * 40, "u64"), box(b"jxlc", cs), box(b"xml ", b"<x/>"))
    assert declared_size(stream) == (3000, 4000)


def test_jxlp_boxes_split_anywhere() -> None:
    cs, _ = header(262145, 65535, tail=b"\x11\x22\x33")
    for cut in range(len(cs) + 1):
        two = container(jxlp(0, cs[:cut]), box(b"jbrd", b"r" * 9), jxlp(1, cs[cut:], True))
        assert declared_size(two) == (65535, 262145), cut
        for cut2 in range(cut, len(cs) + 1):
            three = container(jxlp(0, cs[:cut]), jxlp(1, cs[cut:cut2]),
                              jxlp(2, cs[cut2:], last=True))
            assert declared_size(three) == (65535, 262145), (cut, cut2)


def test_truncated_headers_are_refused() -> None:
    for height, width, small in ((8193, 262145, False), (256, 256, True), (1, 1, False)):
        stream, bits = header(height, width, small=small)
        for n in range(2 + (bits + 7) // 8):
            with pytest.raises(CorruptDataError):
                declared_size(stream[:n])
                pytest.fail(f"{height}x{width}: {n} bytes parsed")
            with pytest.raises(CorruptDataError):
                declared_size(container(box(b"jxlc", stream[:n])))


def test_containers_that_could_be_read_two_ways_are_refused() -> None:
    cs = header(640, 480)[0] + b"rest"
    bad = {
        "no codestream box": container(box(b"jbrd", b"x" * 20)),
        "signature only": JXL_CONTAINER,
        "two jxlc": container(box(b"jxlc", cs), box(b"jxlc", cs)),
        "jxlc then jxlp": container(box(b"jxlc", cs), jxlp(0, cs, True)),
        "jxlp then jxlc": container(jxlp(0, cs[:3]), box(b"jxlc", cs)),
        "jxlp out of order": container(jxlp(1, cs[:3]), jxlp(0, cs[3:], True)),
        "jxlp index repeated": container(jxlp(0, cs[:3]), jxlp(0, cs[3:], True)),
        "no last jxlp": container(jxlp(0, cs[:3]), jxlp(1, cs[3:])),
        "jxlp after the last": container(jxlp(0, cs, True), jxlp(1, b"")),
        "jxlp without its index": container(box(b"jxlp", b"\x00\x00")),
        "a box past the end": container(box(b"jxlc", cs))[:-1],
        "a box shorter than its header": container(b"\x00\x00\x00\x04jxlc" + cs),
        "a 64-bit size past the end": container(box(b"jxlc", cs, "u64")[:-2]),
        "a truncated box header": container(box(b"jxlc", cs), b"\x00\x00\x00"),
        "too many boxes": container(*[box(b"free", b"")] * MAX_BOXES, box(b"jxlc", cs)),
        "a codestream without FF 0A": container(box(b"jxlc", b"\xff\x0b" + cs[2:])),
        "not JPEG XL": b"\xff\xd8\xff\xe0" + cs,
        "empty": b"",
    }
    for what, stream in bad.items():
        with pytest.raises(CorruptDataError):
            declared_size(stream)
            pytest.fail(f"{what}: parsed")
    # the most boxes allowed still parse
    ok = container(*[box(b"free", b"")] * (MAX_BOXES - 2), box(b"jxlc", cs))
    assert declared_size(ok) == (480, 640)


def test_buffer_kinds() -> None:
    stream = container(jxlp(0, header(300, 200)[0]), jxlp(1, b"x", last=True))
    for buf in (stream, bytearray(stream), memoryview(stream)):
        assert declared_size(buf) == (200, 300)


# --------------------------------------------------------------------------- jbrd markers


def jbrd(markers: list[int], app_types: list[int], lengths: list[int], gray: bool = False,
         tail: bytes = b"\xaa\x55") -> bytes:
    """The start of a ``jbrd`` bundle: is_gray, the markers (6 bits: marker - 0xC0, up to
    EOI), each APPn's type (U32 0, 1, 2 + u(1), 4 + u(2)) and 16-bit length - 1, each COM's
    length - 1; then ``tail`` (the rest of the bundle, not read)."""
    w = BitWriter()
    w.put(int(gray), 1)
    for m in markers:
        w.put(m - 0xC0, 6)
    apps = [m for m in markers if m & 0xF0 == 0xE0]
    coms = [m for m in markers if m == 0xFE]
    assert len(app_types) == len(apps) and len(lengths) == len(apps) + len(coms)
    for kind, length in zip(app_types, lengths):
        selector = 0 if kind == 0 else 1 if kind == 1 else 2 if kind < 4 else 3
        w.put(selector, 2)
        if selector >= 2:
            w.put(kind - (2 if selector == 2 else 4), selector - 1)
        w.put(length - 1, 16)
    for length in lengths[len(apps):]:
        w.put(length - 1, 16)
    return w.bytes() + tail


JFIF = [0xE0, 0xDB, 0xC0, 0xC4, 0xDA, 0xD9]
CS = header(480, 640)[0]


def with_jbrd(bundle: bytes, *more: bytes) -> bytes:
    return container(box(b"jxlp", b"\x00\x00\x00\x00" + CS), box(b"jbrd", bundle), *more,
                     box(b"jxlp", b"\x80\x00\x00\x01" + b"frame"))


def test_marker_bytes_of_crafted_bundles() -> None:
    assert declared(CS) == (640, 480, 0)  # a bare codestream has no jbrd
    assert declared(container(box(b"jxlc", CS))) == (640, 480, 0)
    cases = [
        (JFIF, [0], [17]),
        ([0xE0, 0xE1, 0xE2, 0xEF, 0xFE, 0xFE, 0xDA, 0xD9], [0, 1, 2, 7], [17, 3, 65536, 9, 5,
                                                                           65536]),
        ([0xE1] * 5 + [0xD9], [1, 2, 3, 4, 6], [1, 2, 3, 4, 5]),
        ([0xFE, 0xD9], [], [40000]),
        ([0xDB, 0xD9], [], []),
    ]
    for markers, types, lengths in cases:
        for gray in (False, True):
            stream = with_jbrd(jbrd(markers, types, lengths, gray))
            assert marker_bytes(jbrd(markers, types, lengths, gray)) == sum(lengths)
            assert declared(stream) == (640, 480, sum(lengths)), (markers, lengths)
    many = [0xE5] * 16383 + [0xD9]
    assert marker_bytes(jbrd(many, [0] * 16383, [65536] * 16383)) == 16383 * 65536


def test_bad_bundles_are_refused() -> None:
    good = jbrd(JFIF, [0], [17], tail=b"")
    for n in range(len(good)):
        with pytest.raises(CorruptDataError, match="JPEG reconstruction header"):
            marker_bytes(good[:n])
    with pytest.raises(CorruptDataError, match="more than 16384 JPEG markers"):
        marker_bytes(jbrd([0xDB] * 16384 + [0xD9], [], []))
    with pytest.raises(CorruptDataError, match="more than one jbrd box"):
        declared(with_jbrd(good, box(b"jbrd", good)))
