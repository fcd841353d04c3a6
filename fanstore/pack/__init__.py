"""``fanstore pack``: scan a source tree, plan partitions, compress in parallel, write a store."""

from fanstore.pack.plan import CodecPolicy, plan_partitions
from fanstore.pack.scan import ScanEntry, ScanResult, scan_tree
from fanstore.pack.write import PackOptions, PackSummary, pack

__all__ = [
    "CodecPolicy",
    "PackOptions",
    "PackSummary",
    "ScanEntry",
    "ScanResult",
    "pack",
    "plan_partitions",
    "scan_tree",
]
