"""Unix-domain socket paths of any length.

A socket's address holds at most 107 bytes of path (``sun_path``), and a runtime directory
under a deep ``$XDG_RUNTIME_DIR`` or ``$FANSTORE_RUNTIME_DIR`` (or a test's temporary
directory) can be longer. :func:`address` gives a path that fits for the time of one
``bind``/``connect``: the path itself when it fits, else the socket's name under
``/proc/self/fd/N`` of its directory opened ``O_PATH``, which the kernel resolves to the
same directory. The directory is the one the caller named, resolved once (a symlink in
it is not followed at the last step: a socket file replaced by a symlink is refused by
``connect`` as before).

Standard library only, so that the kernel-protocol engine can use it too.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["MAX_PATH", "address"]

#: The longest path a ``sockaddr_un`` holds (108 bytes with its terminating NUL).
MAX_PATH = 107


@contextlib.contextmanager
def address(path: str) -> Iterator[str]:
    """A path for ``bind``/``connect`` to ``path``, valid inside the ``with`` block."""
    if len(os.fsencode(path)) <= MAX_PATH:
        yield path
        return
    directory, name = os.path.split(path)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        short = f"/proc/self/fd/{fd}/{name}"
        if len(os.fsencode(short)) > MAX_PATH:
            raise OSError(f"socket name too long: {name!r}")
        yield short
    finally:
        os.close(fd)
