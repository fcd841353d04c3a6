"""The read core: locate, fetch, decode, verify and cache chunks; one path for every reader.

Pure and synchronous (no trio, FUSE or MPI). See :mod:`fanstore.read.core`.
"""

from fanstore.read.cache import ChunkCache
from fanstore.read.core import ChunkReader
from fanstore.read.decode import Decoder, assemble, chunk_span
from fanstore.read.partitions import LocalPartitions
from fanstore.read.sources import ChunkSource, RemoteSource, RoutedSource
from fanstore.read.stats import ReadStats

__all__ = [
    "ChunkCache",
    "ChunkReader",
    "ChunkSource",
    "Decoder",
    "LocalPartitions",
    "ReadStats",
    "RemoteSource",
    "RoutedSource",
    "assemble",
    "chunk_span",
]
