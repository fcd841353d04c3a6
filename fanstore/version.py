"""The release and the on-disk format versions it reads and writes (docs/format.md)."""

__version__ = "0.1.0"

#: Newest on-disk format this release reads and writes (docs/format.md). A store is written
#: in the oldest version that can hold it: v3, or v4 when identical files of several chunks
#: share one run (pack's dedup).
FORMAT_VERSION = 4
