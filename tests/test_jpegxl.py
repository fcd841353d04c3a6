"""The ``jpegxl`` codec: lossless JPEG recompression, and the inputs it declines.

The JPEGs are made by ``tools/gen_jpegs.py`` from photographs scikit-image and matplotlib
ship (tests/jpeg_helpers.py). Pack, selection, mount and the missing-library line are in
``tests/test_jpeg_store.py``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import pytest

pytest.importorskip("imagecodecs", reason="the jpegxl codec needs imagecodecs (jpeg extra)")

from jpeg_helpers import (  # noqa: E402
    APP5_4000,
    FRAME_8192,
    GREY_8192,
    INTER_3200,
    cmyk_jpeg,
    jpeg_bytes,
    padded,
)

from compressors import (  # noqa: E402
    BadConfigError,
    CodecUnavailableError,
    CorruptDataError,
    DeclinedError,
    JpegXlCodec,
    _util,
    get_codec,
    jpegxl,
    parse_codec_spec,
    parse_spec,
)
from compressors.jxlsize import (  # noqa: E402
    codestream_head,
    declared,
    declared_size,
    parse_size_header,
)


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return jpeg_bytes(24)


@pytest.fixture(scope="module")
def codec() -> JpegXlCodec:
    return parse_spec("jpegxl")


def test_round_trip_is_byte_exact_and_smaller(codec, jpegs) -> None:
    stored = 0
    for jpeg in jpegs:
        blob = codec.encode(jpeg)
        assert blob[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n"
        assert codec.decode(memoryview(blob), len(jpeg)) == jpeg
        assert get_codec(codec.get_config()).decode(blob, len(jpeg)) == jpeg
        stored += len(blob)
    raw = sum(map(len, jpegs))
    assert stored < 0.92 * raw, f"jpegxl stored {stored / raw:.3f} of the JPEG bytes"


def test_buffer_kinds(codec, jpegs) -> None:
    jpeg = jpegs[0]
    for buf in (jpeg, bytearray(jpeg), memoryview(jpeg)):
        assert codec.decode(codec.encode(buf), len(jpeg)) == jpeg


def test_progressive_and_greyscale_jpegs(codec) -> None:
    from PIL import Image

    base = Image.open(io.BytesIO(jpeg_bytes(1, seed=5)[0]))
    for mode, options in (("RGB", {"progressive": True, "quality": 90}),
                          ("L", {"quality": 80}), ("RGB", {"subsampling": 0, "quality": 95})):
        buf = io.BytesIO()
        base.convert(mode).save(buf, "JPEG", **options)
        jpeg = buf.getvalue()
        assert codec.decode(codec.encode(jpeg), len(jpeg)) == jpeg


def test_config_and_spec() -> None:
    codec = parse_spec("jpegxl")
    assert codec.get_config() == {"id": "jpegxl"} and codec.spec == "jpegxl"
    assert get_codec({"id": "jpegxl"}) == codec and codec.declines
    assert parse_codec_spec("jpegxl").label == "jpegxl"
    with pytest.raises(BadConfigError, match="takes no parameters"):
        parse_spec("jpegxl:7")
    with pytest.raises(BadConfigError, match="unknown keys"):
        get_codec({"id": "jpegxl", "effort": 9})
    with pytest.raises(BadConfigError, match="whole files, not solid blocks"):
        parse_codec_spec("jpegxl+solid64k")
    with pytest.raises(BadConfigError, match="only zstd:L"):
        parse_codec_spec("jpegxl+dict")


def test_declines_what_it_cannot_transcode(codec, jpegs) -> None:
    jpeg = jpegs[1]
    declined = {
        "text": b"not a JPEG at all, " * 100,
        "empty": b"",
        "truncated": jpeg[: len(jpeg) // 2],
        "a chunk from the middle": jpeg[1000:5000],
        "CMYK": cmyk_jpeg(),
        "a JPEG XL stream": codec.encode(jpeg),
    }
    for what, data in declined.items():
        with pytest.raises(DeclinedError):
            codec.encode(data)
            pytest.fail(f"{what}: encoded, not declined")


def test_round_trip_is_checked_at_encode(codec, jpegs, monkeypatch) -> None:
    """A transcode whose round trip differs by one byte is declined, not stored."""
    real = codec._decode

    def off_by_one(data, **kwargs):
        out = bytearray(real(data, **kwargs))
        out[len(out) // 2] ^= 1
        return bytes(out)

    monkeypatch.setattr(codec, "_decode", off_by_one)
    with pytest.raises(DeclinedError, match="not byte-exact"):
        codec.encode(jpegs[2])


def test_damaged_streams_are_corrupt_data(codec, jpegs) -> None:
    jpeg = jpegs[3]
    blob = codec.encode(jpeg)
    n = len(jpeg)
    bad = {
        "the JPEG itself": (jpeg, n),
        "truncated": (blob[: len(blob) // 2], n),
        "garbage": (b"\x00" * 200, n),
        "one byte short": (blob, n - 1),
        "one byte long": (blob, n + 1),
        "zero": (blob, 0),
    }
    for what, (data, size) in bad.items():
        with pytest.raises(CorruptDataError):
            codec.decode(data, size)
            pytest.fail(f"{what}: decoded, not refused")
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    try:
        out = codec.decode(bytes(flipped), n)
    except CorruptDataError:
        pass
    else:  # the entropy coder may decode garbage: the store's checksum catches that
        assert out != jpeg and len(out) == n


def test_concurrent_decoding(codec, jpegs) -> None:
    blobs = [(codec.encode(j), j) for j in jpegs[:8]]
    errors: list[str] = []

    def work() -> None:
        for _ in range(3):
            for blob, jpeg in blobs:
                if codec.decode(blob, len(jpeg)) != jpeg:
                    errors.append("mismatch")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_missing_library_names_it(monkeypatch) -> None:
    monkeypatch.setattr(_util, "_MODULES", {})
    monkeypatch.setitem(sys.modules, "imagecodecs", None)  # makes `import imagecodecs` fail
    with pytest.raises(CodecUnavailableError, match="imagecodecs is not installed: pip install"):
        JpegXlCodec()
    with pytest.raises(CodecUnavailableError, match="imagecodecs"):
        parse_codec_spec("jpegxl")


def test_the_generator_is_deterministic(tmp_path) -> None:
    """tools/gen_jpegs.py: the same (seed, file) gives the same bytes with any --jobs."""
    from jpeg_helpers import gen_jpegs_module

    gen = gen_jpegs_module()
    for name, seed, jobs in (("a", 3, 1), ("b", 3, 2), ("c", 4, 1)):
        gen.generate(str(tmp_path / name), 6, seed=seed, classes=2, jobs=jobs)

    def tree(name: str) -> dict[str, bytes]:
        return {p.relative_to(tmp_path / name).as_posix(): p.read_bytes()
                for p in sorted((tmp_path / name).rglob("*.jpg"))}

    a, b, c = tree("a"), tree("b"), tree("c")
    assert len(a) == 6 and a == b and a.keys() == c.keys() and a != c
    assert all(data[:3] == b"\xff\xd8\xff" for data in a.values())


# --------------------------------------------------------------------------- the size bound


def _pillow_jpeg(width: int, height: int, **options) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 200)).save(buf, "JPEG", **options)
    return buf.getvalue()


def test_the_declared_size_of_real_streams(codec, jpegs) -> None:
    """libjxl's own headers: small and large forms, every ratio it picks, odd sizes."""
    from PIL import Image

    for width, height in ((1, 1), (17, 3), (8, 8), (256, 256), (264, 256), (640, 480),
                          (480, 640), (1920, 1080), (300, 360), (513, 257), (2000, 1000)):
        jpeg = _pillow_jpeg(width, height, progressive=width % 2 == 0)
        blob = codec.encode(jpeg)
        assert declared_size(blob) == (width, height)
        assert codec.decode(blob, len(jpeg)) == jpeg
    for jpeg in jpegs:
        size = Image.open(io.BytesIO(jpeg)).size
        assert declared_size(codec.encode(jpeg)) == size


def test_the_bound() -> None:
    assert jpegxl.max_pixels(0) == jpegxl.max_pixels(8192) == 1 << 22
    assert jpegxl.max_pixels(10**6) == 512 * 10**6
    assert jpegxl.max_pixels(4096) < 65535 * 65535 // 1000


def _rewrite_size(blob: bytes, header_bits: int, value: int) -> bytes:
    """``blob`` (libjxl's container: two jxlp boxes, the first holding the headers' start)
    with its SizeHeader replaced by ``value`` (``header_bits`` long, as the old one)."""
    kind = blob.index(b"jxlp")
    first, end = kind + 8, kind - 4 + int.from_bytes(blob[kind - 4:kind], "big")
    piece = bytes(blob[first:end])  # the first piece, after the box's index
    assert piece == codestream_head(blob)[:len(piece)]
    assert len(piece) >= 2 + (header_bits + 7) // 8
    bits = int.from_bytes(piece[2:], "little")
    bits = (bits >> header_bits << header_bits) | value
    return blob[:first + 2] + bits.to_bytes(len(piece) - 2, "little") + blob[first + len(piece):]


def test_a_rewritten_header_is_refused_before_libjxl_sees_it(codec, monkeypatch) -> None:
    jpeg = _pillow_jpeg(16, 8200)  # not small; height a U32 of 18 bits, width one of 9
    blob = codec.encode(jpeg)
    width, height, bits = parse_size_header(codestream_head(blob))
    assert (width, height, bits) == (16, 8200, 35)
    # the same 35 bits: height 262144, width 512 (134 Mpixels), from a 2 KB JPEG
    huge = _rewrite_size(blob, 35, (2 << 1) | ((262144 - 1) << 3) | ((512 - 1) << 26))
    assert declared_size(huge) == (512, 262144)

    def libjxl(*args, **kwargs):
        raise AssertionError("libjxl was given the stream")

    monkeypatch.setattr(codec, "_decode", libjxl)
    with pytest.raises(CorruptDataError, match="declares a 512x262144 image, more than a "
                                                 f"JPEG of {len(jpeg)} bytes holds"):
        codec.decode(huge, len(jpeg))
    for cut in (13, 20, 26, 30):  # inside the first jxlp's header or before the codestream
        with pytest.raises(CorruptDataError):
            codec.decode(huge[:cut], len(jpeg))


def test_encode_declines_a_jpeg_beyond_the_bound(codec, monkeypatch) -> None:
    jpeg = _pillow_jpeg(640, 480)
    monkeypatch.setattr(jpegxl, "PIXELS_PER_BYTE", 0)
    monkeypatch.setattr(jpegxl, "MIN_PIXELS", 640 * 480 - 1)
    with pytest.raises(DeclinedError, match="declares a 640x480 image"):
        codec.encode(jpeg)
    monkeypatch.setattr(jpegxl, "MIN_PIXELS", 640 * 480)
    assert codec.decode(codec.encode(jpeg), len(jpeg)) == jpeg


_CHILD = """
import json, sys
import imagecodecs
from compressors import CodecError, JpegXlCodec
stream, raw_size, direct = open(sys.argv[1], "rb").read(), int(sys.argv[2]), sys.argv[3] == "1"
codec = JpegXlCodec()


def peak_kib():  # VmHWM: this process's own peak (ru_maxrss may carry its parent's over exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


before = peak_kib()
try:
    if direct:
        imagecodecs.jpegxl_decode_jpeg(stream, numthreads=1, out=raw_size)
    else:
        codec.decode(stream, raw_size)
    error = None
except (CodecError, ValueError, RuntimeError) as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"error": error, "grew_kib": peak_kib() - before}))
"""


def _decode_in_child(path, raw_size: int, direct: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(raw_size),
                           str(int(direct))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


BOMBS = {
    "image": (GREY_8192, "the stream declares a 8192x8192 image, more than a JPEG of 40000 "
                         "bytes holds", 100),
    "markers": (APP5_4000, "the stream declares 262144017 bytes of JPEG markers and data, "
                           "more than a JPEG of 40000 bytes holds", 200),
    "inter-marker data": (INTER_3200, "the stream declares 209724817 bytes of JPEG markers "
                                      "and data, more than a JPEG of 40000 bytes holds", 150),
}


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_small_stream_declaring_a_huge_jpeg_allocates_nothing(tmp_path, bomb) -> None:
    """Real streams recorded as a 40 KB file: a 2.3 KB one of a grey 8192x8192 JPEG, a
    12.9 KB one of a 64x64 JPEG with 262 MB of APP5 markers, an 18.4 KB one of a 64x64 JPEG
    with 210 MB of bytes between markers. libjxl given them allocates ~154 MB, ~258 MB and
    ~200 MB before it finds the output too small; the codec refuses them from their
    headers and the process does not grow."""
    fixture, message, libjxl_mib = BOMBS[bomb]
    path = tmp_path / "bomb.jxl"
    path.write_bytes(padded(fixture.read_bytes(), 20_000))
    raw = _decode_in_child(path, 40_000, direct=True)
    assert raw["error"] and raw["grew_kib"] > libjxl_mib * 1024, raw
    ours = _decode_in_child(path, 40_000, direct=False)
    assert ours["error"] == f"CorruptDataError: jpegxl: {message}", ours
    assert ours["grew_kib"] < 8 * 1024, ours


def test_a_frame_larger_than_the_image_is_not_bounded_yet(tmp_path) -> None:
    """The open hole (docs/reliability.md, "Left out"): a 1.9 KB stream whose SizeHeader
    and jbrd box pass the bounds, whose frame header declares an 8192x8192 frame. libjxl
    allocates ~131 MB for it, through the codec too. When the frame header is bounded,
    this test fails: turn it into a test of the bound (the codec must not grow)."""
    assert declared(FRAME_8192.read_bytes()) == (64, 64, 17)
    path = tmp_path / "frame.jxl"
    path.write_bytes(padded(FRAME_8192.read_bytes(), 20_000))
    for direct in (True, False):
        result = _decode_in_child(path, 40_000, direct=direct)
        assert result["error"] and result["grew_kib"] > 100 * 1024, (direct, result)


def test_declared_jpeg_bytes_of_real_streams(codec) -> None:
    """Every APPn and COM segment counted, each one byte below its share of the file; the
    bytes between markers and after EOI exactly as libjxl's writer declares them."""
    from PIL import Image

    base = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(base, "JPEG", comment=b"c" * 300)
    jpeg = base.getvalue()
    assert declared(codec.encode(jpeg))[2] == (16 + 1) + (302 + 1)  # APP0 JFIF, COM
    exif = bytes.fromhex("ffe1") + (2 + 3000).to_bytes(2, "big") + b"Exif\0\0" + bytes(2994)
    jpeg2 = jpeg[:2] + exif * 3 + jpeg[2:]
    blob = codec.encode(jpeg2)
    assert declared(blob)[2] == 17 + 303 + 3 * 3003 < len(jpeg2)
    assert codec.decode(blob, len(jpeg2)) == jpeg2
    with pytest.raises(CorruptDataError, match="bytes of JPEG markers and data"):
        codec.decode(blob, 17 + 303 + 3 * 3003 - 1)
    # data between markers (after APP0, before the COM, as 0xFF fill) and after EOI
    app0 = 4 + int.from_bytes(jpeg[4:6], "big")
    com = jpeg.index(b"\xff\xfe")
    for between, fill, tail in ((b"x", b"", b""), (b"garbage!" * 100, b"\xff\xff", b"t"),
                                (bytes(65535), b"", bytes(70000)), (b"", b"", b"\0" * 300)):
        odd = jpeg[:app0] + between + jpeg[app0:com] + fill + jpeg[com:] + tail
        blob = codec.encode(odd)
        n = len(between) + len(fill) + len(tail)
        assert declared(blob)[2] == 17 + 303 + n, (len(between), len(fill), len(tail))
        assert codec.decode(blob, len(odd)) == odd
        if n:
            with pytest.raises(CorruptDataError, match="bytes of JPEG markers and data"):
                codec.decode(blob, 17 + 303 + n - 1)


def test_the_jbrd_parser_agrees_with_libjxl_on_mutated_boxes() -> None:
    """1-3 bytes changed in the first 80 bytes of real jbrd boxes (grey, progressive, 4:4:4,
    with a COM, bytes between markers, 0xFF fill and a tail), 800 cases, seeded: the parser
    raises nothing but CorruptDataError, and whenever libjxl rebuilds a file from the
    stream the parser accepted it, declaring no more bytes than that file has."""
    import random

    import imagecodecs
    from PIL import Image

    from compressors.jxlsize import _walk, jbrd_bytes

    seeds = []
    for mode, options in (("L", {}), ("RGB", {"progressive": True}),
                          ("RGB", {"subsampling": 0})):
        buf = io.BytesIO()
        Image.new(mode, (48, 40), 100).save(buf, "JPEG", comment=b"hello", **options)
        jpeg = buf.getvalue()
        app0 = 4 + int.from_bytes(jpeg[4:6], "big")
        for odd in (jpeg, jpeg[:app0] + b"gar" + jpeg[app0:] + b"tail",
                    jpeg[:app0] + b"\xff\xff" + jpeg[app0:]):
            seeds.append(imagecodecs.jpegxl_encode_jpeg(odd, numthreads=1))
    rng = random.Random(42)
    rebuilt = 0
    for case in range(800):
        blob = bytearray(rng.choice(seeds))
        start, end = _walk(blob)[1]
        for _ in range(rng.randint(1, 3)):
            pos = start + rng.randrange(min(end - start, 80))
            blob[pos] = rng.choice((blob[pos] ^ 1 << rng.randrange(8), rng.randrange(256)))
        try:
            parts = jbrd_bytes(memoryview(blob)[start:end])
        except CorruptDataError:
            parts = None
        try:
            out = imagecodecs.jpegxl_decode_jpeg(bytes(blob), numthreads=1)
        except (RuntimeError, ValueError, imagecodecs.JpegxlError):
            continue
        assert parts is not None and sum(parts) <= len(out), (case, parts, len(out))
        rebuilt += 1
    assert rebuilt >= 10, rebuilt  # the property was tested, not only refusals
