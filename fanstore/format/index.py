"""The store index (docs/format.md): the whole namespace and where every chunk lives.

This module is the index's public face: the rest of FanStore imports the format's names
from here. Each job lives in a module of its own:

- :mod:`fanstore.format.layout`: the byte layout (constants, column dtypes, the header
  struct and its checks, the lookup table's name hash, the partition table's rows).
- :mod:`fanstore.format.build`: building an index from a pack's rows and writing it.
- :mod:`fanstore.format.tables`: the loaded :class:`Index` and its lookups.
- :mod:`fanstore.format.load`: reading an index from a store, checked and parsed.
- :mod:`fanstore.format.localcopy`: the node-local copy of a loaded index's body that the
  processes of a node share.
- :mod:`fanstore.format.validate`: the checks every index read from disk passes first.
"""

from __future__ import annotations

from fanstore.format.build import (
    IndexBuilder,
    encode_index,
    lookup_table,
    needs_v2,
    write_index,
)
from fanstore.format.layout import (
    BLOB_COLUMNS,
    CHUNK_COLUMNS,
    ENTRY_COLUMNS,
    INDEX_HEADER_SIZE,
    INDEX_MAGIC,
    INDEX_NAME,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    LOOKUP_COLUMNS,
    MAX_CHUNK_SIZE,
    MAX_INDEX_BODY,
    MAX_INDEX_RATIO,
    MAX_NAME,
    MAX_TARGET,
    MTIME_MAX_NS,
    MTIME_MIN_NS,
    PartitionInfo,
    clamp_mtime_ns,
    name_hash,
    parse_index_header,
)
from fanstore.format.load import parse_body, read_index, read_index_bytes, read_index_file
from fanstore.format.localcopy import index_body_parts, map_index_body, write_index_body
from fanstore.format.tables import Index
from fanstore.format.validate import target_stays_inside, validate_index

__all__ = [
    "BLOB_COLUMNS",
    "CHUNK_COLUMNS",
    "ENTRY_COLUMNS",
    "INDEX_HEADER_SIZE",
    "INDEX_MAGIC",
    "INDEX_NAME",
    "KIND_DIR",
    "KIND_FILE",
    "KIND_SYMLINK",
    "LOOKUP_COLUMNS",
    "MAX_CHUNK_SIZE",
    "MAX_INDEX_BODY",
    "MAX_INDEX_RATIO",
    "MAX_NAME",
    "MAX_TARGET",
    "MTIME_MAX_NS",
    "MTIME_MIN_NS",
    "Index",
    "IndexBuilder",
    "PartitionInfo",
    "clamp_mtime_ns",
    "encode_index",
    "index_body_parts",
    "lookup_table",
    "map_index_body",
    "name_hash",
    "needs_v2",
    "parse_body",
    "parse_index_header",
    "read_index",
    "read_index_bytes",
    "read_index_file",
    "target_stays_inside",
    "validate_index",
    "write_index",
    "write_index_body",
]
