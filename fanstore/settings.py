"""The environment, read once: every ``FANSTORE_*`` variable a user may set, typed and checked.

This is the only module of FanStore that reads ``FANSTORE_*`` variables
(``tests/test_layers.py`` fails on a read anywhere else). It reads them once per process
(:func:`current`), and the edges ask first: the ``fanstore`` command before anything else,
so a bad value is one line and exit status 2, never a silent default; the Python API on
first use. What the variables set then travels in the mount's one typed spec
(:class:`fanstore.mountspec.MountSpec`, which reaches the kernel frontend process and the
worker ranks as it is), which is all deeper code reads: a worker process never looks at
the environment.

=============================  ====================================  =====================
variable                       what it sets                          default
=============================  ====================================  =====================
``FANSTORE_FRONTEND``          ``fanstore mount --frontend``'s        ``auto``
                               default: auto, kernel, pyfuse3
``FANSTORE_FUSE_FLAGS``        ``fanstore mount --fuse-flags``'s      none
                               default: ``+NAME,-NAME`` edits of
                               the kernel frontend's INIT flags
                               (``-DO_READDIRPLUS`` for a bare
                               ``find`` over millions of files)
``FANSTORE_STORAGE_OPTIONS``   object-storage options (JSON, or       none
                               ``@FILE``) when a command has no
                               ``--storage-options``
``FANSTORE_RUNTIME_DIR``       where mounts keep sockets, logs and    ``$XDG_RUNTIME_DIR/
                               state                                  fanstore``, else
                                                                      ``/tmp/fanstore-UID``
``FANSTORE_SHM_DIR``           where a node's shared index copy       ``/dev/shm``
                               lives (a tmpfs, sticky or ours)
``FANSTORE_MPI_PIECE``         bytes per message of a remote read's   ``8000`` (MPICH's
                               reply (0: one message per reply)       eager limit here)
=============================  ====================================  =====================

The job scripts in ``slurm/`` read variables of their own (``FANSTORE_WORKERS``,
``FANSTORE_MOUNT``, ...; docs/slurm.md): they become command-line options there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fanstore import fuseflags
from fanstore.errors import UsageError

FRONTENDS = ("auto", "kernel", "pyfuse3")
#: A remote read's reply in messages under MPICH's eager limit on shared memory (8 KB:
#: 8,000-byte sends complete at once, 10,000-byte ones wait for the receiver; measured here).
DEFAULT_MPI_PIECE = 8000
#: The smallest piece that carries a reply header and data (daemon/protocol.py's RESP).
MIN_MPI_PIECE = 64
SHM_DIR = "/dev/shm"
#: Every variable this module reads (the others a user sets are for slurm/'s scripts).
VARIABLES = ("FANSTORE_FRONTEND", "FANSTORE_FUSE_FLAGS", "FANSTORE_STORAGE_OPTIONS",
             "FANSTORE_RUNTIME_DIR", "FANSTORE_SHM_DIR", "FANSTORE_MPI_PIECE")


@dataclass(frozen=True)
class Settings:
    """The environment, typed. ``runtime_dir`` is ``FANSTORE_RUNTIME_DIR`` (None: not set);
    ``xdg_runtime_dir`` the login session's, which the runtime root falls back on."""

    frontend: str = "auto"
    fuse_flags: str = ""
    storage_options: str | None = None
    runtime_dir: str | None = None
    xdg_runtime_dir: str | None = None
    shm_dir: str = SHM_DIR
    mpi_piece: int = DEFAULT_MPI_PIECE


def from_environ(env: Mapping[str, str]) -> Settings:
    """Settings from ``env``; :class:`UsageError` (one line, naming the variable) for a
    value that is not one."""
    frontend = env.get("FANSTORE_FRONTEND") or "auto"
    if frontend not in FRONTENDS:
        raise UsageError(f"$FANSTORE_FRONTEND must be one of {', '.join(FRONTENDS)}, got "
                         f"{frontend!r}")
    flags = env.get("FANSTORE_FUSE_FLAGS", "").strip()
    try:
        fuseflags.check(flags)  # the one check of INIT flag edits (the mount spec's too)
    except ValueError as exc:
        raise UsageError(f"$FANSTORE_FUSE_FLAGS: {exc}") from None
    text = env.get("FANSTORE_MPI_PIECE", "").strip()
    try:
        piece = int(text) if text else DEFAULT_MPI_PIECE
    except ValueError:
        piece = -1
    if piece != 0 and piece < MIN_MPI_PIECE:
        raise UsageError(f"$FANSTORE_MPI_PIECE must be 0 (one message per reply) or a number "
                         f"of bytes of at least {MIN_MPI_PIECE}, got {text!r}")
    runtime = env.get("FANSTORE_RUNTIME_DIR") or None
    if runtime is not None and not os.path.isabs(runtime):
        runtime = os.path.abspath(runtime)
    xdg = env.get("XDG_RUNTIME_DIR") or None
    return Settings(frontend=frontend, fuse_flags=flags,
                    storage_options=env.get("FANSTORE_STORAGE_OPTIONS") or None,
                    runtime_dir=runtime,
                    xdg_runtime_dir=xdg if xdg and os.path.isabs(xdg) else None,
                    shm_dir=env.get("FANSTORE_SHM_DIR") or SHM_DIR, mpi_piece=piece)


_current: Settings | None = None


def current() -> Settings:
    """This process's settings, read from the environment on the first call."""
    global _current
    if _current is None:
        _current = from_environ(os.environ)
    return _current


def reset() -> None:
    """Forget what was read (tests that change the environment call this)."""
    global _current
    _current = None


__all__ = ["DEFAULT_MPI_PIECE", "FRONTENDS", "SHM_DIR", "VARIABLES", "Settings", "current",
           "from_environ", "reset"]
