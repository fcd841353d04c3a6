"""FanStore: a compressed burst-buffer object store for deep-learning training.

Constants and the one entry point of the Python API here; see docs/architecture.md for
the layers.
"""

from fanstore.version import FORMAT_VERSION, __version__

__all__ = ["FORMAT_VERSION", "__version__", "open_store"]


def open_store(path_or_mount, **kwargs):
    """Open a packed store or a live mount for reading (see docs/python-api.md)."""
    from fanstore.api import open_store as _open_store

    return _open_store(path_or_mount, **kwargs)
