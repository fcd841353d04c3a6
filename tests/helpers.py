"""Shared test helpers: run the real CLI, build the special source tree, compare trees, mount.

Everything here is plain functions (no pytest fixtures; those live in ``conftest.py``), so any
test file, including the MPI and Slurm ones, can import it::

    from helpers import FANSTORE, run_cli, assert_no_traceback, make_special_tree

The mount helpers (:func:`mount_store`, :func:`cleanup_mount`) start a background daemon with
``fanstore mount`` and tear it down however the test ended; every daemon pid they see is kept
in :data:`DAEMON_PIDS` for the session-end safety net in ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

# --------------------------------------------------------------------------- the CLI


def _find_fanstore() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "fanstore")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("fanstore")
    if found:
        return found
    raise RuntimeError("cannot find the fanstore command (install the package in the venv)")


#: Absolute path of the ``fanstore`` command of the interpreter running the tests.
FANSTORE: str = _find_fanstore()

MiB = 1 << 20


def run_cli(*args, check: bool = False, timeout: float = 120, text: bool = True,
            input=None, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run ``fanstore *args`` and return the completed process (stdout/stderr captured).

    ``args`` may be str, bytes or path-like. In text mode (the default) output is decoded
    as UTF-8 with ``surrogateescape`` so odd file names never break the decoding; pass
    ``text=False`` for byte-exact stdout (``fanstore cat``). ``check=True`` raises
    ``AssertionError`` with both streams if the exit status is not 0. Extra keyword
    arguments go to :func:`subprocess.run`.
    """
    cmd = [FANSTORE] + [a if isinstance(a, bytes) else os.fspath(a) for a in args]
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if text:
        kwargs.update(encoding="utf-8", errors="surrogateescape")
    proc = subprocess.run(cmd, capture_output=True, timeout=timeout, input=input,
                          env=full_env, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
            f"--- stdout\n{_show(proc.stdout)}\n--- stderr\n{_show(proc.stderr)}"
        )
    return proc


@contextlib.contextmanager
def environment(env: dict | None):
    """This process's environment with ``env`` added (FanStore's settings read afresh),
    as it was afterwards."""
    from fanstore import settings

    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    settings.reset()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        settings.reset()


def run_main(*args, check: bool = False, timeout: float | None = None, text: bool = True,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`run_cli` through the command's ``main`` in this process: the same parsing,
    code, messages (a log record goes to stderr as the command formats it) and exit status,
    without an interpreter's start (0.1-0.35 s of CPU a call, most of a small pack's). For
    tests whose point is not the process: its signals, exit, memory or children. ``env``
    is added to this process's environment for the call. ``timeout`` is not enforced here
    (pytest-timeout is)."""
    import io
    import logging

    from fanstore.cli import main

    argv = [a if isinstance(a, bytes) else os.fspath(a) for a in args]
    argv = [os.fsdecode(a) for a in argv]
    assert argv[:1] != ["mount"], "mount forks a daemon, which must not come from pytest: run_cli"
    raw = {"stdout": io.BytesIO(), "stderr": io.BytesIO()}
    streams = {k: io.TextIOWrapper(b, encoding="utf-8", errors="surrogateescape",
                                   write_through=True) for k, b in raw.items()}
    handler = logging.StreamHandler(streams["stderr"])
    handler.setFormatter(logging.Formatter("fanstore: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if "--debug" in argv else logging.WARNING)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with environment(env), contextlib.redirect_stdout(streams["stdout"]), \
                contextlib.redirect_stderr(streams["stderr"]):
            try:
                code = main(argv)
            except SystemExit as exc:  # --help, --version
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for sig, h in handlers.items():  # select unwinds on SIGTERM: not pytest's business
            signal.signal(sig, h)
    out = {k: b.getvalue() for k, b in raw.items()}
    if text:
        out = {k: v.decode("utf-8", "surrogateescape") for k, v in out.items()}
    proc = subprocess.CompletedProcess(["fanstore", *argv], code, out["stdout"], out["stderr"])
    if check and code != 0:
        raise AssertionError(f"fanstore {' '.join(argv)} exited {code} (in this process)\n"
                             f"--- stdout\n{_show(proc.stdout)}\n--- stderr\n{_show(proc.stderr)}")
    return proc


def _show(out) -> str:
    if isinstance(out, bytes):
        return out[:4000].decode(errors="replace")
    return (out or "")[:4000]


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    """Fail if the process printed a Python traceback or an internal-error line."""
    for name in ("stdout", "stderr"):
        out = getattr(proc, name) or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        assert "Traceback (most recent call last)" not in out, f"traceback on {name}:\n{out}"
        assert "internal error" not in out, f"internal error on {name}:\n{out}"


def assert_cli_error(proc: subprocess.CompletedProcess, code: int | None = None,
                     contains: str | None = None) -> str:
    """Check a failed command: non-zero (or exactly ``code``) status, no traceback, and one
    ``fanstore: error: ...`` line on stderr that contains ``contains``. Returns that line."""
    assert proc.returncode != 0, f"expected a failure, got 0; stdout: {_show(proc.stdout)}"
    if code is not None:
        assert proc.returncode == code, (
            f"exit {proc.returncode}, expected {code}; stderr: {_show(proc.stderr)}")
    assert_no_traceback(proc)
    lines = [ln for ln in (proc.stderr or "").splitlines() if ln.startswith("fanstore: error:")]
    assert len(lines) == 1, f"expected one error line on stderr, got:\n{_show(proc.stderr)}"
    if contains is not None:
        assert contains in lines[0], f"{contains!r} not in {lines[0]!r}"
    return lines[0]


# --------------------------------------------------------------------------- the special tree

#: Options the session's ``special_store`` fixture is packed with (tests that re-pack the
#: special tree, e.g. for determinism, use the same ones).
SPECIAL_PACK_ARGS = ("--partitions", "4", "--jobs", "2", "--codec", "zstd:3", "--no-progress")

#: Size of the big file: above 40 MB and not a multiple of the default 1 MiB chunk.
BIG_SIZE = 41 * MiB + 12345
#: Entries of the big directory.
BIG_DIR_ENTRIES = 3000
#: Levels below ``deep/``.
DEEP_LEVELS = 40
#: Base of the deterministic modification times given to every entry (ns precision).
MTIME_BASE_NS = 1_600_000_000_123_456_789


def _big_bytes(size: int, seed: int = 40) -> bytes:
    """Half compressible text, half random, in 256 KiB stripes (so both stored-raw and
    compressed chunks occur, and chunk boundaries fall inside stripes)."""
    rng = random.Random(seed)
    stripe = 256 << 10
    text = b"".join(b"line %08d of a very compressible stripe\n" % i for i in range(8000))
    out = bytearray()
    n = 0
    while len(out) < size:
        if n % 2:
            out += rng.randbytes(stripe)
        else:
            out += text[(n * 977) % 1000 :][:stripe]
        n += 1
    return bytes(out[:size])


def make_special_tree(root) -> dict:
    """Create the hard-case source tree under ``root`` (which must not exist or be empty).

    Contents: empty files and directories, unicode names and 255-byte names (ASCII and
    multi-byte UTF-8), a non-UTF-8 name, a name with spaces, a directory of exactly
    ``BIG_DIR_ENTRIES`` files, a path ``DEEP_LEVELS`` directories deep, relative symlinks
    (to a file, to a directory, up a level, to a symlink, and one dangling inside the tree),
    executable / read-only / private / sticky modes, files around the 1 MiB chunk size, and
    a ``BIG_SIZE`` (> 40 MB) file. Every entry gets a distinct nanosecond mtime. The content
    is deterministic (fixed seeds).

    Returns a dict of notable paths (``str``, absolute) and counts: ``root``, ``big``,
    ``big_dir``, ``deep_file``, ``empty_file``, ``empty_dir``, ``exec``, ``readonly``,
    ``long_ascii``, ``long_utf8``, ``unicode``, ``non_utf8`` (bytes path), ``symlinks``
    (list), ``dangling``, ``chunk_files`` (list), ``small_files`` (list of a few regular
    files), ``files``, ``dirs`` (not counting the root), ``symlinks_count``, ``raw_bytes``.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    info: dict = {"root": str(root)}

    def write(rel: str, data: bytes, mode: int = 0o644) -> str:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)
        return str(p)

    _special_text_modes_empty(root, write, rng, info)
    _special_names(root, write, info)
    _special_big_dir_deep_chunks(root, write, rng, info)
    _special_links(root, info)
    info["big"] = write("large/big.bin", _big_bytes(BIG_SIZE))
    info.update(_stamp_mtimes(root))
    return info


def _special_text_modes_empty(root: Path, write, rng: random.Random, info: dict) -> None:
    """Plain text files and modes; empty files and directories."""
    info["small_files"] = [
        write("text/hello.txt", b"hello, world\n"),
        write("text/lorem.txt", b"lorem ipsum dolor sit amet\n" * 500),
        write("text/random.bin", rng.randbytes(70_000)),
    ]
    info["exec"] = write("modes/run.sh", b"#!/bin/sh\necho hi\n", 0o755)
    info["readonly"] = write("modes/readonly.txt", b"do not touch\n", 0o444)
    write("modes/private.txt", b"secret\n", 0o600)
    write("modes/group.txt", b"group\n", 0o640)
    write("modes/ro_dir/inside.txt", b"inside a read-only directory\n")
    os.chmod(root / "modes/ro_dir", 0o555)
    (root / "modes/sticky").mkdir()
    os.chmod(root / "modes/sticky", 0o1777)
    info["empty_file"] = write("empty/empty.txt", b"")
    write("empty/also-empty", b"")
    (root / "empty/empty_dir").mkdir()
    info["empty_dir"] = str(root / "empty/empty_dir")
    (root / "empty/nested/a/b/c").mkdir(parents=True)


def _special_names(root: Path, write, info: dict) -> None:
    """Unicode, 255-byte (ASCII and UTF-8), spaced and non-UTF-8 names."""
    info["unicode"] = write("names/ünïcødé-文件.txt", "unicode content ✓\n".encode())
    write("names/emoji-😀/данные.txt", b"cyrillic\n")
    write("names/name with spaces.txt", b"spaces\n")
    long_ascii = "L" * 251 + ".txt"
    long_utf8 = "é" * 127 + "x"  # 254 + 1 = 255 bytes
    assert len(long_ascii.encode()) == 255 and len(long_utf8.encode()) == 255
    info["long_ascii"] = write("names/" + long_ascii, b"long ascii name\n")
    info["long_utf8"] = write("names/" + long_utf8, b"long utf-8 name\n")
    odd = os.fsencode(root / "names") + b"/latin1-\xe9.txt"
    with open(odd, "wb") as f:
        f.write(b"latin-1 name\n")
    info["non_utf8"] = odd


def _special_big_dir_deep_chunks(root: Path, write, rng: random.Random, info: dict) -> None:
    """A directory of BIG_DIR_ENTRIES files, a DEEP_LEVELS-deep path, files around the
    default chunk size (1 MiB)."""
    big_dir = root / "big_dir"
    big_dir.mkdir()
    for i in range(BIG_DIR_ENTRIES):
        (big_dir / f"f{i:05d}.dat").write_bytes(b"%d\n" % i * (i % 7))
    info["big_dir"] = str(big_dir)
    deep = root / "deep"
    for level in range(1, DEEP_LEVELS + 1):
        deep = deep / f"l{level:02d}"
    deep.mkdir(parents=True)
    info["deep_file"] = write(str((deep / "bottom.txt").relative_to(root)), b"the bottom\n")
    info["chunk_files"] = [
        write("chunks/one_less.bin", rng.randbytes(MiB - 1)),
        write("chunks/exact.bin", bytes(MiB)),
        write("chunks/one_more.bin", rng.randbytes(MiB + 1)),
        write("chunks/two_exact.bin", rng.randbytes(2 * MiB)),
    ]


def _special_links(root: Path, info: dict) -> None:
    """Symlinks, all relative and inside the tree (absolute ones are rewritten by pack)."""
    links = {
        "links/to_file": "../text/hello.txt",
        "links/to_dir": "../text",
        "links/to_link": "to_file",
        "links/to_deep": "../deep/l01/l02",
        "links/dangling": "no-such-file",
        "top_link": "text/lorem.txt",
    }
    (root / "links").mkdir()
    for rel, target in links.items():
        os.symlink(target, root / rel)
    info["symlinks"] = [str(root / rel) for rel in links]
    info["dangling"] = str(root / "links/dangling")


def _stamp_mtimes(root: Path) -> dict:
    """Deterministic, distinct nanosecond mtimes, children before parents; the counts."""
    all_paths = [os.fsencode(root)]
    for dirpath, dirnames, filenames in os.walk(os.fsencode(root)):
        for name in filenames + dirnames:
            all_paths.append(os.path.join(dirpath, name))
    files = dirs = links_n = raw = 0
    for k, p in enumerate(sorted(all_paths, key=lambda x: (-x.count(b"/"), x))):
        t = MTIME_BASE_NS + k * 1_000_000_007
        os.utime(p, ns=(t, t), follow_symlinks=False)
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            links_n += 1
        elif stat.S_ISDIR(st.st_mode):
            dirs += 1
        else:
            files += 1
            raw += st.st_size
    return dict(files=files, dirs=dirs - 1, symlinks_count=links_n, raw_bytes=raw)


def make_small_tree(root) -> dict[str, bytes]:
    """A handful of small files under ``root``: nested, empty, multi-chunk with
    ``--chunk-kb 4``, compressible and not, plus ``emptydir/`` and ``link -> sub/c.txt``.
    Deterministic. Returns {relative path: content} of the regular files."""
    files = {
        "a.txt": b"alpha\n" * 100,
        "b.bin": bytes(range(256)) * 40,  # 10 KiB: three 4 KiB chunks
        "empty": b"",
        "sub/c.txt": b"gamma\n",
        "sub/deeper/d.txt": b"delta " * 2000,
        "sub/deeper/e.bin": random.Random(5).randbytes(9000),
    }
    root = Path(root)
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "emptydir").mkdir()
    os.symlink("sub/c.txt", root / "link")
    return files


#: The content of ``outside.txt`` next to the tree of :func:`make_outside_links_tree`.
OUTSIDE_BYTES = b"outside the source\n"


def make_outside_links_tree(top) -> dict:
    """Issue 35's tree: ``TOP/src`` with symlinks that lead outside it, next to
    ``TOP/outside.txt`` and two symlinks looping into each other (``TOP/loop_a``,
    ``loop_b``). Returns {"root": TOP/src, "files": {rel: bytes}, "links": {rel: target},
    "leaving": the links that lead outside, "dangling_out", "looping_out"}.

    ``sub/rel`` climbs out by ``../..``: on a mount at ``TOP/mnt...`` it names
    ``TOP/outside.txt`` too, the kernel resolving it on the host."""
    top = Path(top)
    root = top / "src"
    (root / "sub").mkdir(parents=True)
    (top / "outside.txt").write_bytes(OUTSIDE_BYTES)
    os.chmod(top / "outside.txt", 0o640)
    os.symlink("loop_b", top / "loop_a")
    os.symlink("loop_a", top / "loop_b")
    files = {"f": b"the f\n", "sub/g": b"the g\n"}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    links = {
        "abs": str(top / "outside.txt"),  # absolute, outside
        "sub/rel": "../../outside.txt",  # relative, climbs above the root
        "dangling": "../no-such-file",  # leads out, to nothing
        "outloop": "../loop_a",  # leads out, into a loop
        "inside": "sub/g",
        "sub/up": "../f",
        "inside_dangling": "no-such-file",  # to nothing, inside: kept in every mode
    }
    for rel, target in links.items():
        os.symlink(target, root / rel)
    return {"root": root, "files": files, "links": links,
            "leaving": ["abs", "sub/rel", "dangling", "outloop"],
            "dangling_out": "dangling", "looping_out": "outloop"}


# --------------------------------------------------------------------------- comparisons


def _same_bytes(a: bytes, b: bytes, block: int = MiB) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x = fa.read(block)
            y = fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def assert_same_tree(src, mnt, check_mtime: bool = True) -> int:
    """Assert that ``mnt`` shows exactly the tree at ``src``; return the entries compared.

    Walks both without following symlinks (``lstat``/``scandir`` on bytes paths, so any
    name works) and compares, entry by entry: the set of names in each directory (nothing
    missing, nothing extra), the file type, the permission bits (07777), for regular files
    the size and every byte, for symlinks the target, and (``check_mtime``) ``st_mtime_ns``
    of files and symlinks.
    """
    src_b, mnt_b = os.fsencode(src), os.fsencode(mnt)
    todo = [b""]
    compared = 0
    while todo:
        rel = todo.pop()
        a_dir = os.path.join(src_b, rel) if rel else src_b
        b_dir = os.path.join(mnt_b, rel) if rel else mnt_b
        a_names = sorted(os.listdir(a_dir))
        b_names = sorted(os.listdir(b_dir))
        missing = set(a_names) - set(b_names)
        extra = set(b_names) - set(a_names)
        assert not missing and not extra, (
            f"{rel!r}: missing {sorted(missing)[:10]} extra {sorted(extra)[:10]}")
        assert len(b_names) == len(set(b_names)), f"{rel!r}: duplicate names in the mount"
        for name in a_names:
            r = os.path.join(rel, name) if rel else name
            a, b = os.path.join(src_b, r), os.path.join(mnt_b, r)
            sa, sb = os.lstat(a), os.lstat(b)
            assert stat.S_IFMT(sa.st_mode) == stat.S_IFMT(sb.st_mode), f"{r!r}: type differs"
            assert stat.S_IMODE(sa.st_mode) == stat.S_IMODE(sb.st_mode), (
                f"{r!r}: mode {oct(sa.st_mode)} != {oct(sb.st_mode)}")
            if stat.S_ISDIR(sa.st_mode):
                todo.append(r)
            elif stat.S_ISLNK(sa.st_mode):
                assert os.readlink(a) == os.readlink(b), f"{r!r}: symlink target differs"
            else:
                assert sa.st_size == sb.st_size, f"{r!r}: size {sa.st_size} != {sb.st_size}"
                assert _same_bytes(a, b), f"{r!r}: content differs"
            if check_mtime and not stat.S_ISDIR(sa.st_mode):
                assert sa.st_mtime_ns == sb.st_mtime_ns, f"{r!r}: mtime differs"
            compared += 1
    return compared


def flip_bytes(path, offset: int, n: int = 8) -> bytes:
    """XOR ``n`` bytes of ``path`` at ``offset`` with 0xFF in place; return the old bytes."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        assert len(old) == n, f"{path}: cannot flip {n} bytes at {offset}"
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))
    return old


def stored_extent(store, rel, chunk: int = 0) -> tuple[str, int, int]:
    """(partition file, offset, stored length) of chunk ``chunk`` of file ``rel`` of a store."""
    from fanstore.errors import FanStoreError
    from fanstore.format.index import read_index
    from fanstore.namespace import Namespace

    index = read_index(os.fspath(store))
    try:
        entry = Namespace(index).resolve(rel)
    except FanStoreError:
        entry = None
    assert entry is not None, f"{rel} is not in {store}"
    first, count = index.chunk_run(entry)
    assert 0 <= chunk < count, f"{rel} has {count} chunks"
    k = first + chunk
    part = index.partitions[int(index.chunks["part"][k])].name
    return (os.path.join(os.fspath(store), part), int(index.chunks["offset"][k]),
            int(index.chunks["stored"][k]))


def damage_file(store, rel, chunk: int = 0) -> None:
    """Flip up to 8 bytes in the middle of the stored bytes of one chunk of ``rel``."""
    part, offset, length = stored_extent(store, rel, chunk)
    n = min(8, length)
    flip_bytes(part, offset + (length - n) // 2, n)


def copy_store(store, dest) -> Path:
    """A private copy of a store (to damage or patch); returns ``dest``."""
    shutil.copytree(store, dest)
    return Path(dest)


def set_index_version(store, version: int) -> None:
    """Patch the format version field of ``STORE/fanstore.idx`` (bytes 8-9, outside the
    checksummed body, so only the version check can refuse it)."""
    path = os.path.join(os.fspath(store), "fanstore.idx")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(version.to_bytes(2, "little"))


def damage_directory(store, rel: str, how: str) -> None:
    """Rewrite ``STORE/fanstore.idx`` (a valid checksum: only the structure is wrong) with
    directory ``rel`` damaged: ``"swap"`` its first two names, ``"repeat"`` its first name
    as its second (both load: a lookup in it fails), or ``"span"`` its child run moved one
    entry on (refused when the index is loaded)."""
    import numpy as np

    from fanstore.format.index import INDEX_NAME, encode_index, read_index

    index = read_index(os.fspath(store))
    e = {k: np.array(v) for k, v in index.entries.items()}
    d = [i for i in range(index.n_entries) if index.path(i) == os.fsencode(rel)][0]
    a = int(e["first"][d])
    assert int(e["count"][d]) >= 2, f"{rel} has fewer than two entries"
    if how == "swap":
        for col in ("name_off", "name_len"):
            e[col][a], e[col][a + 1] = e[col][a + 1], e[col][a]
    elif how == "repeat":
        for col in ("name_off", "name_len"):
            e[col][a + 1] = e[col][a]
    elif how == "span":
        e["first"][d] += 1
    else:
        raise ValueError(how)
    meta = {k: v for k, v in index.meta.items()
            if k not in ("columns", "n_entries", "n_chunks", "format_version")}
    (Path(store) / INDEX_NAME).write_bytes(encode_index(
        meta, e, {k: np.array(v) for k, v in index.chunks.items()}, None,
        bytes(index.names), bytes(index.targets), compact=index.version >= 5))


# --------------------------------------------------------------------------- mounts

#: Every daemon pid seen by :func:`mount_store`; the session safety net kills leftovers.
DAEMON_PIDS: set[int] = set()


def fuse_available() -> tuple[bool, str]:
    """(usable, reason): /dev/fuse, fusermount3 and pyfuse3 are all present."""
    if not os.path.exists("/dev/fuse"):
        return False, "/dev/fuse is missing"
    if not shutil.which("fusermount3"):
        return False, "fusermount3 is not installed"
    try:
        import pyfuse3  # noqa: F401
        import trio  # noqa: F401
    except ImportError as exc:
        return False, f"pyfuse3/trio missing ({exc.name})"
    return True, ""


def is_mounted(mnt) -> bool:
    """True if ``mnt`` is listed as a FUSE mount (live or stale)."""
    from fanstore import mounttable, runtime

    key = runtime.mount_key(os.fspath(mnt))
    mounts = mounttable.fuse_mounts()
    return key in mounts or os.path.abspath(mnt) in mounts


def daemon_pid(mnt) -> int | None:
    """The pid the daemon serving ``mnt`` wrote into its runtime state, if any."""
    from fanstore import runtime

    state = runtime.read_state(os.fspath(mnt)) or {}
    return state.get("pid")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a daemon and its kernel-frontend processes)."""
    from fanstore.process import descendants

    return descendants(pid)


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process below it at once (what the OOM killer or a job's
    cgroup does to a whole mount): each is stopped first, so that none acts on another's
    death (a kernel frontend cleans up after a daemon that dies alone). Returns the pids."""
    pids = process_tree(pid)
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    for p in pids:
        os.kill(p, signal.SIGKILL)
    return pids


def pid_alive(pid: int | None) -> bool:
    from fanstore import process

    return process.pid_alive(pid)


# --------------------------------------------------------------------------- processes


class Proc:
    """One process of ``/proc``, read lazily (a predicate of :func:`find_processes` reads
    only what it asks for): ``cmdline`` (NUL-separated), ``argv``, ``environ`` (bytes),
    ``ppid`` and ``state`` (from ``stat``). A file that cannot be read raises OSError: the
    process is gone, or not ours to read."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._files: dict[str, bytes] = {}

    def _read(self, name: str) -> bytes:
        if name not in self._files:
            with open(f"/proc/{self.pid}/{name}", "rb") as f:
                self._files[name] = f.read()
        return self._files[name]

    @property
    def cmdline(self) -> bytes:
        return self._read("cmdline")

    @property
    def argv(self) -> list[bytes]:
        return self.cmdline.split(b"\0")[:-1]

    @property
    def environ(self) -> bytes:
        return self._read("environ")

    @property
    def state(self) -> bytes:
        return self._read("stat").rpartition(b")")[2].split()[0]

    @property
    def ppid(self) -> int:
        return int(self._read("stat").rpartition(b")")[2].split()[1])


def find_processes(match) -> list[int]:
    """The live processes (zombies left out) for which ``match(Proc)`` is true, sorted;
    this process and its parent (pytest's) are never among them. The suite's one scan of
    /proc: every check for a test's daemons, workers, ranks and launchers is a predicate
    here."""
    me = {os.getpid(), os.getppid()}
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in me:
            continue
        proc = Proc(int(name))
        try:
            if match(proc) and proc.state != b"Z":
                found.append(proc.pid)
        except OSError:  # gone while we looked, or not readable: not one of ours
            continue
    return sorted(found)


@contextlib.contextmanager
def started(cmd, env: dict | None = None, **kwargs):
    """``subprocess.Popen(cmd)`` with text pipes for stdout and stderr, killed and reaped
    on the way out however the test ends (a command that is still running then is what
    the test did not wait for)."""
    proc = subprocess.Popen([os.fspath(a) for a in cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def poll_while_running(proc, step, timeout: float = 600, interval: float = 0.02
                       ) -> tuple[str, str]:
    """Call ``step()`` every ``interval`` s while ``proc`` runs (at most ``timeout`` s),
    then wait for it; its (stdout, stderr)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        step()
        time.sleep(interval)
    return proc.communicate(timeout=max(1.0, deadline - time.monotonic()))


def wait_until(pred, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``pred()`` until it is true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def mount_store(store, mnt, *extra, timeout: float = 60) -> int:
    """``fanstore mount STORE MNT *extra`` in background mode; return the daemon pid.

    Creates ``mnt`` if needed. Raises ``AssertionError`` (with the daemon log) if the mount
    fails. The caller must arrange :func:`cleanup_mount` (the ``mounted`` fixture does).
    """
    if not os.path.lexists(mnt):  # (a stale mount point exists but cannot be stat'ed)
        os.makedirs(mnt)
    proc = run_cli("mount", store, mnt, *extra, timeout=timeout)
    pid = daemon_pid(mnt)
    if pid:
        DAEMON_PIDS.add(pid)
    if proc.returncode != 0:
        raise AssertionError(f"fanstore mount {store} {mnt} failed ({proc.returncode}):\n"
                             f"{proc.stderr}\n--- daemon log\n{daemon_log(mnt)}")
    assert is_mounted(mnt), f"{mnt} is not mounted after fanstore mount returned 0"
    assert pid and pid_alive(pid), f"no live daemon pid in the runtime state of {mnt}"
    return pid


def daemon_log(mnt, limit: int = 4000) -> str:
    from fanstore import runtime

    try:
        with open(runtime.MountRuntime.find(os.fspath(mnt)).log_path, errors="replace") as f:
            return f.read()[-limit:]
    except (OSError, AttributeError):  # no runtime (None) or no log
        return "(no daemon log)"


#: set once per test session (conftest) and inherited by every process the tests start
SESSION_MARK = "FANSTORE_TEST_SESSION"


def pid_ours(pid: int | None) -> bool:
    """True if ``pid`` is a live process this test session started (its environment has
    this session's ``FANSTORE_TEST_SESSION``). A pid remembered from earlier may name
    another program by now: this machine's pid_max is 32768 and a suite starts tens of
    thousands of processes, so a killed daemon's pid comes back as anyone's (it once was a
    local slurmd's, which then vanished without a line in its log)."""
    mark = os.environ.get(SESSION_MARK)
    if not mark or not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{SESSION_MARK}={mark}\0".encode() in f.read()
    except OSError:
        return False


def kill_pid(pid: int | None, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` s, a process that is still alive and still
    one of this session's (:func:`pid_ours`)."""
    if not pid_ours(pid):
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if wait_until(lambda: not pid_alive(pid), wait):
            return


def signal_ours(pid: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it is still one of this session's processes."""
    if not pid_ours(pid):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def lazy_unmount(mnt) -> None:
    subprocess.run(["fusermount3", "-u", "-z", "--", os.fspath(mnt)], capture_output=True,
                   timeout=30)


def cleanup_mount(mnt, pid: int | None = None) -> list[str]:
    """Tear down whatever is left of a mount at ``mnt``; never raises.

    In order: ``fanstore umount``; if still mounted, ``fusermount3 -u -z``; then kill the
    daemon (``pid`` or the one in the runtime state) if it is still alive, and lazily
    unmount again if the kill left a stale mount. Each step runs even if an earlier one
    failed. Returns notes on what was needed beyond the first step (for debugging).
    """
    notes: list[str] = []

    def step(what: str, func, *args, **kwargs) -> None:
        try:
            func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - teardown must go on
            notes.append(f"{what} failed: {exc!r}")

    try:
        pid = pid or daemon_pid(mnt)
    except Exception:  # noqa: BLE001
        pid = None
    if is_mounted(mnt) or pid_alive(pid):
        step("fanstore umount", run_cli, "umount", mnt, "--timeout", "10", timeout=30)
    if is_mounted(mnt):
        notes.append("fusermount3 -u -z")
        step("fusermount3 -u -z", lazy_unmount, mnt)
    if pid_alive(pid):
        notes.append(f"kill {pid}")
        step("kill", kill_pid, pid)
    if is_mounted(mnt):  # the kill may have left a stale mount behind
        step("fusermount3 -u -z", lazy_unmount, mnt)
    return notes


def os_error(func, *args, **kwargs) -> int | None:
    """Call ``func``; return the errno of the OSError it raised, or None if it succeeded."""
    try:
        func(*args, **kwargs)
    except OSError as exc:
        return exc.errno
    return None


__all__ = [
    "BIG_DIR_ENTRIES",
    "BIG_SIZE",
    "DAEMON_PIDS",
    "SESSION_MARK",
    "DEEP_LEVELS",
    "FANSTORE",
    "MiB",
    "SPECIAL_PACK_ARGS",
    "assert_cli_error",
    "assert_no_traceback",
    "assert_same_tree",
    "cleanup_mount",
    "copy_store",
    "damage_directory",
    "damage_file",
    "daemon_log",
    "daemon_pid",
    "flip_bytes",
    "fuse_available",
    "is_mounted",
    "kill_pid",
    "lazy_unmount",
    "make_small_tree",
    "make_special_tree",
    "mount_store",
    "os_error",
    "pid_alive",
    "pid_ours",
    "run_cli",
    "set_index_version",
    "signal_ours",
    "stored_extent",
    "wait_until",
]


# --------------------------------------------------------------------------- faults and load
# (used by tests/test_faults.py and tests/test_load.py)

import errno as _errno  # noqa: E402
import json as _json  # noqa: E402
import threading  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tmpfs of ``size`` (``mount -o size=``, e.g. ``"1m"``) mounted at ``path`` (created)
    for the block; always unmounted afterwards. Skips the test when it cannot be mounted
    (not root, no mount permission). Mode 0755 (tmpfs's default is 1777, which staging
    refuses as a local directory: other users could write into it)."""
    import pytest

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                          str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", "--", str(path)], capture_output=True)


def vm_rss_kb(pid: int | None, field: str = "VmRSS") -> int | None:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of /proc/PID/status), None if gone;
    ``field="VmHWM"``: its peak so far."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, TypeError):
        return None
    return None


class RssSampler:
    """Samples the RSS of some pids every ``interval`` s in a thread; ``peak[pid]`` (KiB)."""

    def __init__(self, pids, interval: float = 0.05) -> None:
        self.pids = [p for p in pids if p]
        self.interval = interval
        self.peak: dict[int, int] = {p: 0 for p in self.pids}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.pids:
                kb = vm_rss_kb(p)
                if kb is not None:
                    self.peak[p] = max(self.peak[p], kb)
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def make_load_tree(root, n_files: int = 120, seed: int = 21, big: int = 6) -> dict[str, int]:
    """A deterministic tree for load and fault tests: ``n_files`` files in 6 directories,
    mostly small (0 B to 64 KiB), some medium (up to 900 KiB), ``big`` files of 1.5 to
    5 MiB; a third random bytes, a third text, a third half-and-half. Returns
    {relative path: size}."""
    rng = random.Random(seed)
    root = Path(root)
    sizes: dict[str, int] = {}
    text = b"".join(b"sample %06d label %d pixels %s\n" % (i, i % 10, b"x" * (i % 37))
                    for i in range(40_000))
    for i in range(n_files):
        rel = f"class{i % 6}/item{i:04d}.bin"
        if i < big:
            n = rng.randint(3 * MiB // 2, 5 * MiB)
        elif i % 5 == 0:
            n = rng.randint(100_000, 900_000)
        elif i % 17 == 0:
            n = rng.choice([0, 1, 4095, 4096, 4097])
        else:
            n = rng.randint(1, 64 << 10)
        kind = i % 3
        if kind == 0:
            data = rng.randbytes(n)
        elif kind == 1:
            start = rng.randrange(len(text) - n) if n < len(text) else 0
            data = (text[start:] * (n // len(text) + 2))[:n]
        else:
            data = (rng.randbytes(n // 2) + text * (n // len(text) + 1))[:n]
        assert len(data) == n
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        sizes[rel] = n
    return sizes


def files_by_partition(store) -> dict[int, list[str]]:
    """{partition number: [relative paths of the files stored there]} (empty files left
    out: they own no chunks and read on every node)."""
    from fanstore.format.index import read_index

    index = read_index(os.fspath(store))
    out: dict[int, list[str]] = {p.number: [] for p in index.partitions}
    for entry in index.file_entries().tolist():
        first, count = index.chunk_run(entry)
        if count:
            out[int(index.chunks["part"][first])].append(os.fsdecode(index.path(entry)))
    return out


# The random reader run by ``start_readers`` in its own process. It reads random files of
# a mount, whole or in random ranges (crossing chunks, at and past EOF, zero-length), most
# with O_DIRECT (each read reaches the daemon as asked) and the rest through the page cache
# (dropped again with POSIX_FADV_DONTNEED), and compares every byte with the source.


def reader_main(spec_json: str) -> None:
    spec = _json.loads(spec_json)
    rng = random.Random(spec["seed"])
    files = spec["files"]  # [[rel, size], ...]
    mounts = spec["mounts"]
    src = spec["src"]
    chunk = spec.get("chunk", MiB)
    may_fail = set(spec.get("may_fail", []))
    marker = spec.get("marker")
    direct_share = spec.get("direct", 0.8)
    deadline = time.monotonic() + spec["seconds"]
    stop_file = spec.get("stop_file")
    reading = spec.get("reading")
    out = {"reads": 0, "ops": 0, "bytes_checked": 0, "wrong": [], "errors": {},
           "error_samples": [], "expected_eio": 0, "eio_files": [], "zero_length": 0,
           "past_eof": 0, "max_latency": 0.0, "after_marker_ok": 0, "after_marker_ok_files": 0,
           "after_marker_errors": 0, "short_reads": 0, "short_samples": []}
    eio_files: set[str] = set()
    ok_after: set[str] = set()
    after = False
    while time.monotonic() < deadline:
        if stop_file and os.path.exists(stop_file):
            break
        if marker and not after and os.path.exists(marker):
            after = True
        rel, size = files[rng.randrange(len(files))]
        mnt = mounts[rng.randrange(len(mounts))]
        direct = rng.random() < direct_share
        whole = rng.random() < 0.25
        off = n = 0
        if not whole:
            off = rng.choice([0, rng.randrange(size + 1), max(0, size - 1), size,
                              size + rng.randrange(1, 3 * chunk),
                              max(0, (rng.randrange(size // chunk + 1)) * chunk - 1)])
            n = rng.choice([0, 1, 7, 4096, 65536, chunk - 1, chunk + 1, 3 * chunk + 5,
                            rng.randrange(1, 4 * chunk)])
        t0 = time.monotonic()
        got, off, n, got_error, partial = _reader_read(os.path.join(mnt, rel), rel, size, off,
                                                       n, direct, whole, out)
        out["max_latency"] = max(out["max_latency"], time.monotonic() - t0)
        out["ops"] += 1
        if got_error is not None:
            if partial:  # the bytes a short read gave before the error must still be right
                with open(os.path.join(src, rel), "rb") as f:
                    if os.pread(f.fileno(), len(partial), off) != partial:
                        out["wrong"].append([rel, off, len(partial), "short read"])
            name = _errno.errorcode.get(got_error.errno, str(got_error.errno))
            if got_error.errno == _errno.EIO and rel in may_fail:
                out["expected_eio"] += 1
                eio_files.add(rel)
            else:
                out["errors"][name] = out["errors"].get(name, 0) + 1
                if len(out["error_samples"]) < 5:
                    out["error_samples"].append(f"{rel}: {name}")
                if after:
                    out["after_marker_errors"] += 1
            if spec.get("stop_on_error") and not (got_error.errno == _errno.EIO
                                                  and rel in may_fail):
                break
            continue
        with open(os.path.join(src, rel), "rb") as f:
            want = os.pread(f.fileno(), n, off)
        out["reads"] += 1
        out["bytes_checked"] += len(want)
        if n == 0:
            out["zero_length"] += 1
        if off + n > size:
            out["past_eof"] += 1
        if got != want:
            if len(out["wrong"]) < 10:
                out["wrong"].append([rel, off, n, len(got), len(want)])
        elif reading:  # the first right read: say so (wait_reading)
            open(reading, "w").close()
            reading = None
        if got == want and after:
            out["after_marker_ok"] += 1
            ok_after.add(rel)
    out["eio_files"] = sorted(eio_files)
    out["after_marker_ok_files"] = len(ok_after)
    print(_json.dumps(out))


def _reader_read(path: str, rel: str, size: int, off: int, n: int, direct: bool,
                 whole: bool, out: dict):
    """One read of :func:`reader_main`: (bytes, offset, length, OSError or None, the bytes a
    short read returned before an error)."""
    got, got_error, partial = b"", None, b""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as exc:
        return got, off, n, exc, partial
    try:
        if whole:
            parts = []
            while True:
                block = os.read(fd, MiB)
                if not block:
                    break
                parts.append(block)
            got, off, n = b"".join(parts), 0, size + 1
        else:
            got = os.pread(fd, n, off)
            # A short read before EOF is legal (POSIX): when a daemon goes away in the
            # middle of a request the kernel returns what it had. Read on, as any careful
            # reader does: the next read reports the error.
            if 0 < len(got) < min(n, max(0, size - off)):
                out["short_reads"] += 1
                if len(out["short_samples"]) < 5:
                    out["short_samples"].append([rel, size, off, n, len(got), direct])
                partial = got
                while len(got) < min(n, max(0, size - off)):
                    more = os.pread(fd, n - len(got), off + len(got))
                    if not more:
                        break
                    got += more
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        got_error = exc
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return got, off, n, got_error, partial


def start_readers(n: int, mounts_for, src, sizes: dict[str, int], seconds: float,
                  seed: int = 0, **spec) -> list[subprocess.Popen]:
    """Start ``n`` reader processes (see ``reader_main``); reader ``i`` reads the mounts
    ``mounts_for(i)`` (a list). ``spec`` adds ``chunk``, ``may_fail`` (paths for which EIO
    is expected), ``marker`` (a path: reads after it exists are counted apart), ``direct``
    (share of O_DIRECT opens), ``stop_file``, ``stop_on_error``, ``reading`` (a directory:
    each reader makes a file in it after its first right read, for :func:`wait_reading`)."""
    files = sorted([rel, size] for rel, size in sizes.items())
    reading = spec.pop("reading", None)
    if reading is not None:
        os.makedirs(reading, exist_ok=True)
    procs = []
    for i in range(n):
        body = dict(spec, files=files, mounts=[os.fspath(m) for m in mounts_for(i)],
                    src=os.fspath(src), seconds=seconds, seed=seed * 1000 + i)
        if reading is not None:
            body["reading"] = os.path.join(os.fspath(reading), f"reader-{i}")
        body["may_fail"] = sorted(body.get("may_fail", []))
        if body.get("marker"):
            body["marker"] = os.fspath(body["marker"])
        if body.get("stop_file"):
            body["stop_file"] = os.fspath(body["stop_file"])
        code = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); "
                "from helpers import reader_main; reader_main(sys.argv[1])")
        procs.append(subprocess.Popen([sys.executable, "-c", code, _json.dumps(body)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        procs[-1].reading = body.get("reading")
    return procs


def shm_mapped(pid: int) -> set[str]:
    """The /dev/shm files process ``pid`` maps (empty if it is gone or not ours to read)."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(b"/dev/shm/"):
                    found.add(os.fsdecode(fields[5].strip()))
    except OSError:
        pass
    return found


def wait_reading(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """Wait until every reader (started with ``reading=``) has read right once: a fault
    injected after this lands mid-read whatever the machine's load (a reader's interpreter
    takes 0.1 s to start alone and seconds on a busy machine). AssertionError naming the
    readers that did not, or that exited first."""
    pending = lambda: [p for p in procs if not os.path.exists(p.reading)]  # noqa: E731
    wait_until(lambda: not pending() or any(p.poll() is not None for p in pending()),
               timeout)
    late = pending()
    assert not late, (f"{len(late)} of {len(procs)} readers made no right read within "
                      f"{timeout:g} s; exited: {[p.returncode for p in late]}")


def abort_fuse_connection(mnt) -> bool:
    """Abort the kernel FUSE connection of the mount at ``mnt`` (found in mountinfo, never
    by touching the mount point, which may hang): pending requests fail with ENOTCONN, so
    processes stuck on a wedged daemon wake up. Returns True if a connection was aborted."""
    target = os.path.abspath(os.fspath(mnt))
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[4] == target and " - fuse" in line:
                    minor = fields[2].split(":")[1]
                    with open(f"/sys/fs/fuse/connections/{minor}/abort", "w") as a:
                        a.write("1")
                    return True
    except OSError:
        pass
    return False


def collect_readers(procs: list[subprocess.Popen], timeout: float, mounts=()) -> list[dict]:
    """Wait for every reader (at most ``timeout`` s in all) and return their summaries.

    A reader still running then is reported as hung: it is killed, and if it does not die
    (a process waiting on a wedged FUSE daemon cannot), the FUSE connections of ``mounts``
    are aborted so that it does, and the test fails instead of hanging."""
    deadline = time.monotonic() + timeout
    results, problems = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                for m in mounts:
                    abort_fuse_connection(m)
                try:
                    p.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            problems.append(f"reader {p.pid} hung (killed after {timeout:g} s)")
            continue
        if p.returncode != 0:
            problems.append(f"reader {p.pid} exited {p.returncode}: {err[-2000:]}")
            continue
        results.append(_json.loads(out))
    assert not problems, "\n".join(problems)
    return results


def summarize_readers(results: list[dict]) -> dict:
    """Totals over reader summaries (errors merged by errno name)."""
    total = {"readers": len(results), "reads": 0, "ops": 0, "bytes_checked": 0, "wrong": [],
             "errors": {}, "expected_eio": 0, "eio_files": set(), "zero_length": 0,
             "past_eof": 0, "max_latency": 0.0, "after_marker_ok": 0,
             "after_marker_errors": 0, "error_samples": [], "short_reads": 0,
             "short_samples": []}
    for r in results:
        for key in ("reads", "ops", "bytes_checked", "expected_eio", "zero_length", "past_eof",
                    "after_marker_ok", "after_marker_errors", "short_reads"):
            total[key] += r[key]
        total["wrong"] += r["wrong"]
        total["error_samples"] += r["error_samples"]
        total["short_samples"] += r["short_samples"]
        total["eio_files"] |= set(r["eio_files"])
        total["max_latency"] = max(total["max_latency"], r["max_latency"])
        for name, k in r["errors"].items():
            total["errors"][name] = total["errors"].get(name, 0) + k
    return total


def stats_json(mnt) -> dict:
    """``fanstore stats MNT --json`` as a dict."""
    return _json.loads(run_cli("stats", mnt, "--json", check=True).stdout)


__all__ += [
    "RssSampler",
    "abort_fuse_connection",
    "TESTS_DIR",
    "collect_readers",
    "files_by_partition",
    "make_load_tree",
    "reader_main",
    "start_readers",
    "stats_json",
    "summarize_readers",
    "tmpfs",
    "vm_rss_kb",
]
