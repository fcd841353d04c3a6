"""``fanstore pack``: read a source (a directory, tar shards, a zip file, an S3 prefix),
compress it into partitions in parallel, write a store (locally or to S3)."""

from fanstore.pack.options import PackOptions, PackSummary
from fanstore.pack.plan import CodecPolicy, plan_partitions
from fanstore.pack.scan import ScanEntry, ScanResult, scan_tree
from fanstore.pack.write import pack


def pack_any(src: str, dest: str, policy: CodecPolicy | None = None,
             options: PackOptions | None = None, streams: int = 0) -> PackSummary:
    """Pack SRC, whatever kind it is (see ``fanstore.pack.sources.detect``), into DEST (a
    path or an ``s3://`` URL). A directory takes the planned path (``pack``); anything
    else is streamed (``fanstore.pack.stream``). ``streams``: parallel S3 range reads
    (0: ``options.jobs``, or 8)."""
    from fanstore.pack.sources import DirectorySource, open_source
    from fanstore.pack.stream import pack_stream

    options = options or PackOptions()
    source = open_source(src, streams=streams or options.jobs or 8)
    if isinstance(source, DirectorySource):
        return pack(src, dest, policy, options)
    return pack_stream(source, dest, policy, options)


__all__ = [
    "CodecPolicy",
    "PackOptions",
    "PackSummary",
    "ScanEntry",
    "ScanResult",
    "pack",
    "pack_any",
    "plan_partitions",
    "scan_tree",
]
