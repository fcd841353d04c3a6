"""The JPEG XL size-header parser (``compressors.jxlsize``) on crafted headers: every size
form and ratio, bare codestreams and containers (``jxlc``, ``jxlp`` split anywhere), and the
streams it must refuse. The headers are written here by an independent bit writer that
follows ISO/IEC 18181-1 (A.2, SizeHeader); real libjxl streams are in test_jpegxl.py."""

from __future__ import annotations

import pytest

from compressors import CorruptDataError
from compressors.jxlsize import JXL_CONTAINER, MAX_BOXES, declared_size, parse_size_header

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
