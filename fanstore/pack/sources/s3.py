"""Objects under an S3 prefix, read with parallel range requests.

The prefix is listed once (every key below it, sorted), then the objects are read in that
order: a pool of ``streams`` threads fetches byte ranges (8 MiB) ahead of the packer, at
most ``window`` bytes in flight, so many small objects and a few huge ones both keep the
streams busy. Each key becomes a file (mode 0644, mtime = LastModified); directories are
implied by the keys (mode 0755). S3 has no modes, symlinks, hard links or empty
directories, so a store packed from S3 has none either; keys ending in '/' (directory
markers some tools write) are left out.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

from fanstore.errors import PackError
from fanstore.format.index import KIND_FILE, clamp_mtime_ns
from fanstore.pack.sources.base import Member, Source
from fanstore.storage import open_location

RANGE = 8 << 20


class S3Source(Source):
    what = "S3 prefix"
    has_modes = False  # every object would say 0644: the store is private unless --shared

    def __init__(self, url: str, streams: int = 8, block: int = RANGE,
                 window: int | None = None) -> None:
        self.loc = open_location(url)
        self.url = self.loc.url
        self.streams = max(1, streams)
        self.block = block
        self.window = window or max(64 << 20, 2 * self.streams * block)
        self.loc.check()
        objects = self.loc.list()
        if not objects:
            raise PackError(f"{self.url}: no objects under this prefix")
        self.objects = sorted(objects.items())
        self.total_bytes = sum(size for _, (size, _) in self.objects)
        self._read = 0

    @property
    def bytes_read(self) -> int:
        return self._read

    def members(self) -> Iterator[Member]:
        ranges = [(i, start, min(start + self.block, size))
                  for i, (_, (size, _)) in enumerate(self.objects)
                  for start in range(0, size, self.block)]
        pending: deque[tuple[int, int, Future]] = deque()
        nxt = 0
        inflight = 0
        pool = ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="s3-read")

        def fill() -> None:
            nonlocal nxt, inflight
            while nxt < len(ranges) and (inflight < self.window or not pending):
                i, a, b = ranges[nxt]
                name = self.objects[i][0]
                pending.append((i, b - a, pool.submit(self.loc.read_range, name, a, b)))
                inflight += b - a
                nxt += 1

        try:
            for i, (name, (size, mtime)) in enumerate(self.objects):
                buf = bytearray()

                def read(n: int, _i=i, _buf=buf) -> bytes:
                    nonlocal inflight
                    while len(_buf) < n and pending and pending[0][0] == _i:
                        _, length, fut = pending.popleft()
                        data = fut.result()  # a StorageError names the object and range
                        inflight -= length
                        self._read += length
                        _buf += data
                        fill()
                    out = bytes(_buf[:n])
                    del _buf[:n]
                    return out

                fill()
                yield Member(name.encode("utf-8", "surrogateescape"), KIND_FILE, 0o644,
                             clamp_mtime_ns(mtime), size, read=read, where=self.url, ordinal=i)
                # Skip whatever the packer did not read (a refused name, say).
                while pending and pending[0][0] == i:
                    _, length, fut = pending.popleft()
                    fut.cancel()
                    inflight -= length
                    self._read += length
                fill()
        finally:
            for _, _, fut in pending:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
