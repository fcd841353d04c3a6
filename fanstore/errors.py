"""FanStore's error tree.

Library errors (codec, OS, MPI) are translated into these at the layer that sees them.
Only the FUSE frontends turn them into errnos (``FuseErrno`` in :mod:`fanstore.fuse.kernelfs`,
``pyfuse3.FUSEError`` in :mod:`fanstore.fuse.pyfuse3`), and only :mod:`fanstore.cli` turns
them into a message and an exit status (and the entry points of the processes it starts,
before their logging is set up).
"""

from __future__ import annotations

import errno as _errno


class FanStoreError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with, ``errno`` what FUSE reports."""

    exit_code = 1
    errno = _errno.EIO
    #: Already reported elsewhere (e.g. by rank 0 of a parallel job): exit without a message.
    quiet = False
    #: How the CLI names it: ``fanstore: <label>: <message>``.
    label = "error"


class UsageError(FanStoreError):
    """Bad command-line input or bad arguments to an API call."""

    exit_code = 2
    errno = _errno.EINVAL


class SpecError(UsageError):
    """A mount spec (or what travels with it between FanStore's processes) is not one: a
    key unknown or missing, a value of the wrong type or out of range
    (:mod:`fanstore.strictjson`, :mod:`fanstore.mountspec`). Built from the command line,
    that is bad usage."""


class FormatError(FanStoreError):
    """A store, index or partition is malformed, truncated or inconsistent."""

    exit_code = 1


class DamagedDirectoryError(FormatError):
    """A directory of a loaded index breaks what a lookup in it relies on (its names are not
    strictly sorted by bytes: one is out of order or repeats). ``directory`` is its path in
    the store ("/" for the root): the error is that directory's alone (EIO for a lookup in
    it), and a mount logs it once per directory."""

    def __init__(self, message: str, directory: str) -> None:
        super().__init__(message)
        self.directory = directory


class VersionTooNewError(FormatError):
    """The store was written by a newer FanStore (format version above ours)."""

    exit_code = 33


class VersionTooOldError(FormatError):
    """The store uses a format version this release no longer reads."""

    exit_code = 32


class NotAStoreError(FormatError):
    """The path is not a (complete) FanStore store."""


class CorruptDataError(FanStoreError):
    """Stored bytes failed a checksum or could not be decoded."""

    errno = _errno.EIO


class NotFoundError(FanStoreError):
    errno = _errno.ENOENT


class IsADirectoryError_(FanStoreError):
    errno = _errno.EISDIR


class NotADirectoryError_(FanStoreError):
    errno = _errno.ENOTDIR


class OutsideStoreError(NotFoundError):
    """A path leads through a symlink whose target leaves the store (an absolute target,
    or ``..`` above the root). Such links are stored as they are, as squashfs and tar do:
    the mount shows them and the kernel resolves them on the host; FanStore's own readers
    (the Python API, ``cat``) resolve symlinks only inside the store. From the store's
    point of view the path names nothing, so it is a :class:`NotFoundError` (ENOENT)."""


class SymlinkLoopError(FanStoreError):
    """A path crosses more symlinks than a lookup follows (a loop)."""

    errno = _errno.ELOOP


class PermissionDeniedError(FanStoreError):
    """The asking user may not read this entry (its mode bits, as the mount enforces them)."""

    errno = _errno.EACCES


class ReadOnlyError(FanStoreError):
    """A write to the read-only file system."""

    errno = _errno.EROFS


class InvalidRequestError(FanStoreError):
    """An operation that does not apply to this entry (readlink of a file, ...)."""

    errno = _errno.EINVAL


class PackError(FanStoreError):
    """The source tree cannot be packed as asked (unreadable files, escaping symlinks, ...)."""


class StoreExistsError(PackError):
    """The destination already holds a store and --force was not given."""


class MountError(FanStoreError):
    """Mounting, unmounting or talking to a daemon failed."""


class UnsafePathError(FanStoreError):
    """A path FanStore would write or trust is not safe from other local users: a runtime
    or local directory that is not ours or is open to others, a symlink where a file or
    directory was expected (docs/reliability.md, "Multi-user nodes")."""

    errno = _errno.EACCES


class RemoteError(FanStoreError):
    """A peer daemon did not answer, answered with an error, or is gone."""

    errno = _errno.EIO


class NodeStoppingError(RemoteError):
    """This node stops serving its mount: a read of another node's data that has not been
    answered by then ends (ENOTCONN, as any read of a mount whose daemon goes away)."""

    errno = _errno.ENOTCONN


class StageError(FanStoreError):
    """Copying partitions to node-local storage failed."""


class StorageError(FanStoreError):
    """Object storage (S3) failed: no such bucket, refused credentials, an endpoint that
    stopped answering after the retries, a missing optional dependency."""


class BudgetNotMetError(FanStoreError):
    """The codec selector found no candidate meeting the decompression budget (not a
    failure: the report names the fastest choice; the status tells scripts)."""

    exit_code = 3
    label = "budget not met"
