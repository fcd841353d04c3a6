"""``fanstore select --check STORE_OR_MOUNT``: read a packed store the way a selection
predicted, and compare.

The prediction comes from ``--report FILE`` (the JSON of ``fanstore select --json``) or
from the store itself (``pack --codec auto`` records its selection in the index metadata);
its mode, cores and reader are the defaults of the check, so the check reads the way the
prediction was made. The read is one epoch (:mod:`.epoch`): every file of the store once,
in a shuffled order (prefetch mode: the order handed to the mount first), by ``--cores``
readers (at most the cores here; more are scaled as the selection scales them). A store is
mounted afresh in a temporary directory (``--workers`` at most ``--cores``, as the trials
mount) after its partitions are dropped from the page cache, so the epoch is cold as the
selection's trials are (checked with ``mincore``: a store on a tmpfs is said not to be);
a live mount is read as it is (its page cache as the job left it) and in its own mode.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fanstore.errors import FanStoreError, UsageError
from fanstore.select.epoch import COLD_RESIDENT, PassResult, Target, drop_page_cache, run_pass
from fanstore.select.measuring import local_cores
from fanstore.select.policy import MODES, Budget
from fanstore.select.tempmount import mount, unmount
from fanstore.select.trial import API_CACHE_MB, HowToRead

MB = 1e6


@dataclass
class Prediction:
    """What a selection predicted for the store: its rates per node (raw bytes/s and
    files/s), how it was made, and the budget it was made for. ``per_kind``: the per-kind
    mix (kind -> codec label) the prediction is for, when the store holds it; None: the
    single choice ``chosen``."""

    files_per_s: float | None
    bytes_per_s: float | None
    rate_from: str
    mode: str
    cores: int | None
    reader: str | None
    chosen: str | None
    required_bytes_per_s: float | None
    required_files_per_s: float | None
    where: str
    per_kind: dict[str, str] | None = None

    @classmethod
    def from_report(cls, doc: dict[str, Any], where: str,
                    codecs: Sequence[str] = ()) -> Prediction:
        """The prediction of report ``doc`` for a store holding ``codecs`` (specs, as
        :func:`run_check` lists them): the per-kind mix's when the store holds the mix
        (:func:`packed_mix`), else the single choice's."""
        if not isinstance(doc, dict) or doc.get("quick"):
            raise UsageError(f"{where}: not the report of a full selection (fanstore select "
                             "--json)")
        mix = packed_mix(doc, codecs)
        pred = (doc.get("per_kind_predicted") if mix else doc.get("predicted")) or {}
        budget = doc.get("budget") or {}
        mb = pred.get("mb_per_s", pred.get("node_mb_per_s"))
        files = pred.get("files_per_s", pred.get("node_files_per_s"))
        req_mb = budget.get("required_mb_per_s")
        reader = (doc.get("reader") or {}).get("reader") if doc.get("reader") else None
        return cls(files, None if mb is None else mb * MB, pred.get("rate_from", "model"),
                   doc.get("mode", "sync"), budget.get("cores"), reader, doc.get("chosen"),
                   None if req_mb is None else req_mb * MB,
                   budget.get("required_files_per_s"), where, mix)

    def describe(self) -> str:
        """What the prediction is for: the codec, or the per-kind mix."""
        if self.per_kind is None:
            return str(self.chosen)
        return "the per-kind mix (" + ", ".join(f"{k}={v}" for k, v in
                                                 sorted(self.per_kind.items())) + ")"

    def specs(self) -> set[str]:
        """The codec specs a store packed as predicted may hold."""
        labels = [str(self.chosen)] if self.per_kind is None else list(self.per_kind.values())
        return {"none"}.union(*(_specs(label) for label in labels))


def packed_mix(doc: dict[str, Any], codecs: Sequence[str]) -> dict[str, str] | None:
    """The per-kind mix of report ``doc`` if a store of ``codecs`` holds it, else None.

    A report whose mix met the budget ends with the command that packs the mix
    (``--kind-codec``), and ``pack --codec auto --per-kind`` stores it; its
    ``pack_command_single`` packs the single choice. The store tells which: one packed with
    the single choice holds none of the codecs only the mix uses. (A mix that differs from
    the single choice in solid blocks alone holds the same codecs: the mix, as the report's
    command packs it.)"""
    mix = doc.get("per_kind")
    pred = doc.get("per_kind_predicted")
    if not isinstance(mix, dict) or not isinstance(pred, dict) or not pred.get("met"):
        return None
    mix = {str(k): str(v) for k, v in mix.items()}
    only_mix = set().union(*(_specs(label) for label in mix.values())) \
        - _specs(str(doc.get("chosen"))) - {"none"}
    if only_mix and codecs and not only_mix & set(codecs):
        return None
    return mix


def _specs(label: str) -> set[str]:
    """The codec specs a store's codec table shows for ``label``: without its solid-block
    suffix, and for a ``+dict`` label also plain zstd (kinds without a dictionary)."""
    base = _base(label)
    return {base, base.replace("+dict", "")}


@dataclass
class CheckResult:
    path: str
    kind: str  # "store" or "mount"
    mode: str
    reader: str
    readers: int
    cores: int
    files: int
    bytes: int
    passed: PassResult
    files_per_s: float
    bytes_per_s: float
    scaled: bool
    prediction: Prediction | None
    codecs: list[str] = field(default_factory=list)
    ratio: float | None = None
    seconds: float = 0.0

    @property
    def met(self) -> bool | None:
        """Whether the read meets the budget the prediction was made for (None: no
        budget known)."""
        p = self.prediction
        if p is None or not p.required_bytes_per_s:
            return None
        budget = Budget(p.mode if p.mode in MODES else "sync", p.required_bytes_per_s,
                        max(1, p.cores or 1), math.inf)
        return budget.met_by(self.bytes_per_s)


def load_prediction(path: str | None, meta: dict[str, Any],
                    codecs: Sequence[str] = ()) -> Prediction | None:
    """From ``--report FILE``, else the store's recorded selection, else None; for a
    store of ``codecs`` (:meth:`Prediction.from_report`)."""
    if path:
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as exc:
            raise UsageError(f"--report {path}: {exc.strerror}") from None
        except ValueError:
            raise UsageError(f"--report {path}: not JSON (the output of fanstore select "
                             "--json)") from None
        return Prediction.from_report(doc, path, codecs)
    sel = meta.get("selection")
    if isinstance(sel, dict) and not sel.get("quick") and sel.get("predicted"):
        return Prediction.from_report(sel, "the store's recorded selection", codecs)
    return None


def run_check(path: str, mode: str | None, cores: int | None, reader: str | None,
              report: str | None = None, max_files: int = 0, seed: int = 0) -> CheckResult:
    """Read ``path`` (a store or a live mount) as the prediction says; see the module
    docstring. ``max_files``: read a random sample of that many files (0: every file)."""
    from fanstore.api import MountReader, open_store
    from fanstore.format.index import read_index

    t0 = time.monotonic()
    if not os.path.exists(path):
        raise UsageError(f"--check {path}: no such store or mount point (it does not exist)")
    handle = open_store(path)
    try:
        if isinstance(handle, MountReader):
            kind, store_path, mount_mode = "mount", handle.store_path, handle.mode
        else:
            kind, store_path, mount_mode = "store", path, None
        ns = handle.ns
        entries = list(ns.walk_files(0))
        rels = [os.fsdecode(ns.path(e)) for e in entries]
        sizes = dict(zip(rels, (int(x) for x in ns.index.entries["size"][entries]))) \
            if entries else {}
    finally:
        handle.close()
    index = read_index(store_path)
    codecs = sorted({_spec(cfg) for cfg in index.codecs[1:]}) or ["none"]
    pred = load_prediction(report, index.meta, codecs)
    mode = mount_mode or mode or (pred.mode if pred else None) or "sync"
    cores = cores or (pred.cores if pred and pred.cores else None) or local_cores()
    reader = reader or (pred.reader if pred and pred.reader else None) or "mount"
    if not rels:
        raise UsageError(f"{path}: the store holds no files to read")
    rng = random.Random(seed)
    order = list(rels)
    rng.shuffle(order)
    if max_files and max_files < len(order):
        order = order[:max_files]
    readers = max(1, min(cores, local_cores()))
    if kind == "mount":
        target = Target(reader, path, order_to=path if mode == "prefetch" else None)
        passed = run_pass(target, order, readers, watch=path)
    else:
        passed = _fresh_pass(path, order, readers, reader, mode,
                             HowToRead(reader, mode, readers, cores).workers)
    if passed.errors:
        raise FanStoreError(f"{path}: {passed.errors} file(s) could not be read (first: "
                            f"{passed.first_error})")
    files_s, bytes_s = passed.files_per_s, passed.bytes_per_s
    scaled = cores > readers and passed.cpu > 0
    if scaled:
        factor = max(1.0, min(cores / readers, cores * passed.seconds / passed.cpu))
        files_s, bytes_s = files_s * factor, bytes_s * factor
    raw = sum(sizes[r] for r in order)
    stored = int(index.chunks["stored"].sum(dtype="u8"))
    total_raw = int(index.chunks["raw"].sum(dtype="u8"))
    return CheckResult(path, kind, mode, reader, readers, cores, len(order), raw, passed,
                       files_s, bytes_s, scaled, pred, codecs,
                       total_raw / stored if stored else None, time.monotonic() - t0)


def _spec(cfg: dict[str, Any]) -> str:
    from compressors import get_codec

    try:
        return get_codec(cfg).spec
    except FanStoreError:
        return str(cfg.get("id"))


def _fresh_pass(store: str, order: list[str], readers: int, reader: str,
                mode: str, workers: int) -> PassResult:
    """A cold epoch of ``store``: its files dropped from the page cache (``resident``:
    what stayed), a fresh temporary mount of ``workers`` (or the API on the store, in
    sync mode)."""
    resident = drop_page_cache([store]).fraction
    if reader == "api" and mode == "sync":
        passed = run_pass(Target("api", store, cache_mb=API_CACHE_MB), order, readers)
        passed.resident = resident
        return passed
    tmp = tempfile.mkdtemp(prefix="fanstore-check-")
    mnt = os.path.join(tmp, "mnt")
    os.mkdir(mnt)
    try:
        mount(store, mnt, "--mode", mode, "--workers", str(workers))
        try:
            passed = run_pass(Target(reader, mnt, order_to=mnt if mode == "prefetch"
                                     else None), order, readers, watch=mnt)
        finally:
            unmount(mnt)
    finally:
        if not os.path.ismount(mnt):
            shutil.rmtree(tmp, ignore_errors=True)
    passed.resident = resident
    return passed


def _start(res: CheckResult) -> str:
    """How the read started: cold (checked), not cold, or a live mount as it was."""
    if res.kind == "mount":
        return "as the mount is (its page cache as the job left it)"
    resident = res.passed.resident
    if resident is None:
        return "page cache dropped (not checked: no mincore), a fresh mount"
    if resident <= COLD_RESIDENT:
        return "cold (page cache dropped, a fresh mount)"
    return (f"NOT cold: {resident:.0%} of the store stayed in the page cache after the drop "
            "(a tmpfs?), a fresh mount")


def report_lines(res: CheckResult) -> list[str]:
    """The check's report: what was read and how, predicted vs measured, the budget."""
    p = res.prediction
    how = ("through a temporary mount" if res.reader == "mount" else
           "with the Python API") if res.kind == "store" else \
        ("through the live mount" if res.reader == "mount" else
         "with the Python API on the live mount")
    cold = _start(res)
    order = "the order handed to the mount first" if res.mode == "prefetch" else \
        "a shuffled order"
    ratio = f", ratio {res.ratio:.2f}x" if res.ratio else ""
    lines = [f"check     {res.path}: {res.files:,} files, {res.bytes / MB:,.1f} MB "
             f"({', '.join(res.codecs)}{ratio})",
             f"read      {res.mode}, {res.readers} reader{'s' if res.readers != 1 else ''} "
             f"{how}, {cold}, every file once in {order} ({res.passed.seconds:.1f} s)"]
    cpu = res.passed.cpu / max(1, res.passed.files) * 1e6
    scaled = (f", scaled from {res.readers} readers to {res.cores} cores by the CPU per file"
              if res.scaled else "")
    if p is None or p.files_per_s is None:
        lines.append("predicted none: give --report FILE (the output of fanstore select "
                     "--json); a store packed with --codec auto carries its own")
    else:
        lines.append(f"predicted {p.files_per_s:,.0f} files/s ({(p.bytes_per_s or 0) / MB:,.0f} "
                     f"MB/s) per node, {p.mode}, {p.cores} cores, {p.rate_from}, for "
                     f"{p.describe()} ({p.where})")
    ratio_s = (f": {res.files_per_s / p.files_per_s:.2f}x the prediction"
               if p is not None and p.files_per_s else "")
    lines.append(f"measured  {res.files_per_s:,.0f} files/s ({res.bytes_per_s / MB:,.0f} MB/s) "
                 f"per node{scaled}{ratio_s}; {cpu:,.0f} µs of CPU per file (readers and "
                 "mount)")
    if p is not None and p.chosen and _holds_other(p, res.codecs):
        lines.append(f"note      the prediction is for {p.describe()}; this store holds "
                     f"{', '.join(res.codecs)}")
    if p is not None and p.mode != res.mode:
        lines.append(f"note      the prediction is for {p.mode} mode; this {res.kind} was read "
                     f"in {res.mode} mode")
    if res.met is not None and p is not None and p.required_bytes_per_s:
        need = p.required_bytes_per_s
        lines.append(f"budget    {need / MB:,.0f} MB/s"
                     + (f" ({p.required_files_per_s:,.0f} files/s)"
                        if p.required_files_per_s else "")
                     + (": met" if res.met else
                        f": NOT met ({res.bytes_per_s / need:.0%} of it)"))
    return lines


def _holds_other(p: Prediction, codecs: Sequence[str]) -> bool:
    """Whether a store of ``codecs`` is not packed as ``p`` predicts: the single choice's
    codec missing from it, or a codec the prediction does not name in it."""
    if p.per_kind is None and _base(str(p.chosen)) not in codecs and \
            _specs(str(p.chosen)).isdisjoint(codecs):
        return True
    return not set(codecs) <= p.specs()


def _base(label: str) -> str:
    """A codec label without its solid-block suffix (the codec table does not name it)."""
    head, plus, tail = label.rpartition("+solid")
    return head if plus and tail.endswith("k") else label


def to_json(res: CheckResult) -> dict[str, Any]:
    p = res.prediction
    return {"path": res.path, "kind": res.kind, "mode": res.mode, "reader": res.reader,
            "readers": res.readers, "cores": res.cores, "files": res.files,
            "mb": round(res.bytes / MB, 3), "codecs": res.codecs, "ratio": res.ratio,
            "seconds": round(res.passed.seconds, 3),
            "cold": (None if res.kind == "mount" or res.passed.resident is None
                     else res.passed.resident <= COLD_RESIDENT),
            "resident_after_drop": res.passed.resident,
            "measured": {"files_per_s": round(res.files_per_s, 1),
                         "mb_per_s": round(res.bytes_per_s / MB, 1),
                         "scaled_to_cores": res.cores if res.scaled else None,
                         "cpu_us_per_file": round(res.passed.cpu / max(1, res.passed.files)
                                                  * 1e6, 1)},
            "predicted": None if p is None else {
                "files_per_s": p.files_per_s,
                "mb_per_s": None if p.bytes_per_s is None else round(p.bytes_per_s / MB, 1),
                "rate_from": p.rate_from, "mode": p.mode, "cores": p.cores,
                "chosen": p.chosen, "per_kind": p.per_kind, "from": p.where},
            "measured_over_predicted": (round(res.files_per_s / p.files_per_s, 3)
                                        if p is not None and p.files_per_s else None),
            "met": res.met}


__all__ = ["CheckResult", "Prediction", "load_prediction", "report_lines", "run_check",
           "to_json"]
