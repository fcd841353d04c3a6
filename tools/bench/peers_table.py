#!/usr/bin/env python3
"""Turn the rows of peers_run.sh's peers.sh runs into the `peers` section of docs/benchmarks.md.

Every ratio compares rows of ONE run (the machine is shared; absolute numbers drift between
runs): FanStore vs the raw directory and vs squashfuse_ll with the same codec, measured in the
same peers.sh invocation. Build times come from the run that built the artifact (peers.sh
reuses images with SKIP_BUILD=1), which the table says.

    peers_table.py --work /tmp/fsbench --run /tmp/fsbench/fanstore-run1.jsonl \
        [--run .../fanstore-run2.jsonl] [--label TEXT] (--docs docs/benchmarks.md | --stdout)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402

SECTION = "peers"

# The targets for FanStore (docs/benchmarks.md repeats them next to the numbers).
COLD_VS_SQFUSE = 1.25
WARM_VS_SQFUSE = 1.25
WARM_VS_RAW_AIM = 0.8
PACK_VS_MKSQUASHFS = 1.0
RATIO_MIN = 2.0

CODEC_TAG = {"zstd3": "zstd:3", "lz4": "lz4"}


class Run:
    def __init__(self, idx: int, path: str) -> None:
        self.idx = idx
        self.path = path
        self.rows = h.load_rows(path)
        self.builds = {r["artifact"]: r for r in self.rows if r.get("kind") == "build"}
        self.meas = [r for r in self.rows if "op" in r]
        self.backends = list(dict.fromkeys(r["backend"] for r in self.meas if r.get("backend")))

    def pick(self, **kw) -> list[dict]:
        return [r for r in self.meas if all(str(r.get(k)) == str(v) for k, v in kw.items())]

    def vals(self, key: str, **kw) -> list[float]:
        """Values of ``key`` over the matching rows; passes with read errors do not count."""
        return [r[key] for r in self.pick(**kw)
                if r.get(key) is not None and not r.get("errors") and not r.get("rc")]

    def errors(self, **kw) -> int:
        return sum(int(r.get("errors") or 0) for r in self.pick(**kw))

    def med(self, key: str, **kw) -> float | None:
        return h.med(self.vals(key, **kw))


def is_fanstore(backend: str) -> bool:
    return backend.startswith("fanstore")


def tag_of(backend: str) -> str | None:
    """zstd3 / lz4 for FanStore and squashfs backends."""
    if is_fanstore(backend) or backend.startswith("sqfs-"):  # fanstore-zstd3[-kernel]
        return backend.split("-")[1] if "-" in backend else None
    return None


def peer_of(backend: str) -> str | None:
    tag = tag_of(backend)
    return f"sqfs-{tag}-squashfuse_ll" if tag else None


def build_of(runs: list[Run], artifact: str) -> tuple[dict | None, int | None]:
    """The build record of an artifact, from the latest run that has it, and that run's number."""
    for run in reversed(runs):
        if artifact in run.builds:
            return run.builds[artifact], run.idx
    return None, None


def artifact_of(backend: str) -> str | None:
    if is_fanstore(backend):
        return backend
    tag = tag_of(backend)
    if backend.startswith("sqfs-") and tag:
        return f"data-{tag}.sqfs"
    return None


def _summary(work: str) -> dict:
    try:
        with open(os.path.join(work, "lists", "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _intro(runs: list[Run], work: str, summary: dict, label: str,
           total_seconds: int | None) -> list[str]:
    out = [f"> **{label}**", ""] if label else []
    out += [f"Generated {h.now_utc()} from {len(runs)} peers.sh run(s)"
            + (f", {total_seconds / 60:.0f} min in all" if total_seconds else "") + ".", ""]
    out += [f"- run {run.idx}: {', '.join(run.backends)}" for run in runs]
    out += ["", "### Machine", "", h.machine_table(work), ""]
    if summary:
        out += ["### Dataset (`../shared/bench/gen_dataset.py`)", "",
                f"{summary.get('n_small', 0):,} small files ({summary.get('small_bytes', 0):,} "
                f"bytes) and {summary.get('n_large', 0)} large file(s) of "
                f"{summary.get('large_mib')} MiB; {summary.get('total_bytes') or 0:,} bytes in "
                f"all, seed {summary.get('seed')}.", ""]
    return out


def _read_targets(run: Run, b: str) -> list[tuple]:
    peer, out = peer_of(b), []
    for wk in (1, 4):
        q = dict(list="small.txt", op="read", workers=wk)
        fc, fw = (run.med("files_per_s", backend=b, phase=ph, **q) for ph in ("cold", "warm"))
        if peer in run.backends:
            pc, pw = (run.med("files_per_s", backend=peer, phase=ph, **q)
                      for ph in ("cold", "warm"))
            out += [_target("cold small-file reads", b, f"{peer} (run {run.idx})", wk, fc, pc,
                            COLD_VS_SQFUSE, "≥"),
                    _target("warm small-file reads", b, f"{peer} (run {run.idx})", wk, fw, pw,
                            WARM_VS_SQFUSE, "≥")]
        if "raw" in run.backends:
            rw = run.med("files_per_s", backend="raw", phase="warm", **q)
            out.append(_target("warm small-file reads (aim)", b, f"raw (run {run.idx})", wk,
                               fw, rw, WARM_VS_RAW_AIM, "≥"))
    return out


def _targets(runs: list[Run], total_bytes: int | None) -> list[tuple]:
    targets = []
    for run in runs:
        for b in filter(is_fanstore, run.backends):
            targets += _read_targets(run, b)
            peer = peer_of(b)
            fb, _ = build_of(runs, artifact_of(b) or "")
            sb, sr = build_of(runs, artifact_of(peer) or "") if peer else (None, None)
            if fb and sb and fb.get("ok") and sb.get("ok"):
                targets.append(_target("pack time", b, f"mksquashfs "
                                       f"{CODEC_TAG.get(tag_of(b), '')} (run {sr})", "",
                                       fb["seconds"], sb["seconds"], PACK_VS_MKSQUASHFS, "≤",
                                       fmt="{:.2f}x time"))
            if fb and fb.get("ok") and total_bytes and fb.get("bytes"):
                r, goal = total_bytes / fb["bytes"], tag_of(b) == "zstd3"
                targets.append(("compression ratio", b, "–", "", f"{r:.2f}",
                                f"≥ {RATIO_MIN}" if goal else "(≥ 2.0 is for zstd:3)",
                                h.check(r >= RATIO_MIN) if goal else "–"))
    return targets


def _builds(runs: list[Run], total_bytes: int | None) -> list[tuple]:
    arts: dict[str, list[str]] = {}  # artifact -> the backends that use it, in order
    for run in runs:
        for b in run.backends:
            if artifact_of(b) and b not in arts.setdefault(artifact_of(b), []):
                arts[artifact_of(b)].append(b)
    builds = []
    for a, users in arts.items():
        rec, ridx = build_of(runs, a)
        mount = h.num(h.med([m for run in runs for u in users
                             for m in run.vals("seconds", op="mount", backend=u)]), 2)
        ok = rec and rec.get("ok")
        builds.append((a, ", ".join(users), *(("–",) * 4 if not rec else (
            f"run {ridx}", h.num(rec.get("seconds"), 1) if ok else "FAILED",
            h.num(rec.get("bytes", 0) / 1e6),
            f"{(total_bytes / rec['bytes']) if ok and total_bytes and rec.get('bytes') else 0:.2f}"
        )), mount))
    return builds


def _small(run: Run, wk: int) -> list[tuple]:
    q, out = dict(list="small.txt", op="read", workers=wk), []
    raw_c, raw_w = (run.med("files_per_s", backend="raw", phase=ph, **q)
                    for ph in ("cold", "warm"))
    for b in run.backends:
        rows = run.pick(backend=b, **q)
        if not rows:
            continue
        c, w = dict(q, backend=b, phase="cold"), dict(q, backend=b, phase="warm")
        cf, wf = h.med(run.vals("files_per_s", **c)), h.med(run.vals("files_per_s", **w))
        peer = peer_of(b) if is_fanstore(b) else None
        pc, pw = (run.med("files_per_s", backend=peer, phase=ph, **q) if peer else None
                  for ph in ("cold", "warm"))
        flags = " ⚠ cut at time limit" if any(r.get("truncated") for r in rows) else ""
        out.append((run.idx, (f"**{b}**" if is_fanstore(b) else b) + flags + h.err_tag(rows),
                    wk, h.spread(run.vals("files_per_s", **c)), h.spread(run.vals("MB_per_s", **c)),
                    h.spread(run.vals("files_per_s", **w)), h.spread(run.vals("MB_per_s", **w)),
                    f"{h.num(run.med('lat_ms_p50', **c), 2)} / "
                    f"{h.num(run.med('lat_ms_p99', **c), 1)}",
                    h.num(run.med("cpu_busy_pct", **c)), h.ratio(cf, raw_c), h.ratio(wf, raw_w),
                    h.ratio(cf, pc) if peer else "", h.ratio(wf, pw) if peer else ""))
    return out


def _spot_check(run: Run, b: str) -> str:
    ver = run.pick(backend=b, op="verify")
    if not ver:
        check = "–"
    elif all(v.get("ok") for v in ver):
        check = f"ok ({ver[0].get('checked')} files)"
    else:
        first = (ver[0].get("first_bad") or ["?"])[0]
        check = f"**FAILED** ({ver[0].get('bad')} of {ver[0].get('checked')}; {first[:160]})"
    errs = run.errors(backend=b)
    if errs:
        check += f"; ⚠ {errs} read errors in the passes (those passes are left out)"
    mount_err = [r for r in run.pick(backend=b, op="mount") if r.get("error")]
    if mount_err:
        check += f"; ⚠ {mount_err[0]['error']} ({len(mount_err)}x)"
    return check


def _meta(run: Run, b: str) -> tuple:
    lq = dict(backend=b, list="large.txt", op="read")
    return (run.idx, b, *(h.num(run.med("seconds", backend=b, op="walk", phase=ph), 3)
                          for ph in ("cold", "warm")),
            *(h.num(run.med("files_per_s", backend=b, op="stat", phase=ph))
              for ph in ("cold", "warm")),
            *(h.num(run.med("MB_per_s", phase=ph, **lq)) for ph in ("cold", "warm")),
            _spot_check(run, b))


def _commands(runs: list[Run]) -> list[str]:
    out = ["### Exact commands", "", "```"]
    for run in runs:
        out.append(f"# ===== run {run.idx}: BACKENDS=\"{' '.join(run.backends)}\"")
        try:
            with open(run.path[:-len(".jsonl")] + ".commands.txt") as f:
                out += [line.rstrip("\n").replace(h.REPO + "/", "") for line in f]
        except OSError:
            out.append("# (command log missing)")
    return out + ["```"]


def section(runs: list[Run], work: str, label: str, total_seconds: int | None) -> str:
    summary = _summary(work)
    total_bytes = summary.get("total_bytes")
    out = _intro(runs, work, summary, label, total_seconds)
    out += [h.table(["target", "FanStore", "compared with", "readers", "measured", "goal",
                     "status"], _targets(runs, total_bytes), "lllrrrl", "The issue's targets"),
            "",
            h.table(["artifact", "used by", "built in", "build s", "size MB", "ratio",
                     "mount s (median)"], _builds(runs, total_bytes), "llrrrrr",
                    "Build (pack) cost and size"), "",
            h.table(["run", "backend", "readers", "cold files/s", "cold MB/s", "warm files/s",
                     "warm MB/s", "cold p50 / p99 ms", "cold CPU %", "cold vs raw",
                     "warm vs raw", "cold vs sqfuse_ll", "warm vs sqfuse_ll"],
                    [x for run in runs for wk in (1, 4) for x in _small(run, wk)],
                    "rl" + "r" * 11, "Small-file reads (every small file once, shuffled)"), "",
            h.table(["run", "backend", "walk cold s", "walk warm s", "stat cold /s",
                     "stat warm /s", "large cold MB/s", "large warm MB/s", "spot check"],
                    [_meta(run, b) for run in runs for b in run.backends],
                    "rl" + "r" * 6 + "l", "Metadata and large files"), ""]
    return "\n".join(out + _commands(runs))


def _target(what, b, other, wk, mine, theirs, goal, op, fmt="{:.2f}x") -> tuple:
    if mine is None or not theirs:
        return (what, b, other, wk, "–", f"{op} {goal}", "–")
    r = mine / theirs
    return (what, b, other, wk, f"{fmt.format(r)} ({h.num(mine, 1 if mine < 100 else 0)} vs "
            f"{h.num(theirs, 1 if theirs < 100 else 0)})", f"{op} {goal}",
            h.check(r >= goal if op == "≥" else r <= goal))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="peers.sh WORKDIR (for lists/summary.json)")
    ap.add_argument("--run", action="append", required=True, help="a run's .jsonl, in order")
    ap.add_argument("--label", default="")
    ap.add_argument("--total-seconds", type=int)
    ap.add_argument("--docs", default=h.DOCS)
    ap.add_argument("--stdout", action="store_true", help="print the section, touch nothing")
    a = ap.parse_args(argv)
    runs = [Run(i + 1, p) for i, p in enumerate(a.run)]
    label = a.label
    if not label:
        n_small = _summary(a.work).get("n_small", 0)
        reps = max([int(r.get("rep", 0)) for run in runs for r in run.pick(phase="cold",
                                                                       list="small.txt")] or [0])
        if n_small < 20000 or reps < 3:
            label = (f"SMOKE RUN ({n_small:,} small files, {reps} cold pass(es) per cell, on a "
                     "machine shared with other jobs): it shows the harness works end to end; "
                     "the numbers are not results. Run `tools/bench/peers_run.sh` with its "
                     "defaults on a quiet machine for real numbers.")
    text = section(runs, a.work, label, a.total_seconds)
    if a.stdout:
        print(text)
    else:
        h.replace_section(SECTION, text, a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
