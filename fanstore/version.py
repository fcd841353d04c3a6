"""The release and the on-disk format version it writes (docs/format.md)."""

__version__ = "0.1.0"

#: Version of the on-disk format written by this release (docs/format.md).
FORMAT_VERSION = 1
