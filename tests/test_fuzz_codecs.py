"""Fuzzing every registered codec's ``decode`` with random and mutated streams.

The codecs are listed from the registry (``compressors.CODECS``), so a new codec is fuzzed
without a change here; each is fuzzed with its default config and with every golden
fixture config of its id (tests/fixtures/codecs: zstd with a dictionary, the blosc2
variants). Seeds: each fixture's raw bytes (a JPEG for ``jpegxl``) and a few generic inputs,
encoded by the codec (inputs it declines are skipped; every codec must keep one).

A case is a seed's stream after 1-3 mutations (bit flips, bytes set, truncation, extension,
insertion, deletion, a duplicated or moved run, an integer field of the first 64 bytes set
to an edge value, little or big endian), or random bytes, alone or after a real stream's
first bytes; decoded with the raw size the seed records, or (1 case in 8) that size off by
one, zero or doubled. The decode runs in a child process (tests/codec_fuzz_child.py), many
cases per child. The property:

- the decode returns exactly ``raw_size`` bytes (the seed's own bytes when the stream and
  size are the seed's; a mutated stream may decode to other bytes, which the store's
  XXH3-64 catches) or raises a ``compressors`` error (``CodecError``); never another
  exception, never a crash (a child killed by a signal, or silent for 60 s, fails the test
  with the input saved under the test's temporary directory);
- the child's peak RSS (VmHWM) stays within its peak after warming up plus
  ``RSS_ALLOWANCE`` (64 MiB: libjxl working on the largest image a stream of the seed's
  size may declare, 4 Mpixels, ~25 MB; allocator slack) plus 4x the largest raw size
  asked for.

``FAST`` cases per codec in the default run (the same ones every time), ``SLOW`` in the
slow suite; the counts are asserted and printed with the peak RSS (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import random
import select
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from compressors import CODECS, CodecUnavailableError, DeclinedError, get_codec

HERE = Path(__file__).resolve().parent
CHILD = HERE / "codec_fuzz_child.py"
FIXTURES = HERE / "fixtures" / "codecs"

FAST = 300
SLOW = 50_000
RSS_ALLOWANCE_KIB = 64 * 1024
CASE_TIMEOUT = 60.0
END = (1 << 64) - 1
EDGE = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
        (1 << 63) - 1, (1 << 64) - 1]


def _generic_inputs() -> list[bytes]:
    rng = random.Random(5)
    text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "\n"]) for _ in range(900))
    return [b"", b"x", bytes(4096), rng.randbytes(3000), text.encode(),
            bytes(range(256)) * 12]


def seeds_of(codec_id: str) -> list[tuple[dict, bytes, bytes]]:
    """``(config, raw, stream)`` seeds of ``codec_id``: its default config and every
    golden config of that id, each over every input it does not decline."""
    configs, raws = [{"id": codec_id}], []
    for cfg_path in sorted(FIXTURES.glob("*/config.json")):
        cfg = json.loads(cfg_path.read_text())
        if cfg["id"] == codec_id:
            raws.append((cfg_path.parent / "raw.bin").read_bytes())
            if cfg not in configs:
                configs.append(cfg)
    seeds = []
    for cfg in configs:
        try:
            codec = get_codec(cfg)
        except CodecUnavailableError as exc:
            pytest.skip(str(exc))
        for raw in raws + _generic_inputs():
            try:
                seeds.append((cfg, raw, codec.encode(raw)))
            except DeclinedError:
                continue
    assert seeds, f"{codec_id}: declines every seed input; add a fixture it encodes"
    return seeds


# --------------------------------------------------------------------------- mutations


def _set_int(rng: random.Random, data: bytearray) -> None:
    width = rng.choice((1, 2, 4, 8))
    if len(data) < width:
        return
    pos = rng.randrange(min(len(data), 64) - width + 1)
    value = rng.choice(EDGE + [len(data), len(data) + 1, len(data) - 1, rng.getrandbits(32)])
    value &= (1 << 8 * width) - 1
    data[pos:pos + width] = value.to_bytes(width, rng.choice(("little", "big")))


def _mutate_once(rng: random.Random, data: bytearray) -> None:
    n = len(data)
    kind = rng.randrange(9)
    if kind == 0 and n:  # bit flips
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif kind == 1 and n:  # bytes set, most often in the header
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(min(n, 32)) if rng.random() < 0.6 else rng.randrange(n)
            data[pos] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
    elif kind == 2:  # truncation
        del data[rng.randrange(n + 1):]
    elif kind == 3:  # extension
        data += rng.randbytes(rng.randint(1, 64))
    elif kind == 4:  # insertion
        pos = rng.randrange(n + 1)
        data[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif kind == 5 and n:  # deletion
        pos = rng.randrange(n)
        del data[pos:pos + rng.randint(1, 16)]
    elif kind == 6 and n > 1:  # a run duplicated or moved elsewhere
        a = rng.randrange(n)
        run = bytes(data[a:a + rng.randint(1, 64)])
        if rng.random() < 0.5:
            del data[a:a + len(run)]
        pos = rng.randrange(len(data) + 1)
        data[pos:pos] = run
    else:  # an integer field of the header set to an edge value
        _set_int(rng, data)


def make_case(rng: random.Random, seeds) -> tuple[int, bytes, int, bool]:
    """``(seed index, stream, raw size, unmutated)``."""
    i = rng.randrange(len(seeds))
    _, raw, stream = seeds[i]
    roll = rng.random()
    if roll < 0.05:
        data = bytearray(rng.randbytes(rng.randint(0, 2 * len(stream) + 16)))
    elif roll < 0.12:
        data = bytearray(stream[:rng.randint(0, 16)] + rng.randbytes(rng.randint(0, 256)))
    elif roll < 0.15:
        data = bytearray(stream)
    else:
        data = bytearray(stream)
        for _ in range(rng.randint(1, 3)):
            _mutate_once(rng, data)
    size = len(raw)
    if rng.random() < 0.125:
        size = rng.choice((size + 1, max(0, size - 1), 0, 2 * size))
    return i, bytes(data), size, bytes(data) == stream and size == len(raw)


# --------------------------------------------------------------------------- the child


class ChildDecoder:
    """One child process decoding cases for the configs of one codec."""

    def __init__(self, seeds) -> None:
        self.configs = []
        for cfg, _, _ in seeds:
            if cfg not in self.configs:
                self.configs.append(cfg)
        self.proc = subprocess.Popen([sys.executable, str(CHILD)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        warm = {}
        for cfg, raw, stream in seeds:
            warm.setdefault(self.configs.index(cfg), [self.configs.index(cfg), stream.hex(),
                                                      len(raw)])
        for doc in (self.configs, list(warm.values())):
            body = json.dumps(doc).encode()
            self.proc.stdin.write(struct.pack("<I", len(body)) + body)
        self.proc.stdin.flush()
        self.warm_kib = self._peak(b"R")

    def _take(self, n: int) -> bytes | None:
        """``n`` bytes of the child's answer; None if it died or fell silent."""
        fd, data = self.proc.stdout.fileno(), b""
        while len(data) < n:
            ready, _, _ = select.select([fd], [], [], CASE_TIMEOUT)
            if not ready:
                return None
            piece = os.read(fd, n - len(data))
            if not piece:
                return None
            data += piece
        return data

    def _peak(self, tag: bytes) -> int:
        got = self._take(9)
        assert got and got[:1] == tag, f"child: {got!r} {self.failure()}"
        return struct.unpack("<Q", got[1:])[0]

    def decode(self, index: int, stream: bytes, raw_size: int) -> tuple[str, object] | None:
        """``("O", (length, digest))``, ``("E", error name)``, ``("X", repr)``; None if
        the child died or hung."""
        try:
            self.proc.stdin.write(struct.pack("<HQI", index, raw_size, len(stream)) + stream)
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        tag = self._take(1)
        if tag == b"O":
            body = self._take(24)
            return None if body is None else ("O", (struct.unpack("<Q", body[:8])[0],
                                                    body[8:]))
        if tag in (b"E", b"X"):
            head = self._take(4)
            text = head and self._take(struct.unpack("<I", head)[0])
            return None if text is None else (tag.decode(), text.decode())
        return None

    def failure(self) -> str:
        """How the child ended (after a None from :meth:`decode`)."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = f"hung for {CASE_TIMEOUT:.0f} s, killed"
        err = self.proc.stderr.read().decode(errors="replace")[-2000:]
        return f"exit status {code}; stderr: {err}"

    def finish(self) -> int:
        """End the child; its peak RSS (KiB)."""
        self.proc.stdin.write(struct.pack("<HQI", 0, END, 0))
        self.proc.stdin.flush()
        peak = self._peak(b"D")
        assert self.proc.wait(30) == 0
        return peak

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except BrokenPipeError:  # unsent bytes for a child that died
                pass


# --------------------------------------------------------------------------- the target


def _digest(data: bytes) -> bytes:
    import hashlib

    return hashlib.blake2b(data, digest_size=16).digest()


def fuzz_codec(codec_id: str, n: int, seed: int, save_dir: Path) -> dict:
    """Run ``n`` cases against ``codec_id``; returns the counts and the peak RSS. Fails on
    a broken property, with the input saved under ``save_dir``."""
    seeds = seeds_of(codec_id)
    digests = [_digest(raw) for _, raw, _ in seeds]
    rng = random.Random(f"{codec_id}:{seed}")
    child = ChildDecoder(seeds)
    counts = {"exact": 0, "other bytes": 0, "refused": 0}
    largest = max(len(raw) for _, raw, _ in seeds)
    try:
        for case in range(n):
            i, stream, size, unmutated = make_case(rng, seeds)
            largest = max(largest, size)
            cfg = seeds[i][0]
            got = child.decode(child.configs.index(cfg), stream, size)
            problem = _check(got, size, unmutated, digests[i])
            if problem:
                if got is None:
                    problem += "; " + child.failure()
                path = save_dir / f"{codec_id}-case{case}.bin"
                path.write_bytes(stream)
                (save_dir / f"{codec_id}-case{case}.json").write_text(
                    json.dumps({"config": cfg, "raw_size": size, "problem": problem}))
                pytest.fail(f"{codec_id} case {case} ({json.dumps(cfg)}, raw_size {size}, "
                            f"{len(stream)} bytes saved to {path}): {problem}")
            counts["refused" if got[0] == "E" else
                   "exact" if got[1][1] == digests[i] else "other bytes"] += 1
        peak = child.finish()
    finally:
        child.close()
    bound = child.warm_kib + RSS_ALLOWANCE_KIB + 4 * largest // 1024
    assert peak <= bound, f"{codec_id}: peak RSS {peak} KiB > {bound} KiB"
    return {"cases": sum(counts.values()), **counts, "warm_kib": child.warm_kib,
            "peak_kib": peak, "bound_kib": bound}


def _check(got, size: int, unmutated: bool, digest: bytes) -> str | None:
    if got is None:
        return "the child died or hung"
    kind, value = got
    if kind == "X":
        return f"an exception that is not a compressors error: {value}"
    if kind == "E":
        return "a valid stream was refused" if unmutated else None
    length, out = value
    if length != size:
        return f"decoded {length} bytes, raw_size is {size}"
    if unmutated and out != digest:
        return "a valid stream decoded to other bytes"
    return None


def _run(codec_id: str, n: int, seed: int, tmp_path: Path) -> None:
    result = fuzz_codec(codec_id, n, seed, tmp_path)
    print(f"\n{codec_id}: {json.dumps(result)}")
    assert result["cases"] == n


@pytest.mark.parametrize("codec_id", sorted(CODECS))
def test_decode_fuzz(codec_id, tmp_path) -> None:
    _run(codec_id, FAST, 0, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("codec_id", sorted(CODECS))
def test_decode_fuzz_long(codec_id, tmp_path) -> None:
    _run(codec_id, SLOW, int(os.environ.get("FANSTORE_FUZZ_SEED", "1")), tmp_path)


def test_a_crash_is_reported_with_the_input_saved(tmp_path, monkeypatch) -> None:
    """The harness itself: a child that dies of SIGSEGV in the middle of case 5 fails the
    target, naming the signal, with the stream of that case saved."""
    import signal

    real, sent = ChildDecoder.decode, []

    def decode(self, index, stream, raw_size):
        sent.append(stream)
        if len(sent) == 6:
            os.kill(self.proc.pid, signal.SIGSEGV)
            self.proc.wait(10)
        return real(self, index, stream, raw_size)

    monkeypatch.setattr(ChildDecoder, "decode", decode)
    with pytest.raises(pytest.fail.Exception) as failed:
        fuzz_codec("zlib", 20, 0, tmp_path)
    message = str(failed.value)
    assert "zlib case 5" in message and "exit status -11" in message, message
    assert (tmp_path / "zlib-case5.bin").read_bytes() == sent[5]
    saved = json.loads((tmp_path / "zlib-case5.json").read_text())
    assert saved["config"] == {"id": "zlib"} and "exit status -11" in saved["problem"]
