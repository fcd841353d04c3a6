"""Creating files and directories that no other local user can read, replace or redirect.

Shared nodes have other accounts beside every mount (docs/reliability.md, "Multi-user
nodes"). Every file FanStore writes outside a store it is packing goes through here:

- :func:`private_dir` makes or checks a directory only this user may use: created 0700,
  then ``lstat``-ed and refused unless it is a real directory (not a symlink) owned by this
  uid with no group/other bits (tmux's rule for ``/tmp/tmux-<uid>``). One of ours that
  only others could read (0755, as older FanStore made them; nobody else could write into
  it) is closed to 0700 instead of refused.
- :func:`owned_dir` checks a directory this user writes into that others may read (a
  node-local staging dir of a public store): a real directory owned by this uid, writable
  by nobody else.
- :func:`create_excl` opens a new file ``O_CREAT|O_EXCL|O_NOFOLLOW``: it never opens
  something another user planted at that name, and never follows a symlink.
- :func:`atomic_write` writes a fresh temporary file beside the target (a random name,
  created exclusively) and renames it into place.
- :func:`open_nofollow` opens an existing file for reading (or writing) without following
  a symlink and checks it is a regular file owned by an expected uid.
- :func:`trusted_path` checks that no other user can replace a directory on the way to a
  path (every existing directory on it is owned by root or this uid and writable by nobody
  else, unless sticky like /tmp), and :func:`make_dirs` creates what is missing of a
  directory path one ``mkdir`` at a time, never through a symlink planted at a name.
- :func:`current_umask` and :func:`umask_mode`: the modes a file or directory of data
  others may share gets (what ``open``/``mkdir`` would give), as an exact mode.

Failures are :class:`~fanstore.errors.UnsafePathError` (one line naming the path and what
is wrong with it), or the OSError of the system call for ordinary I/O failures.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from fanstore.errors import UnsafePathError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _describe(st: os.stat_result) -> str:
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else
            "not a directory" if not stat.S_ISDIR(st.st_mode) else "a directory")
    return f"{kind} owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def private_dir(path: str, create: bool = True, what: str = "runtime directory") -> str:
    """Make (mode 0700, parents too) or check ``path``: a real directory owned by this uid
    with no group or other permission bits. Returns ``path``; raises UnsafePathError."""
    uid = os.geteuid()
    if create:
        parent = os.path.dirname(os.path.abspath(path))
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafePathError(f"cannot create {what} {path}: {exc.strerror}") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePathError(f"cannot use {what} {path}: {exc.strerror}") from None
    if (stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) & 0o077
            and not stat.S_IMODE(st.st_mode) & 0o022):
        # Ours, and nobody else could ever write into it (e.g. made 0755 by an older
        # FanStore): nothing in it can be another user's, so close it and go on.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
            try:
                if os.fstat(fd).st_ino == st.st_ino:
                    os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            st = os.lstat(path)
        except OSError:
            pass
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != uid
            or stat.S_IMODE(st.st_mode) & 0o077):
        raise UnsafePathError(
            f"{what} {path} is unsafe ({_describe(st)}; it must be a directory owned by uid "
            f"{uid} with mode 0700): remove it, or set FANSTORE_RUNTIME_DIR to a private "
            "directory")
    return path


def owned_dir(path: str, what: str = "directory") -> os.stat_result:
    """Check ``path`` is a real directory owned by this uid that no other user can write
    to (group/other may read it). Returns its stat; raises UnsafePathError."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePathError(f"cannot use {what} {path}: {exc.strerror}") from None
    uid = os.geteuid()
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != uid
            or stat.S_IMODE(st.st_mode) & 0o022):
        raise UnsafePathError(
            f"{what} {path} is unsafe ({_describe(st)}; it must be a directory owned by uid "
            f"{uid} that no other user can write to)")
    return st


def create_excl(path: str, mode: int = 0o600, flags: int = os.O_WRONLY) -> int:
    """Open a new file at ``path`` (``O_CREAT|O_EXCL|O_NOFOLLOW``) with exactly ``mode``
    (set again with fchmod: the umask may only narrow the create mode). Returns the fd."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return fd


def temp_name(path: str) -> str:
    """A fresh hidden name beside ``path`` for a file to be renamed onto it."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{secrets.token_hex(6)}.tmp")


def atomic_write(path: str, data: bytes, mode: int = 0o600, fsync: bool = False) -> None:
    """Write ``data`` to a new exclusive temporary file beside ``path`` and rename it onto
    ``path`` (readers see the old file or the new one, never a part)."""
    for _ in range(8):
        tmp = temp_name(path)
        try:
            fd = create_excl(tmp, mode)
            break
        except FileExistsError:
            continue
    else:
        raise UnsafePathError(f"cannot create a temporary file beside {path}")
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_nofollow(path: str, owner: int | None = None, what: str = "file",
                  write: bool = False) -> int:
    """Open an existing regular file read-only (``write``: write-only, not truncated)
    without following a symlink; with ``owner``, refuse a file owned by another uid.
    Returns the fd."""
    access = os.O_WRONLY if write else os.O_RDONLY
    try:
        fd = os.open(path, access | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{what} {path} is a symlink; refusing to follow it") \
                from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
        os.close(fd)
        kind = "regular file" if stat.S_ISREG(st.st_mode) else "special file"
        raise UnsafePathError(f"{what} {path} is unsafe (a {kind} owned by uid {st.st_uid}; "
                              f"expected a regular file owned by uid {owner})")
    os.set_blocking(fd, True)
    return fd


# --------------------------------------------------------------------------- modes and paths


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``; else the
    classic set-and-restore, which is not thread-safe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def umask_mode(mode: int) -> int:
    """``mode`` narrowed by the umask: what ``open(..., mode)`` or ``mkdir(..., mode)``
    would give (0o666 for files, 0o777 for directories), as an exact mode for fchmod."""
    return mode & ~current_umask() & 0o7777


def _trusted(st: os.stat_result, uid: int) -> bool:
    """Nobody but root or ``uid`` can replace what lies in (or at) this node: owned by
    one of them, and a directory open for writing to others only if it is sticky."""
    if st.st_uid not in (0, uid):
        return False
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return False
    return True


def trusted_path(path: str, what: str = "directory") -> None:
    """Refuse ``path`` when another user could swap a directory on the way to it: every
    existing component of it, as written and resolved, must be owned by root or this uid,
    and a directory writable by others must be sticky (as /tmp). A symlink on the way must
    be owned by root or this uid too. Components that do not exist yet are not checked
    (:func:`make_dirs` creates them). Raises UnsafePathError."""
    uid = os.geteuid()
    absolute = os.path.abspath(path)
    chains = [absolute]
    real = os.path.realpath(absolute)
    if real != absolute:
        chains.append(real)
    for chain in chains:
        parts = chain.split(os.sep)
        for i in range(1, len(parts) + 1):
            p = os.sep.join(parts[:i]) or os.sep
            try:
                st = os.lstat(p)
            except (FileNotFoundError, NotADirectoryError):
                break  # not there (yet): nothing below it to swap
            except OSError as exc:
                raise UnsafePathError(f"cannot use {what} {path}: {p}: {exc.strerror}") \
                    from None
            if not _trusted(st, uid):
                raise UnsafePathError(
                    f"{what} {path} is unsafe: {p} is {_describe(st)}, so another user could "
                    f"replace what lies below it; use a path whose directories are owned by "
                    f"root or uid {uid} and writable by no other user (or sticky, as /tmp)")


def make_dirs(path: str, mode: int, parent_mode: int = 0o700,
              what: str = "directory") -> bool:
    """Create the missing directories of ``path``, top down, each with ``mkdir`` (which
    never follows a symlink at the name it creates): ``path`` itself with ``mode``, missing
    parents with ``parent_mode``. Each is ``lstat``-checked as a real directory owned by
    this uid afterwards (someone may have been faster). Returns whether ``path`` was
    created. Raises UnsafePathError, or the OSError of a mkdir that failed otherwise."""
    absolute = os.path.abspath(path)
    missing = []
    p = absolute
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode if d == absolute else parent_mode)
        except FileExistsError:
            pass  # raced: checked below like anything else found there
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafePathError(f"{what} {d} is unsafe ({_describe(st)}; it appeared while "
                                  "FanStore was creating it)")
    return bool(missing)
