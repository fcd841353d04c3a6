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
    JpegParts,
    declared_size,
    jbrd_bytes,
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


# --------------------------------------------------------------------------- jbrd bundles

# The JPEGData bundle's U32 fields, written out here from the field list (libjxl's
# lib/jxl/jpeg/jpeg_data.cc, ISO/IEC 18181-2): per selector a constant or (offset, bits).
APP_TYPE = (0, 1, (2, 1), (4, 2))
ONE_TO_FOUR = (1, 2, 3, 4)
HUFFMAN_CODES = (4, (2, 3), (10, 4), (26, 6))
SYMBOL_COUNT = (0, 1, (2, 3), (0, 8))
SYMBOL = ((0, 2), (4, 2), (8, 4), (1, 8))
LAST_PASS = (0, 1, 2, (3, 3))
ENTRIES = (0, (1, 2), (4, 4), (20, 16))
BLOCK_STEP = (0, (1, 3), (9, 5), (41, 28))
ZERO_RUNS = (1, (2, 2), (5, 4), (20, 8))
TAIL = (0, (1, 8), (257, 16), (65793, 22))


def put_u32(w: BitWriter, dist, value: int) -> None:
    """``value`` with the first selector of ``dist`` that holds it."""
    for selector, form in enumerate(dist):
        offset, bits = (form, 0) if isinstance(form, int) else form
        if offset <= value < offset + (1 << bits) and (bits or value == offset):
            w.put(selector, 2)
            w.put(value - offset, bits)
            return
    raise AssertionError(f"{value} does not fit {dist}")


#: A DC code: 12 values of every selector's range and libjxl's end symbol 256.
DC_CODE = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 256]
AC_CODE = list(range(1, 163)) + [256]


def put_codes(w: BitWriter, codes: list[list[int]]) -> None:
    """Huffman codes: U32 count; each 1 bit is_ac, 2 bits id, 1 bit is_last, 17 U32 counts
    of codes by length (their total: the symbols), then the U32 symbols."""
    put_u32(w, HUFFMAN_CODES, len(codes))
    for i, values in enumerate(codes):
        w.put(i % 2, 1), w.put(i // 2 % 4, 2), w.put(int(i == len(codes) - 1), 1)
        counts = [0] * 17
        for j in range(len(values)):
            counts[1 + j % 16] += 1  # any split: only the total says how many symbols
        for c in counts:
            put_u32(w, SYMBOL_COUNT, c)
        for v in values:
            put_u32(w, SYMBOL, v)


def bundle(markers: list[int], app_types=(), lengths=(), *, gray=False, tables=2,
           kind: int | None = None, ids=(), quant=None, codes=None, scans=None,
           restart=0, reset_points=None, zero_runs=None, inter=(), tail=0,
           huge: str = "", rest=b"\xaa\x55") -> bytes:
    """A ``jbrd`` JPEGData bundle: is_gray, the markers (6 bits: marker - 0xC0, up to EOI,
    0xFF for data between markers), each APPn's type (U32) and 16-bit length - 1, each
    COM's length - 1, the quantisation tables (U32 count, 1 bit precision, 2 bits index,
    1 bit is_last), the component kind (2 bits; 3: U32 count and 8-bit ids), a 2-bit table
    index per component, the Huffman codes (U32 count; 1 bit is_ac, 2 bits id, 1 bit
    is_last, 17 U32 counts, the U32 symbols), per scan (U32 components, 6+6+4+4 bits, 2+2+2
    per component, U32 last pass), the restart interval (16 bits, if a DRI marker), per
    scan its reset points and extra zero runs, per inter-marker marker a 16-bit length, the
    tail's length (U32), the padding flag (0); then ``rest`` (the brotli data, not read).
    ``huge``: the bundle stops at its first scan's 65,555 "reset points" or "zero runs"."""
    w = BitWriter()
    w.put(int(gray), 1)
    for m in markers:
        w.put(m - 0xC0, 6)
    apps = [m for m in markers if m & 0xF0 == 0xE0]
    assert len(app_types) == len(apps) and len(lengths) == len(apps) + markers.count(0xFE)
    for kind_, length in zip(app_types, lengths):
        put_u32(w, APP_TYPE, kind_)
        w.put(length - 1, 16)
    for length in lengths[len(apps):]:
        w.put(length - 1, 16)
    put_u32(w, ONE_TO_FOUR, tables)
    for i in range(tables):
        w.put(0, 1), w.put(i, 2), w.put(int(i == tables - 1), 1)
    kind = (0 if gray else 1) if kind is None else kind
    count = len(ids) if kind == 3 else 1 if kind == 0 else 3
    w.put(kind, 2)
    if kind == 3:
        put_u32(w, ONE_TO_FOUR, count)
        for i in ids:
            w.put(i, 8)
    for q in quant if quant is not None else [0] + [min(1, tables - 1)] * (count - 1):
        w.put(q, 2)
    put_codes(w, [DC_CODE, AC_CODE] * 2 if codes is None else codes)
    scans = [list(range(count))] * markers.count(0xDA) if scans is None else scans
    for comps in scans:
        put_u32(w, ONE_TO_FOUR, len(comps))
        w.put(0, 6), w.put(63, 6), w.put(0, 4), w.put(0, 4)
        for c in comps:
            w.put(c, 2), w.put(c % 2, 2), w.put(c % 2, 2)
        put_u32(w, LAST_PASS, 0)
    if 0xDD in markers:
        w.put(restart, 16)
    for i in range(len(scans)):
        if huge:
            put_u32(w, ENTRIES, 65555 if huge == "reset points" else 0)
            if huge == "zero runs":
                put_u32(w, ENTRIES, 65555)
            return w.bytes() + rest
        points = (reset_points or {}).get(i, [])
        put_u32(w, ENTRIES, len(points))
        last = -1
        for block in points:
            put_u32(w, BLOCK_STEP, block - last - 1)
            last = block
        runs = (zero_runs or {}).get(i, [])
        put_u32(w, ENTRIES, len(runs))
        last = -1
        for n, block in runs:
            put_u32(w, ZERO_RUNS, n)
            put_u32(w, BLOCK_STEP, block - last - 1)
            last = block
    assert len(inter) == markers.count(0xFF)
    for length in inter:
        w.put(length, 16)
    put_u32(w, TAIL, tail)
    w.put(0, 1)  # has_zero_padding_bit
    return w.bytes() + rest


JFIF = [0xE0, 0xDB, 0xC0, 0xC4, 0xDA, 0xD9]
CS = header(480, 640)[0]


def with_jbrd(body: bytes, *more: bytes) -> bytes:
    return container(box(b"jxlp", b"\x00\x00\x00\x00" + CS), box(b"jbrd", body), *more,
                     box(b"jxlp", b"\x80\x00\x00\x01" + b"frame"))


PROGRESSIVE = [0xE0, 0xE1, 0xFE, 0xDB, 0xDB, 0xC2, 0xC4, 0xDD] + [0xDA, 0xC4] * 9 + [0xDA,
                                                                                  0xD9]
CASES = {
    "baseline": dict(markers=JFIF, app_types=[0], lengths=[17]),
    "grey": dict(markers=JFIF, app_types=[0], lengths=[17], gray=True, tables=1),
    "apps of every type, COMs": dict(
        markers=[0xE0, 0xE1, 0xE2, 0xEF, 0xE1, 0xE5, 0xFE, 0xFE, 0xDB, 0xC0, 0xC4, 0xDA, 0xD9],
        app_types=[0, 2, 1, 0, 3, 0], lengths=[17, 3, 65536, 9, 5, 3, 65536, 3]),
    "custom components": dict(markers=JFIF, app_types=[0], lengths=[17], kind=3,
                              ids=[82, 71, 66], tables=3, quant=[0, 1, 2]),
    "one custom component": dict(markers=JFIF, app_types=[0], lengths=[17], kind=3, ids=[7],
                                 tables=1),
    "RGB": dict(markers=JFIF, app_types=[0], lengths=[17], kind=2),
    "progressive, restarts, reset points, zero runs": dict(
        markers=PROGRESSIVE, app_types=[0, 2], lengths=[17, 3000, 302], restart=64,
        scans=[[0, 1, 2], [0], [1], [2]] + [[0]] * 6,
        codes=[DC_CODE, AC_CODE, [3, 7, 8, 23, 24, 255, 256], [256], []] + [AC_CODE] * 6,
        reset_points={1: [0, 1, 9, 10, 41, 42, 3 * 2 ** 26 - 1], 4: [5]},
        zero_runs={1: [(1, 0), (4, 8), (2, 3 * 2 ** 26)], 9: [(3, 100)]}),
    "inter-marker data and a tail": dict(
        markers=[0xFF, 0xE0, 0xFF, 0xDB, 0xC0, 0xC4, 0xFF, 0xDA, 0xFF, 0xD9],
        app_types=[0], lengths=[17], inter=[0, 1, 65535, 8], tail=4260096),
    "the most Huffman codes and symbols": dict(
        markers=JFIF, app_types=[0], lengths=[17], codes=[list(range(1, 257)) + [256]] * 89),
}


@pytest.mark.parametrize("what", sorted(CASES))
def test_jpeg_parts_of_crafted_bundles(what) -> None:
    case = CASES[what]
    body = bundle(**case)
    expected = JpegParts(sum(case["lengths"]), sum(case.get("inter", ())), case.get("tail", 0))
    assert jbrd_bytes(body) == expected
    assert declared(with_jbrd(body)) == (640, 480, sum(expected))
    assert jbrd_bytes(memoryview(bytearray(body))) == expected


@pytest.mark.parametrize("tail", [0, 1, 256, 257, 65792, 65793, 65794, 4260096])
def test_every_tail_length_form(tail) -> None:
    assert jbrd_bytes(bundle(JFIF, [0], [17], tail=tail)).tail == tail


def test_the_most_markers() -> None:
    apps = bundle([0xE5] * 16382 + [0xDA, 0xD9], [0] * 16382, [65536] * 16382)
    assert jbrd_bytes(apps) == (16382 * 65536, 0, 0)
    inter = bundle([0xDA] + [0xFF] * 16382 + [0xD9], inter=[65535] * 16382)
    assert jbrd_bytes(inter) == (0, 16382 * 65535, 0)
    with pytest.raises(CorruptDataError, match="more than 16384 JPEG markers"):
        jbrd_bytes(bundle([0xDA] + [0xDB] * 16383 + [0xD9]))


@pytest.mark.parametrize("what", sorted(set(CASES) - {"the most Huffman codes and symbols"}))
def test_truncated_bundles_are_refused(what) -> None:
    body = bundle(**dict(CASES[what], rest=b""))
    for n in range(len(body)):
        with pytest.raises(CorruptDataError, match="ends inside its JPEG reconstruction|"
                                                   "more than the rest of the JPEG"):
            jbrd_bytes(body[:n])
            pytest.fail(f"{n} of {len(body)} bytes parsed")


def test_bad_bundles_are_refused() -> None:
    base = dict(markers=JFIF, app_types=[0], lengths=[17])
    bad = {
        "no scan": (dict(markers=[0xE0, 0xDB, 0xC4, 0xD9], app_types=[0], lengths=[17]),
                    "without a scan"),
        "APPn type 4": (dict(base, app_types=[4]), "unknown APPn type"),
        "APPn type 7": (dict(base, app_types=[7]), "unknown APPn type"),
        "a 2-byte APPn": (dict(base, lengths=[2]), "segment of 2 bytes"),
        "a 1-byte COM": (dict(markers=[0xFE] + JFIF[1:], lengths=[1]), "segment of 1 bytes"),
        "4 quantisation tables": (dict(base, tables=4), "4 quantisation tables"),
        "2 custom components": (dict(base, kind=3, ids=[1, 2], quant=[0, 0]),
                                "JPEG of 2 components"),
        "a missing table": (dict(base, tables=2, quant=[0, 2, 0]), "missing quantisation"),
        "258 symbols": (dict(base, codes=[DC_CODE, list(range(257)) + [256]]),
                        "258 symbols"),
        "a scan of 4": (dict(base, scans=[[0, 1, 2, 0]]), "scan of 4 components"),
        "a grey scan of component 1": (dict(base, gray=True, tables=1, scans=[[1]]),
                                       "scan of a missing component"),
        "block 3 * 2**26": (dict(base, reset_points={0: [3 * 2 ** 26]}), "JPEG block"),
        "zero run block 3 * 2**26 + 1": (dict(base, zero_runs={0: [(1, 3 * 2 ** 26 + 1)]}),
                                         "JPEG block"),
        "5 zero runs": (dict(base, zero_runs={0: [(5, 3)]}), "more than 4 extra zero runs"),
    }
    for what, (case, message) in bad.items():
        with pytest.raises(CorruptDataError, match=message):
            jbrd_bytes(bundle(**case))
            pytest.fail(f"{what}: parsed")


def test_counts_the_box_cannot_hold_are_refused_unread() -> None:
    """65,555 reset points or extra zero runs declared, 2,000 bytes left (each takes at
    least 2 or 4 bits): refused before the loop over them."""
    for huge, what in (("reset points", "reset points"), ("zero runs", "extra zero runs")):
        body = bundle(JFIF, [0], [17], huge=huge, rest=bytes(2000))
        with pytest.raises(CorruptDataError, match=f"65555 JPEG {what} declared, more than"):
            jbrd_bytes(body)
    # enough bytes for them: read (all block steps 0), then no zero runs, no tail
    assert jbrd_bytes(bundle(JFIF, [0], [17], huge="reset points", rest=bytes(16400))) \
        == (17, 0, 0)


def test_more_than_one_jbrd_is_refused() -> None:
    good = bundle(JFIF, [0], [17])
    with pytest.raises(CorruptDataError, match="more than one jbrd box"):
        declared(with_jbrd(good, box(b"jbrd", good)))
