"""The on-disk format (every version a store may have, v1 to the current one): index and
partition round trips, byte layout, version checks, truncation, hostile indexes, and the
golden stores in ``tests/fixtures/format``."""

from __future__ import annotations

import copy
import errno
import hashlib
import importlib.util
import json
import os
import random
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard

from fanstore import FORMAT_VERSION
from fanstore.errors import (
    DamagedDirectoryError,
    FormatError,
    NotADirectoryError_,
    NotAStoreError,
    NotFoundError,
    OutsideStoreError,
    VersionTooNewError,
    VersionTooOldError,
)
from fanstore.format.index import (
    CHUNK_COLUMNS,
    ENTRY_COLUMNS,
    INDEX_HEADER_SIZE,
    INDEX_MAGIC,
    INDEX_NAME,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    IndexBuilder,
    encode_index,
    parse_body,
    read_index,
    read_index_bytes,
    target_stays_inside,
)
from fanstore.format.partition import (
    PARTITION_HEADER_SIZE,
    PARTITION_MAGIC,
    PARTITION_VERSION,
    PartitionWriter,
    encode_partition_header,
    file_checksum,
    partition_name,
    read_partition_header,
)
from fanstore.format.validate import unsorted_directories
from fanstore.namespace import Namespace
from fanstore.read import LocalPartitions
from fanstore.store import LocalStore

GOLDEN = Path(__file__).parent / "fixtures" / "format"
REGENERATE = "python tests/fixtures/format/regenerate.py"


# --------------------------------------------------------------------------- a tiny index


def _tiny_parts() -> dict:
    """Inputs of ``encode_index`` for this namespace (chunk size 4096):

        /            dir   (entry 0)
        a/           dir   (1)
        f            file  (2)  5000 bytes: chunks 0, 1 in partition 0
        l -> f       link  (3)
        a/g          file  (4)  10 bytes: chunk 2 in partition 1
    """
    b = IndexBuilder(5, 3)
    e = b.entries
    rows = [  # parent, kind, mode, size, mtime
        (0, KIND_DIR, 0o755, 0, 10),
        (0, KIND_DIR, 0o750, 0, 11),
        (0, KIND_FILE, 0o644, 5000, 12),
        (0, KIND_SYMLINK, 0o777, 1, 13),
        (1, KIND_FILE, 0o600, 10, 14),
    ]
    for i, (parent, kind, mode, size, mtime) in enumerate(rows):
        e["parent"][i], e["kind"][i], e["mode"][i] = parent, kind, mode
        e["size"][i], e["mtime_ns"][i] = size, mtime
    for i, name in ((1, b"a"), (2, b"f"), (3, b"l"), (4, b"g")):
        b.set_name(i, name)
    e["first"][0], e["count"][0] = 1, 3
    e["first"][1], e["count"][1] = 4, 1
    e["first"][2], e["count"][2], e["checksum"][2] = 0, 2, 111
    b.set_target(3, b"f")
    e["first"][4], e["count"][4], e["checksum"][4] = 2, 1, 222
    return _parts_of(b, [(0, 64, 100, 4096, 1), (0, 164, 50, 904, 1), (1, 64, 10, 10, 0)],
                     [{"size": 214, "checksum": "00", "files": 1, "raw_bytes": 5000},
                      {"size": 74, "checksum": "11", "files": 1, "raw_bytes": 10}],
                     {"files": 2, "dirs": 1, "symlinks": 1, "raw_bytes": 5010})


def _parts_of(b: IndexBuilder, chunks, partitions: list[dict], counts: dict) -> dict:
    """The ``encode_index`` inputs of builder ``b`` (its entries filled in) with ``chunks``
    rows (partition, offset, stored, raw, codec slot; checksum 1000 + row), chunk size 4096
    and codecs none / zstd:3."""
    c = b.chunks
    for k, (part, off, stored, raw, codec) in enumerate(chunks):
        c["part"][k], c["offset"][k], c["stored"][k], c["raw"][k] = part, off, stored, raw
        c["codec"][k], c["checksum"][k] = codec, 1000 + k
    meta = {"chunk_size": 4096, "codecs": [{"id": "none"}, {"id": "zstd", "level": 3}],
            "partitions": partitions, "counts": counts}
    return {"meta": meta, "e": b.entries, "c": b.chunks, "lookup": b.build_lookup(),
            "names": bytes(b.names), "targets": bytes(b.targets)}


def _encode(parts: dict) -> bytes:
    return encode_index(parts["meta"], parts["e"], parts["c"], parts["lookup"],
                        parts["names"], parts["targets"])


def _reencode_body(data: bytes, body: bytes) -> bytes:
    """Index bytes with ``body`` as its (valid-checksum) body and the header of ``data``."""
    stored = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(body)
    head = bytearray(data[:INDEX_HEADER_SIZE])
    struct.pack_into("<QQQ", head, 16, len(body), len(stored), xxhash.xxh3_64_intdigest(stored))
    return bytes(head) + stored


def _body(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data[INDEX_HEADER_SIZE:])


def test_index_round_trip_by_hand():
    parts = _tiny_parts()
    index = read_index_bytes(_encode(parts))
    assert index.n_entries == 5 and index.n_chunks == 3 and index.chunk_size == 4096
    for name, dtype in ENTRY_COLUMNS:
        assert index.entries[name].dtype == np.dtype(dtype)
        assert np.array_equal(index.entries[name], parts["e"][name]), name
    for name, dtype in CHUNK_COLUMNS:
        assert np.array_equal(index.chunks[name], parts["c"][name]), name
    assert index.codecs == parts["meta"]["codecs"]
    assert [(p.number, p.size, p.checksum, p.files) for p in index.partitions] == [
        (0, 214, "00", 1), (1, 74, "11", 1)]
    # No file shares a chunk: written in the oldest format that holds it, v1 (no e_offset).
    assert index.meta["format_version"] == 1 == index.version
    assert "e_offset" not in index.meta["columns"]
    assert index.meta["counts"] == parts["meta"]["counts"]
    assert [index.path(i) for i in range(5)] == [b"", b"a", b"f", b"l", b"a/g"]
    assert index.target(3) == b"f"
    ns = Namespace(index)  # paths are resolved by the namespace (the one symlink rule)
    assert ns.resolve("a/g") == 4 and ns.resolve(b"./a//g") == 4
    assert ns.resolve("") == 0
    with pytest.raises(NotFoundError):
        ns.resolve("a/nope")
    with pytest.raises(NotADirectoryError_):
        ns.resolve("f/x")
    assert index.lookup(0, b"g") is None  # g lives in a/, not in the root
    assert index.stored_bytes_of(2) == 150


def test_encode_index_is_deterministic():
    assert _encode(_tiny_parts()) == _encode(_tiny_parts())


def test_index_header_layout_matches_the_spec():
    """docs/format.md: magic, u16 version, u16 flags, u32 header size, u64 body_raw,
    u64 body_stored, u64 XXH3-64 of the stored body, zero padding to 64 bytes."""
    data = _encode(_tiny_parts())
    assert data[:8] == INDEX_MAGIC == b"FANSTIDX"
    version, flags, hsize, raw, stored, digest = struct.unpack_from("<HHIQQQ", data, 8)
    assert (version, flags, hsize) == (1, 0, 64)  # v1: no file in a solid chunk
    assert stored == len(data) - 64
    assert digest == xxhash.xxh3_64_intdigest(data[64:])
    assert raw == len(_body(data))
    assert data[40:64] == bytes(24)
    body = _body(data)
    (meta_len,) = struct.unpack_from("<I", body)
    meta = json.loads(body[4 : 4 + meta_len])
    for name, (off, length) in meta["columns"].items():
        assert off % 8 == 0 and off >= 4 + meta_len and off + length <= len(body), name
    off, length = meta["columns"]["names"]
    assert body[off : off + length] == b"afl" + b"g"


def test_partition_header_layout_and_round_trip():
    head = encode_partition_header(7)
    assert len(head) == PARTITION_HEADER_SIZE == 64
    assert head[:8] == PARTITION_MAGIC == b"FANSTPRT"
    assert struct.unpack_from("<HHII", head, 8) == (PARTITION_VERSION, 0, 64, 7) == (1, 0, 64, 7)
    assert head[20:] == bytes(44)
    assert read_partition_header(head) == 7
    assert partition_name(3) == "part-00003.fsp"


def test_partition_writer_offsets_and_checksum(tmp_path):
    path = tmp_path / partition_name(2)
    w = PartitionWriter(str(path), 2)
    assert w.append(b"abc") == 64
    assert w.append(b"defgh") == 67
    digest = w.close()
    data = path.read_bytes()
    assert data[64:] == b"abcdefgh" and len(data) == w.size == 72
    assert read_partition_header(data) == 2
    assert digest == xxhash.xxh3_128_hexdigest(data) == file_checksum(str(path))


def test_partition_writer_abort_removes_the_file(tmp_path):
    path = tmp_path / partition_name(0)
    w = PartitionWriter(str(path), 0)
    w.append(b"x" * 100)
    w.abort()
    assert not path.exists()


# --------------------------------------------------------------------------- version checks


def _with_version(data: bytes, version: int) -> bytes:
    return data[:8] + struct.pack("<H", version) + data[10:]


def test_newer_index_version_is_refused_with_exit_code_33():
    data = _with_version(_encode(_tiny_parts()), FORMAT_VERSION + 1)
    with pytest.raises(VersionTooNewError) as info:
        read_index_bytes(data, where="x/fanstore.idx")
    msg = str(info.value)
    assert info.value.exit_code == 33
    assert f"v{FORMAT_VERSION + 1}" in msg and "newer" in msg and "upgrade" in msg
    assert msg.startswith("x/fanstore.idx: ") and "\n" not in msg


def test_older_index_version_is_refused_with_exit_code_32():
    data = _with_version(_encode(_tiny_parts()), 0)
    with pytest.raises(VersionTooOldError) as info:
        read_index_bytes(data)
    assert info.value.exit_code == 32 and "no longer supported" in str(info.value)


def test_newer_partition_version_is_refused():
    head = bytearray(encode_partition_header(0))
    struct.pack_into("<H", head, 8, FORMAT_VERSION + 1)
    with pytest.raises(VersionTooNewError) as info:
        read_partition_header(bytes(head), "p")
    assert info.value.exit_code == 33 and "newer" in str(info.value)


@pytest.mark.parametrize("patch, match", [
    ((0, b"FANSTIDY"), None),
    ((12, struct.pack("<I", 32)), "header size"),
    ((16, struct.pack("<Q", 1 << 40)), "absurd size"),
])
def test_bad_index_header_fields(patch, match):
    data = bytearray(_encode(_tiny_parts()))
    off, value = patch
    data[off : off + len(value)] = value
    with pytest.raises(FormatError, match=match) as info:
        read_index_bytes(bytes(data))
    if match is None:
        assert isinstance(info.value, NotAStoreError) and "bad magic" in str(info.value)


@pytest.mark.parametrize("patch, match", [
    ((0, b"FANSTPRX"), "bad magic"),
    ((12, struct.pack("<I", 65)), "unsupported partition header"),
    ((8, struct.pack("<H", 0)), "unsupported partition header"),
])
def test_bad_partition_header_fields(patch, match):
    head = bytearray(encode_partition_header(0))
    off, value = patch
    head[off : off + len(value)] = value
    with pytest.raises(FormatError, match=match):
        read_partition_header(bytes(head))


# --------------------------------------------------------------------------- truncation


def test_truncated_index_is_refused_at_every_length():
    data = _encode(_tiny_parts())
    for n in sorted({0, 1, 8, 63, 64, 65, 100, len(data) // 2, len(data) - 1}):
        with pytest.raises(FormatError) as info:
            read_index_bytes(data[:n])
        assert "truncated" in str(info.value), n
        assert "\n" not in str(info.value)


def test_extended_or_flipped_index_is_refused():
    data = _encode(_tiny_parts())
    with pytest.raises(FormatError, match="truncated or extended"):
        read_index_bytes(data + b"\0")
    for pos in (64, 70, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(FormatError, match="checksum mismatch"):
            read_index_bytes(bytes(bad))


def test_body_size_lie_is_refused():
    data = bytearray(_encode(_tiny_parts()))
    raw = struct.unpack_from("<Q", data, 16)[0]
    struct.pack_into("<Q", data, 16, raw + 8)
    with pytest.raises(FormatError, match="size does not match"):
        read_index_bytes(bytes(data))


def test_read_index_of_missing_or_empty_paths(tmp_path):
    with pytest.raises(NotAStoreError, match="no such directory"):
        read_index(str(tmp_path / "nope"))
    with pytest.raises(NotAStoreError, match=f"no {INDEX_NAME}"):
        read_index(str(tmp_path))


def _copy_store(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_truncated_or_extended_partition_is_refused(small_store, tmp_path):
    store = _copy_store(small_store, tmp_path / "s")
    index = read_index(str(store))
    part = store / partition_name(0)
    size = part.stat().st_size
    os.truncate(part, size - 1)
    with pytest.raises(FormatError, match=r"partition is truncated \(\d+ bytes, the index says"):
        LocalPartitions(str(store), index)
    os.truncate(part, size + 1)
    with pytest.raises(FormatError, match="partition is too long"):
        LocalPartitions(str(store), index)
    os.truncate(part, 10)
    with pytest.raises(FormatError, match="truncated"):
        LocalStore(str(store))
    os.unlink(part)
    with pytest.raises(FormatError, match="part-00000.fsp is missing"):
        LocalStore(str(store))
    # The other partition alone still opens.
    LocalPartitions(str(store), index, [1]).close()


def test_partition_with_a_foreign_number_is_refused(small_store, tmp_path):
    store = _copy_store(small_store, tmp_path / "s")
    part = store / partition_name(1)
    data = bytearray(part.read_bytes())
    struct.pack_into("<I", data, 16, 0)
    part.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="header says partition 0, expected 1"):
        LocalStore(str(store))


# --------------------------------------------------------------------------- hostile indexes


def _set(col: str, i: int, value):
    table, name = col.split(".")

    def mutate(p):
        p[table][name][i] = value
    return mutate


def _rename(entry: int, new: bytes):
    def mutate(p):
        # Same length, so offsets stay valid: patch the name blob in place.
        off = int(p["e"]["name_off"][entry])
        names = bytearray(p["names"])
        names[off : off + len(new)] = new
        p["e"]["name_len"][entry] = len(new)
        p["names"] = bytes(names)
    return mutate


def _target(new: bytes):
    def mutate(p):
        p["targets"] = new
        p["e"]["count"][3] = len(new)
        p["e"]["size"][3] = len(new)
    return mutate


def _meta(key: str, value):
    def mutate(p):
        p["meta"][key] = value
    return mutate


HOSTILE = {
    "chunk past its partition": (_set("c.offset", 1, 200), "outside its partition"),
    "chunk inside the header": (_set("c.offset", 2, 10), "outside its partition"),
    "chunk in a missing partition": (_set("c.part", 2, 5), "outside the partition table"),
    "decompression bomb": (_set("c.raw", 1, 1 << 30), "absurd raw size"),
    "raw chunk of size 0": (_set("c.raw", 2, 0), "absurd raw size"),
    "unknown codec": (_set("c.codec", 0, 9), "outside the codec table"),
    "file size lie": (_set("e.size", 2, 5001), "differs from the sum"),
    "short middle chunk": (lambda p: (_set("c.raw", 0, 4000)(p), _set("c.raw", 1, 1000)(p)),
                           "not chunk_size long"),
    "bad kind": (_set("e.kind", 2, 7), "unknown entry kind"),
    "mode beyond 07777": (_set("e.mode", 2, 0o17777), "beyond 07777"),
    "child run too long": (_set("e.count", 0, 4), "child counts"),
    "wrong parent": (_set("e.parent", 4, 0), "parent"),
    "name with a slash": (_rename(1, b"/"), "contains '/'"),
    "name with NUL": (_rename(2, b"\0"), "contains '/' or NUL"),
    "name '.'": (_rename(1, b"."), "named '.' or '..'"),
    "empty name": (_set("e.name_len", 2, 0), "empty or over-long"),
    "name past the blob": (_set("e.name_off", 2, 1000), "outside the name table"),
    "symlink target with NUL": (_target(b"a\0b"), "symlink target contains NUL"),
    "symlink target past the blob": (_set("e.first", 3, 100), "outside the target table"),
    "directory with data": (_set("e.checksum", 1, 5), "carries file data"),
    "chunk size zero": (_meta("chunk_size", 0), "bad chunk size"),
    "chunk size huge": (_meta("chunk_size", 1 << 40), "bad chunk size"),
    "codec table malformed": (_meta("codecs", [{"level": 3}]), "codec table"),
    "partition table malformed": (_meta("partitions", [{"size": "x"}]), "partition 0"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_index_is_refused(case):
    mutate, match = HOSTILE[case]
    parts = copy.deepcopy(_tiny_parts())
    mutate(parts)
    with pytest.raises(FormatError, match=match):
        read_index_bytes(_encode(parts))


@pytest.mark.parametrize("target", [b"../../etc/passwd", b"/etc/passwd", b"a/../.."])
def test_a_symlink_that_leads_outside_is_kept_as_it_is(target):
    """Stored as squashfs and tar store it (the index refused it before issue 35): the
    target comes back verbatim for the mount's readlink, and the store's own resolver
    stops at the store's edge with OutsideStoreError (a NotFoundError, ENOENT)."""
    parts = copy.deepcopy(_tiny_parts())
    _target(target)(parts)
    index = read_index_bytes(_encode(parts))
    ns = Namespace(index)
    link = ns.resolve("l")
    assert ns.readlink(link) == target
    with pytest.raises(OutsideStoreError, match="symlink 'l' -> .* leads outside the store") \
            as info:
        ns.file_entry("l")
    assert isinstance(info.value, NotFoundError) and info.value.errno == errno.ENOENT
    assert ns.file_entry("f") == 2


def test_overlapping_chunks_are_refused():
    parts = _tiny_parts()
    # a/g's chunk moved onto f's first chunk in partition 0 (stored length fits inside).
    parts["c"]["part"][2] = 0
    parts["c"]["offset"][2] = 100
    with pytest.raises(FormatError, match="overlap"):
        read_index_bytes(_encode(parts))


def test_bad_lookup_table_is_refused():
    parts = _tiny_parts()
    lk_hash, lk_entry = parts["lookup"]
    parts["lookup"] = (lk_hash[:-1], lk_entry[:-1])
    with pytest.raises(FormatError, match="lookup table has the wrong length"):
        read_index_bytes(_encode(parts))
    parts["lookup"] = (lk_hash[::-1].copy(), lk_entry[::-1].copy())
    with pytest.raises(FormatError, match="not sorted"):
        read_index_bytes(_encode(parts))


def test_random_body_damage_never_escapes_as_another_error():
    """A body whose bytes were changed but whose checksum was recomputed (a buggy or hostile
    writer) is either refused with FormatError or yields an index that validates."""
    data = _encode(_tiny_parts())
    body = _body(data)
    rng = random.Random(0)
    refused = 0
    for _ in range(400):
        bad = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        try:
            index = read_index_bytes(_reencode_body(data, bytes(bad)))
        except FormatError:
            refused += 1
            continue
        # Accepted: it must still be safe to walk the namespace.
        ns = Namespace(index)
        for entry in range(index.n_entries):
            ns.stat(entry)
            if ns.is_dir(entry):
                list(ns.children(entry))
    assert refused > 100  # most damage is detected


def test_target_stays_inside():
    assert target_stays_inside(b"a/l", b"../f")
    assert target_stays_inside(b"a/b/l", b"../../f")
    assert target_stays_inside(b"l", b"a/../b")
    assert not target_stays_inside(b"l", b"..")
    assert not target_stays_inside(b"a/l", b"../../f")
    assert not target_stays_inside(b"a/l", b"/etc/passwd")
    assert not target_stays_inside(b"l", b"a/../../x")


# --------------------------------------------------------------------------- pack round trip


def test_index_of_the_special_store_describes_the_source(special_tree, special_store):
    """Every source entry is in the index with its kind, permission bits, size, mtime (ns)
    and symlink target, in breadth-first order with children sorted; nothing extra."""
    index = read_index(str(special_store))
    ns = Namespace(index)
    root = os.fsencode(special_tree["root"])
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = b"" if rel_dir == b"." else rel_dir
        d = ns.resolve(rel_dir)
        names = sorted(dirnames + filenames)
        assert [ns.name(c) for c in ns.children(d)] == names, rel_dir
        for name in names:
            rel = os.path.join(rel_dir, name) if rel_dir else name
            st = os.lstat(os.path.join(root, rel))
            entry = ns.resolve(rel)
            s = ns.stat(entry)
            assert s.mode == st.st_mode, rel
            assert s.mtime_ns == st.st_mtime_ns, rel
            if stat.S_ISLNK(st.st_mode):
                assert ns.readlink(entry) == os.readlink(os.path.join(root, rel))
                assert s.size == st.st_size
            elif stat.S_ISREG(st.st_mode):
                assert s.size == st.st_size, rel
            seen += 1
    assert seen == index.n_entries - 1
    assert index.meta["counts"] == {
        "files": special_tree["files"], "dirs": special_tree["dirs"],
        "symlinks": special_tree["symlinks_count"], "raw_bytes": special_tree["raw_bytes"],
        "stored_bytes": sum(p.size for p in index.partitions)}
    # Breadth-first: depth never decreases along the entry table.
    depth = np.zeros(index.n_entries, dtype=np.int64)
    parent = index.entries["parent"]
    for i in range(1, index.n_entries):
        depth[i] = depth[int(parent[i])] + 1
    assert np.all(np.diff(depth) >= 0)


def test_partition_table_checksums_match_the_files(small_store):
    index = read_index(str(small_store))
    for p in index.partitions:
        path = small_store / p.name
        assert path.stat().st_size == p.size
        assert file_checksum(str(path)) == p.checksum


# --------------------------------------------------------------------------- golden store


def _regen_module():
    spec = importlib.util.spec_from_file_location("fanstore_format_regen",
                                                  GOLDEN / "regenerate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "v4", "v5"])
def test_golden_store_reads(version):
    """The committed stores still read, byte for byte (compatibility with old stores: v1 to
    v4 are what earlier FanStores wrote; v5 what this one writes)."""
    store = GOLDEN / version
    if not (store / INDEX_NAME).exists():
        pytest.fail(f"missing golden store {store}; regenerate with: {REGENERATE}")
    manifest = json.loads(_regen_module().manifest_path(version).read_text())
    with LocalStore(str(store)) as s:
        ns = s.ns
        assert ns.n_entries == len(manifest) + 1
        for rel, rec in manifest.items():
            entry = ns.resolve(rel)
            st = ns.stat(entry)
            assert stat.S_IMODE(st.mode) == rec["mode"] and st.mtime_ns == rec["mtime_ns"], rel
            if rec["kind"] == "file":
                data = s.read_file(rel)
                assert len(data) == rec["size"] == st.size, rel
                assert hashlib.sha256(data).hexdigest() == rec["sha256"], rel
            elif rec["kind"] == "symlink":
                assert os.fsdecode(ns.readlink(entry)) == rec["target"]
            else:
                assert ns.is_dir(entry)
        # The fixture exercises both a compressed and a stored-raw chunk, and a 2-chunk file.
        assert set(s.index.chunks["codec"].tolist()) == {0, 1}
        assert ns.chunks(ns.resolve("two_chunks.bin"))[1] == 2
        assert s.index.version == int(version[1:])
        if version in ("v4", "v5"):  # duplicates stored once: a two-chunk run, a solid chunk
            for rel in ("two_chunks.bin", "text.txt"):
                a, b = ns.resolve(rel), ns.resolve(f"dir/{rel.replace('.', '_copy.', 1)}")
                assert (ns.chunks(a), ns.data_offset(a)) == (ns.chunks(b), ns.data_offset(b))
        if version != "v1":  # two files share a solid chunk, one at an offset
            a, b = ns.resolve("text.txt"), ns.resolve("dir/ünï.txt")
            assert ns.chunks(a) == (ns.chunks(b)[0], 1) and ns.chunks(b)[1] == 1
            assert (ns.data_offset(a), ns.data_offset(b)) == (0, manifest["text.txt"]["size"])
        else:
            assert "e_offset" not in s.index.meta["columns"]


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "v4", "v5"])
def test_golden_store_is_reproduced_by_the_packer(tmp_path, version):
    """Packing the golden tree again gives identical partitions and the same index (up to
    the recorded source path and tool version, and its layout: the packer writes v5, the
    older goldens stay as earlier releases wrote them, with the same entries, chunks and
    names; v5 keeps no whole-file checksum for a file of one chunk). If this fails after an
    intended writer change, regenerate the fixture; test_golden_store_reads must keep
    passing."""
    regen = _regen_module()
    src, dest = tmp_path / "src", tmp_path / "store"
    regen.build_tree(src, duplicates=version in regen.WITH_DUPLICATES)
    assert regen.manifest_of(src) == json.loads(regen.manifest_path(version).read_text())
    regen.pack_tree(src, dest, regen.STORES[version])
    golden = GOLDEN / version
    names = sorted(os.listdir(golden))
    assert sorted(os.listdir(dest)) == names
    for name in names:
        if name != INDEX_NAME:
            assert (dest / name).read_bytes() == (golden / name).read_bytes(), (
                f"{name} differs from the golden fixture; regenerate with: {REGENERATE}")
    a, b = read_index(str(golden)), read_index(str(dest))
    # The optional "access" key (docs/format.md) is newer than the goldens, which stay as
    # stores of an older FanStore: test_golden_store_reads shows they still read. The
    # golden tree is public, so the packer records it shared.
    if version not in ("v3", "v4", "v5"):
        assert "access" not in a.meta
        b.meta.pop("access")
    assert b.meta.get("access", "shared") == "shared"
    assert a.meta.get("access", "shared") == "shared"

    def meta(index):
        m = copy.deepcopy(index.meta)
        m.pop("created_by", None)
        m["pack"].pop("source", None)
        m["pack"].pop("tool", None)
        m.pop("columns", None)
        m.pop("format_version", None)
        m.pop("filters", None)
        return m

    assert a.version == int(version[1:]) and len(b.lk_hash) == 0
    assert b.version == 5 == FORMAT_VERSION
    assert meta(a) == meta(b)
    for name, _ in ENTRY_COLUMNS:
        if name == "checksum":  # v5: 0 for a file of one chunk (the chunk's covers it)
            one = (b.entries["kind"] == KIND_FILE) & (b.entries["count"] == 1)
            assert np.array_equal(a.entries[name][~one], b.entries[name][~one])
            assert one.any() and not b.entries[name][one].any()
            continue
        assert np.array_equal(a.entries[name], b.entries[name]), name
    for name, _ in CHUNK_COLUMNS:
        assert np.array_equal(a.chunks[name], b.chunks[name]), name
    assert a.names == b.names and a.targets == b.targets


# --------------------------------------------------------------------------- format v2


def _tiny_tree(f: int, g: int, h: int) -> IndexBuilder:
    """The five entries the tiny v2 and v4 indexes share: / , a/, f, a/g, a/h of the given
    sizes, the directories' runs set; the files' chunk runs are the caller's."""
    b = IndexBuilder(5, 3)
    e = b.entries
    rows = [(0, KIND_DIR, 0o755, 0), (0, KIND_DIR, 0o755, 0), (0, KIND_FILE, 0o644, f),
            (1, KIND_FILE, 0o644, g), (1, KIND_FILE, 0o644, h)]
    for i, (parent, kind, mode, size) in enumerate(rows):
        e["parent"][i], e["kind"][i], e["mode"][i], e["size"][i] = parent, kind, mode, size
    for i, name in ((1, b"a"), (2, b"f"), (3, b"g"), (4, b"h")):
        b.set_name(i, name)
    e["first"][0], e["count"][0] = 1, 2
    e["first"][1], e["count"][1] = 3, 2
    return b


def _tiny_v2_parts() -> dict:
    """A v2 index: two files share one solid chunk.

        /            dir   (entry 0)
        a/           dir   (1)
        f            file  (2)  5000 bytes: chunks 0, 1 in partition 0
        a/g          file  (3)  10 bytes at offset 0 of chunk 2 (partition 1)
        a/h          file  (4)  20 bytes at offset 10 of chunk 2
    """
    b = _tiny_tree(5000, 10, 20)
    e = b.entries
    e["first"][2], e["count"][2], e["checksum"][2] = 0, 2, 111
    e["first"][3], e["count"][3], e["checksum"][3] = 2, 1, 222
    e["first"][4], e["count"][4], e["checksum"][4] = 2, 1, 333
    e["offset"][4] = 10
    return _parts_of(b, [(0, 64, 100, 4096, 1), (0, 164, 50, 904, 1), (1, 64, 12, 30, 1)],
                     [{"size": 214, "checksum": "00", "files": 1, "raw_bytes": 5000},
                      {"size": 76, "checksum": "11", "files": 2, "raw_bytes": 30}],
                     {"files": 3, "dirs": 1, "symlinks": 0, "raw_bytes": 5030})


def test_v2_index_round_trip():
    parts = _tiny_v2_parts()
    data = _encode(parts)
    assert struct.unpack_from("<H", data, 8)[0] == 2
    index = read_index_bytes(data)
    assert index.version == 2 == index.meta["format_version"] < FORMAT_VERSION
    assert "e_offset" in index.meta["columns"]
    for name, _ in ENTRY_COLUMNS:
        assert np.array_equal(index.entries[name], parts["e"][name]), name
    ns = Namespace(index)
    assert ns.chunks(3) == ns.chunks(4) == (2, 1)
    assert (ns.data_offset(3), ns.data_offset(4), ns.data_offset(2)) == (0, 10, 0)


def test_a_lone_file_in_a_block_is_still_v1():
    """Written in the oldest version that holds the store: nothing shared, no offset -> v1."""
    parts = _tiny_v2_parts()
    parts["e"]["count"][4] = 0  # h empty, g alone in chunk 2 (raw 30 > its size 10: v2)
    parts["e"]["size"][4] = 0
    parts["e"]["offset"][4] = 0
    parts["e"]["first"][4] = 0
    assert read_index_bytes(_encode(parts)).version == 2
    parts["c"]["raw"][2] = 10  # g's chunk holds exactly g: v1 semantics
    assert read_index_bytes(_encode(parts)).version == 1


HOSTILE_V2 = {
    "solid file past its chunk": (_set("e.offset", 4, 11), "outside its chunk"),
    "solid file size past its chunk": (_set("e.size", 3, 31), "outside its chunk"),
    "offset of a multi-chunk file": (_set("e.offset", 2, 5), "several chunks has a data offset"),
    "run over another file's chunk": (_set("e.first", 3, 1), "overlap"),
    "orphan chunk": (lambda p: (_set("e.count", 2, 1)(p), _set("e.size", 2, 4096)(p)),
                     "belongs to no file"),
    "offset on a directory": (_set("e.offset", 1, 3), "has a data offset"),
    "empty file with an offset": (lambda p: (_set("e.count", 3, 0)(p), _set("e.size", 3, 0)(p),
                                             _set("e.offset", 3, 4)(p)),
                                  "differs from the sum"),
    "huge offset": (_set("e.offset", 4, 0xFFFFFFFF), "outside its chunk"),
    "file size beyond 2**62": (_set("e.size", 3, 1 << 63), "absurd size"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_V2))
def test_hostile_v2_index_is_refused(case):
    mutate, match = HOSTILE_V2[case]
    parts = copy.deepcopy(_tiny_v2_parts())
    mutate(parts)
    with pytest.raises(FormatError, match=match):
        read_index_bytes(_encode(parts))


def _as_v1(data: bytes, drop_offset: bool) -> bytes:
    """Index bytes relabelled as format v1 (header and metadata), with or without its
    e_offset column (the body keeps its layout: the metadata area has room to spare)."""
    body = bytearray(_body(data))
    (meta_len,) = struct.unpack_from("<I", body)
    meta = json.loads(body[4 : 4 + meta_len])
    meta["format_version"] = 1
    if drop_offset:
        del meta["columns"]["e_offset"]
    new = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    assert len(new) <= meta_len
    struct.pack_into("<I", body, 0, len(new))
    body[4 : 4 + meta_len] = new + b" " * (meta_len - len(new))
    out = bytearray(_reencode_body(data, bytes(body)))
    struct.pack_into("<H", out, 8, 1)
    return bytes(out)


def test_v1_index_cannot_share_chunks_or_carry_offsets():
    data = _encode(_tiny_v2_parts())
    with pytest.raises(FormatError, match="column 'offset' of a later version"):
        read_index_bytes(_as_v1(data, drop_offset=False))
    parts = _tiny_v2_parts()
    parts["e"]["offset"][4] = 0  # g and h at the same bytes of a shared chunk: v2 only
    with pytest.raises(FormatError, match="differs from the sum of its chunks"):
        read_index_bytes(_as_v1(_encode(parts), drop_offset=True))


def test_metadata_version_must_match_the_header():
    data = bytearray(_encode(_tiny_v2_parts()))
    struct.pack_into("<H", data, 8, 1)  # header says v1, metadata v2
    with pytest.raises(FormatError, match="metadata says format v2, its header v1"):
        read_index_bytes(bytes(data))


# --------------------------------------------------------------------------- format v3


def _random_tree_parts(seed: int, lookup: bool, most: int = 800
                       ) -> tuple[dict, list[tuple[int, bytes]]]:
    """A random namespace of about ``most`` entries (directories of 0-40 children named
    with 1-30 random bytes, none '/' or NUL) as ``encode_index`` inputs, v1 (with a lookup
    table) or v3; and the (parent, name) of entries 1, 2, ... in order."""
    rng = random.Random(seed)
    alphabet = [bytes([c]) for c in range(1, 256) if c != ord("/")]
    rows, queue = [(0, KIND_DIR, b"")], [0]  # (parent, kind, name), breadth-first
    children: dict[int, tuple[int, int]] = {}
    while queue:
        d = queue.pop(0)
        names: set[bytes] = set()
        lo = 0 if most <= 800 else 30  # a large tree must not die out
        want = 40 if d == 0 else rng.randint(lo, 40) if len(rows) < most else 0
        while len(names) < want:
            name = b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
            if name not in (b".", b".."):
                names.add(name)
        children[d] = (len(rows), len(names))
        for k, name in enumerate(sorted(names)):
            kind = KIND_DIR if rng.random() < 0.1 or k == 0 else KIND_FILE
            rows.append((d, kind, name))
            if kind == KIND_DIR:
                queue.append(len(rows) - 1)
    b = IndexBuilder(len(rows), 0)
    e = b.entries
    for i, (parent, kind, _name) in enumerate(rows):
        e["parent"][i], e["kind"][i], e["mode"][i] = parent, kind, 0o755
    b.set_names([r[2] for r in rows[1:]])
    for d, (first, count) in children.items():
        e["first"][d], e["count"][d] = first, count
    meta = {"chunk_size": 4096, "codecs": [{"id": "none"}], "partitions": [],
            "counts": {"files": int((e["kind"] == KIND_FILE).sum()),
                       "dirs": int((e["kind"] == KIND_DIR).sum()) - 1, "symlinks": 0,
                       "raw_bytes": 0}}
    parts = {"meta": meta, "e": e, "c": b.chunks,
             "lookup": b.build_lookup() if lookup else None,
             "names": bytes(b.names), "targets": b""}
    return parts, [(int(p), n) for p, _, n in rows[1:]]


@pytest.mark.parametrize("seed", range(6))
def test_v3_has_no_lookup_table_and_finds_every_name_as_v1_did(seed):
    """v3 drops the lookup table and narrows the name columns; bisecting a directory's
    sorted children finds exactly what v1's hash table found, one name or many at once,
    and nothing for names that are not there."""
    v1, names = _random_tree_parts(seed, lookup=True)
    v3, _ = _random_tree_parts(seed, lookup=False)
    a, b = read_index_bytes(_encode(v1)), read_index_bytes(_encode(v3))
    assert (a.version, b.version) == (1, 3) and len(a.lk_hash) == a.n_entries - 1
    assert len(b.lk_hash) == 0 and "lk_hash" not in b.meta["columns"]
    assert b.entries["name_off"].dtype == np.dtype("<u4")
    assert b.entries["name_len"].dtype == np.dtype("u1")
    rng = random.Random(seed)
    missing = [(p, n + bytes([rng.randint(1, 255)])) for p, n in rng.sample(names, 40)]
    missing += [(p, n[:-1]) for p, n in rng.sample(names, 40) if len(n) > 1]
    missing = [(p, n) for p, n in missing if n not in {m for q, m in names if q == p}]
    for index in (a, b):
        for entry, (parent, name) in enumerate(names, start=1):
            assert index.lookup(parent, name) == entry
        for parent, name in missing:
            assert index.lookup(parent, name) is None
        pairs = names + missing
        got = index.lookup_many(np.array([p for p, _ in pairs]), [n for _, n in pairs])
        assert got.tolist() == list(range(1, len(names) + 1)) + [-1] * len(missing)
        few = rng.sample(pairs, 3)  # a few names of large directories: bisected one by one
        got = index.lookup_many(np.array([p for p, _ in few]), [n for _, n in few])
        assert got.tolist() == [-1 if index.lookup(p, n) is None else index.lookup(p, n)
                                for p, n in few]


@pytest.mark.parametrize("damage", ["swap", "repeat"])
def test_an_unsorted_or_repeated_name_is_refused_in_its_directory(damage):
    """Lookups bisect: a directory whose names are out of order (or one repeats) is refused
    at the first lookup in it (FormatError: EIO through a mount), and only it; the index
    loads (checking every directory at load took 4 s of a 10M-file mount's start-up)."""
    parts, names = _random_tree_parts(1, lookup=False)
    e = parts["e"]
    parent = e["parent"].astype(np.int64)
    i = next(k for k in range(1, len(parent) - 1) if parent[k] == parent[k + 1] != 0)
    if damage == "swap":
        e["name_off"][i], e["name_off"][i + 1] = e["name_off"][i + 1], e["name_off"][i]
        e["name_len"][i], e["name_len"][i + 1] = e["name_len"][i + 1], e["name_len"][i]
    else:
        e["name_off"][i + 1], e["name_len"][i + 1] = e["name_off"][i], e["name_len"][i]
    index = read_index_bytes(_encode(parts), where="STORE")
    damaged = int(parent[i])
    shown = os.fsdecode(index.path(damaged)) or "/"
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(DamagedDirectoryError, match="are not sorted, or one repeats"
                           ) as info:
            index.lookup(damaged, index.name(i))
        assert info.value.directory == shown
        assert str(info.value).startswith(f"STORE: the names of directory {shown} ")
        with pytest.raises(DamagedDirectoryError, match="are not sorted, or one repeats"):
            index.lookup_many(np.array([damaged] * 3), [index.name(i)] * 3)
    for entry, (p, name) in enumerate(names, start=1):
        if p != damaged:
            assert index.lookup(p, name) == entry
    assert unsorted_directories(index).tolist() == [damaged]
    # Many paths at once (a dataset's files): those in the directory name nothing (-1),
    # the others are found; the damage does not fail the batch.
    ns = Namespace(index)
    files = [k for k in range(1, index.n_entries) if int(e["kind"][k]) == KIND_FILE]
    paths = [os.fsdecode(index.path(k)) for k in files]
    inside = [int(parent[k]) == damaged or damaged in _ancestors(index, k) for k in files]
    assert any(inside) and not all(inside)
    got = ns.file_entries(paths)
    assert got == [-1 if bad else k for k, bad in zip(files, inside)]


def _ancestors(index, entry: int) -> set[int]:
    out = set()
    while entry:
        entry = int(index.entries["parent"][entry])
        out.add(entry)
    return out


def _sorted_by_bytes(index, d: int) -> bool:
    """The oracle: a directory's names strictly increase under Python's bytes order."""
    names = [index.name(k) for k in range(int(index.entries["first"][d]),
                                          int(index.entries["first"][d])
                                          + int(index.entries["count"][d]))]
    return all(a < b for a, b in zip(names, names[1:]))


@pytest.mark.parametrize("seed", range(4))
def test_unsorted_directories_names_exactly_the_damaged_ones(seed):
    """What ``verify`` checks: every directory whose names are out of order or repeated,
    and no other, agreeing with Python's bytes order (the order lookups bisect under;
    a prefix sorts first) on random trees damaged in random directories (names swapped,
    repeated, a neighbour's name with a byte added or cut)."""
    parts, _ = _random_tree_parts(seed, lookup=False)
    e, rng = parts["e"], random.Random(seed)
    assert unsorted_directories(read_index_bytes(_encode(parts))).tolist() == []
    dirs = [d for d in np.nonzero(e["kind"] == KIND_DIR)[0].tolist() if e["count"][d] >= 2]
    names = bytearray(parts["names"])
    for d in rng.sample(dirs, min(6, len(dirs))):
        k = int(e["first"][d]) + rng.randrange(int(e["count"][d]) - 1)
        how = rng.choice(["swap", "repeat", "longer", "shorter"])
        if how == "swap":
            for col in ("name_off", "name_len"):
                e[col][k], e[col][k + 1] = e[col][k + 1], e[col][k]
        elif how == "repeat":
            e["name_off"][k + 1], e["name_len"][k + 1] = e["name_off"][k], e["name_len"][k]
        else:  # this name becomes the next one plus a byte, or the next this one less one
            off, ln = int(e["name_off"][k + 1]), int(e["name_len"][k + 1])
            at = k
            new = names[off:off + ln] + b"\x01"
            if how == "shorter":
                off, ln = int(e["name_off"][k]), int(e["name_len"][k])
                at, new = k + 1, names[off:off + ln - 1]
            if not new or new in (b".", b".."):
                continue
            e["name_off"][at], e["name_len"][at] = len(names), len(new)
            names += new
    parts["names"] = bytes(names)
    index = read_index_bytes(_encode(parts))
    expected = [d for d in dirs if not _sorted_by_bytes(index, d)]
    assert expected
    assert unsorted_directories(index).tolist() == expected


@pytest.mark.parametrize("move", [1, "end"])
def test_a_child_run_out_of_place_is_refused_naming_its_directory(move):
    """A directory's child run moved (one entry on, or past the last entry) breaks the
    tree every reader walks: the index is refused when loaded, one line naming the first
    directory out of place (its path and entry)."""
    parts, names = _random_tree_parts(2, lookup=False)
    e = parts["e"]
    d = next(k for k in range(1, len(e["kind"])) if e["kind"][k] == KIND_DIR
             and e["count"][k] >= 1)
    e["first"][d] = e["first"][d] + 1 if move == 1 else len(e["kind"])
    path, k = [], d
    while k:
        path.append(names[k - 1][1])
        k = names[k - 1][0]
    shown = os.fsdecode(b"/".join(reversed(path)))
    with pytest.raises(FormatError) as info:
        read_index_bytes(_encode(parts), where="STORE")
    assert str(info.value) == ("STORE: directory child runs are not contiguous in "
                               f"breadth-first order (first at directory {shown} (entry {d}))")


def _mapping_rss(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return rss


def test_a_mapped_index_costs_a_process_only_the_pages_it_reads(request):
    """A process maps the node's index copy (its checksum checked by reading the file, not
    through the mapping) and builds its Namespace without touching the body: resident are
    only the pages its queries read, never the whole copy (the node shares it)."""
    from fanstore.format.index import map_index_body, write_index_body

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (where a node's index copy lives)")
    parts, names = _random_tree_parts(3, lookup=False, most=100_000)
    index = read_index_bytes(_encode(parts))
    # in a tmpfs, as the node's copy is: a file system that caches large folios (ext4) maps
    # a whole folio on a touch, which says nothing about what FanStore reads
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    request.addfinalizer(lambda: shutil.rmtree(shm, ignore_errors=True))
    path = str(shm / "copy.idx")
    write_index_body(path, index)
    size = os.path.getsize(path)
    assert size > 4 << 20
    mapped = map_index_body(path, check=True)
    ns = Namespace(mapped)
    assert ns.n_entries == index.n_entries
    # A fault maps the pages around it that are in the page cache: up to fault_around_bytes
    # (64 KiB by default) per touched place.
    around = 64 << 10
    start = _mapping_rss(path)  # the header, the metadata JSON and the column directory
    assert start <= around + len(json.dumps(mapped.meta)), (start, size)
    parent, name = names[len(names) // 2]
    assert ns.lookup(parent, name) == len(names) // 2 + 1
    assert ns.stat(parent).nlink >= 2
    # a bisection and a stat touch a few places in a dozen columns
    assert start < _mapping_rss(path) <= start + 24 * around < size / 4


# --------------------------------------------------------------------------- format v4


def _tiny_v4_parts() -> dict:
    """A v4 index: identical files stored once (chunk size 4096).

        /            dir   (entry 0)
        a/           dir   (1)
        f            file  (2)  5000 bytes: chunks 0, 1 in partition 0
        a/g          file  (3)  5000 bytes: the same run as f (a duplicate of f)
        a/h          file  (4)  10 bytes: chunk 2 in partition 1
    """
    b = _tiny_tree(5000, 5000, 10)
    e = b.entries
    e["first"][2], e["count"][2], e["checksum"][2] = 0, 2, 111
    e["first"][3], e["count"][3], e["checksum"][3] = 0, 2, 111
    e["first"][4], e["count"][4], e["checksum"][4] = 2, 1, 222
    parts = _parts_of(b, [(0, 64, 100, 4096, 1), (0, 164, 50, 904, 1), (1, 64, 10, 10, 0)],
                      [{"size": 214, "checksum": "00", "files": 1, "raw_bytes": 5000},
                       {"size": 74, "checksum": "11", "files": 1, "raw_bytes": 10}],
                      {"files": 3, "dirs": 1, "symlinks": 0, "raw_bytes": 10010})
    parts["lookup"] = None
    return parts


def test_v4_is_written_only_when_a_run_of_several_chunks_is_shared():
    parts = _tiny_v4_parts()
    data = _encode(parts)
    assert struct.unpack_from("<H", data, 8)[0] == 4 < FORMAT_VERSION
    index = read_index_bytes(data)
    assert index.version == 4 == index.meta["format_version"]
    ns = Namespace(index)
    assert ns.chunks(2) == ns.chunks(3) == (0, 2)
    # A one-chunk file sharing a chunk (solid blocks, or a duplicate of it) is v3 as before.
    parts["e"]["first"][3], parts["e"]["count"][3], parts["e"]["size"][3] = 2, 1, 10
    assert read_index_bytes(_encode(parts)).version == 3


def test_a_shared_run_of_several_chunks_is_refused_before_v4():
    """What an older reader (v3) says about a v4 store's shared run: what this one says
    about a v3 index holding one (an older FanStore refuses v4 itself as too new)."""
    data = bytearray(_encode(_tiny_v4_parts()))
    body = bytearray(_body(bytes(data)))
    (meta_len,) = struct.unpack_from("<I", body)
    meta = json.loads(body[4 : 4 + meta_len])
    meta["format_version"] = 3
    new = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    body[4 : 4 + meta_len] = new.ljust(meta_len)
    relabelled = bytearray(_reencode_body(bytes(data), bytes(body)))
    struct.pack_into("<H", relabelled, 8, 3)
    with pytest.raises(FormatError, match="file chunk runs overlap"):
        read_index_bytes(bytes(relabelled))


def test_a_v4_index_with_names_that_need_a_lookup_table_is_not_written():
    parts = _tiny_v4_parts()
    parts["lookup"] = IndexBuilder(0, 0).build_lookup()
    with pytest.raises(FormatError, match="only the v4 layout holds"):
        _encode(parts)


def _bad_v4_sharing(mutate):
    """``_tiny_v4_parts`` with a third chunk of 4096 bytes in f's run (f and g then hold
    chunks 0-2, h chunk 3), mutated by ``mutate``."""
    def make():
        b = IndexBuilder(5, 4)
        parts = _tiny_v4_parts()
        for name in parts["c"]:
            b.chunks[name][[0, 1, 3]] = parts["c"][name]
        b.chunks["part"][2], b.chunks["offset"][2] = 0, 214
        b.chunks["stored"][2], b.chunks["raw"][2], b.chunks["codec"][2] = 60, 4096, 1
        b.chunks["raw"][1] = 4096
        parts["c"] = b.chunks
        parts["e"]["count"][2:4] = 3
        parts["e"]["size"][2:4] = 3 * 4096
        parts["e"]["first"][4] = 3
        parts["meta"]["partitions"][0]["size"] = 274
        mutate(parts)
        return parts
    return make


HOSTILE_V4 = {
    "runs overlapping, not the same": (_set("e.first", 3, 1), "overlap"),
    "a run inside another": (lambda p: (_set("e.count", 3, 2)(p), _set("e.size", 3, 8192)(p)),
                             "overlap"),
    "the same run, another size": (_set("e.size", 3, 3 * 4096 - 1), "differs from the sum"),
    "the same first, a longer run": (lambda p: (_set("e.count", 3, 4)(p),
                                                _set("e.size", 3, 3 * 4096 + 10)(p)),
                                     "overlap"),
    "a one-chunk file on a shared run": (
        lambda p: (_set("e.first", 3, 1)(p), _set("e.count", 3, 1)(p), _set("e.size", 3, 10)(p)),
        "overlap"),
    "a shared run with an offset": (_set("e.offset", 3, 5), "several chunks has a data offset"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_V4))
def test_hostile_v4_sharing_is_refused(case):
    mutate, match = HOSTILE_V4[case]
    good = _bad_v4_sharing(lambda p: None)()
    assert read_index_bytes(_encode(good)).version == 4  # the unmutated index reads
    with pytest.raises(FormatError, match=match):
        read_index_bytes(_encode(_bad_v4_sharing(mutate)()))


def test_the_format_package_names_the_current_version():
    """fanstore/format's docstring says which version pack writes: it must be
    FORMAT_VERSION (it said v2 while the format was v3)."""
    import re

    import fanstore.format as fmt
    from fanstore.version import FORMAT_VERSION

    said = re.search(r"\(v(\d+)", fmt.__doc__ or "")
    assert said is not None and int(said.group(1)) == FORMAT_VERSION, fmt.__doc__


# --------------------------------------------------------------------------- format v5


def _compact(parts: dict) -> bytes:
    return encode_index(parts["meta"], parts["e"], parts["c"], None, parts["names"],
                        parts["targets"], compact=True)


def _many_files_parts(n: int = 600) -> dict:
    """A flat v5-able tree of ``n`` one-chunk files (enough rows for the column filters),
    each in a chunk of its own in partition 0, sizes and times growing."""
    b = IndexBuilder(n + 1, n)
    e, c = b.entries, b.chunks
    e["kind"][0], e["mode"][0], e["first"][0], e["count"][0] = KIND_DIR, 0o755, 1, n
    names = [b"f%05d" % i for i in range(n)]
    for i, name in enumerate(names, start=1):
        e["kind"][i], e["mode"][i], e["size"][i] = KIND_FILE, 0o644, 100 + i
        e["mtime_ns"][i] = 1_700_000_000_000_000_000 + 7919 * i
        e["first"][i], e["count"][i], e["checksum"][i] = i - 1, 1, 5000 + i
        b.set_name(i, name)
        k = i - 1
        c["part"][k], c["offset"][k] = 0, 64 + sum(range(101, 100 + i))
        c["stored"][k] = c["raw"][k] = 100 + i
        c["checksum"][k] = 5000 + i
    total = int(c["stored"].sum())
    meta = {"chunk_size": 4096, "codecs": [{"id": "none"}],
            "partitions": [{"size": 64 + total, "checksum": "00", "files": n,
                            "raw_bytes": total}],
            "counts": {"files": n, "dirs": 0, "symlinks": 0, "raw_bytes": total}}
    return {"meta": meta, "e": e, "c": c, "names": bytes(b.names), "targets": b""}


def test_a_compact_index_is_v5_filtered_and_reads_as_its_columns():
    parts = _many_files_parts()
    data = _compact(parts)
    assert struct.unpack_from("<H", data, 8)[0] == 5 == FORMAT_VERSION
    body = _body(data)
    (meta_len,) = struct.unpack_from("<I", body)
    filters = json.loads(body[4 : 4 + meta_len])["filters"]
    # growing columns are stored as deltas; the stored bytes are not the plain column
    assert filters["c_offset"] == filters["e_name_off"] == "delta+shuffle"
    off, length = json.loads(body[4 : 4 + meta_len])["columns"]["c_offset"]
    assert body[off : off + length] != parts["c"]["offset"].tobytes()
    index = read_index_bytes(data)
    assert index.version == 5 == index.meta["format_version"]
    for name, _ in ENTRY_COLUMNS:
        want = parts["e"][name] if name != "checksum" else np.zeros(len(parts["e"]["kind"]))
        assert np.array_equal(index.entries[name], want), name
    for name, _ in CHUNK_COLUMNS:
        assert np.array_equal(index.chunks[name], parts["c"][name]), name
    # the plain body is what a node maps: parsed again, it gives the same columns
    again = parse_body(index.body, "copy", 5)
    assert np.array_equal(again.chunks["offset"], parts["c"]["offset"])
    # smaller than the same index written without filters (v3)
    assert len(data) < len(encode_index(parts["meta"], parts["e"], parts["c"], None,
                                         parts["names"], b""))


def test_a_v5_file_of_several_chunks_keeps_its_checksum():
    index = read_index_bytes(encode_index(**{
        k: v for k, v in _tiny_v4_parts().items() if k != "lookup"}, lookup=None,
        compact=True))
    assert index.version == 5
    assert index.entries["checksum"].tolist() == [0, 0, 111, 111, 0]


@pytest.mark.parametrize("filters, message", [
    ({"c_offset": "rot13"}, "unknown index column filter"),
    ({"e_nope": "shuffle"}, "unknown column"),
    ({"names": "shuffle"}, "unknown column"),
    (["c_offset"], "filters are malformed"),
])
def test_a_v5_index_with_bad_filters_is_refused(filters, message):
    data = _compact(_many_files_parts())
    body = bytearray(_body(data))
    (meta_len,) = struct.unpack_from("<I", body)
    meta = json.loads(body[4 : 4 + meta_len])
    meta["filters"] = filters
    new = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    assert len(new) <= meta_len
    body[4 : 4 + meta_len] = new.ljust(meta_len)
    with pytest.raises(FormatError, match=message):
        read_index_bytes(_reencode_body(data, bytes(body)))


def test_the_format_packages_docstring_names_the_current_version():
    """``fanstore.format``'s docstring is where a reader learns the version: it must say
    the one the code writes (and that the older ones still read)."""
    import fanstore.format
    from fanstore.format.layout import FORMAT_VERSION

    first = fanstore.format.__doc__.splitlines()[0]
    want = f"(v{FORMAT_VERSION}; v1-v{FORMAT_VERSION - 1} still read)"
    assert want in first, f"{first!r} does not say {want!r}"


def test_an_index_copy_that_cannot_be_written_whole_is_removed(tmp_path, monkeypatch):
    """The node's index copy on a file system that fills up while it is written (ENOSPC
    after the first part): the error comes out and no partial copy is left; a file that
    was already at the path is never removed (it is not ours)."""
    import errno

    from fanstore.format import localcopy

    index = read_index_bytes(_encode(_random_tree_parts(1, lookup=False, most=50)[0]))

    def full(_index):
        yield b"x" * 4096
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(localcopy, "index_body_parts", full)
    path = tmp_path / "copy.idx"
    with pytest.raises(OSError) as err:
        localcopy.write_index_body(str(path), index)
    assert err.value.errno == errno.ENOSPC and not path.exists()
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        localcopy.write_index_body(str(path), index)
    assert path.read_bytes() == b"someone else's"
