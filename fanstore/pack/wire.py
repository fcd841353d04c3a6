"""What crosses a process boundary in a pack: partition tasks (:class:`PartTask`), their
results (:class:`PartResult`) and digest requests, as buffers with struct headers, never
pickled.

A message is a JSON header (small: numbers, names, codec configs) followed by raw
little-endian arrays, each named in the header with its dtype and length. Paths travel as
one NUL-separated byte string (a path cannot hold a NUL). The same encoding carries a
pack's tasks and results between the pack and its worker processes (``fanstore.pack.pool``)
and between MPI ranks (``fanstore.daemon.mpipack``).

Over a pipe, each message is a frame of ``fanstore.process`` (kind, length, body).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from fanstore.errors import PackError

_LEN = struct.Struct("<Q")
_RESULT_ARRAYS = ("entries", "file_sums", "chunk_counts", "chunk_firsts", "data_offsets")
#: Columns of a task's file list: (name, dtype) in PartTask.files order, the path apart.
_FILE_COLUMNS = (("entry", "<u4"), ("size", "<u8"), ("slot", "<u2"), ("solid", "<u4"),
                 ("group", "<u4"))


@dataclass
class PartTask:
    number: int
    path: str
    #: (entry, abs path, size, codec slot, solid block size or 0, block group). Files with a
    #: block size go into solid blocks: one open block per (slot, block size, group), where
    #: the group is the file's kind (similar files compress best together).
    files: list[tuple[int, bytes, int, int, int, int]]
    codecs: list[dict[str, Any]]  # codec table (slot -> config); slot 0 is "none"
    chunk_size: int


@dataclass
class PartResult:
    number: int
    size: int = 0
    checksum: str = ""
    entries: np.ndarray | None = None  # entry id per file, in partition order
    file_sums: np.ndarray | None = None
    chunk_counts: np.ndarray | None = None
    chunk_firsts: np.ndarray | None = None  # first chunk of each file (partition-relative)
    data_offsets: np.ndarray | None = None  # offset in the first chunk (solid blocks)
    chunks: dict[str, np.ndarray] | None = None
    raw_bytes: int = 0
    error: str | None = None


def pack_message(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """``header`` (JSON) and ``arrays`` as one buffer (see the module docstring)."""
    header = dict(header, arrays=[[name, arr.dtype.str, int(arr.shape[0])]
                                  for name, arr in arrays.items()])
    head = json.dumps(header).encode()
    parts = [_LEN.pack(len(head)), head]
    parts += [np.ascontiguousarray(arr).tobytes() for arr in arrays.values()]
    return b"".join(parts)


def unpack_message(data, pos: int = 0) -> tuple[dict[str, Any], dict[str, np.ndarray], int]:
    """The header and arrays of the message at ``pos`` of ``data``, and where it ends."""
    view = memoryview(data)
    try:
        (n,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        header = json.loads(bytes(view[pos:pos + n]))
        pos += n
        arrays = {}
        for name, dtype, count in header.pop("arrays"):
            nbytes = np.dtype(dtype).itemsize * count
            if pos + nbytes > len(view):
                raise ValueError("truncated")
            arrays[name] = np.frombuffer(bytes(view[pos:pos + nbytes]), dtype=dtype,
                                         count=count)
            pos += nbytes
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise PackError(f"internal error: a damaged message between pack processes "
                        f"({exc})") from None
    return header, arrays, pos


def encode_task(task) -> bytes:
    """One :class:`PartTask`."""
    cols = list(zip(*task.files)) if task.files else [()] * 6
    arrays = {name: np.array(cols[i if i == 0 else i + 1], dtype=dtype)
              for i, (name, dtype) in enumerate(_FILE_COLUMNS)}
    arrays["paths"] = np.frombuffer(b"\0".join(cols[1]), dtype="u1")
    header = {"number": task.number, "path": task.path, "chunk_size": task.chunk_size,
              "codecs": task.codecs}
    return pack_message(header, arrays)


def decode_task(data, pos: int = 0):
    """The task at ``pos`` of ``data``, and where it ends."""
    header, arrays, end = unpack_message(data, pos)
    cols = [arrays[name].tolist() for name, _ in _FILE_COLUMNS]
    n = len(cols[0])
    paths = arrays["paths"].tobytes().split(b"\0") if n else []
    files = list(zip(cols[0], paths, *cols[1:]))
    return PartTask(header["number"], header["path"], files, header["codecs"],
                    header["chunk_size"]), end


def encode_tasks(tasks: list) -> bytes:
    """Several tasks, one after the other."""
    return b"".join(encode_task(t) for t in tasks)


def decode_tasks(data) -> list:
    return _decode_each(decode_task, data)


def _decode_each(decode_one, data) -> list:
    """Every message of ``data``, one after the other, by ``decode_one(data, pos)``."""
    out, pos = [], 0
    while pos < len(data):
        item, pos = decode_one(data, pos)
        out.append(item)
    return out


def encode_result(r) -> bytes:
    """One :class:`PartResult`."""
    arrays: dict[str, np.ndarray] = {}
    if r.error is None:
        arrays = {name: getattr(r, name) for name in _RESULT_ARRAYS}
        arrays.update({"c_" + name: arr for name, arr in r.chunks.items()})
    header = {"number": r.number, "size": r.size, "checksum": r.checksum,
              "raw_bytes": r.raw_bytes, "error": r.error}
    return pack_message(header, arrays)


def decode_result(data, pos: int = 0):
    header, arrays, end = unpack_message(data, pos)
    r = PartResult(header["number"], header["size"], header["checksum"])
    r.raw_bytes = header["raw_bytes"]
    r.error = header["error"]
    if r.error is None:
        for name in _RESULT_ARRAYS:
            setattr(r, name, arrays[name])
        r.chunks = {name[2:]: arr for name, arr in arrays.items() if name.startswith("c_")}
    return r, end


def encode_results(results: list) -> bytes:
    return b"".join(encode_result(r) for r in results)


def decode_results(data) -> list:
    return _decode_each(decode_result, data)


def encode_paths(paths: list[bytes], limit: int | None) -> bytes:
    """A digest request: ``paths`` and how much of each to hash (None: all)."""
    return pack_message({"limit": limit},
                        {"paths": np.frombuffer(b"\0".join(paths), dtype="u1")})


def decode_paths(data) -> tuple[list[bytes], int | None]:
    header, arrays, _ = unpack_message(data)
    blob = arrays["paths"].tobytes()
    return (blob.split(b"\0") if blob else []), header["limit"]


def encode_digests(digests: list[bytes | None]) -> bytes:
    """Digests of 16 bytes, None for a file that could not be read."""
    ok = np.array([d is not None for d in digests], dtype="u1")
    blob = b"".join(d if d is not None else bytes(16) for d in digests)
    return pack_message({}, {"ok": ok, "digests": np.frombuffer(blob, dtype="u1")})


def decode_digests(data) -> list[bytes | None]:
    _, arrays, _ = unpack_message(data)
    blob = arrays["digests"].tobytes()
    return [blob[16 * i:16 * i + 16] if ok else None for i, ok in enumerate(arrays["ok"])]
