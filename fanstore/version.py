"""The release and the on-disk format versions it reads and writes (docs/format.md)."""

__version__ = "0.1.0"

#: Newest on-disk format this release reads and writes (docs/format.md). A store is written
#: in the oldest version that can hold it: v1 unless some file lives in a solid block (v2).
FORMAT_VERSION = 3
