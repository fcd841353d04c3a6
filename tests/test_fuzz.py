"""Fuzzers over everything FanStore parses from outside: the index, partition headers and
the MPI peer protocol (hypothesis).

Each target runs ``FAST`` cases in the default run (derandomized: the same cases every
time) and ``SLOW`` (>= 10,000) in the slow suite (``make test-slow``). The property is the
same everywhere: the parser either returns something valid or raises one of FanStore's own
errors, never anything else. Beyond that:

- a fuzzed index that passes validation is written into a real store and read like
  ``fanstore cat`` and ``fanstore verify`` read it (every entry stat'ed, listed, read, whole
  and in ranges): only FanStore errors come out, no file outside the store is ever opened
  (an audit hook records every ``open``), and every partition read lies inside the
  partition, after its header;
- a fuzzed peer request that the decoder accepts is answered by the real server code
  (``MpiTransport._read``) from real partitions: with exactly the partition's bytes, or a
  refusal status; never bytes from outside the partition.

The numbers of cases actually run are asserted (and reported in docs/reliability.md).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import math
import os
import shutil
import struct
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fanstore.daemon import protocol as P
from fanstore.daemon.mpitransport import MpiTransport
from fanstore.errors import FanStoreError
from fanstore.format.index import (
    lookup_table,
    CHUNK_COLUMNS,
    ENTRY_COLUMNS,
    INDEX_HEADER_SIZE,
    INDEX_MAGIC,
    INDEX_NAME,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    encode_index,
    parse_index_header,
    read_index,
    read_index_bytes,
)
from fanstore.format.partition import (
    PARTITION_HEADER_SIZE,
    PARTITION_MAGIC,
    encode_partition_header,
    read_partition_header,
)
from fanstore.read import LocalPartitions
from fanstore.store import LocalStore
from fanstore.verify import verify_store
from helpers import run_cli, run_main

#: Cases per target in the default run and in the slow suite.
FAST = 300
SLOW = 10_000

#: Cases run per target in this session (checked and printed by each fuzz test).
CASES: dict[str, int] = {}


def _settings(n: int, slow: bool):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=not slow,  # the default run always tries the same cases
        database=None if not slow else settings.default.database,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def _run(name: str, make, n: int, slow: bool) -> None:
    """Build the hypothesis test with ``make(settings)``, run it, check the case count."""
    CASES[name] = 0
    make(_settings(n, slow))()
    # (hypothesis does not count an example rejected by ``assume``; ours does not either)
    print(f"\n{name}: {CASES[name]} cases")
    assert CASES[name] >= n, f"{name}: only {CASES[name]} of {n} cases ran"


def _count(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


# --------------------------------------------------------------------------- the base store


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small real store: nested directories, a symlink up a level and one to a directory,
    an empty file, multi-chunk files (4 KiB chunks, compressed and stored raw), 3 partitions.
    Returns a dict with the store path, a scratch copy whose index the fuzzers rewrite, the
    index parts (``encode_index`` arguments) and the valid index bytes."""
    root = tmp_path_factory.mktemp("fuzz")
    src = root / "src"
    rnd = np.random.default_rng(3)
    files = {
        "a.txt": b"alpha " * 1500,  # 9000 bytes: 3 compressed chunks
        "b.bin": rnd.integers(0, 256, 10_000, dtype=np.uint8).tobytes(),  # stored raw
        "empty": b"",
        "d1/c.txt": b"gamma\n",
        "d1/d2/e.txt": b"delta " * 700,
        "d1/d2/f.bin": rnd.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "z/last": b"z" * 5000,
    }
    for rel, data in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    os.symlink("../a.txt", src / "d1" / "up")
    os.symlink("d2", src / "d1" / "to_dir")
    (src / "emptydir").mkdir()
    store = root / "store"
    run_main("pack", src, store, "--partitions", "3", "--chunk-kb", "4", "--jobs", "1",
            "--codec", "zstd:1", "--no-progress", check=True)
    scratch = root / "scratch"
    shutil.copytree(store, scratch)
    index = read_index(str(store))
    parts = {
        "meta": {k: v for k, v in index.meta.items()
                 if k not in ("columns", "n_entries", "n_chunks", "format_version")},
        "e": {k: np.array(v) for k, v in index.entries.items()},
        "c": {k: np.array(v) for k, v in index.chunks.items()},
        "lookup": None if index.version >= 3 else (np.array(index.lk_hash),
                                                    np.array(index.lk_entry)),
        "names": bytes(index.names),
        "targets": bytes(index.targets),
    }
    data = (store / INDEX_NAME).read_bytes()
    sizes = {p.number: os.path.getsize(store / p.name) for p in index.partitions}
    content = {p.number: (store / p.name).read_bytes() for p in index.partitions}
    # Warm up every lazy import on the read path before any audit window opens.
    with LocalStore(str(store)) as s:
        for rel, data_ in files.items():
            assert s.read_file(rel) == data_
    verify_store(str(store), jobs=1, progress=False)
    return {"store": store, "scratch": scratch, "parts": parts, "index": data,
            "files": files, "sizes": sizes, "content": content}


# --------------------------------------------------------------------------- watching reads

_AUDIT: list | None = None
_AUDIT_LOCK = threading.Lock()
_HOOKED = False


def _audit_hook(event: str, args) -> None:
    if event != "open" or _AUDIT is None:
        return
    path = args[0]
    if isinstance(path, int):
        return  # open(fd): no path involved
    with _AUDIT_LOCK:
        if _AUDIT is not None:
            _AUDIT.append(os.fsdecode(os.fspath(path)))


@contextmanager
def watch_opens():
    """Record the path of every file opened in this process (sys.addaudithook)."""
    global _AUDIT, _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit_hook)
        _HOOKED = True
    seen: list[str] = []
    _AUDIT = seen
    try:
        yield seen
    finally:
        _AUDIT = None


@contextmanager
def watch_partition_reads(sizes: dict[int, int]):
    """Check every ``LocalPartitions.fetch``/``read_into``: inside the partition, after its
    header (the index can point nowhere else)."""
    bad: list[tuple] = []
    orig_fetch, orig_into = LocalPartitions.fetch, LocalPartitions.read_into

    def fetch(self, part, offset, length, entry=None):
        if not (PARTITION_HEADER_SIZE <= offset and offset + length <= sizes.get(part, -1)):
            bad.append(("fetch", part, offset, length))
        return orig_fetch(self, part, offset, length, entry)

    def read_into(self, part, offset, view):
        if not (PARTITION_HEADER_SIZE <= offset and offset + len(view) <= sizes.get(part, -1)):
            bad.append(("read_into", part, offset, len(view)))
        return orig_into(self, part, offset, view)

    LocalPartitions.fetch, LocalPartitions.read_into = fetch, read_into
    try:
        yield bad
    finally:
        LocalPartitions.fetch, LocalPartitions.read_into = orig_fetch, orig_into


#: Files a reader may open besides the store's: the Python installation's own (a codec id
#: the registry does not know makes it look for a plugin in the installed packages'
#: entry points, docs/architecture.md "codecs").
#: An editable install keeps its metadata (``fanstore.egg-info``) in the source tree, outside
#: sys.prefix: the installed distributions' metadata directories count as the installation.
_INSTALLATION = tuple(sorted(
    {os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix)}
    | {os.path.realpath(str(d._path)) + os.sep for d in importlib.metadata.distributions()
       if getattr(d, "_path", None) is not None}))


def _metadata_dirs() -> tuple[str, ...]:
    """Metadata of installed distributions (an unknown codec id makes the registry read the
    entry points of every distribution; an editable install keeps its egg-info in the
    repository, outside sys.prefix)."""
    import importlib.metadata

    dirs = set()
    for dist in importlib.metadata.distributions():
        path = getattr(dist, "_path", None)
        if path is not None:
            dirs.add(os.path.realpath(os.fspath(path)) + os.sep)
    return tuple(sorted(dirs))


_INSTALLATION += _metadata_dirs()


def exercise_accepted_index(base, data: bytes) -> str:
    """An index that ``read_index_bytes`` accepted: install it in the scratch store and read
    everything the way the CLI does. Only FanStore errors may come out; nothing outside the
    store is opened; every partition read is in bounds. Returns what happened."""
    scratch = base["scratch"]
    (scratch / INDEX_NAME).write_bytes(data)
    inside = os.path.realpath(scratch) + os.sep
    outcome = "read"
    with watch_opens() as opened, watch_partition_reads(base["sizes"]) as bad_reads:
        try:
            store = LocalStore(str(scratch))
        except FanStoreError:
            outcome = "refused at open"
        else:
            with store:
                ns = store.ns
                for entry in range(ns.n_entries):
                    st_ = ns.stat(entry)
                    ns.show(entry)
                    if st_.kind == KIND_DIR:
                        names = [ns.name(c) for c in ns.children(entry)]
                        assert all(n and b"/" not in n and b"\0" not in n
                                   and n not in (b".", b"..") for n in names), names
                    elif st_.kind == KIND_SYMLINK:
                        # kept as written, absolute or climbing out (as squashfs and
                        # tar keep them); where it leads is judged when it is followed
                        target = ns.readlink(entry)
                        assert target and b"\0" not in target, target
                    else:
                        assert st_.kind == KIND_FILE
                        size = ns.size(entry)
                        for off, n in ((0, -1), (1, 4095), (size - 1, 10), (size, 1),
                                       (4096, 4097)):
                            try:
                                got = store.read(entry, max(0, off), n)
                            except FanStoreError:
                                continue
                            want = size - max(0, off) if n < 0 else min(n, size - max(0, off))
                            assert len(got) == max(0, want)
            report = verify_store(str(scratch), jobs=1, progress=False)
            assert report.checked == int((store.index.entries["kind"] == KIND_FILE).sum())
    outside = [p for p in opened if not os.path.realpath(p).startswith(inside)
               and not os.path.realpath(p).startswith(_INSTALLATION)]
    assert not outside, f"opened outside the store: {outside}"
    assert not bad_reads, f"partition reads out of bounds: {bad_reads}"
    return outcome


def check_index(base, data: bytes) -> str:
    try:
        read_index_bytes(data)
    except FanStoreError:
        return "refused"
    return exercise_accepted_index(base, data)


# --------------------------------------------------------------------------- index: bytes


def _with_valid_header(body_stored: bytes, body_raw: int | None = None,
                       version: int = 1) -> bytes:
    head = struct.pack("<8sHHIQQQ", INDEX_MAGIC, version, 0, INDEX_HEADER_SIZE,
                       len(body_stored) * 4 if body_raw is None else body_raw,
                       len(body_stored), xxhash.xxh3_64_intdigest(body_stored))
    return head.ljust(INDEX_HEADER_SIZE, b"\0") + body_stored


def _index_garbage(base, name):
    def make(s):
        @s
        @given(kind=st.integers(0, 3), blob=st.binary(max_size=600), raw=st.integers(0, 1 << 40))
        def t(kind, blob, raw):
            _count(name)
            if kind == 0:  # anything at all
                data = blob
            elif kind == 1:  # a valid header with a garbage body (checksum right)
                data = _with_valid_header(blob, raw)
            elif kind == 2:  # a real zstd frame of garbage (passes everything up to JSON)
                frame = zstandard.ZstdCompressor(write_content_size=True).compress(blob)
                data = _with_valid_header(frame, len(blob))
            else:  # a prefix of the valid index followed by garbage
                cut = raw % (len(base["index"]) + 1)
                data = base["index"][:cut] + blob
            try:
                parse_index_header(data)
            except FanStoreError:
                pass
            check_index(base, data)
        return t
    return make


def test_fuzz_index_garbage(base):
    _run("index bytes", _index_garbage(base, "index bytes"), FAST, slow=False)


@pytest.mark.slow
def test_fuzz_index_garbage_slow(base):
    _run("index bytes", _index_garbage(base, "index bytes"), SLOW, slow=True)


# --------------------------------------------------------------------------- index: fields

_U = {"<u1": 8, "u1": 8, "<u2": 16, "<u4": 32, "<u8": 64, "<i8": 64}
_DTYPES = {("e", n): dt for n, dt in ENTRY_COLUMNS} | {("c", n): dt for n, dt in CHUNK_COLUMNS}
_COLUMNS = sorted(_DTYPES)


def _special_ints(parts) -> list[int]:
    n, m = len(parts["e"]["kind"]), len(parts["c"]["part"])
    names, targets = len(parts["names"]), len(parts["targets"])
    base = [0, 1, 2, 7, 63, 64, 65, 255, 256, 4095, 4096, 4097, n - 1, n, n + 1, m - 1, m,
            m + 1, names - 1, names, names + 1, targets, 0o777, 0o7777, 0o10000,
            (1 << 16) - 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 62,
            (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    return base


_JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
    st.sampled_from([0, 1, -1, 64, 4096, 1 << 30, 1 << 62, 1 << 63, 1 << 64]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["zstd", "none", "lz4", "", "..", "/etc/passwd", "a/../../b"]),
)
_JSON = st.recursive(_JSON_LEAF, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=8), kids, max_size=3)),
    max_leaves=6)

#: Places in the metadata JSON a mutation may replace (or delete, with value ``_DELETE``).
_META_PATHS = [
    ("chunk_size",), ("codecs",), ("codecs", 0), ("codecs", 1), ("codecs", 1, "level"),
    ("codecs", 1, "id"), ("partitions",), ("partitions", 0), ("partitions", 0, "size"),
    ("partitions", 1, "checksum"), ("partitions", 2, "broadcast"), ("partitions", 1, "files"),
    ("counts",), ("counts", "files"), ("counts", "raw_bytes"), ("pack",), ("selection",),
    ("created_by",), ("format_version",), ("n_entries",), ("n_chunks",), ("columns",),
    ("columns", "e_kind"), ("columns", "c_offset"), ("columns", "names"),
    ("columns", "e_name_off", 0), ("columns", "c_raw", 1), ("columns", "lk_hash"),
]
_DELETE = object()


def _set_path(obj, path, value) -> bool:
    for key in path[:-1]:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return False
    last = path[-1]
    try:
        if value is _DELETE:
            del obj[last]
        else:
            obj[last] = value
    except (KeyError, IndexError, TypeError):
        return False
    return True


def _patch_meta(data: bytes, patches) -> bytes | None:
    """Index bytes with metadata values changed (``patches``: (path, value) pairs; the column
    layout is kept), or None if the new JSON does not fit in the space the encoder reserved
    for it or a path does not exist any more."""
    body = bytearray(zstandard.ZstdDecompressor().decompress(data[INDEX_HEADER_SIZE:]))
    (meta_len,) = struct.unpack_from("<I", body)
    meta = json.loads(body[4 : 4 + meta_len])
    room = min(off for off, _ in meta["columns"].values()) - 4
    for path, value in patches:
        if not _set_path(meta, path, value):
            return None
    new = json.dumps(meta, separators=(",", ":")).encode()
    if len(new) > room:
        return None
    struct.pack_into("<I", body, 0, len(new))
    body[4 : 4 + room] = new.ljust(room, b" ")
    stored = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(body))
    return _with_valid_header(stored, len(body), struct.unpack_from("<H", data, 8)[0])


_column_mutation = st.tuples(st.just("column"), st.sampled_from(_COLUMNS), st.integers(0, 1 << 16),
                             st.one_of(st.integers(0, 40), st.integers(0, (1 << 64) - 1),
                                       st.integers(-3, 3).map(lambda d: ("delta", d))))
_blob_mutation = st.tuples(st.just("blob"), st.sampled_from(["names", "targets"]),
                           st.integers(0, 1 << 16),
                           st.sampled_from([b"/", b"\0", b".", b"..", b"../", b"/etc", b"",
                                            b"x", b"\xff", b"../../../etc/passwd"]))
_lookup_mutation = st.tuples(st.just("lookup"), st.sampled_from(["hash", "entry", "drop", "swap"]),
                             st.integers(0, 1 << 16), st.integers(0, (1 << 64) - 1))
_meta_mutation = st.tuples(st.just("meta"), st.sampled_from(_META_PATHS),
                           st.one_of(_JSON, st.just(_DELETE)))
_body_mutation = st.tuples(st.just("body"), st.integers(0, 1 << 20), st.integers(0, 255),
                           st.sampled_from(["set", "insert", "delete", "truncate"]))
_header_mutation = st.tuples(st.just("header"), st.sampled_from([8, 10, 12, 16, 24, 32]),
                             st.integers(0, (1 << 64) - 1))


def _apply(base, mutations) -> bytes | None:
    """Apply mutations in order: array/blob ones first (re-encoded with valid checksums by
    ``encode_index``), then metadata, body bytes and header fields."""
    parts = copy.deepcopy(base["parts"])
    specials = _special_ints(parts)
    for mut in mutations:
        if mut[0] == "column":
            _, (table, col), row, value = mut
            arr = parts[table][col]
            if not len(arr):
                continue
            row %= len(arr)
            bits = arr.dtype.itemsize * 8  # the index's own width (v3 narrows two)
            if isinstance(value, tuple):
                value = int(arr[row]) + value[1]
            elif value <= 40:
                value = specials[value % len(specials)]
            if arr.dtype.kind == "i":
                value = (value + (1 << 63)) % (1 << 64) - (1 << 63)
            else:
                value %= 1 << bits
            arr[row] = value
        elif mut[0] == "blob":
            _, blob, pos, insert = mut
            data = bytearray(parts[blob])
            pos %= len(data) + 1
            data[pos : pos + len(insert)] = insert  # same length where it fits
            parts[blob] = bytes(data)
        elif mut[0] == "lookup":
            _, what, row, value = mut
            if parts["lookup"] is None:  # a v3 index has no lookup table
                continue
            h, e = (a.copy() for a in parts["lookup"])
            if not len(h):
                continue
            row %= len(h)
            if what == "hash":
                h[row] = value
            elif what == "entry":
                e[row] = value % (1 << 32)
            elif what == "drop":
                h, e = np.delete(h, row), np.delete(e, row)
            else:
                other = value % len(h)
                e[row], e[other] = e[other], e[row]
            parts["lookup"] = (h, e)
    data = encode_index(parts["meta"], parts["e"], parts["c"], parts["lookup"],
                        parts["names"], parts["targets"], level=1)
    patches = [(mut[1], mut[2]) for mut in mutations if mut[0] == "meta"]
    if patches:
        data = _patch_meta(data, patches)
        if data is None:
            return None
    for mut in mutations:
        if mut[0] == "body":
            _, pos, byte, how = mut
            body = bytearray(zstandard.ZstdDecompressor().decompress(data[INDEX_HEADER_SIZE:]))
            pos %= max(1, len(body))
            if how == "set" and body:
                body[pos] = byte
            elif how == "insert":
                body[pos:pos] = bytes([byte])
            elif how == "delete":
                del body[pos : pos + 1]
            else:
                del body[pos:]
            stored = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(
                bytes(body))
            data = _with_valid_header(stored, len(body))
        elif mut[0] == "header":
            _, off, value = mut
            size = 8 if off >= 16 else (4 if off == 12 else 2)
            raw = bytearray(data)
            raw[off : off + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
            data = bytes(raw)
    return data


#: Mostly the validated fields; header fields and raw body bytes now and then.
_MUTATIONS = st.lists(st.one_of(_column_mutation, _column_mutation, _column_mutation,
                                _blob_mutation, _lookup_mutation, _meta_mutation, _meta_mutation,
                                _body_mutation, _header_mutation), min_size=1, max_size=4)

#: What the structure-aware fuzzer saw (refused / accepted and read), for the report.
OUTCOMES: dict[str, int] = {}


def _index_fields(base, name):
    def make(s):
        @s
        @given(mutations=_MUTATIONS)
        def t(mutations):
            data = _apply(base, mutations)
            assume(data is not None)
            _count(name)
            outcome = check_index(base, data)
            OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
        return t
    return make


def test_fuzz_index_fields(base):
    OUTCOMES.clear()
    _run("index fields", _index_fields(base, "index fields"), FAST, slow=False)
    # The mutations must really exercise the validators: most refused, some accepted.
    assert OUTCOMES.get("refused", 0) > FAST // 3, OUTCOMES


@pytest.mark.slow
def test_fuzz_index_fields_slow(base):
    OUTCOMES.clear()
    _run("index fields", _index_fields(base, "index fields"), SLOW, slow=True)
    assert OUTCOMES.get("refused", 0) > SLOW // 3, OUTCOMES
    print(f"\nindex field fuzzing outcomes: {OUTCOMES}")


def test_the_unmutated_index_is_accepted_and_reads_right(base):
    """The fuzzers' baseline: the base index itself, re-encoded by ``_apply`` with a no-op
    mutation, is accepted and every file reads back exactly (so "refused" above means the
    mutation was caught, not that the harness is broken)."""
    data = _apply(base, [("column", ("e", "mtime_ns"), 1, ("delta", 0))])
    assert check_index(base, data) == "read"
    (base["scratch"] / INDEX_NAME).write_bytes(data)
    with LocalStore(str(base["scratch"])) as s:
        for rel, content in base["files"].items():
            assert s.read_file(rel) == content


@pytest.mark.parametrize("path, value, match", [
    (("chunk_size",), math.inf, "chunk_size"),
    (("chunk_size",), "4096", "chunk_size"),
    (("partitions", 0, "size"), 1 << 70, "partition 0"),
    (("partitions", 0, "size"), math.inf, "partition 0"),
    (("partitions", 1, "files"), math.nan, "partition 1"),
    (("counts",), [1], "counts"),
    (("counts", "files"), "many", "counts"),
    (("selection",), [1, 2], "selection"),
])
def test_hostile_metadata_values_are_refused(base, path, value, match):
    """Values the fuzzer found crashing the parser (OverflowError, ValueError,
    AttributeError) before they were validated: now each is a FormatError."""
    data = _patch_meta(base["index"], [(path, value)])
    assert data is not None
    with pytest.raises(FanStoreError, match=match):
        read_index_bytes(data)


@pytest.mark.parametrize("col, row_of, value, version", [
    ("name_off", "file", (1 << 64) - 1, 1),  # int64 -1: the old check let an empty name in
    ("name_off", "file", (1 << 64) - 100_000, 1),  # int64 -100000: an IndexError
    ("name_off", "file", (1 << 32) - 1, 3),  # the largest a v3 name offset can say
    ("first", "symlink", (1 << 64) - 1, 3),  # an empty symlink target
])
def test_offsets_above_2_63_are_refused(base, col, row_of, value, version):
    parts = copy.deepcopy(base["parts"])
    kind = KIND_FILE if row_of == "file" else KIND_SYMLINK
    row = int(np.nonzero(parts["e"]["kind"] == kind)[0][0])
    lookup = None
    if version == 1:  # 64-bit name offsets and a lookup table: the older layout
        parts["e"]["name_off"] = parts["e"]["name_off"].astype("<u8")
        parts["e"]["name_len"] = parts["e"]["name_len"].astype("<u2")
        lookup = lookup_table(parts["e"], parts["names"])
    parts["e"][col][row] = value
    data = encode_index(parts["meta"], parts["e"], parts["c"], lookup,
                        parts["names"], parts["targets"])
    assert struct.unpack_from("<H", data, 8)[0] == version
    with pytest.raises(FanStoreError, match="outside the (name|target) table"):
        read_index_bytes(data)


def test_an_index_decompression_bomb_is_refused_before_allocating():
    """A 32 KB index whose zstd frame (RLE blocks) expands to 1 GiB: refused from its
    header, without allocating the gigabyte."""
    total, block = 1 << 30, 128 << 10
    frame = bytearray(b"\x28\xb5\x2f\xfd") + bytes([(3 << 6) | (1 << 5)]) + \
        struct.pack("<Q", total)
    for k in range(total // block):
        last = 1 if k == total // block - 1 else 0
        frame += struct.pack("<I", last | (1 << 1) | (block << 3))[:3] + b"\0"
    data = _with_valid_header(bytes(frame), total)
    assert len(data) < 40_000
    with pytest.raises(FanStoreError, match="absurd size"):
        parse_index_header(data)
    with pytest.raises(FanStoreError, match="absurd size"):
        read_index_bytes(data)


# --------------------------------------------------------------------------- partitions


def _partition_headers(name):
    def make(s):
        @s
        @given(blob=st.binary(max_size=80), version=st.integers(0, 65535),
               hsize=st.sampled_from([0, 63, 64, 65, 1 << 31]),
               number=st.integers(0, (1 << 32) - 1), structured=st.booleans())
        def t(blob, version, hsize, number, structured):
            _count(name)
            if structured:
                blob = struct.pack("<8sHHII", PARTITION_MAGIC, version, 0, hsize,
                                   number).ljust(64, b"\0") + blob
            try:
                got = read_partition_header(blob)
            except FanStoreError:
                return
            assert blob[:8] == PARTITION_MAGIC and got == struct.unpack_from("<I", blob, 16)[0]
        return t
    return make


def test_fuzz_partition_headers():
    _run("partition headers", _partition_headers("partition headers"), FAST, slow=False)
    assert read_partition_header(encode_partition_header(7)) == 7


@pytest.mark.slow
def test_fuzz_partition_headers_slow():
    _run("partition headers", _partition_headers("partition headers"), SLOW, slow=True)


# --------------------------------------------------------------------------- the peer protocol


def _server(base) -> MpiTransport:
    """The real server-side request handling (``_read``) over the base store's partitions,
    without MPI (``_read`` touches only the partitions and the counters)."""
    t = MpiTransport.__new__(MpiTransport)
    index = read_index(str(base["store"]))
    t.parts = LocalPartitions(str(base["store"]), index)
    t.served_requests = t.served_bytes = t.server_errors = 0
    t.on_served = None
    return t


_U64 = st.one_of(st.integers(0, (1 << 64) - 1), st.integers(0, 70_000),
                 st.sampled_from([0, 1, 63, 64, P.MAX_REQUEST, P.MAX_REQUEST + 1, (1 << 64) - 1]))


def _protocol(base, name):
    server = _server(base)
    sizes, content = base["sizes"], base["content"]

    def make(s):
        @s
        @given(which=st.sampled_from(["request", "response", "control", "garbage"]),
               magic_ok=st.integers(0, 9), version=st.sampled_from([2, 2, 2, 0, 1, 65535]),
               op=st.one_of(st.sampled_from([1, 2]), st.integers(0, 65535)),
               part=st.one_of(st.integers(0, 4), st.integers(0, (1 << 32) - 1)),
               tag=st.one_of(st.integers(0, 2000), st.integers(0, (1 << 32) - 1)),
               offset=_U64, length=_U64, req_id=_U64, payload=st.binary(max_size=64),
               cut=st.integers(-2, 2),
               piece=st.one_of(st.sampled_from([0, 8000]), st.integers(0, (1 << 32) - 1)))
        def t(which, magic_ok, version, op, part, tag, offset, length, req_id, payload, cut,
              piece):
            _count(name)
            bad_magic = b"FSXX" if magic_ok == 0 else None
            if which == "request":
                raw = P.REQ.pack(bad_magic or P.REQ_MAGIC, version, op, part, tag, offset,
                                 length, req_id, piece, 0)
                raw = raw[: len(raw) + cut] if cut < 0 else raw + payload[:cut]
                try:
                    req = P.decode_request(raw)
                except P.ProtocolError:
                    return
                assert req.op in (P.Op.READ, P.Op.PING) and req.reply_tag >= P.REPLY_TAG_BASE
                assert req.length <= P.MAX_REQUEST
                if req.op != P.Op.READ:
                    return
                buf, status = server._read(req)
                if status != P.Status.OK:
                    assert buf is None
                    assert status in (P.Status.NOT_HERE, P.Status.BAD_REQUEST)
                    return
                assert req.part in sizes and 0 < req.length
                assert req.offset + req.length <= sizes[req.part]
                first = P.pieces(req.length, req.piece)[0]
                assert P.pieces(req.length, req.piece)[-1][1] == len(buf)
                resp = P.decode_response_header(bytes(buf[first[0]:first[1]]), req.piece)
                assert (resp.status, resp.length, resp.req_id) == (P.Status.OK, req.length,
                                                                    req.req_id)
                assert bytes(buf[P.RESP.size:]) == \
                    content[req.part][req.offset : req.offset + req.length]
            elif which == "response":
                status = op % 8
                raw = P.RESP.pack(bad_magic or P.RESP_MAGIC, version, status, length,
                                  req_id) + payload
                raw = raw[: len(raw) + cut] if cut < 0 else raw
                try:
                    resp = P.decode_response_header(raw)
                except P.ProtocolError:
                    return
                assert resp.status in set(P.Status)
                if resp.status == P.Status.OK:
                    assert resp.length == len(raw) - P.RESP.size
            elif which == "control":
                n = len(payload) if magic_ok > 3 else length % 600
                raw = P.CTRL.pack(bad_magic or P.CTRL_MAGIC, version, op % 4, part, n) + \
                    payload
                raw = raw[: len(raw) + cut] if cut < 0 else raw
                try:
                    msg = P.decode_control(raw)
                except P.ProtocolError:
                    return
                assert msg.kind in set(P.Control)
                assert len(raw) == P.CTRL.size + n and isinstance(msg.reason, str)
            else:
                for decode in (P.decode_request, P.decode_response_header, P.decode_control):
                    try:
                        decode(payload)
                    except P.ProtocolError:
                        pass
        return t
    return make, server


def test_fuzz_protocol(base):
    make, server = _protocol(base, "protocol")
    try:
        _run("protocol", make, FAST, slow=False)
    finally:
        server.parts.close()


@pytest.mark.slow
def test_fuzz_protocol_slow(base):
    make, server = _protocol(base, "protocol")
    try:
        _run("protocol", make, SLOW, slow=True)
    finally:
        server.parts.close()


def test_protocol_round_trips_and_server_range_checks(base):
    """Hand-picked edges of the server's range check (the fuzzer's oracle, made explicit)."""
    server = _server(base)
    try:
        size0 = base["sizes"][0]
        cases = [
            ((0, 64, 10), P.Status.OK),
            ((0, size0 - 1, 1), P.Status.OK),
            ((0, size0 - 1, 2), P.Status.BAD_REQUEST),  # one byte past the end
            ((0, size0, 1), P.Status.BAD_REQUEST),
            ((0, (1 << 64) - 1, 1), P.Status.BAD_REQUEST),  # no wrap-around
            ((0, 10, 0), P.Status.BAD_REQUEST),  # nothing asked
            ((3, 64, 1), P.Status.NOT_HERE),
            (((1 << 32) - 1, 64, 1), P.Status.NOT_HERE),
        ]
        for (part, off, n), status in cases:
            raw = P.encode_request(P.Request(P.Op.READ, part, 1000, off, n, 5))
            buf, got = server._read(P.decode_request(raw))
            assert got == status, (part, off, n)
            if status == P.Status.OK:
                assert bytes(buf[P.RESP.size:]) == base["content"][part][off : off + n]
    finally:
        server.parts.close()



# --------------------------------------------------------------------------- symlink chains

#: A fixed tree (breadth-first, children sorted by name bytes) whose six symlinks get
#: fuzzed targets. Directories: the root, a, b, a/c; files f and a/c/g (empty).
_CHAIN_TREE = [
    (b"", KIND_DIR), (b"L0", KIND_SYMLINK), (b"L1", KIND_SYMLINK), (b"a", KIND_DIR),
    (b"b", KIND_DIR), (b"f", KIND_FILE), (b"a/L2", KIND_SYMLINK), (b"a/L3", KIND_SYMLINK),
    (b"a/c", KIND_DIR), (b"b/L5", KIND_SYMLINK), (b"a/c/L4", KIND_SYMLINK),
    (b"a/c/g", KIND_FILE),
]
_CHAIN_LINKS = [p for p, k in _CHAIN_TREE if k == KIND_SYMLINK]
_CHAIN_WORDS = [b"..", b".", b"", b"a", b"b", b"c", b"f", b"g", b"zz"] + \
    [b"L%d" % k for k in range(6)]
#: Relative targets (b"" makes "a//b" and trailing slashes: ENOTDIR after a file).
_CHAIN_TARGET = st.lists(st.sampled_from(_CHAIN_WORDS), min_size=1, max_size=6).map(
    lambda words: b"/".join(words).lstrip(b"/") or b".")


def _chain_index(targets: list[bytes]) -> bytes:
    """The index of _CHAIN_TREE with these targets for its symlinks (in order)."""
    from fanstore.format.index import IndexBuilder

    row = {p: i for i, (p, _) in enumerate(_CHAIN_TREE)}
    b = IndexBuilder(len(_CHAIN_TREE), 0)
    e = b.entries
    it = iter(targets)
    for i, (path, kind) in enumerate(_CHAIN_TREE):
        e["kind"][i] = kind
        e["mode"][i] = 0o777 if kind == KIND_SYMLINK else 0o755
        if i:
            e["parent"][i] = row[path.rpartition(b"/")[0]]
            b.set_name(i, path.rpartition(b"/")[2])
        if kind == KIND_SYMLINK:
            t = next(it)
            b.set_target(i, t)
            e["size"][i] = len(t)
    for i, (path, kind) in enumerate(_CHAIN_TREE):
        if kind == KIND_DIR:
            kids = [j for j in range(1, len(_CHAIN_TREE)) if e["parent"][j] == i]
            e["first"][i], e["count"][i] = (kids[0], len(kids)) if kids else (0, 0)
    meta = {"chunk_size": 4096, "codecs": [{"id": "none"}], "partitions": [],
            "counts": {"files": 2, "dirs": 3, "symlinks": 6, "raw_bytes": 0}}
    return encode_index(meta, b.entries, b.chunks, b.build_lookup(), bytes(b.names),
                        bytes(b.targets))


def _kernel(root: str, rel: bytes) -> tuple:
    """Where the kernel resolves ``root/rel`` (every symlink followed): ("ok", path
    inside root), ("out",) or the errno's name."""
    import errno

    try:
        fd = os.open(os.path.join(os.fsencode(root), rel), os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        return ({errno.ENOENT: "noent", errno.ENOTDIR: "notdir", errno.ELOOP: "loop"}
                [exc.errno],)
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    if real == root:
        return ("ok", b"")
    if real.startswith(root + "/"):
        return ("ok", os.fsencode(real[len(root) + 1:]))
    return ("out",)


def _fanstore(ns, rel: bytes) -> tuple:
    """The same through FanStore's one rule (``Namespace.resolve``)."""
    from fanstore.errors import (
        NotADirectoryError_,
        NotFoundError,
        OutsideStoreError,
        SymlinkLoopError,
    )

    try:
        return ("ok", ns.path(ns.resolve(rel, follow=True)))
    except OutsideStoreError:
        return ("out",)
    except NotFoundError:
        return ("noent",)
    except NotADirectoryError_:
        return ("notdir",)
    except SymlinkLoopError:
        return ("loop",)


def _chain_case(workdir: str, targets: list[bytes]) -> str:
    """One fuzzed tree. The tree is made for real too, deep below directories holding
    nothing else (a walk that climbs out can only end outside or fail), and the kernel
    resolves every symlink. Every such index is accepted (symlinks may lead out: issue
    35); FanStore resolves each symlink as the kernel does, except that it stops at the
    store's edge ("out"), where the kernel goes on outside (and, here, finds nothing but
    the directories above). The directory scan and the archive namespace keep the same
    symlinks: every one but loops, and with --symlinks skip none that leads out."""
    import tempfile

    from fanstore.format.index import read_index_bytes as load
    from fanstore.namespace import Namespace
    from fanstore.pack.options import Symlinks

    ns = Namespace(load(_chain_index(targets)))
    top = tempfile.mkdtemp(dir=workdir)
    try:
        root = os.path.join(top, "x1", "x2", "ROOT")
        _make_chain_tree(root, dict(zip(_CHAIN_LINKS, targets)))
        seen = {p: _kernel(root, p) for p in _CHAIN_LINKS}
        ours = {p: _fanstore(ns, p) for p in _CHAIN_LINKS}
        for p in _CHAIN_LINKS:
            if ours[p] == ("out",):
                assert seen[p] in (("out",), ("noent",), ("notdir",)), (targets, p)
            else:
                assert ours[p] == seen[p], (targets, p)
        kept = _kept_both_ways(root, targets, Symlinks.STORE)
        kept_skip = _kept_both_ways(root, targets, Symlinks.SKIP)
        assert kept_skip <= kept, targets
        assert all(ours[p] == ("out",) for p in kept - kept_skip), (targets, ours)
        assert all(ours[p] != ("out",) and seen[p] != ("out",) for p in kept_skip), targets
        assert all(ours[p] == ("loop",) for p in set(_CHAIN_LINKS) - kept), (targets, ours)
    finally:
        shutil.rmtree(top)
    return "leads out" if ("out",) in ours.values() else "inside"


def _make_chain_tree(root: str, links: dict[bytes, bytes]) -> None:
    for path, kind in _CHAIN_TREE:
        full = os.path.join(os.fsencode(root), path)
        if kind == KIND_DIR:
            os.makedirs(full)
        elif kind == KIND_FILE:
            open(full, "wb").close()
        else:
            os.symlink(links[path], full)


def _kept_both_ways(root: str, targets: list[bytes], mode) -> set[bytes]:
    """The symlinks a directory scan of ``root`` keeps with ``--symlinks mode``, checked to
    be those the archive namespace of the same tree keeps."""
    from fanstore.pack.scan import scan_tree
    from fanstore.pack.sources.base import Node, VirtualTree

    links = dict(zip(_CHAIN_LINKS, targets))
    tree = VirtualTree(symlinks=mode)
    for path, kind in _CHAIN_TREE:
        if kind == KIND_DIR:
            tree.add(path, Node(KIND_DIR, 0o755, 0))
        elif kind == KIND_FILE:
            tree.add(path, Node(KIND_FILE, 0o644, 0, file_id=0))
        else:
            tree.add(path, Node(KIND_SYMLINK, 0o777, 0, target=links[path]))
    scanned = scan_tree(root, symlinks=mode)
    kept = {e.rel for e in scanned.entries if e.kind == KIND_SYMLINK}
    built = tree.build(b"archive")
    assert kept == {e.rel for e in built.entries if e.kind == KIND_SYMLINK}, (
        targets, mode, scanned.problems, tree.problems)
    assert scanned.outside_skipped == built.outside_skipped, (targets, mode)
    return kept


def _chains(workdir: str, name: str, outcomes: dict):
    def make(s):
        @s
        @given(targets=st.lists(_CHAIN_TARGET, min_size=6, max_size=6))
        def t(targets):
            _count(name)
            outcome = _chain_case(workdir, targets)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        return t
    return make


def test_fuzz_symlink_chains(tmp_path):
    outcomes: dict[str, int] = {}
    _run("symlink chains", _chains(str(tmp_path), "symlink chains", outcomes), FAST, slow=False)
    assert outcomes.get("leads out", 0) > FAST // 20 and outcomes.get("inside", 0) > FAST // 20, \
        outcomes


@pytest.mark.slow
def test_fuzz_symlink_chains_slow(tmp_path):
    outcomes: dict[str, int] = {}
    _run("symlink chains", _chains(str(tmp_path), "symlink chains", outcomes), SLOW, slow=True)
    print(f"\nsymlink chain fuzzing outcomes: {outcomes}")
