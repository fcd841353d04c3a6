"""FanStore: a compressed burst-buffer object store for deep-learning training.

Constants only here; see docs/architecture.md for the layers.
"""

__version__ = "0.1.0"

#: Newest on-disk format this release reads and writes (docs/format.md). A store is written
#: in the oldest version that can hold it: v1 unless some file lives in a solid block (v2).
FORMAT_VERSION = 2


def open_store(path_or_mount, **kwargs):
    """Open a packed store or a live mount for reading (see docs/python-api.md)."""
    from fanstore.api import open_store as _open_store

    return _open_store(path_or_mount, **kwargs)
