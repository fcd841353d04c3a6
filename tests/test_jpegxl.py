"""The ``jpegxl`` codec: lossless JPEG recompression, and the inputs it declines.

The JPEGs are made by ``tools/gen_jpegs.py`` from photographs scikit-image and matplotlib
ship (tests/jpeg_helpers.py). Pack, selection, mount and the missing-library line are in
``tests/test_jpeg_store.py``.
"""

from __future__ import annotations

import io
import sys
import threading

import pytest

pytest.importorskip("imagecodecs", reason="the jpegxl codec needs imagecodecs (jpeg extra)")

from jpeg_helpers import cmyk_jpeg, jpeg_bytes  # noqa: E402

from compressors import (  # noqa: E402
    BadConfigError,
    CodecUnavailableError,
    CorruptDataError,
    DeclinedError,
    JpegXlCodec,
    _util,
    get_codec,
    parse_codec_spec,
    parse_spec,
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
