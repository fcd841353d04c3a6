"""What a pack is asked (:class:`PackOptions`) and what it reports (:class:`PackSummary`),
shared by both packers: the planned one of a directory (``fanstore.pack.write``) and the
streaming one of archives and S3 prefixes (``fanstore.pack.stream``); and the checks of
both on the options and on the entries a source cannot give."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fanstore.errors import PackError, UsageError
from fanstore.format.index import MAX_CHUNK_SIZE

log = logging.getLogger(__name__)


class Symlinks(enum.Enum):
    """What a pack does with a symlink that leads outside the source (``--symlinks``): an
    absolute target outside it, ``..`` above its root, or a chain of symlinks that climbs
    out. A symlink that stays inside is kept as a symlink in every mode."""

    #: kept as a symlink, its target as it is (as mksquashfs and tar do): the mount shows
    #: it and the kernel resolves it on the host; FanStore's own readers do not follow it
    STORE = "store"
    #: the regular file it leads to is stored in its place (a directory source only; a
    #: dangling or looping one, or one to a directory, cannot be packed)
    FOLLOW = "follow"
    #: left out; the summary says how many
    SKIP = "skip"


@dataclass
class PackOptions:
    partitions: int = 8
    jobs: int = 0  # 0: all cores
    chunk_size: int = 1 << 20
    skip_unreadable: bool = False
    force: bool = False
    broadcast: list[str] = field(default_factory=list)
    progress: bool | None = None  # None: on a terminal only
    extra_meta: dict[str, Any] = field(default_factory=dict)
    #: the owner means to share the store: the umask decides its modes even when the
    #: source holds entries other users may not read (``--shared``; see pack.access)
    shared: bool = False
    #: symlinks that lead outside the source (``--symlinks``)
    symlinks: Symlinks = Symlinks.STORE
    #: files whose bytes equal an earlier file's are stored once (``--no-dedup``: each
    #: gets its own chunks; a directory source only: fanstore.pack.dedup)
    dedup: bool = True
    #: shows one line to the user (the CLI prints it; the default logs a warning)
    notify: Callable[[str], None] = field(default=lambda text: log.warning("%s", text))


@dataclass
class PackSummary:
    dest: str
    files: int
    dirs: int
    symlinks: int
    raw_bytes: int
    stored_bytes: int
    index_bytes: int
    partitions: int
    seconds: float
    skipped: list[str]
    #: symlinks that lead outside the source, left out (``--symlinks skip``)
    outside_skipped: int = 0
    #: files stored once as a copy of an earlier identical file, and their bytes
    duplicates: int = 0
    saved_bytes: int = 0
    #: files a codec of some inputs only (jpegxl) declined: stored raw (pack.fallback)
    fallbacks: Any = None
    #: where the time went: (phase, seconds) in order (a directory's pack)
    phases: list[tuple[str, float]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def ratio_with_index(self) -> float:
        """Raw bytes over everything the store holds (on many small files the index, with
        its dictionaries, is a few percent of the store)."""
        total = self.stored_bytes + self.index_bytes
        return self.raw_bytes / total if total else 1.0

    def lines(self) -> list[str]:
        mb_s = self.raw_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0
        left_out = (f" ({self.outside_skipped:,} leading outside the source left out)"
                    if self.outside_skipped else "")
        return [
            (f"packed {self.files:,} files, {self.dirs:,} directories, {self.symlinks:,} "
             f"symlinks{left_out} into {self.partitions} partitions at {self.dest}"),
            (f"raw {_mb(self.raw_bytes)}, stored {_mb(self.stored_bytes)} "
             f"(+ index {_mb(self.index_bytes)}), ratio {self.ratio:.2f}x "
             f"({self.ratio_with_index:.2f}x with the index)"),
            f"time {self.seconds:.1f} s, {mb_s:.0f} MB/s" + (
                " (" + ", ".join(f"{name} {t:.1f} s" for name, t in self.phases) + ")"
                if self.phases else ""),
        ] + self._dedup_lines() + (self.fallbacks.lines() if self.fallbacks else []) + (
            [f"skipped {len(self.skipped)} entries (--skip-unreadable)"] if self.skipped else [])


    def _dedup_lines(self) -> list[str]:
        if not self.duplicates:
            return []
        n = self.duplicates
        what = "1 file identical to an earlier one" if n == 1 else \
            f"{n:,} files identical to earlier ones"
        return [f"{what} stored once: {_mb(self.saved_bytes)} of raw data not stored again"]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def check_symlinks(symlinks: Symlinks, source_kind: str) -> None:
    """``--symlinks follow`` needs a directory source: a symlink in an archive or under an
    S3 prefix that leads outside it leads to nothing a pack may read (never the host's
    files: a hostile archive would pack them)."""
    if symlinks is Symlinks.FOLLOW and source_kind != "directory":
        raise UsageError(f"--symlinks follow needs a directory source; with a {source_kind} "
                         "source give --symlinks store or skip")


def check_options(options: PackOptions) -> None:
    if options.partitions < 1:
        raise UsageError("--partitions must be at least 1")
    if not 4096 <= options.chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"chunk size must be between 4 KiB and {MAX_CHUNK_SIZE >> 20} MiB")


def report_problems(problems: list[str], options: PackOptions) -> list[str]:
    """Fail listing ``problems`` (entries that cannot be packed), or, with
    ``--skip-unreadable``, list them as skipped and return them."""
    if not problems:
        return []
    if not options.skip_unreadable:
        for p in problems:
            options.notify(f"cannot pack {p}")
        n = len(problems)
        raise PackError(
            f"{n} entr{'y' if n == 1 else 'ies'} cannot be packed (listed above); fix "
            "them or pass --skip-unreadable to leave them out"
        )
    for p in problems:
        options.notify(f"skipping {p}")
    return list(problems)
