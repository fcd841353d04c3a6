"""Tests of the standalone ``compressors`` codec library.

Golden fixtures live in ``tests/fixtures/codecs/<name>/``; regenerate them with
``python tests/fixtures/codecs/regenerate.py`` after an intended encoder change.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import struct
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import compressors
from compressors import (
    CODECS,
    BadConfigError,
    Blosc2Codec,
    Codec,
    CodecError,
    CodecSpec,
    CodecUnavailableError,
    CorruptDataError,
    UnknownCodecError,
    ZstdCodec,
    _util,
    available,
    get_codec,
    parse_codec_spec,
    parse_spec,
    register_codec,
    registry,
    train_dictionary,
)

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

FIXTURES = Path(__file__).parent / "fixtures" / "codecs"
REGENERATE = "python tests/fixtures/codecs/regenerate.py"
MiB = 1 << 20

SPECS = [
    "none",
    "zstd:1",
    "zstd:3",
    "zstd:19",
    "lz4",
    "lz4hc:9",
    "lz4hc:12",
    "snappy",
    "blosc2",
    "blosc2:blosclz:9:noshuffle:1",
    "blosc2:lz4:5:shuffle:4",
    "blosc2:lz4hc:9:bitshuffle:4",
    "blosc2:zstd:5:shuffle:4",
    "blosc2:zlib:1:bitshuffle:8",
    "blosc2:lz4:0:noshuffle:2",
    "zlib:1",
    "zlib:6",
]
DICT = "zstd:3+dict"  # pseudo spec: ZstdCodec(3) with a dictionary trained from JSON records
ALL = SPECS + [DICT]
COMPRESSING = [s for s in ALL if s != "none"]

GOLDEN = [
    "none", "zstd-1", "zstd-3", "zstd-19", "zstd-3-dict", "lz4", "lz4hc-9", "lz4hc-12",
    "snappy", "blosc2-default", "blosc2-blosclz-9-noshuffle-1", "blosc2-lz4-5-shuffle-4",
    "blosc2-lz4hc-9-bitshuffle-4", "blosc2-zstd-5-shuffle-4", "blosc2-zlib-1-bitshuffle-8",
    "zlib-1", "zlib-6", "jpegxl",
]


# --------------------------------------------------------------------------- helpers


def json_records(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    return [json.dumps({"id": rng.randrange(10**6), "label": rng.choice(["cat", "dog", "bird"]),
                        "user": f"user{rng.randrange(300):03d}", "score": round(rng.random(), 3)}
                       ).encode() for _ in range(count)]


@pytest.fixture(scope="session")
def zstd_dict() -> bytes:
    return train_dictionary(json_records(7, 500), size=2048)


def make_codec(spec: str, zstd_dict: bytes) -> Codec:
    return ZstdCodec(3, dict_data=zstd_dict) if spec == DICT else parse_spec(spec)


@pytest.fixture(params=ALL)
def codec(request: pytest.FixtureRequest, zstd_dict: bytes) -> Codec:
    return make_codec(request.param, zstd_dict)


@pytest.fixture(params=COMPRESSING)
def compressing_codec(request: pytest.FixtureRequest, zstd_dict: bytes) -> Codec:
    return make_codec(request.param, zstd_dict)


def _shapes() -> dict[str, bytes]:
    rng = np.random.default_rng(1234)
    smooth = np.cumsum(rng.normal(size=16384)).astype(np.float32).tobytes()
    text = "\n".join(f"line {i}: label={i % 13} path=/data/train/{i % 97:03d}.jpg"
                     for i in range(400)).encode()
    noise = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    big = (smooth * 10 + text * 8 + noise * 16)[:MiB]
    return {
        "empty": b"",
        "one_byte": b"\x07",
        "random": noise,
        "zeros": bytes(65536),
        "text": text,
        "float32": smooth,
        "1MiB": big + bytes(MiB - len(big)),
        "json": b"\n".join(json_records(3, 40)),
    }


SHAPES = _shapes()
MIXED = SHAPES["text"][:3000] + SHAPES["float32"][:4000] + SHAPES["random"][:1000]


def reset_peak_rss() -> Callable[[], int]:
    """Start measuring peak RSS; returns a function giving the growth since then (bytes).

    Linux: resets VmHWM through /proc/self/clear_refs, which also sees allocations made
    by C/Rust libraries (invisible to tracemalloc). Elsewhere: ru_maxrss delta (weaker).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

        def hwm() -> int:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

        def rss() -> int:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

        base = rss()
        return lambda: hwm() - base
    except OSError:
        if resource is None:
            return lambda: 0
        scale = 1 if sys.platform == "darwin" else 1024
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale - base


def _rejected_bounded_here(call: Callable[[], Any], limit: int) -> CorruptDataError:
    rss_growth = reset_peak_rss()
    tracemalloc.start()
    # CPU time, not wall time: the bound is on the work done before refusing (a bomb
    # decoded in full costs seconds of CPU), which a busy machine does not change
    start = time.process_time()
    try:
        with pytest.raises(CorruptDataError) as info:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    cpu = time.process_time() - start
    assert peak < limit, f"decoder allocated {peak} bytes through Python allocators"
    assert rss_growth() < limit, f"peak RSS grew by {rss_growth()} bytes while decoding"
    assert cpu < 2.0, f"rejection took {cpu:.2f} s of CPU"
    return info.value


def assert_rejected_bounded(call: Callable[[], Any], limit: int = 16 * MiB) -> CorruptDataError:
    """``call`` must raise CorruptDataError quickly without allocating anywhere near a bomb.

    Peak RSS is a property of the whole process: in a full run, a thread another test left
    finishing (a reader, a server) can allocate while we measure. Where fork exists, the
    check runs in a forked child, which has only the calling thread; the child reports the
    error's message (or the failed assertion) back through a pipe.
    """
    if not hasattr(os, "fork"):
        return _rejected_bounded_here(call, limit)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(rfd)
            try:
                err = _rejected_bounded_here(call, limit)
                out = {"ok": True, "message": str(err)}
            except BaseException as exc:  # the failed assertion travels to the parent
                out = {"ok": False, "message": f"{type(exc).__name__}: {exc}"}
            os.write(wfd, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and raw, "the measuring child failed"
    out = json.loads(raw)
    if not out["ok"]:
        pytest.fail(out["message"])
    return CorruptDataError(out["message"])


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip(codec: Codec, shape: str) -> None:
    raw = SHAPES[shape]
    encoded = codec.encode(raw)
    assert type(encoded) is bytes
    decoded = codec.decode(encoded, len(raw))
    assert type(decoded) is bytes
    assert decoded == raw


def test_compresses_redundant_data(compressing_codec: Codec) -> None:
    raw = SHAPES["zeros"] + SHAPES["text"]
    size = len(compressing_codec.encode(raw))
    if compressing_codec.get_config().get("clevel") == 0:  # blosc2 clevel 0 only stores
        assert len(raw) <= size <= len(raw) + 64
    else:
        assert size < len(raw) // 4


def test_buffer_inputs(codec: Codec) -> None:
    floats = np.frombuffer(SHAPES["float32"], dtype=np.float32)
    reference = codec.encode(floats.tobytes())
    assert codec.encode(floats) == reference  # ndarray, itemsize 4
    assert codec.encode(memoryview(floats)) == reference  # memoryview of format 'f'
    assert codec.encode(bytearray(floats.tobytes())) == reference
    padded = b"xx" + floats.tobytes()
    assert codec.encode(memoryview(padded)[2:]) == reference  # offset slice
    strided = memoryview(SHAPES["text"])[::2]  # non-contiguous
    assert codec.decode(codec.encode(strided), len(strided)) == bytes(strided)
    for wrapped in (memoryview(reference), bytearray(reference), np.frombuffer(reference, np.uint8)):
        assert codec.decode(wrapped, floats.nbytes) == floats.tobytes()
    assert codec.decode(reference, np.int64(floats.nbytes)) == floats.tobytes()


def test_config_round_trip(codec: Codec) -> None:
    config = codec.get_config()
    assert isinstance(config["id"], str) and config["id"] == type(codec).codec_id
    again = get_codec(json.loads(json.dumps(config)))
    assert again == codec and hash(again) == hash(codec)
    assert type(again).from_config(config) == codec
    assert again.decode(codec.encode(MIXED), len(MIXED)) == MIXED
    assert pickle.loads(pickle.dumps(codec)) == codec


def test_spec_round_trip(codec: Codec) -> None:
    if codec.get_config().get("dict"):
        assert codec.spec == "zstd:3+dict"
        with pytest.raises(BadConfigError, match="zstd:3\\+dict"):
            parse_spec(codec.spec)
        return
    assert parse_spec(codec.spec) == codec
    assert parse_spec(codec.spec).spec == codec.spec


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("zstd", "zstd:3"), ("zstd:9", "zstd:9"), ("lz4hc", "lz4hc:9"), ("lz4hc:12", "lz4hc:12"),
        ("zlib", "zlib:6"), ("zlib:9", "zlib:9"), ("blosc2", "blosc2:zstd:5:shuffle:1"),
        ("blosc2:lz4", "blosc2:lz4:5:shuffle:1"), ("blosc2:zstd:5:shuffle:4", "blosc2:zstd:5:shuffle:4"),
        ("none", "none"), ("lz4", "lz4"), ("snappy", "snappy"),
    ],
)
def test_spec_defaults(spec: str, canonical: str) -> None:
    assert parse_spec(spec).spec == canonical


@pytest.mark.parametrize(
    ("text", "codec", "dictionary", "solid_kb", "label"),
    [
        ("zstd:3", "zstd:3", False, 0, "zstd:3"),
        ("zstd", "zstd:3", False, 0, "zstd:3"),
        ("zstd:19+dict", "zstd:19", True, 0, "zstd:19+dict"),
        ("zstd:3+solid16k", "zstd:3", False, 16, "zstd:3+solid16k"),
        ("zstd:19+dict+solid64k", "zstd:19", True, 64, "zstd:19+dict+solid64k"),
        ("blosc2:zstd:5:shuffle:4+solid32k", "blosc2:zstd:5:shuffle:4", False, 32,
         "blosc2:zstd:5:shuffle:4+solid32k"),
        ("none", "none", False, 0, "none"),
        ("lz4+solid1k", "lz4", False, 1, "lz4+solid1k"),
    ],
)
def test_codec_spec_grammar(text: str, codec: str, dictionary: bool, solid_kb: int,
                            label: str) -> None:
    spec = parse_codec_spec(text)
    assert spec == CodecSpec(parse_spec(codec), dictionary, solid_kb)
    assert spec.label == str(spec) == label
    assert parse_codec_spec(spec.label) == spec  # the label is a spec


def test_codec_spec_of_a_dictionary_codec_is_its_label(zstd_dict: bytes) -> None:
    # What `fanstore info` lists for a chunk with a dictionary is a spec pack accepts.
    spec = parse_codec_spec(ZstdCodec(9, dict_data=zstd_dict).spec)
    assert spec == CodecSpec(ZstdCodec(9), dictionary=True)


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("zstd:3+dict+dict", BadConfigError, "'+dict' comes once"),
        ("zstd:3+solid64k+dict", BadConfigError, "before '+solidNk'"),
        ("zstd:3+solid16k+solid64k", BadConfigError, "'+solidNk' comes once"),
        ("zstd:3+solid0k", BadConfigError, "at least 1 KiB"),
        ("zstd:3+solid64", BadConfigError, "unknown suffix '+solid64'"),
        ("zstd:3+", BadConfigError, "unknown suffix '+'"),
        ("zstd:3+fast", BadConfigError, "(NAME[:ARG...][+dict][+solidNk])"),
        ("lz4+dict", BadConfigError, "only zstd:L takes a trained dictionary"),
        ("zstd:99+dict", BadConfigError, "invalid codec spec 'zstd:99': zstd level must be"),
        ("bogus+solid64k", UnknownCodecError, "unknown codec 'bogus'"),
        ("", UnknownCodecError, "empty"),
    ],
)
def test_codec_spec_errors(text: str, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)) as info:
        parse_codec_spec(text)
    assert "\n" not in str(info.value)


def test_equality_hash_repr(zstd_dict: bytes) -> None:
    assert parse_spec("zstd:3") == ZstdCodec() == ZstdCodec(3)
    assert parse_spec("zstd:3") != parse_spec("zstd:4")
    assert parse_spec("zlib:3") != parse_spec("zstd:3")
    assert ZstdCodec(3, dict_data=zstd_dict) != ZstdCodec(3)
    assert len({parse_spec("lz4"), parse_spec("lz4"), parse_spec("lz4hc")}) == 2
    assert repr(parse_spec("zstd:9")) == "ZstdCodec(level=9)"
    assert repr(parse_spec("blosc2:lz4:5:shuffle:4")) == (
        "Blosc2Codec(codec='lz4', clevel=5, filter='shuffle', typesize=4)")
    assert len(repr(ZstdCodec(3, dict_data=zstd_dict))) < 150  # the dictionary is abbreviated


def test_get_codec_caches_instances(zstd_dict: bytes) -> None:
    config = ZstdCodec(5, dict_data=zstd_dict).get_config()
    first = get_codec(config)
    assert get_codec(config) is first
    assert get_codec(json.loads(json.dumps(config))) is first  # equal config, other object
    config["level"] = 6  # a mutated config must not hit the identity fast path
    assert get_codec(config).level == 6


# --------------------------------------------------------------------------- codec specifics


def test_zstd_frame_format() -> None:
    zstandard = pytest.importorskip("zstandard")
    encoded = parse_spec("zstd:3").encode(MIXED)
    params = zstandard.get_frame_parameters(encoded)
    assert params.content_size == len(MIXED)
    assert not params.has_checksum


def test_zstd_dictionary(zstd_dict: bytes) -> None:
    assert 0 < len(zstd_dict) <= 2048
    with_dict = ZstdCodec(3, dict_data=zstd_dict)
    sample = json_records(99, 1)[0]
    encoded = with_dict.encode(sample)
    assert len(encoded) < len(ZstdCodec(3).encode(sample))
    config = with_dict.get_config()
    assert config["dict_id"] == with_dict.dict_id and config["dict_id"] > 0
    assert get_codec(json.loads(json.dumps(config))).decode(encoded, len(sample)) == sample
    with pytest.raises(CorruptDataError):  # a dictionary frame needs its dictionary
        ZstdCodec(3).decode(encoded, len(sample))


def test_zstd_dictionary_config_errors(zstd_dict: bytes) -> None:
    config = ZstdCodec(3, dict_data=zstd_dict).get_config()
    with pytest.raises(BadConfigError, match="dict_id"):
        get_codec({**config, "dict_id": config["dict_id"] + 1})
    with pytest.raises(BadConfigError, match="base64"):
        get_codec({**config, "dict": "not base64!"})
    with pytest.raises(BadConfigError, match="empty"):
        ZstdCodec(3, dict_data=b"")


def test_train_dictionary_needs_samples() -> None:
    with pytest.raises(BadConfigError, match="training failed"):
        train_dictionary([b"abc", b"abd"], size=4096)
    with pytest.raises(BadConfigError, match="size"):
        train_dictionary(json_records(1, 100), size=10)


def test_zstd_refuses_frame_without_content_size() -> None:
    zstandard = pytest.importorskip("zstandard")
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = cobj.compress(MIXED) + cobj.flush()
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(CorruptDataError, match="does not record"):
        parse_spec("zstd").decode(frame, len(MIXED))


def test_lz4_raw_block_without_size_prefix() -> None:
    lz4_block = pytest.importorskip("lz4.block")
    for spec, mode in (("lz4", {}), ("lz4hc:12", {"mode": "high_compression", "compression": 12})):
        encoded = parse_spec(spec).encode(MIXED)
        assert encoded == lz4_block.compress(MIXED, store_size=False, **mode)
        assert lz4_block.decompress(encoded, uncompressed_size=len(MIXED)) == MIXED


def test_blosc2_runs_single_threaded(monkeypatch: pytest.MonkeyPatch) -> None:
    blosc2 = pytest.importorskip("blosc2")
    seen: list[int] = []
    real_c, real_d = blosc2.compress2, blosc2.decompress2
    monkeypatch.setattr(blosc2, "compress2", lambda s, **kw: seen.append(kw["nthreads"]) or real_c(s, **kw))
    monkeypatch.setattr(blosc2, "decompress2", lambda s, **kw: seen.append(kw["nthreads"]) or real_d(s, **kw))
    codec = parse_spec("blosc2:lz4:5:shuffle:4")
    assert codec.decode(codec.encode(MIXED), len(MIXED)) == MIXED
    assert seen == [1, 1]


def test_blosc2_header_records_parameters() -> None:
    blosc2 = pytest.importorskip("blosc2")
    encoded = parse_spec("blosc2:zstd:5:shuffle:4").encode(MIXED)
    nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(encoded)
    assert (nbytes, cbytes, encoded[3]) == (len(MIXED), len(encoded), 4)  # byte 3: typesize


def test_blosc2_rejects_oversized_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compressors.blosc2, "MAX_BUFFER", 1000)
    with pytest.raises(BadConfigError, match="more than 1000 bytes"):
        parse_spec("blosc2").encode(bytes(1001))
    assert parse_spec("blosc2").encode(bytes(1000))


def test_blosc2_refuses_uninitialised_special_chunk() -> None:
    blosc2 = pytest.importorskip("blosc2")
    schunk = blosc2.SChunk(chunksize=4000, cparams={"typesize": 4})
    schunk.fill_special(1000, blosc2.SpecialValue.UNINIT)
    with pytest.raises(CorruptDataError, match="special"):
        parse_spec("blosc2").decode(schunk.get_chunk(0), 4000)


#: A 32-byte chunk found by tests/test_fuzz_codecs.py that made c-blosc2 segfault: flags
#: 0x5d (the reserved compressor format 2, delta), filter code 0x80, reserved byte 0xff.
BLOSC2_SEGFAULT = bytes.fromhex(
    "05015d010000000001000000200000000000800000000000000000000000ff00")


def test_blosc2_refuses_headers_it_never_writes() -> None:
    pytest.importorskip("blosc2")
    codec = parse_spec("blosc2:blosclz:9:noshuffle:1")
    with pytest.raises(CorruptDataError, match="flags 0x5d"):
        codec.decode(BLOSC2_SEGFAULT, 0)
    empty = codec.encode(b"")
    assert codec.decode(empty, 0) == b"" and empty[2] == 0x07

    def edit(**at: int) -> bytes:
        out = bytearray(empty)
        for pos, value in at.items():
            out[int(pos[1:])] = value
        return bytes(out)

    refused = {
        "no extended header": (edit(b2=0x03), "not an extended-header chunk"),
        "reserved format 2": (edit(b2=0x47), "flags 0x47"),
        "user-defined codec": (edit(b2=0xC7), "flags 0xc7"),
        "super-chunk codec": (edit(b2=0xE7), "flags 0xe7"),
        "delta": (edit(b2=0x0F), "flags 0x0f"),
        "delta filter": (edit(b17=3), "filter codes"),
        "user filter": (edit(b18=0x80), "filter codes"),
        "dictionary": (edit(b31=0x01), "chunk flags 0x01"),
        "lazy": (edit(b31=0x08), "chunk flags 0x08"),
        "instrumented": (edit(b31=0x80), "chunk flags 0x80"),
        "reserved special": (edit(b31=0x50), "special value 5"),
        "short": (empty[:20], "claims 32 compressed bytes, got 20"),
    }
    for what, (data, message) in refused.items():
        with pytest.raises(CorruptDataError, match=message):
            codec.decode(data, 0)
            pytest.fail(f"{what}: decoded")
    zeros = parse_spec("blosc2:zstd:5:shuffle:4").encode(bytes(5000))
    assert zeros[31] == 0x10 and codec.decode(zeros, 5000) == bytes(5000)


def test_concurrent_decoding(zstd_dict: bytes) -> None:
    codecs = [make_codec(s, zstd_dict) for s in ALL]
    raws = [SHAPES["float32"][i * 4096:(i + 3) * 4096] for i in range(8)]
    jobs = [(c, raw, c.encode(raw)) for c in codecs for raw in raws]
    barrier = threading.Barrier(8)

    def work(offset: int) -> bool:
        barrier.wait()
        return all(c.decode(enc, len(raw)) == raw for c, raw, enc in jobs[offset:] + jobs[:offset])

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(0, 8 * 7, 7)))


# --------------------------------------------------------------------------- bounded decode


@pytest.fixture(params=ALL)
def sample(request: pytest.FixtureRequest, zstd_dict: bytes) -> tuple[Codec, bytes]:
    codec = make_codec(request.param, zstd_dict)
    return codec, codec.encode(MIXED)


def test_truncated_input(sample: tuple[Codec, bytes]) -> None:
    codec, encoded = sample
    for cut in (1, 7, len(encoded) // 2, len(encoded) - 1):
        with pytest.raises(CorruptDataError):
            codec.decode(encoded[:-cut], len(MIXED))


def test_garbage_input(sample: tuple[Codec, bytes]) -> None:
    codec, _ = sample
    rng = random.Random(5)
    for size in (0, 3, 40, 1000):
        garbage = bytes(rng.randrange(256) for _ in range(size))
        with pytest.raises(CorruptDataError):
            codec.decode(garbage, len(MIXED))


def test_trailing_bytes(sample: tuple[Codec, bytes]) -> None:
    codec, encoded = sample
    with pytest.raises(CorruptDataError):
        codec.decode(encoded + b"\x00junk", len(MIXED))


@pytest.mark.parametrize("delta", [-1, 1, -len(MIXED), 10 * MiB])
def test_wrong_raw_size(sample: tuple[Codec, bytes], delta: int) -> None:
    codec, encoded = sample
    assert_rejected_bounded(lambda: codec.decode(encoded, len(MIXED) + delta))


def test_empty_stream_is_not_empty_data(compressing_codec: Codec) -> None:
    assert compressing_codec.decode(compressing_codec.encode(b""), 0) == b""
    with pytest.raises(CorruptDataError):
        compressing_codec.decode(b"", 0)
    with pytest.raises(CorruptDataError):
        compressing_codec.decode(compressing_codec.encode(b""), 1)


@pytest.mark.parametrize("raw_size", [-1, 1.5, "10", None, True])
def test_bad_raw_size(raw_size: Any) -> None:
    codec = parse_spec("zstd")
    with pytest.raises(CorruptDataError, match="raw_size"):
        codec.decode(codec.encode(b"abc"), raw_size)


def _zero_stream(write: Callable[[bytes], bytes], flush: Callable[[], bytes], total: int) -> bytes:
    chunk = bytes(MiB)
    return b"".join([write(chunk) for _ in range(total // MiB)] + [flush()])


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """Tiny streams that inflate to 100 MiB (built without holding 100 MiB at once)."""
    import zlib

    zstandard = pytest.importorskip("zstandard")
    sized = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=100 * MiB)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    zobj = zlib.compressobj(9)
    return {
        "zstd": _zero_stream(sized.compress, sized.flush, 100 * MiB),
        "zstd-unsized": _zero_stream(unsized.compress, unsized.flush, 100 * MiB),
        "zlib": _zero_stream(zobj.compress, zobj.flush, 100 * MiB),
    }


@pytest.mark.parametrize("name", ["zstd", "zstd-unsized", "zlib"])
@pytest.mark.parametrize("raw_size", [0, 1000, 50 * MiB])
def test_stream_bombs(bombs: dict[str, bytes], name: str, raw_size: int) -> None:
    bomb = bombs[name]
    assert len(bomb) < 200_000
    codec = parse_spec(name.split("-")[0])
    # Output is capped at raw_size (+1); zlib's growing output buffer is joined once at the
    # end, so the transient peak may reach twice that - never anything like the 100 MiB bomb.
    assert_rejected_bounded(lambda: codec.decode(bomb, raw_size), limit=16 * MiB + 2 * raw_size)


def test_lz4_bomb_and_impossible_ratio() -> None:
    codec = parse_spec("lz4")
    bomb = codec.encode(bytes(64 * MiB))
    assert len(bomb) < 1 * MiB
    assert_rejected_bounded(lambda: codec.decode(bomb, 1000))
    err = assert_rejected_bounded(lambda: codec.decode(b"\x00" * 10, 10**12))  # no 1 TB malloc
    assert "cannot hold" in str(err)


def test_snappy_header_claiming_huge_size() -> None:
    codec = parse_spec("snappy")
    hostile = b"\xff\xff\xff\xff\x0f" + b"\x00" * 64  # varint 2**32 - 1, then junk
    assert_rejected_bounded(lambda: codec.decode(hostile, 1000))
    # even when raw_size agrees with the header, 69 bytes cannot hold 4 GiB:
    err = assert_rejected_bounded(lambda: codec.decode(hostile, 2**32 - 1))
    assert "cannot hold" in str(err)
    bomb = codec.encode(bytes(64 * MiB))
    assert len(bomb) < 4 * MiB
    assert_rejected_bounded(lambda: codec.decode(bomb, 1000))
    assert_rejected_bounded(lambda: codec.decode(bomb, 32 * MiB), limit=16 * MiB + 32 * MiB)


def test_blosc2_header_claiming_huge_size() -> None:
    codec = parse_spec("blosc2:lz4:5:shuffle:4")
    hostile = bytearray(codec.encode(MIXED))
    hostile[4:8] = struct.pack("<i", 2**31 - 100)  # header field: uncompressed size
    assert_rejected_bounded(lambda: codec.decode(bytes(hostile), len(MIXED)))
    bomb = codec.encode(bytes(64 * MiB))
    assert len(bomb) < 1 * MiB
    assert_rejected_bounded(lambda: codec.decode(bomb, 1000))


def test_library_errors_are_chained() -> None:
    zstandard = pytest.importorskip("zstandard")
    damaged = bytearray(parse_spec("zstd").encode(MIXED))
    header = zstandard.frame_header_size(damaged)
    damaged[header:header + 3] = b"\xff\xff\xff"  # valid frame header, reserved block type
    with pytest.raises(CorruptDataError) as info:
        parse_spec("zstd").decode(bytes(damaged), len(MIXED))
    assert isinstance(info.value.__cause__, zstandard.ZstdError)
    lz4_block = pytest.importorskip("lz4.block")
    with pytest.raises(CorruptDataError) as info:
        parse_spec("lz4").decode(b"\xf0" + bytes(20), 1000)
    assert isinstance(info.value.__cause__, lz4_block.LZ4BlockError)


# --------------------------------------------------------------------------- errors and registry


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("zstdd", UnknownCodecError,
         "unknown codec 'zstdd' (known: none, zstd, lz4, lz4hc, snappy, blosc2, zlib, jpegxl)"),
        ("", UnknownCodecError, "empty"),
        ("zstd:25", BadConfigError, "invalid codec spec 'zstd:25': zstd level must be 1-19, got 25"),
        ("zstd:0", BadConfigError, "zstd level must be 1-19, got 0"),
        ("zstd:-1", BadConfigError, "zstd level must be an integer 1-19, got '-1'"),
        ("zstd:fast", BadConfigError, "zstd level must be an integer 1-19, got 'fast'"),
        ("zstd:3:4", BadConfigError, "zstd takes at most 1 field(s) (zstd:<level>), got 2"),
        ("lz4:1", BadConfigError, "lz4 takes no parameters"),
        ("lz4hc:13", BadConfigError, "lz4hc level must be 1-12, got 13"),
        ("zlib:0", BadConfigError, "zlib level must be 1-9, got 0"),
        ("blosc2:brotli", BadConfigError,
         "blosc2 codec must be one of blosclz, lz4, lz4hc, zstd, zlib, got 'brotli'"),
        ("blosc2:lz4:10", BadConfigError, "blosc2 clevel must be 0-9, got 10"),
        ("blosc2:lz4:5:delta", BadConfigError,
         "blosc2 filter must be one of noshuffle, shuffle, bitshuffle, got 'delta'"),
        ("blosc2:lz4:5:shuffle:256", BadConfigError, "blosc2 typesize must be 1-255, got 256"),
        ("blosc2:lz4:5:shuffle:4:1", BadConfigError, "blosc2:<codec>:<clevel>:<filter>:<typesize>"),
    ],
)
def test_bad_specs(spec: str, error: type[CodecError], message: str) -> None:
    with pytest.raises(error) as info:
        parse_spec(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)  # both UnknownCodecError and BadConfigError


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"id": "nope"}, UnknownCodecError, "unknown codec 'nope'"),
        ({"level": 3}, BadConfigError, "'id'"),
        ([("id", "zstd")], BadConfigError, "must be a dict"),
        ({"id": "zstd", "level": 3, "bogus": 1}, BadConfigError, "unknown keys ['bogus']"),
        ({"id": "zstd", "level": "3"}, BadConfigError, "zstd level must be 1-19, got '3'"),
        ({"id": "zstd", "level": True}, BadConfigError, "zstd level"),
        ({"id": "zlib", "level": 3.0}, BadConfigError, "zlib level"),
        ({"id": "zstd", "level": b"3"}, BadConfigError, "JSON"),
        ({"id": "blosc2", "codec": "lz4", "clevel": 5, "filter": "shuffle", "typesize": 0},
         BadConfigError, "typesize must be 1-255"),
    ],
)
def test_bad_configs(config: Any, error: type[CodecError], message: str) -> None:
    with pytest.raises(error, match=None) as info:
        get_codec(config)
    assert message in str(info.value)


def test_from_config_checks_id() -> None:
    with pytest.raises(BadConfigError, match="does not match"):
        ZstdCodec.from_config({"id": "zlib", "level": 3})


def test_error_hierarchy() -> None:
    for cls in (UnknownCodecError, CodecUnavailableError, CorruptDataError, BadConfigError):
        assert issubclass(cls, CodecError)
    assert issubclass(UnknownCodecError, ValueError) and issubclass(BadConfigError, ValueError)
    assert not issubclass(CorruptDataError, ValueError)


def test_available_lists_importable_codecs() -> None:
    optional = ["jpegxl"] if _imports("imagecodecs") else []
    assert available() == ["none", "zstd", "lz4", "lz4hc", "snappy", "blosc2", "zlib"] + optional
    assert list(CODECS) == available() + (["jpegxl"] if not optional else [])
    with pytest.raises(TypeError):
        CODECS["x"] = ZstdCodec  # type: ignore[index]


def _imports(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_missing_library_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_util, "_MODULES", {})
    monkeypatch.setitem(sys.modules, "blosc2", None)  # makes `import blosc2` fail
    with pytest.raises(CodecUnavailableError, match="blosc2 is not installed: pip install blosc2"):
        Blosc2Codec()
    with pytest.raises(CodecUnavailableError):
        parse_spec("blosc2:lz4")
    assert "blosc2" not in available()
    monkeypatch.setattr(_util, "_MODULES", {})  # available() cached the other libraries
    monkeypatch.setitem(sys.modules, "snappy", None)
    with pytest.raises(CodecUnavailableError, match="pip install python-snappy"):
        parse_spec("snappy")
    assert parse_spec("zlib").decode(parse_spec("zlib").encode(MIXED), len(MIXED)) == MIXED


class ReverseCodec(Codec):
    """Toy codec for registry tests."""

    codec_id = "reverse-test"

    def encode(self, buf: Any) -> bytes:
        return bytes(memoryview(buf).cast("B"))[::-1]

    def decode(self, buf: Any, raw_size: int) -> bytes:
        if len(buf) != raw_size:
            raise CorruptDataError("size")
        return bytes(buf)[::-1]

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    @property
    def spec(self) -> str:
        return self.codec_id


@pytest.fixture
def clean_registry():
    yield
    for codec_id in ("reverse-test", "plugin-test"):
        registry._REGISTRY.pop(codec_id, None)
    registry._INSTANCES.clear()
    registry._BY_IDENTITY.clear()


def test_register_codec(clean_registry: None) -> None:
    assert register_codec(ReverseCodec) is ReverseCodec
    assert register_codec(ReverseCodec) is ReverseCodec  # idempotent
    assert get_codec({"id": "reverse-test"}).decode(b"cba", 3) == b"abc"
    assert parse_spec("reverse-test").encode(b"abc") == b"cba"
    assert "reverse-test" in available()
    other = type("Other", (ReverseCodec,), {})
    with pytest.raises(BadConfigError, match="already registered"):
        register_codec(other)
    with pytest.raises(BadConfigError):
        register_codec(dict)  # type: ignore[arg-type]


PLUGIN_SOURCE = '''
from compressors import Codec

class PluginCodec(Codec):
    codec_id = "plugin-test"
    def encode(self, buf): return b"P" + bytes(buf)
    def decode(self, buf, raw_size): return bytes(buf)[1:]
    def get_config(self): return {"id": self.codec_id}
    @property
    def spec(self): return self.codec_id
'''


def test_entry_point_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             clean_registry: None) -> None:
    (tmp_path / "fanstore_test_plugin.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    group = registry.ENTRY_POINT_GROUP
    eps = [EntryPoint("plugin-test", "fanstore_test_plugin:PluginCodec", group),
           EntryPoint("broken-test", "fanstore_no_such_module:Codec", group)]
    calls: list[str] = []

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        calls.append(group)
        return eps

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", fake_entry_points)
    assert "plugin-test" not in CODECS
    assert get_codec({"id": "plugin-test"}).encode(b"x") == b"Px"
    assert calls == ["fanstore.codecs"] and "plugin-test" in CODECS
    assert parse_spec("plugin-test").decode(b"Px", 1) == b"x"
    assert calls == ["fanstore.codecs"]  # loaded once, then registered
    with pytest.raises(CodecUnavailableError, match="broken-test"):
        parse_spec("broken-test")
    with pytest.raises(UnknownCodecError, match="broken-test"):  # plugins listed as known
        parse_spec("missing")


# --------------------------------------------------------------------------- golden fixtures


def _load_golden(name: str) -> tuple[Codec, bytes, bytes]:
    folder = FIXTURES / name
    if not folder.is_dir():
        pytest.fail(f"missing golden fixture {folder}; regenerate with: {REGENERATE}")
    config = json.loads((folder / "config.json").read_text())
    try:
        codec = get_codec(config)
    except CodecUnavailableError as exc:  # jpegxl without imagecodecs (the jpeg extra)
        pytest.skip(str(exc))
    return (codec, (folder / "raw.bin").read_bytes(),
            (folder / "encoded.bin").read_bytes())


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_decode(name: str) -> None:
    codec, raw, encoded = _load_golden(name)
    assert codec.decode(encoded, len(raw)) == raw, f"{name}: stored stream no longer decodes"


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_encode(name: str) -> None:
    codec, raw, encoded = _load_golden(name)
    assert 1000 < len(raw) < 8000
    got = codec.encode(raw)
    assert got == encoded, (
        f"{name} ({codec.spec}): encoder output changed ({len(got)} bytes, fixture has "
        f"{len(encoded)}). Old data still decodes if test_golden_decode passes; if the change "
        f"is intended (e.g. library upgrade), regenerate with: {REGENERATE}")


def test_golden_fixture_tree_covers_every_codec_and_stays_small() -> None:
    names = {p.parent.name for p in FIXTURES.glob("*/config.json")}
    assert names == set(GOLDEN)
    configs = [json.loads((FIXTURES / n / "config.json").read_text()) for n in GOLDEN]
    assert {c["id"] for c in configs} == set(CODECS)
    blosc2 = [c for c in configs if c["id"] == "blosc2"]
    assert {c["codec"] for c in blosc2} == set(compressors.blosc2.CODECS)
    assert {c["filter"] for c in blosc2} == set(compressors.blosc2.FILTERS)
    assert any("dict" in c for c in configs)
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file()) < 200_000
