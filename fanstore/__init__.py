"""FanStore: a compressed burst-buffer object store for deep-learning training.

Constants only here; see docs/architecture.md for the layers.
"""

__version__ = "0.1.0"

#: Version of the on-disk format written by this release (docs/format.md).
FORMAT_VERSION = 1


def open_store(path_or_mount, **kwargs):
    """Open a packed store or a live mount for reading (see docs/python-api.md)."""
    from fanstore.api import open_store as _open_store

    return _open_store(path_or_mount, **kwargs)
