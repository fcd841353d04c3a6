"""The release and the on-disk format versions it reads and writes (docs/format.md)."""

__version__ = "0.1.0"

#: Newest on-disk format this release reads and writes (docs/format.md): ``fanstore pack``
#: writes v5 (a compact index); v1 to v4 are still read.
FORMAT_VERSION = 5
