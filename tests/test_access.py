"""Data at rest keeps the source's access; staging, secrets and unmounting are safe from the
other users of a node (docs/reliability.md, "Multi-user nodes").

- Packing: a source with anything other users may not read gives a private store (0700,
  files 0600) and one line saying so; a public one follows the umask; ``--shared`` opts
  out; tar/zip members, the archive's own mode, S3 sources and MPI packs follow the same
  rule. A second user (``second_user.py``) tries to read a private store with the
  ``fanstore`` command and by opening its files.
- Staging (``mount --local-dir``): copies follow the store; nothing is written through a
  symlink; a local directory another user owns, can write to or can swap is refused with
  one line.
- Secrets: S3 credentials from the environment or a file work and never show up in any
  FanStore process's command line; credentials on the command line give a warning.
- Unmounting: a mount point whose name starts with ``-`` unmounts (``fusermount3 -u --``).

The attacks on a live mount (runtime directory, control socket, index copy) are in
``test_multiuser.py``.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from helpers import (
    assert_cli_error,
    assert_no_traceback,
    cleanup_mount,
    daemon_pid,
    is_mounted,
    process_tree,
    run_cli,
    run_main,
)
from second_user import reachable_for_others, shared_test_dir

ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parent.parent
SECRET = b"the secret of d/secret.txt\n" * 40
PUBLIC = b"public bytes\n" * 100
PACK = ("--codec", "zstd:3", "--no-progress", "--jobs", "1", "--partitions", "2")
PRIVATE_LINE = "is not readable by other users, so the store is private"

# Run as the other user with the system Python: open each path, print the errno (0: opened).
OPEN_EACH = r"""
import json, sys
out = {}
for p in sys.argv[1:]:
    try:
        open(p, "rb").close()
        out[p] = 0
    except OSError as exc:
        out[p] = exc.errno
print(json.dumps(out))
"""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _tree(root: Path, secret_mode: int = 0o600, dir_mode: int = 0o755) -> Path:
    (root / "d").mkdir(parents=True)
    (root / "d" / "secret.txt").write_bytes(SECRET)
    (root / "pub.txt").write_bytes(PUBLIC)
    os.chmod(root / "pub.txt", 0o644)
    os.chmod(root / "d" / "secret.txt", secret_mode)
    os.chmod(root / "d", dir_mode)
    os.chmod(root, 0o755)
    return root


def _modes(store: Path) -> tuple[int, set[int]]:
    """(mode of the store directory, the set of modes of the files in it)."""
    return (stat.S_IMODE(os.stat(store).st_mode),
            {stat.S_IMODE(os.stat(p).st_mode) for p in store.iterdir()})


def _access(store) -> str | None:
    from fanstore.format.index import read_index

    return read_index(str(store)).meta.get("access")


def _private_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if "private" in ln]


def _assert_private(store: Path) -> None:
    assert _modes(store) == (0o700, {0o600}), _modes(store)
    assert _access(store) == "private"


def _assert_shared(store: Path) -> None:
    mask = _umask()
    assert _modes(store) == (0o777 & ~mask, {0o666 & ~mask}), _modes(store)
    assert _access(store) == "shared"


class _Other:
    """The other user running FanStore (the venv's interpreter and this source tree)."""

    def __init__(self, user) -> None:
        self.user = user
        self.env = user.env(PYTHONPATH=str(REPO))

    def fanstore(self, *args, text: bool = True) -> subprocess.CompletedProcess:
        return self.user.run([sys.executable, "-m", "fanstore.cli", *map(str, args)],
                             env=self.env, timeout=120, text=text)

    def open_each(self, *paths) -> dict[str, int]:
        r = self.user.python(OPEN_EACH, *map(str, paths))
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


@pytest.fixture
def other(other_user):
    with reachable_for_others(os.path.realpath(sys.executable), REPO, sys.prefix):
        yield _Other(other_user)


# ============================================================================ packing


@pytest.mark.skipif(not ROOT, reason="needs root to make a second user")
def test_a_0600_file_makes_a_store_no_other_user_can_read(other):
    """Before: every store was world-readable, and ``fanstore cat STORE d/secret.txt`` as
    another user printed the secret."""
    with shared_test_dir() as d:
        src = _tree(Path(d) / "src")
        store = Path(d) / "store"
        proc = run_main("pack", src, store, *PACK, check=True)
        lines = _private_lines(proc)
        assert len(lines) == 1, proc.stderr  # said once, with an example and the way out
        assert lines[0].startswith("fanstore: ") and PRIVATE_LINE in lines[0]
        assert "d/secret.txt (mode 0600)" in lines[0] and "--shared" in lines[0]
        _assert_private(store)

        r = other.fanstore("cat", store, "d/secret.txt", text=False)
        assert r.returncode == 1 and r.stdout == b""
        err = r.stderr.decode()
        assert "Traceback" not in err
        assert [ln for ln in err.splitlines() if ln.startswith("fanstore: error:")] == \
            [ln for ln in err.splitlines() if ln.strip()], err  # one line, nothing else
        assert "Permission denied" in err, err
        files = [store / "fanstore.idx", store / "part-00000.fsp", store / "part-00001.fsp"]
        assert other.open_each(*files) == {str(p): errno.EACCES for p in files}
        # the owner still reads it
        assert run_main("cat", store, "d/secret.txt", text=False, check=True).stdout == SECRET


@pytest.mark.skipif(not ROOT, reason="needs root to make a second user")
def test_a_public_tree_stays_shareable_and_shared_opts_out(other):
    """A public tree follows the umask (as mksquashfs and tar do) and says nothing; so does a
    private one packed with --shared (before: no --shared, no recorded decision)."""
    with shared_test_dir() as d:
        for name, secret_mode, extra in (("public", 0o644, ()), ("opted", 0o600, ("--shared",))):
            src = _tree(Path(d) / f"src-{name}", secret_mode)
            store = Path(d) / f"store-{name}"
            proc = run_main("pack", src, store, *PACK, *extra, check=True)
            assert _private_lines(proc) == [], proc.stderr
            _assert_shared(store)
            r = other.fanstore("cat", store, "pub.txt", text=False)
            assert r.returncode == 0 and r.stdout == PUBLIC, r.stderr
            assert set(other.open_each(store / "fanstore.idx").values()) == {0}


@pytest.mark.parametrize("case", ["0700 directory", "0640 file", "0700 source root"])
def test_anything_others_may_not_read_makes_the_store_private(tmp_path, case):
    src = _tree(tmp_path / "src", secret_mode=0o640 if case == "0640 file" else 0o644,
                dir_mode=0o700 if case == "0700 directory" else 0o755)
    if case == "0700 source root":
        os.chmod(src, 0o700)
    store = tmp_path / "store"
    proc = run_main("pack", src, store, *PACK, check=True)
    lines = _private_lines(proc)
    assert len(lines) == 1, proc.stderr
    expect = {"0700 directory": "directory d (mode 0700)", "0640 file": "d/secret.txt (mode 0640)",
              "0700 source root": f"the source {src} itself (mode 0700)"}[case]
    assert expect in lines[0]
    _assert_private(store)


def _archive(tmp: Path, kind: str, member_mode: int, archive_mode: int) -> Path:
    src = _tree(tmp / "tree", secret_mode=member_mode)
    if kind == "tar":
        path = tmp / "ds.tar"
        with tarfile.open(path, "w") as tf:
            tf.add(src, arcname=".")
    else:
        path = tmp / "ds.zip"
        with zipfile.ZipFile(path, "w") as zf:
            for p in sorted(src.rglob("*")):
                zf.write(p, p.relative_to(src).as_posix())
    os.chmod(path, archive_mode)
    return path


@pytest.mark.parametrize("kind", ["tar", "zip"])
@pytest.mark.parametrize("member_mode,archive_mode,why", [
    (0o644, 0o600, "archive"), (0o600, 0o644, "member"), (0o644, 0o644, None)])
def test_a_streamed_source_follows_its_members_and_its_own_mode(tmp_path, kind, member_mode,
                                                               archive_mode, why):
    archive = _archive(tmp_path, kind, member_mode, archive_mode)
    store = tmp_path / "store"
    proc = run_main("pack", archive, store, *PACK, check=True)
    lines = _private_lines(proc)
    if why is None:
        assert lines == [], proc.stderr
        _assert_shared(store)
        return
    assert len(lines) == 1, proc.stderr
    if why == "archive":
        assert f"the archive {archive} (mode 0600)" in lines[0]
    else:
        assert "d/secret.txt (mode 0600)" in lines[0]
    _assert_private(store)


def test_an_s3_source_gives_a_private_store_unless_shared(s3_server, tmp_path):
    """S3 objects carry no modes: the store is private, with one line; --shared opts out."""
    bucket = s3_server.new_bucket()
    fs = s3_server.fs()
    fs.pipe(f"{bucket}/raw/a.txt", PUBLIC)
    fs.pipe(f"{bucket}/raw/b/c.txt", PUBLIC)
    url = f"s3://{bucket}/raw"
    proc = run_main("pack", url, tmp_path / "private", *PACK, env=s3_server.env, check=True)
    lines = _private_lines(proc)
    assert len(lines) == 1 and "object storage carries no file modes" in lines[0], proc.stderr
    _assert_private(tmp_path / "private")
    proc = run_main("pack", url, tmp_path / "shared", *PACK, "--shared", env=s3_server.env,
                   check=True)
    assert _private_lines(proc) == [], proc.stderr
    _assert_shared(tmp_path / "shared")


@pytest.mark.mpi
def test_an_mpi_pack_of_a_private_tree_is_private_and_says_so_once(tmp_path):
    from mpi_helpers import MPIEXEC, mpi_available

    ok, why = mpi_available()
    if not ok:
        pytest.skip(why)
    from helpers import FANSTORE

    src = _tree(tmp_path / "src")
    store = tmp_path / "store"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([MPIEXEC, "-n", "2", FANSTORE, "pack", str(src), str(store), *PACK],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(_private_lines(proc)) == 1, proc.stderr
    _assert_private(store)


# ============================================================================ staging


def _stage(store, local, numbers=None, **kw):
    from fanstore.daemon.staging import stage_partitions
    from fanstore.format.index import read_index

    index = read_index(str(store))
    numbers = list(range(len(index.partitions))) if numbers is None else numbers
    return stage_partitions(str(store), str(local), index, numbers, jobs=1, who="rank 0 (t)",
                            **kw)


def test_staged_copies_follow_the_store(tmp_path):
    """Before: copies and records were 0644 and the local directory 0755 whatever the
    store's modes, so a private store became readable on every node it was staged on."""
    mask = _umask()
    for name, secret_mode in (("private", 0o600), ("shared", 0o644)):
        src = _tree(tmp_path / f"src-{name}", secret_mode)
        store = tmp_path / f"store-{name}"
        run_main("pack", src, store, *PACK, check=True)
        local = tmp_path / f"node-{name}" / "local"  # neither exists yet
        report = _stage(store, local)
        assert len(report.copied) == 2
        files = sorted(local.iterdir())
        assert [p.name for p in files] == ["part-00000.fsp", "part-00000.fsp.ok",
                                           "part-00001.fsp", "part-00001.fsp.ok"]
        dir_mode = stat.S_IMODE(os.stat(local).st_mode)
        file_modes = {stat.S_IMODE(os.stat(p).st_mode) for p in files}
        parent_mode = stat.S_IMODE(os.stat(local.parent).st_mode)
        if name == "private":
            assert (dir_mode, file_modes) == (0o700, {0o600})
        else:
            assert (dir_mode, file_modes) == (0o777 & ~mask, {0o666 & ~mask})
        assert parent_mode == 0o700  # a missing parent is made private
    # A copy left 0644 by an older FanStore is reused, and closed, for a private store.
    local = tmp_path / "node-private" / "local"
    for p in local.iterdir():
        os.chmod(p, 0o644)
    report = _stage(tmp_path / "store-private", local)
    assert report.reused == [0, 1] and report.copied == []
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in local.iterdir()} == {0o600}


def test_staging_never_writes_through_a_planted_symlink(tmp_path):
    """Symlinks at the names staging writes (a copy's temporary name, a record's temporary
    name, the copy itself): each is replaced or removed, never followed; their targets are
    untouched. Before: the .ok record was written through ``part-NNNNN.fsp.ok.tmp``."""
    src = _tree(tmp_path / "src", 0o644)
    store = tmp_path / "store"
    run_main("pack", src, store, *PACK, check=True)
    local = tmp_path / "local"
    local.mkdir(mode=0o755)
    victims = {}
    for i, name in enumerate(["part-00000.fsp.ok.tmp", ".part-00000.fsp.partial",
                              "part-00001.fsp.ok.tmp", "part-00001.fsp"]):
        victim = tmp_path / f"victim{i}"
        victim.write_bytes(b"do not touch %d\n" % i)
        victims[victim] = victim.read_bytes()
        os.symlink(victim, local / name)
    report = _stage(store, local)
    assert report.copied == [0, 1]
    for victim, data in victims.items():
        assert victim.read_bytes() == data, victim
    from fanstore.format.index import read_index
    from fanstore.format.partition import file_checksum

    for p in read_index(str(store)).partitions:
        assert not os.path.islink(local / p.name)
        assert file_checksum(str(local / p.name)) == p.checksum


def test_a_planted_partial_copy_is_never_resumed_through_a_symlink(s3_server, tmp_path,
                                                                  monkeypatch):
    """A stage-in from S3 resumes a ``.partial`` whose record matches. Before: a symlink
    planted there (to a file of the partition's size) was opened for writing and the
    partition's bytes went into its target."""
    src = _tree(tmp_path / "src", 0o644)
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ds.fs"
    run_main("pack", src, url, *PACK, env=s3_server.env, check=True)
    from fanstore.format.index import read_index

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    index = read_index(url)
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    info = index.partitions[0]
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * info.size)
    os.symlink(victim, local / f".{info.name}.partial")
    (local / f".{info.name}.partial.json").write_text(json.dumps(
        {"size": info.size, "checksum": info.checksum, "block": 8 << 20, "done": []}))
    report = _stage(url, local, block=8 << 20)
    assert sorted(report.copied) == [0, 1]
    assert victim.read_bytes() == b"v" * info.size
    assert not os.path.islink(local / info.name)


@pytest.mark.fuse
@pytest.mark.skipif(not ROOT, reason="needs root to make a second user")
@pytest.mark.parametrize("attack", [
    "made by the other user", "a symlink of the other user", "below the other user's dir",
    "writable by others"])
def test_a_local_dir_another_user_controls_is_refused(other_user, attack):
    """``fanstore mount --local-dir`` in a world-writable (sticky) directory where the other
    user got there first. Before: the copies went into their directory, or through their
    symlink into a directory of root's. Now: one line, exit 1, nothing written."""
    with shared_test_dir() as d:
        d = Path(d)
        os.chmod(d, 0o1777)  # like /tmp
        src = _tree(d / "src", 0o644)
        store = d / "store"
        run_main("pack", src, store, *PACK, check=True)
        local = d / "local"
        victim = d / "root-dir"
        victim.mkdir()  # root's: the other user cannot write here, but could make root do it
        (victim / "keep").write_bytes(b"keep")
        if attack == "made by the other user":
            r = other_user.python("import os, sys; os.mkdir(sys.argv[1], 0o777); "
                                  "os.chmod(sys.argv[1], 0o777)", str(local))
        elif attack == "a symlink of the other user":
            r = other_user.python("import os, sys; os.symlink(sys.argv[2], sys.argv[1])",
                                  str(local), str(victim))
        elif attack == "below the other user's dir":
            r = other_user.python("import os, sys; os.mkdir(sys.argv[1], 0o755)", str(local))
            local = local / "node0"
        else:
            local.mkdir()
            os.chmod(local, 0o777)
            r = subprocess.CompletedProcess([], 0, "", "")
        assert r.returncode == 0, r.stderr
        before = sorted(os.listdir(local)) if local.is_dir() else None
        mnt = d / "mnt"
        mnt.mkdir()
        proc = run_cli("mount", store, mnt, "--local-dir", local, timeout=60)
        try:
            line = assert_cli_error(proc, code=1, contains="is unsafe")
            assert f"local directory {local}" in line
            assert not is_mounted(mnt)
            assert sorted(os.listdir(victim)) == ["keep"]
            if before is not None:
                assert sorted(os.listdir(local)) == before
        finally:
            if is_mounted(mnt) or daemon_pid(mnt):
                cleanup_mount(mnt, daemon_pid(mnt))


# ============================================================================ secrets


def _no_credentials_env(monkeypatch, server, tmp_path) -> None:
    """The endpoint but no credentials anywhere botocore looks (a fresh HOME, no instance
    metadata)."""
    for k, v in server.env.items():
        if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(k, v)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
              "AWS_PROFILE", "FANSTORE_STORAGE_OPTIONS"):
        monkeypatch.delenv(k, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _cmdlines(pids) -> list[bytes]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read())
        except OSError:
            pass
    return out


@pytest.mark.fuse
def test_credentials_from_a_file_work_and_never_reach_a_command_line(
        s3_server, tmp_path, monkeypatch, mounted):
    """``--storage-options @FILE`` (and ``$FANSTORE_STORAGE_OPTIONS=@FILE``) instead of the
    JSON in argv: pack to S3 and mount from it work, and the secret is in no FanStore
    process's /proc/PID/cmdline (the pack and its workers while it runs; the mount's daemon
    and its frontend processes). Before: no @FILE, so a secret had to be in argv."""
    _no_credentials_env(monkeypatch, s3_server, tmp_path)
    secret = "S3CR3T-" + secrets.token_hex(12)
    creds = tmp_path / "s3.json"
    creds.write_text(json.dumps({"key": "fanstore-test", "secret": secret}))
    os.chmod(creds, 0o600)
    src = tmp_path / "src"
    src.mkdir()
    rng = __import__("random").Random(3)
    for i in range(6):
        (src / f"r{i}.bin").write_bytes(rng.randbytes(4 << 20))
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ds.fs"

    # Without the file there are no credentials at all: the file is what makes it work.
    proc = run_main("pack", src, url, *PACK)
    assert_cli_error(proc, contains="access denied")

    from helpers import FANSTORE

    cmd = [FANSTORE, "pack", str(src), url, "--codec", "zstd:1", "--no-progress",
           "--jobs", "2", "--partitions", "2", "--storage-options", f"@{creds}"]
    pack = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[bytes] = []
    while pack.poll() is None:
        seen += _cmdlines(process_tree(pack.pid))
        time.sleep(0.01)
    out, err = pack.communicate()
    assert pack.returncode == 0, err
    assert "warning" not in err, err
    assert any(f"@{creds}".encode() in c for c in seen), seen  # sampled while it ran
    assert not [c for c in seen if secret.encode() in c]

    monkeypatch.setenv("FANSTORE_STORAGE_OPTIONS", f"@{creds}")
    mnt = mounted(url, "--local-dir", tmp_path / "local")
    assert (mnt / "r3.bin").read_bytes() == (src / "r3.bin").read_bytes()
    pids = process_tree(daemon_pid(mnt))
    lines = _cmdlines(pids)
    assert len(lines) >= 2, lines  # the daemon and its frontend
    assert not [c for c in lines if secret.encode() in c]


def test_credentials_in_argv_work_with_one_warning(s3_server, tmp_path, monkeypatch):
    """A secret inside --storage-options JSON is accepted, with one warning line that every
    user of the node can read it (pack and mount); an @FILE that others may read gets one
    too. Before: no warning."""
    _no_credentials_env(monkeypatch, s3_server, tmp_path)
    secret = "S3CR3T-" + secrets.token_hex(12)
    inline = json.dumps({"key": "fanstore-test", "client_kwargs": {}, "secret": secret})
    src = _tree(tmp_path / "src", 0o644)
    url = f"s3://{s3_server.new_bucket()}/ds.fs"
    proc = run_main("pack", src, url, *PACK, "--storage-options", inline, check=True)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("fanstore: warning:")]
    assert len(warnings) == 1, proc.stderr
    assert "--storage-options on the command line holds credentials (key, secret)" in \
        warnings[0] and "every user of this node can read" in warnings[0]
    assert secret not in proc.stderr
    # mount prints it too (here before refusing a mount without --local-dir)
    proc = run_cli("mount", url, tmp_path / "mnt", "--storage-options", inline)
    assert_cli_error(proc, code=2, contains="needs --local-dir")
    assert proc.stderr.count("fanstore: warning: --storage-options on the command line") == 1
    # no secret, no warning
    proc = run_main("ls", url, "--storage-options", json.dumps({"timeout": 10}))
    assert "warning" not in proc.stderr
    # a file with the secret that others may read
    creds = tmp_path / "s3.json"
    creds.write_text(inline)
    os.chmod(creds, 0o644)
    proc = run_main("ls", url, "--storage-options", f"@{creds}", check=True)
    assert proc.stderr.count("fanstore: warning:") == 1, proc.stderr
    assert f"{creds} holds credentials (key, secret) but other users may read it (mode " \
           f"0644); chmod 600 {creds}" in proc.stderr
    assert_no_traceback(proc)


def test_a_bad_options_file_is_one_line(tmp_path):
    proc = run_main("ls", "s3://bucket/ds.fs", "--storage-options", f"@{tmp_path}/missing")
    assert_cli_error(proc, code=2,
                     contains=f"--storage-options @{tmp_path}/missing: cannot read "
                              f"{tmp_path}/missing: No such file or directory")
    (tmp_path / "bad.json").write_text("[1, 2]")
    proc = run_main("ls", "s3://bucket/ds.fs", "--storage-options", f"@{tmp_path}/bad.json")
    assert_cli_error(proc, code=2, contains="expected a JSON object")


# ============================================================================ unmounting


@pytest.mark.fuse
def test_a_mount_point_named_like_an_option_unmounts(small_store, tmp_path, mounted):
    """``fanstore umount -- -z``: fusermount3 gets ``--`` before the path. Before: it read
    the path as options (``-z`` ...) and the unmount failed."""
    mnt = mounted(small_store, mnt=tmp_path / "-z")
    assert is_mounted(mnt)
    proc = run_cli("umount", "--", "-z", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(mnt)
    assert shutil.which("fusermount3")


# ============================================================================ runtime directories


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_sweep_removes_only_gone_daemons_runtime_directories(tmp_path, monkeypatch):
    """What a later mount or umount sweeps (fanstore.runtime.sweep_dead): the directory of
    a daemon that is gone (killed, or failed and kept for ``fanstore wait``, or whose pid
    a later process has), and one with no state that is older than a start-up; never a live daemon's, a young one, a name
    that is not a mount's, or anything through a symlink."""
    from fanstore import runtime

    root = tmp_path / "rt"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("FANSTORE_RUNTIME_DIR", str(root))
    monkeypatch.setenv("FANSTORE_SHM_DIR", str(tmp_path / "no-shm"))
    dead = _dead_pid()

    def mount_dir(name, state=None, age=0.0):
        d = root / name
        d.mkdir(mode=0o700)
        (d / "daemon.log").write_text("log\n")
        if state is not None:
            (d / "state.json").write_text(json.dumps(state))
        if age:
            t = time.time() - age
            os.utime(d, (t, t))
        return d

    killed = mount_dir("0" * 16, {"pid": dead, "phase": "ready"})
    failed = mount_dir("1" * 16, {"pid": dead, "phase": "failed", "error": "x"})
    old = mount_dir("2" * 16, age=3600)
    live = mount_dir("3" * 16, {"pid": os.getpid(), "phase": "ready", "updated": time.time()})
    # a dead daemon's pid reused by a process that started after its state was written
    reused = mount_dir("6" * 16, {"pid": os.getpid(), "phase": "ready", "updated": 1e9})
    young = mount_dir("4" * 16)
    other = mount_dir("not-a-mount", {"pid": dead})
    target = tmp_path / "target"
    target.mkdir()
    (target / "state.json").write_text(json.dumps({"pid": dead}))
    (root / ("5" * 16)).symlink_to(target)

    removed = runtime.sweep_dead()
    assert sorted(removed) == sorted(str(d) for d in (killed, failed, old, reused))
    assert not any(d.exists() for d in (killed, failed, old, reused))
    assert all(d.is_dir() for d in (live, young, other))
    assert (target / "state.json").exists() and (root / ("5" * 16)).is_symlink()


def test_a_sweep_leaves_a_runtime_root_that_is_not_private(tmp_path, monkeypatch):
    from fanstore import runtime

    root = tmp_path / "rt"
    root.mkdir(mode=0o700)
    d = root / ("0" * 16)
    d.mkdir(mode=0o700)
    (d / "state.json").write_text(json.dumps({"pid": _dead_pid()}))
    root.chmod(0o777)
    monkeypatch.setenv("FANSTORE_RUNTIME_DIR", str(root))
    monkeypatch.setenv("FANSTORE_SHM_DIR", str(tmp_path / "no-shm"))
    assert runtime.sweep_dead() == [] and d.is_dir()
