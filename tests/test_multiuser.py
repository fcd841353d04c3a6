"""Another local user attacks a live mount: nothing may be read, redirected or broken.

Shared nodes have other accounts beside every mount (docs/reliability.md, "Multi-user
nodes"). A second, unprivileged user (``second_user.py``) tries each attack of the review
against a real mount of the first (root here, the riskiest owner: a daemon that follows a
planted symlink as root can overwrite any file). Every attempt must fail, the mount must go
on serving the source's bytes, and the owner's mount, stats and umount must still work.

The attacks on the packed data and the staged copies (file modes at rest) are in
``test_access.py``; hostile archives and stores in ``test_hostile_input.py``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import (
    assert_cli_error,
    daemon_pid,
    is_mounted,
    pid_alive,
    kill_tree,
    run_cli,
    wait_until,
)
from second_user import fuse_device_for_all, reachable_for_others, shared_test_dir

pytestmark = pytest.mark.fuse

#: the index copies go to a directory of the module's own made like /dev/shm (mode 1777:
#: these tests are about another user's files there), not the machine's: any daemon of
#: this uid sweeps a dead daemon's copy from its directory, and in the machine's /dev/shm
#: another test's daemon once removed the copy a test had left to check (isolation.py)
OWN_SHM = "sticky"

ROOT = os.geteuid() == 0

# A client of the control socket in the system Python (stdlib only), run as the other
# user: connects, sends each request line, prints what came back (or the error).
SOCKET_CLIENT = r"""
import json, socket, sys
path, lines = sys.argv[1], json.loads(sys.argv[2])
out = []
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
except OSError as exc:
    print(json.dumps({"connect_error": exc.errno}))
    sys.exit(0)
for line in lines:
    try:
        s.sendall(line.encode() + b"\n")
        data = s.recv(65536)
        out.append(data.decode(errors="replace"))
    except OSError as exc:
        out.append(f"oserror {exc.errno}")
print(json.dumps({"replies": out}))
"""


def _read_all(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        with open(root / rel, "rb", buffering=0) as f:
            assert f.read() == data, rel


def _old_shm_name(mnt: Path) -> str:
    """The predictable name older FanStore gave the index copy (the attack's target), in
    the index copies' directory (this module's own, made like /dev/shm)."""
    from fanstore import runtime, settings

    key = hashlib.sha1(runtime.mount_key(str(mnt)).encode()).hexdigest()[:16]
    return f"{settings.current().shm_dir}/fanstore-{os.geteuid()}-{key}-index.body"


def _owner_request(sock_path: str, line: bytes, timeout: float = 10.0) -> dict:
    """One request line from the owner (this process); the reply object."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(line + b"\n")
        f = s.makefile("rb")
        reply = f.readline()
    assert reply.endswith(b"\n"), f"no reply to {line[:60]!r}"
    return json.loads(reply)


# ============================================================================ runtime directory


@pytest.mark.skipif(not ROOT, reason="needs root to act as a second user")
@pytest.mark.parametrize("planted", ["open-dir", "their-dir", "symlink"])
def test_runtime_dir_made_first_by_another_user_is_refused(planted, monkeypatch, other_user,
                                                           small_store, small_tree, mounted,
                                                           tmp_path):
    """The other user makes the runtime root before the owner's first mount (an open
    directory, a private one of theirs, or a symlink to their directory): the mount is
    refused with one line naming it, nothing is written where they can see it, and once
    it is gone the owner mounts, reads, asks stats and unmounts as usual."""
    root = f"/tmp/fanstore-mu-rt-{secrets.token_hex(4)}"
    trap = f"/tmp/fanstore-mu-trap-{secrets.token_hex(4)}"
    monkeypatch.setenv("FANSTORE_RUNTIME_DIR", root)
    try:
        if planted == "open-dir":
            other_user.run(["mkdir", "-m", "0777", root], check=True)
            watched = root
        elif planted == "their-dir":
            other_user.run(["mkdir", "-m", "0700", root], check=True)
            watched = root
        else:
            other_user.run(["mkdir", "-m", "0777", trap], check=True)
            other_user.run(["ln", "-s", trap, root], check=True)
            watched = trap
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        proc = run_cli("mount", small_store, mnt)
        line = assert_cli_error(proc, contains="unsafe")
        assert root in line
        assert not is_mounted(mnt)
        assert os.listdir(watched) == [], "the daemon wrote into the other user's directory"
    finally:
        for p in (root, trap):
            if os.path.islink(p):
                os.unlink(p)
            elif os.path.isdir(p):
                shutil.rmtree(p)
    # The planted directory is gone: the owner's mount, stats and umount work.
    files = small_tree[1]
    try:
        m = mounted(small_store, mnt=tmp_path / "mnt2")
        _read_all(m, files)
        st = os.lstat(root)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid()
        stats = run_cli("stats", m, "--json", check=True)
        assert json.loads(stats.stdout)["reads"] >= 0
        run_cli("umount", m, check=True)
        assert not is_mounted(m)
    finally:
        mounted.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(not ROOT, reason="needs root")
def test_runtime_root_that_only_others_could_read_is_closed_not_refused(monkeypatch,
                                                                        small_store, mounted,
                                                                        tmp_path):
    """A root of ours that is 0755 (as older FanStore made /tmp/fanstore-<uid>): nobody else
    could have written into it, so it is closed to 0700 and used."""
    root = tmp_path / "rt"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    monkeypatch.setenv("FANSTORE_RUNTIME_DIR", str(root))
    mounted(small_store, mnt=tmp_path / "mnt")
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700


@pytest.mark.skipif(not ROOT, reason="needs root to act as a second user")
def test_runtime_root_inside_another_users_directory_is_refused(monkeypatch, other_user,
                                                                small_store, tmp_path):
    """A root of ours (0700) whose parent another user may write (an $XDG_RUNTIME_DIR or
    $FANSTORE_RUNTIME_DIR there): they could rename it away and plant a symlink to their
    own directory after our check, so the mount is refused with one line; nothing is
    written under their directory."""
    parent = f"/tmp/fanstore-mu-parent-{secrets.token_hex(4)}"
    other_user.run(["mkdir", "-m", "0777", parent], check=True)
    root = os.path.join(parent, "rt")
    os.mkdir(root, 0o700)
    monkeypatch.setenv("FANSTORE_RUNTIME_DIR", root)
    try:
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        proc = run_cli("mount", small_store, mnt)
        line = assert_cli_error(proc, contains="unsafe")
        assert parent in line
        assert not is_mounted(mnt)
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_xdg_runtime_dir_is_used_when_set(monkeypatch, small_store, small_tree, mounted,
                                          tmp_path):
    """Without $FANSTORE_RUNTIME_DIR a mount's state goes to $XDG_RUNTIME_DIR/fanstore
    (0700), where the commands that talk to the mount find it."""
    from fanstore import runtime

    monkeypatch.delenv("FANSTORE_RUNTIME_DIR", raising=False)
    # deep enough that the socket's path does not fit a socket address (107 bytes): it
    # did, under a longer temporary directory, the mount failed with "AF_UNIX path too long"
    xdg = tmp_path / ("deep" * 16) / "xdg"
    xdg.mkdir(mode=0o700, parents=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    m = mounted(small_store, mnt=tmp_path / "mnt")
    _read_all(m, small_tree[1])
    rt = runtime.MountRuntime.find(str(m))
    assert rt is not None and rt.root == str(xdg / "fanstore")
    assert stat.S_IMODE(os.lstat(rt.root).st_mode) == 0o700
    assert os.path.exists(rt.socket_path) and len(rt.socket_path) > 107
    assert json.loads(run_cli("stats", m, "--json", check=True).stdout)["reads"] >= 0
    run_cli("umount", m, check=True)
    assert not is_mounted(m)


def test_unix_sockets_of_any_path_length(tmp_path):
    """The engine's handoff socket (worker ranks join a kernel mount through it) binds and
    is joined at a path longer than a socket address holds; the socket file is where the
    path says, 0600."""
    import threading

    from fanstore.fuse.engine import handoff
    from fanstore.unixsock import address

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    path = str(deep / "workers.sock")
    assert len(path) > 107
    with pytest.raises(OSError, match="too long"):
        socket.socket(socket.AF_UNIX).bind(path)
    server = handoff.HandoffServer(path)
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        r, w = os.pipe()
        t = threading.Thread(target=server.accept, args=(1, lambda slot: r, {"bufsize": 4096}, 10))
        t.start()
        grant, conn = handoff.join(path, 10)
        t.join(10)
        assert grant.slot == 1 and grant.bufsize == 4096
        conn.close()
        os.close(grant.fd)
        os.close(r)
        os.close(w)
    finally:
        server.close()
    assert not os.path.exists(path)
    with address(path) as short:  # a name too long even below /proc/self/fd/N is an error
        assert short.startswith("/proc/self/fd/") and short.endswith("/workers.sock")
    with pytest.raises(OSError, match="socket name too long"), address(str(deep / ("n" * 100))):
        pass


# ============================================================================ shared memory


@pytest.mark.skipif(not ROOT, reason="needs root to act as a second user")
def test_index_copy_is_private_unpredictable_and_removed_after_sigkill(other_user,
                                                                       small_store,
                                                                       small_tree, mounted,
                                                                       tmp_path, frontend):
    """The node's index copy in the shm directory (this module's, made like /dev/shm): the
    other user pre-creates the name older versions used (to read or swap it): the mount
    uses a random name instead, 0600, which they cannot read; after SIGKILL of every daemon process the copy is left, and ``fanstore umount``
    removes it (but not the other user's file)."""
    mnt = tmp_path / "mnt"
    old = _old_shm_name(mnt)
    other_user.run(["/bin/sh", "-c",
                    f"printf junk > {old} && chmod 0666 {old}"], check=True)
    try:
        m = mounted(small_store, mnt=mnt)
        _read_all(m, small_tree[1])
        from fanstore import runtime

        copy = (runtime.read_state(str(m)) or {}).get("index_copy")
        assert copy and copy != old
        st = os.lstat(copy)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        r = other_user.run(["cat", copy])
        assert r.returncode != 0 and "Permission denied" in r.stderr
        assert open(old, "rb").read() == b"junk"  # theirs, untouched
        # SIGKILL every process of the daemon: the copy stays behind ...
        pid = daemon_pid(m)
        kill_tree(pid)
        assert wait_until(lambda: not pid_alive(pid), 10)
        assert os.path.exists(copy)
        # ... until the owner's umount cleans up after the dead daemon.
        proc = run_cli("umount", m)
        assert proc.returncode == 0, proc.stderr
        assert not os.path.exists(copy)
        assert not is_mounted(m)
        assert open(old, "rb").read() == b"junk"
    finally:
        if os.path.lexists(old):
            os.unlink(old)


def test_the_next_mount_removes_a_killed_daemons_index_copy(small_store, small_tree,
                                                           mounted, tmp_path):
    """A SIGKILLed daemon cannot remove its index copy; the user's next mount (of any
    mount point) does, and leaves a live daemon's copy alone."""
    from fanstore import runtime

    first = mounted(small_store, mnt=tmp_path / "a")
    live = mounted(small_store, mnt=tmp_path / "b")
    dead_copy = (runtime.read_state(str(first)) or {}).get("index_copy")
    live_copy = (runtime.read_state(str(live)) or {}).get("index_copy")
    assert dead_copy and live_copy and os.path.exists(dead_copy)
    pid = daemon_pid(first)
    kill_tree(pid)
    assert wait_until(lambda: not pid_alive(pid), 10)
    assert os.path.exists(dead_copy)
    m = mounted(small_store, mnt=tmp_path / "c")
    _read_all(m, small_tree[1])
    assert not os.path.exists(dead_copy)
    assert os.path.exists(live_copy)
    _read_all(live, small_tree[1])


@pytest.mark.parametrize("damage", ["symlink", "their-file", "magic", "truncated",
                                    "longer", "checksum"])
def test_a_bad_index_copy_is_refused_before_it_is_parsed(damage, small_store, tmp_path):
    """Readers map the node's index copy only after checking it: no symlink, the daemon's
    uid, the magic, the sizes and the body's checksum; anything else is one FormatError or
    UnsafePathError (a reader never parses a swapped or damaged copy)."""
    from fanstore.errors import FanStoreError
    from fanstore.format.index import index_body_parts, map_index_body, read_index

    good = tmp_path / "good.idx"
    good.write_bytes(b"".join(index_body_parts(read_index(small_store))))
    assert map_index_body(str(good), owner=os.geteuid()).n_entries > 0
    bad = tmp_path / "bad.idx"
    data = bytearray(good.read_bytes())
    if damage == "symlink":
        bad.symlink_to(good)
    elif damage == "their-file":
        from second_user import other_user

        user, why = other_user()
        if user is None:
            pytest.skip(why)
        bad.write_bytes(data)
        os.chown(bad, user.uid, user.gid)
    elif damage == "magic":
        data[0] ^= 0xFF
        bad.write_bytes(data)
    elif damage == "truncated":
        bad.write_bytes(data[:-1])
    elif damage == "longer":
        bad.write_bytes(data + b"\0")
    else:
        data[-1] ^= 0x01
        bad.write_bytes(data)
    with pytest.raises(FanStoreError):
        map_index_body(str(bad), owner=os.geteuid())


# ============================================================================ control socket


@pytest.fixture
def own_runtime_root(monkeypatch):
    """A runtime root of this test's own (``FANSTORE_RUNTIME_DIR``), for a test that opens
    its modes: the shared one (``/tmp/fanstore-0``) is every parallel test's, and another
    test's mount would close it again under this one. Under /tmp (not pytest's 0700
    tree) so that the second user can reach it once it is opened."""
    import shutil
    import tempfile

    from fanstore import settings

    root = tempfile.mkdtemp(prefix="fanstore-rt-test-", dir="/tmp")
    monkeypatch.setenv("FANSTORE_RUNTIME_DIR", root)
    settings.reset()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        monkeypatch.undo()
        settings.reset()


@pytest.mark.skipif(not ROOT, reason="needs root to act as a second user")
def test_control_socket_refuses_another_user_even_when_reachable(other_user, small_store,
                                                                 small_tree, own_runtime_root,
                                                                 mounted, tmp_path):
    """The other user cannot reach the socket (a 0700 directory); and when the directory is
    opened up by mistake, the daemon itself refuses them (SO_PEERCRED): shutdown, info and a
    read of stored bytes get nothing, and the mount keeps serving."""
    from fanstore import runtime

    m = mounted(small_store, mnt=tmp_path / "mnt")
    rt = runtime.MountRuntime.find(str(m))
    attack = [json.dumps({"op": "shutdown", "reason": "x", "everywhere": True}),
              json.dumps({"op": "info"}),
              json.dumps({"op": "read_stored", "part": 0, "offset": 0, "length": 16})]
    r = other_user.python(SOCKET_CLIENT, rt.socket_path, json.dumps(attack))
    assert json.loads(r.stdout) == {"connect_error": errno.EACCES}, r.stdout + r.stderr
    modes = [(p, stat.S_IMODE(os.lstat(p).st_mode)) for p in (rt.root, rt.path,
                                                               rt.socket_path)]
    try:
        os.chmod(rt.root, 0o711)
        os.chmod(rt.path, 0o711)
        os.chmod(rt.socket_path, 0o666)
        r = other_user.python(SOCKET_CLIENT, rt.socket_path, json.dumps(attack))
        out = json.loads(r.stdout)
        assert "connect_error" not in out, out
        assert all(reply in ("", f"oserror {errno.EPIPE}", f"oserror {errno.ECONNRESET}")
                   for reply in out["replies"]), out
    finally:
        for p, mode in modes:
            os.chmod(p, mode)
    time.sleep(0.5)
    assert is_mounted(m) and pid_alive(daemon_pid(m))
    _read_all(m, small_tree[1])
    stats = json.loads(run_cli("stats", m, "--json", check=True).stdout)
    assert stats.get("control_refused", 0) >= 1


def test_control_socket_answers_malformed_requests_and_keeps_serving(small_store,
                                                                     small_tree, mounted,
                                                                     tmp_path):
    """Each malformed request gets an error reply on the same connection; none stops the
    daemon; the mount still reads right."""
    from fanstore import runtime

    m = mounted(small_store, mnt=tmp_path / "mnt")
    sock = runtime.MountRuntime.find(str(m)).socket_path
    bad = [
        b'{"op":[1]}',
        b'{"op":{"a":1}}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"op":"info","x":[[[[[[1]]]]]]}',
        b'{"op":"read_stored","part":"x","offset":0,"length":1}',
        b'{"op":"read_stored","part":0,"offset":-1,"length":1}',
        b'{"op":"read_stored","part":0,"offset":0,"length":1e300}',
        b'{"op":"fetch","entry":true,"path":[1]}',
        b'{"op":"shutdown","everywhere":"yes"}',
        b'{"op":"prefetch","list":"/etc/shadow"}',
        b'{"op":"prefetch","paths":[1,2]}',
        b"\xff\xfe not json",
        b'"just a string"',
        b'{"op":"no-such-op"}',
    ]
    for line in bad:
        reply = _owner_request(sock, line)
        assert "error" in reply and reply.get("errno") in (errno.EINVAL, errno.EIO), \
            (line[:60], reply)
        assert "internal error" not in reply["error"], (line[:60], reply)
    # many requests on one connection, malformed and good mixed
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock)
        f = s.makefile("rb")
        for line in (b'{"op":[1]}', b'{"op":"ping"}', b"nope", b'{"op":"ping"}'):
            s.sendall(line + b"\n")
            reply = json.loads(f.readline())
            assert ("error" in reply) == (b"ping" not in line), (line, reply)
    assert pid_alive(daemon_pid(m))
    _read_all(m, small_tree[1])


def _connect(path: str) -> socket.socket:
    """A connected client socket (retrying while the listen backlog is full)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    deadline = time.monotonic() + 10
    while True:
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_control_socket_bounds_connections(small_store, small_tree, mounted, tmp_path):
    """More connections than the daemon serves at once: the surplus gets an error reply and
    is closed; once they go, new connections are served."""
    from fanstore import control, runtime

    m = mounted(small_store, mnt=tmp_path / "mnt")
    sock = runtime.MountRuntime.find(str(m)).socket_path
    held = []
    try:
        for _ in range(control.MAX_CONNECTIONS):
            held.append(_connect(sock))
        # one request on the last held connection proves they are all being served
        held[-1].sendall(b'{"op":"ping"}\n')
        assert b'"ok": true' in held[-1].recv(4096)
        extra = _connect(sock)
        reply = json.loads(extra.makefile("rb").readline())
        assert "at most" in reply["error"]
        extra.close()
    finally:
        for s in held:
            s.close()
    assert wait_until(lambda: "ok" in _owner_request(sock, b'{"op":"ping"}'), 10)
    _read_all(m, small_tree[1])


def test_control_server_bounds_line_size_and_time(tmp_path, monkeypatch):
    """In-process: a request line over the size bound, and one that stops half-way, get an
    error reply and the connection is dropped; the server goes on."""
    from fanstore import control

    monkeypatch.setattr(control, "MAX_LINE", 4096)
    monkeypatch.setattr(control, "REQUEST_TIMEOUT", 0.6)
    path = str(tmp_path / "c.sock")
    server = control.ControlServer(path, {"ping": lambda req: {"ok": True}})
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(b'{"op":"ping","pad":"' + b"x" * 10_000)
            reply = json.loads(s.makefile("rb").readline())
            assert "longer than 4096" in reply["error"]
            assert s.recv(10) == b""  # dropped
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            t0 = time.monotonic()
            s.sendall(b'{"op":"pi')
            reply = json.loads(s.makefile("rb").readline())
            assert "not finished within" in reply["error"]
            assert time.monotonic() - t0 < 5
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # idle is fine
            s.settimeout(10)
            s.connect(path)
            time.sleep(1.0)
            s.sendall(b'{"op":"ping"}\n')
            assert json.loads(s.makefile("rb").readline()) == {"ok": True}
    finally:
        server.close()


def test_client_refuses_oversized_replies(tmp_path):
    """The client never believes a reply's size: more than asked is an error, at once (no
    allocation of what the other side announced)."""
    from fanstore import control
    from fanstore.errors import MountError

    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.makefile("rb").readline()
            conn.sendall(b'{"ok": true, "size": 1099511627776}\n')
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        client = control.ControlClient("fake", timeout=5, path=path)
        with pytest.raises(MountError, match="announced 1099511627776 bytes"):
            client.request({"op": "read_stored"}, expect=100)
        client = control.ControlClient("fake", timeout=5, path=path)
        with pytest.raises(MountError, match="at most"):
            client.request({"op": "stats"})
    finally:
        srv.close()


@pytest.mark.skipif(not ROOT, reason="needs root to act as a second user")
def test_client_refuses_a_socket_served_by_another_user(other_user, tmp_path):
    """An impostor daemon of another uid at the socket path: the client refuses to talk to
    it (a reader would otherwise trust its ``info`` and read where it says)."""
    from fanstore import control
    from fanstore.errors import UnsafePathError

    with shared_test_dir() as d:
        os.chmod(d, 0o777)
        path = os.path.join(d, "imp.sock")
        fake = other_user.popen(["/usr/bin/python3", "-c", (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(4)\n"
            "import os; os.chmod(sys.argv[1], 0o666); print('up', flush=True)\n"
            "while True:\n"
            "    c,_=s.accept(); c.makefile('rb').readline()\n"
            "    c.sendall(b'{\"ok\": true, \"store\": \"/etc\", \"data_dir\": \"/etc\"}\\n')\n"
        ), path], stdout=__import__("subprocess").PIPE, text=True)
        try:
            assert fake.stdout.readline().strip() == "up"
            client = control.ControlClient("imp", timeout=5, path=path)
            with pytest.raises(UnsafePathError, match=f"uid {other_user.uid}"):
                client.request({"op": "info"})
        finally:
            fake.kill()
            fake.wait()


# ============================================================================ an unprivileged owner


@pytest.mark.skipif(not ROOT, reason="needs root to make a second user")
def test_unprivileged_owner_mounts_and_prefetch_reads_follow_file_modes(other_user, tmp_path):
    """A prefetch-mode mount made by an unprivileged user (fusermount3, kernel frontend):
    their own private runtime directory; prefetch-mode API reads go through the mount, so
    a file of mode 0200 is EACCES through the mount and through the API alike, a 0644 one
    reads."""
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    with shared_test_dir() as d, fuse_device_for_all(), \
            reachable_for_others(os.path.realpath(sys.executable), repo, sys.prefix):
        src = Path(d) / "src"
        (src / "d").mkdir(parents=True)
        (src / "d" / "open.txt").write_bytes(b"open\n" * 100)
        (src / "d" / "wo.txt").write_bytes(b"write-only\n")
        os.chmod(src / "d" / "wo.txt", 0o200)
        store = Path(d) / "store"
        run_cli("pack", src, store, "--codec", "zstd:3", "--no-progress", "--jobs", "1",
                check=True)
        for p in [store, *store.iterdir()]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        mnt = Path(d) / "mnt"
        mnt.mkdir()
        os.chown(mnt, other_user.uid, other_user.gid)
        env = other_user.env(PYTHONPATH=os.environ.get("PYTHONPATH", ""),
                             FANSTORE_FRONTEND="kernel")
        fs = [sys.executable, "-m", "fanstore.cli"]
        r = other_user.run([*fs, "mount", store, mnt, "--mode", "prefetch"], env=env,
                           timeout=120)
        try:
            assert r.returncode == 0, r.stderr
            rt_root = f"/tmp/fanstore-{other_user.uid}"
            st = os.lstat(rt_root)
            assert st.st_uid == other_user.uid and stat.S_IMODE(st.st_mode) == 0o700
            code = (
                "import sys, fanstore\n"
                "s = fanstore.open_store(sys.argv[1])\n"
                "print(s.read('d/open.txt') == b'open\\n' * 100)\n"
                "try:\n"
                "    s.read('d/wo.txt'); print('read')\n"
                "except Exception as e: print(type(e).__name__, getattr(e, 'errno', None))\n"
                "try:\n"
                "    open(sys.argv[1] + '/d/wo.txt', 'rb').read(); print('read')\n"
                "except OSError as e: print('OSError', e.errno)\n")
            r2 = other_user.run([sys.executable, "-c", code, mnt], env=env)
            assert r2.stdout.split("\n")[:3] == [
                "True", f"PermissionDeniedError {errno.EACCES}",
                f"OSError {errno.EACCES}"], r2.stdout + r2.stderr
        finally:
            other_user.run([*fs, "umount", mnt], env=env, timeout=60)
            if is_mounted(mnt):
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
            shutil.rmtree(f"/tmp/fanstore-{other_user.uid}", ignore_errors=True)
