"""The on-disk format (v5; v1-v4 still read): pure, synchronous, no MPI/FUSE/trio.

The index: :mod:`.layout` (bytes), :mod:`.build` (written by a pack), :mod:`.load` and
:mod:`.validate` (read and checked), :mod:`.tables` (the loaded :class:`Index`); the data:
:mod:`.partition`; :mod:`.localcopy` and :mod:`.symlinks` for staged copies and links.

The canonical byte layout is docs/format.md; the constants and struct layouts here are its
executable form and the two must change together.
"""

from fanstore.format.index import (
    CHUNK_COLUMNS,
    ENTRY_COLUMNS,
    INDEX_NAME,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    Index,
    IndexBuilder,
    read_index,
    read_index_bytes,
    write_index,
)
from fanstore.format.partition import (
    PARTITION_HEADER_SIZE,
    PartitionWriter,
    partition_name,
    read_partition_header,
)

__all__ = [
    "CHUNK_COLUMNS",
    "ENTRY_COLUMNS",
    "INDEX_NAME",
    "KIND_DIR",
    "KIND_FILE",
    "KIND_SYMLINK",
    "Index",
    "IndexBuilder",
    "PARTITION_HEADER_SIZE",
    "PartitionWriter",
    "partition_name",
    "read_index",
    "read_index_bytes",
    "read_partition_header",
    "write_index",
]
