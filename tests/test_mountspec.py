"""The one mount spec (fanstore/mountspec.py) and its one strict JSON helper
(fanstore/strictjson.py): round trips, and every bad spec as one line naming its key."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from fanstore import fuseflags, strictjson
from fanstore.errors import SpecError, UsageError
from fanstore.mountspec import MountSpec, NodeShare


def _share(**over) -> NodeShare:
    fields = dict(spec=MountSpec("/s", "/mnt/{rank}", mode="prefetch", fuse_flags="-DO_READDIRPLUS",
                                 replicas="auto", local_dir="/l", local_capacity=1 << 30),
                  mountpoint="/mnt/0", data_dir="/l", local_parts=(0, 2), replicated=(2,),
                  table=((0,), (1,), (0, 1)), index_copy="/dev/shm/x.idx",
                  socket_path="/run/ctl.sock", worker_socket="/run/workers.sock", fuse_workers=3)
    fields.update(over)
    return NodeShare(**fields)


def _raw(obj) -> dict:
    return json.loads(strictjson.to_json(obj))


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> str:
    text = str(exc.value)
    assert "\n" not in text and all(w in text for w in words), text
    return text


# --------------------------------------------------------------------------- round trips

def test_a_spec_round_trips_through_json():
    spec = MountSpec("/s", "/m")
    assert strictjson.from_json(MountSpec, strictjson.to_json(spec)) == spec
    share = _share()
    again = strictjson.from_json(NodeShare, strictjson.to_json(share))
    assert again == share and again.spec == share.spec
    assert again.table == ((0,), (1,), (0, 1)) and isinstance(again.local_parts, tuple)
    assert again.spec.remote_timeout == 30.0 and isinstance(again.spec.remote_timeout, float)


def test_the_json_keys_are_exactly_the_fields():
    raw = _raw(_share())
    assert list(raw) == [f.name for f in dataclasses.fields(NodeShare)]
    assert list(raw["spec"]) == [f.name for f in dataclasses.fields(MountSpec)]


def test_lists_and_whole_numbers_are_taken_in_python_too():
    share = _share(local_parts=[0, 2], table=[[0], [1], [0, 1]])
    assert share.local_parts == (0, 2) and share.table == ((0,), (1,), (0, 1))
    assert hash(share) == hash(_share())
    assert MountSpec("/s", "/m", remote_timeout=5).remote_timeout == 5.0


def test_a_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MountSpec("/s", "/m").cache_mb = 1


# --------------------------------------------------------------------------- strict JSON

@pytest.mark.parametrize("data", [b"[1, 2]", b"{not json", b"\xff", b"", b"null", b'"x"'])
def test_not_a_json_object(data):
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(MountSpec, data)
    _one_line(exc, "MountSpec", "not a JSON object")


def test_an_unknown_key_is_named():
    raw = _raw(MountSpec("/s", "/m"))
    raw["surprise"] = 1
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(MountSpec, json.dumps(raw))
    _one_line(exc, "MountSpec", "unknown key 'surprise'")


@pytest.mark.parametrize("key", ["store", "cache_mb", "fuse_flags", "mpi_piece"])
def test_a_missing_key_is_named_even_with_a_default(key):
    raw = _raw(MountSpec("/s", "/m"))
    del raw[key]
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(MountSpec, json.dumps(raw))
    _one_line(exc, "MountSpec", f"missing key {key!r}")


def test_a_bad_nested_object_is_named():
    raw = _raw(_share())
    del raw["spec"]["mode"]
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(NodeShare, json.dumps(raw))
    _one_line(exc, "MountSpec", "missing key 'mode'")
    raw = _raw(_share())
    raw["spec"] = [1]
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(NodeShare, json.dumps(raw))
    _one_line(exc, "NodeShare", "'spec' must be an object (MountSpec)")


@pytest.mark.parametrize("key, value, words", [
    ("cache_mb", "256", ["'cache_mb'", "a whole number", "'256'"]),
    ("cache_mb", True, ["'cache_mb'", "a whole number"]),
    ("cache_mb", 2.5, ["'cache_mb'", "a whole number"]),
    ("allow_other", "yes", ["'allow_other'", "true or false"]),
    ("allow_other", 1, ["'allow_other'", "true or false"]),
    ("remote_timeout", "30", ["'remote_timeout'", "a number"]),
    ("store", 7, ["'store'", "a string"]),
    ("local_dir", 0, ["'local_dir'", "a string or null"]),
    ("replicas", None, ["'replicas'", "a whole number or a string"]),
    ("local_capacity", "1G", ["'local_capacity'", "a whole number or null"]),
])
def test_a_wrong_type_is_one_error_naming_the_key(key, value, words):
    raw = _raw(MountSpec("/s", "/m"))
    raw[key] = value
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(MountSpec, json.dumps(raw))
    _one_line(exc, "MountSpec", *words)


@pytest.mark.parametrize("key, value", [
    ("local_parts", ["a"]), ("local_parts", 3), ("table", [[0], "x"]), ("fuse_workers", "3"),
])
def test_a_wrong_type_in_a_share_is_one_error_naming_the_key(key, value):
    raw = _raw(_share())
    raw[key] = value
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(NodeShare, json.dumps(raw))
    _one_line(exc, "NodeShare", repr(key))


def test_the_same_check_holds_in_python():
    with pytest.raises(SpecError) as exc:
        MountSpec("/s", "/m", cache_mb="256")
    _one_line(exc, "MountSpec", "'cache_mb' must be a whole number, not '256'")


def test_to_json_takes_an_instance_only():
    with pytest.raises(TypeError):
        strictjson.to_json({"store": "/s"})
    with pytest.raises(TypeError):
        strictjson.to_json(MountSpec)


# --------------------------------------------------------------------------- validation

def test_a_spec_is_normalised_once():
    spec = MountSpec("rel/store", "/m")
    assert spec.frontend == "kernel" and spec.store == os.path.abspath("rel/store")
    assert MountSpec("s3://bucket/x", "/m", local_dir="/l").store == "s3://bucket/x"
    assert strictjson.from_json(MountSpec, strictjson.to_json(spec)) == spec


@pytest.mark.parametrize("over, words", [
    (dict(frontend="fusepy"), ["frontend (--frontend)", "kernel or pyfuse3", "'fusepy'"]),
    (dict(mode="sometimes"), ["mode (--mode)", "sync or prefetch"]),
    (dict(cache_mb=-1), ["cache_mb (--cache-mb)", ">= 0"]),
    (dict(prefetch_mb=0), ["prefetch_mb (--prefetch-mb)", ">= 1"]),
    (dict(replicas=0), ["replicas (--replicas)", "'auto'"]),
    (dict(replicas="many"), ["replicas (--replicas)", "'many'"]),
    (dict(ranks_per_node=0), ["ranks_per_node (--ranks-per-node)"]),
    (dict(remote_timeout=0), ["remote_timeout (--remote-timeout)", "> 0"]),
    (dict(start_timeout=float("inf")), ["start_timeout (--start-timeout)"]),
    (dict(mpi_piece=12), ["mpi_piece ($FANSTORE_MPI_PIECE)", ">= 64"]),
    (dict(mountpoint=""), ["mountpoint", "a path"]),
    (dict(fuse_flags="-NO_SUCH_FLAG"),
     ["fuse_flags (--fuse-flags)", "bad flag edit '-NO_SUCH_FLAG'", "NO_SUCH_FLAG"]),
    (dict(fuse_flags="DO_READDIRPLUS"), ["fuse_flags", "is not +NAME or -NAME"]),
    (dict(store="s3://b/x"), ["in object storage: mounting it needs --local-dir"]),
    (dict(local_capacity=1, local_dir="/l"), ["--local-capacity sizes --replicas auto"]),
    (dict(local_capacity=1, replicas="auto"), ["it needs --local-dir"]),
    (dict(frontend="pyfuse3", mode="prefetch"),
     ["--mode prefetch is served by the kernel frontend"]),
])
def test_a_bad_value_is_one_usage_error(over, words):
    with pytest.raises(SpecError) as exc:
        MountSpec(**{"store": "/s", "mountpoint": "/m", **over})
    assert isinstance(exc.value, UsageError) and exc.value.exit_code == 2
    _one_line(exc, *words)


def test_a_share_checks_its_values():
    with pytest.raises(SpecError) as exc:
        _share(fuse_workers=0)
    _one_line(exc, "NodeShare", "fuse_workers")
    with pytest.raises(SpecError) as exc:
        _share(local_parts=(-1,))
    _one_line(exc, "NodeShare", ">= 0")
    with pytest.raises(SpecError) as exc:
        _share(index_copy="")
    _one_line(exc, "NodeShare", "index_copy")


def test_what_the_spec_derives():
    share = _share()
    assert share.cache_bytes == (256 << 20) // 3
    spec = MountSpec("/s", "/m", workers=5, threads=7)
    assert spec.worker_count() == 5 and spec.decode_threads() == 7 and not spec.prefetch
    assert 1 <= MountSpec("/s", "/m").worker_count() <= 16


def test_a_worker_rank_gets_a_share_or_an_error():
    from fanstore.daemon.nodegroup import RankStart

    start = RankStart(share=_share(), error="")
    assert strictjson.from_json(RankStart, strictjson.to_json(start)) == start
    failed = RankStart(share=None, error="node 1: no space")
    assert strictjson.from_json(RankStart, strictjson.to_json(failed)) == failed
    for share, error in ((None, ""), (_share(), "both")):
        with pytest.raises(SpecError) as exc:
            RankStart(share=share, error=error)
        _one_line(exc, "RankStart")
    raw = _raw(start)
    raw["share"]["spec"]["surprise"] = 1
    with pytest.raises(SpecError) as exc:
        strictjson.from_json(RankStart, json.dumps(raw))
    _one_line(exc, "MountSpec", "unknown key 'surprise'")


# --------------------------------------------------------------------------- INIT flags

def test_flag_edits_have_one_parser():
    from fanstore.fuse.engine import DEFAULT_INIT_FLAGS, proto

    for name, bit in fuseflags.BITS.items():
        assert getattr(proto, name) == bit and proto.INIT_FLAG_NAMES[bit] == name
    assert fuseflags.apply("-do_readdirplus, +ASYNC_DIO", DEFAULT_INIT_FLAGS) == \
        (DEFAULT_INIT_FLAGS & ~proto.DO_READDIRPLUS) | proto.ASYNC_DIO
    assert fuseflags.apply("", 5) == 5 and fuseflags.check("") == ""
    for bad in ("DO_READDIRPLUS", "+", "-NOPE", "+DO_READDIRPLUS,x"):
        with pytest.raises(ValueError, match="bad flag edit"):
            fuseflags.check(bad)
