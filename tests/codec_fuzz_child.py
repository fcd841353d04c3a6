"""The child process of tests/test_fuzz_codecs.py: decodes the streams it is sent with one
codec, so that a crash (a signal) or a runaway allocation of the codec's library is seen
from outside instead of taking the test runner down.

Protocol on stdin/stdout, all integers little-endian:

- in: a u32 length and a JSON list of codec configs, then one of warm-up cases
  (``[config index, stream hex, raw size]``, decoded before anything is measured); then per
  case a u16 config index, a u64 raw size, a u32 length and the stream; a raw size of
  2**64-1 ends it;
- out: ``R`` + u64 VmHWM (KiB) once the codec is built and warmed up; per case ``O`` + the
  output's u64 length + its 16-byte BLAKE2b digest, ``E`` + a u32 length + the name of the
  compressors error raised, or ``X`` + a u32 length + the repr of any other exception; at
  the end ``D`` + u64 VmHWM (KiB).
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys

from compressors import CodecError, get_codec

_CASE = struct.Struct("<HQI")
END = (1 << 64) - 1


def peak_kib() -> int:
    """VmHWM: this process's peak RSS (ru_maxrss may carry the parent's over exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _read(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise SystemExit(f"short read: {len(data)} of {n}")
    return data


def _length(stream) -> int:
    return struct.unpack("<I", _read(stream, 4))[0]


def _reply(out, tag: bytes, text: str) -> None:
    body = text.encode()[:4000]
    out.write(tag + struct.pack("<I", len(body)) + body)


def main() -> None:
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    codecs = [get_codec(c) for c in json.loads(_read(inp, _length(inp)))]
    for index, stream, raw_size in json.loads(_read(inp, _length(inp))):
        codecs[index].decode(bytes.fromhex(stream), raw_size)  # the libraries loaded
    out.write(b"R" + struct.pack("<Q", peak_kib()))
    out.flush()
    while True:
        index, raw_size, length = _CASE.unpack(_read(inp, _CASE.size))
        if raw_size == END:
            break
        stream = _read(inp, length)
        try:
            data = codecs[index].decode(stream, raw_size)
        except CodecError as exc:
            _reply(out, b"E", type(exc).__name__)
        except BaseException as exc:  # noqa: BLE001 - reported, the fuzzer fails on it
            _reply(out, b"X", repr(exc))
        else:
            digest = hashlib.blake2b(data, digest_size=16).digest()
            out.write(b"O" + struct.pack("<Q", len(data)) + digest)
        out.flush()
    out.write(b"D" + struct.pack("<Q", peak_kib()))
    out.flush()


if __name__ == "__main__":
    main()
