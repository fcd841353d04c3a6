"""Shared helpers of the benchmark drivers in tools/bench (stdlib only).

- ``replace_section``: rewrite one marked section of docs/benchmarks.md, keep the rest.
- ``machine_info``: the machine-description rows every section prints.
- formatting of medians with their min-max, ratios, numbers.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs", "benchmarks.md")
RESULTS_DIR = os.path.join(REPO, "tools", "bench", "results")

DOC_HEADER = """# Benchmarks

Written by the scripts in `tools/bench/`; each section below is owned by one script and
rewritten, between its `<!-- BEGIN name -->` / `<!-- END name -->` markers, when that script
runs. Rerun everything with `make bench` (see the intro of each section for its own command).
"""


# ------------------------------------------------------------------------------ docs


def replace_section(name: str, body: str, path: str = DOCS) -> None:
    """Put ``body`` between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in ``path``.

    Everything outside the markers is kept byte for byte; a missing file is created with a
    short header, a missing section is appended. The file is replaced atomically.
    """
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = DOC_HEADER
    block = f"{begin}\n{body.rstrip()}\n{end}"
    i = text.find(begin)
    j = text.find(end, i + len(begin)) if i >= 0 else -1
    if i >= 0 and j >= 0:
        text = text[:i] + block + text[j + len(end):]
    else:
        if i >= 0:  # a BEGIN without its END: refuse rather than eat the rest of the file
            raise RuntimeError(f"{path}: '{begin}' has no matching '{end}'")
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ machine


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cmd(*argv: str) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        return (p.stdout or p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def git_commit(repo: str = REPO) -> str:
    """The checked-out commit, read from .git (no git command is run); in a worktree,
    .git is a file naming its git directory, whose refs are in the main one."""
    git = common_dir = os.path.join(repo, ".git")
    if os.path.isfile(git):
        link = _read(git).strip()
        if link.startswith("gitdir: "):
            git = os.path.join(repo, link[8:])
            common_dir = os.path.join(git, _read(os.path.join(git, "commondir")).strip() or ".")
    head = _read(os.path.join(git, "HEAD")).strip()
    if head.startswith("ref: "):
        ref = head[5:]
        sha = _read(os.path.join(common_dir, ref)).strip()
        if not sha:
            for line in _read(os.path.join(common_dir, "packed-refs")).splitlines():
                if line.endswith(" " + ref):
                    sha = line.split()[0]
        return f"{sha[:12]} ({ref.rsplit('/', 1)[-1]}; uncommitted changes not shown)" if sha else "?"
    return head[:12] or "?"


def machine_info(work_dir: str) -> list[tuple[str, str]]:
    cpu = "?"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    os_name = "?"
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            os_name = line.split("=", 1)[1].strip('"')
    fs = _cmd("findmnt", "-T", work_dir, "-n", "-o", "SOURCE,FSTYPE")
    disk = "?"
    src = fs.split()[0] if fs else ""
    if src.startswith("/dev/"):
        dev = os.path.basename(src).rstrip("0123456789") or os.path.basename(src)
        rota = _read(f"/sys/block/{dev}/queue/rotational").strip()
        if rota:
            disk = f"{dev}, rotational={rota}" + (" (virtio)" if dev.startswith("vd") else "")
    load = _read("/proc/loadavg").split()[:3]
    return [
        ("CPU", f"{cpu}, nproc = {os.cpu_count()}"),
        ("RAM", f"{mem / 2**30:.1f} GiB"),
        ("kernel", f"{platform.release()} {platform.machine()}"),
        ("OS", os_name),
        ("work dir", f"{work_dir} on {fs or '?'}"),
        ("disk", disk),
        ("load average at start", " ".join(load) + " (the machine is shared)"),
        ("software", f"Python {platform.python_version()}; {_cmd('fusermount3', '-V') or 'fusermount3 ?'}"),
        ("FanStore commit", git_commit()),
    ]


def machine_table(work_dir: str) -> str:
    rows = ["| item | value |", "| --- | --- |"]
    rows += [f"| {k} | {v} |" for k, v in machine_info(work_dir)]
    return "\n".join(rows)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def loadavg1() -> float | None:
    try:
        return float(_read("/proc/loadavg").split()[0])
    except (IndexError, ValueError):
        return None


def dir_bytes(path: str) -> int:
    """Apparent size of a file or of every file under a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for top, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def have(cmd: str) -> bool:
    return shutil.which(cmd) is not None


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


# ------------------------------------------------------------------------------ format


def med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def num(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "–"
    if digits == 0:
        return f"{v:,.0f}"
    return f"{v:,.{digits}f}"


def spread(values: list[float], digits: int = 0) -> str:
    """'median (min–max)' or just the value when there is one."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    m = statistics.median(values)
    if len(values) == 1:
        return num(m, digits)
    return f"{num(m, digits)} ({num(min(values), digits)}–{num(max(values), digits)})"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    if a is None or not b:
        return "–"
    return f"{a / b:.{digits}f}x"


def check(ok: bool | None) -> str:
    return "–" if ok is None else ("**met**" if ok else "**missed**")


def python() -> str:
    return sys.executable


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def guarded_run(bench, log, still_mounted, doing: str = "unmounting and cleaning up") -> bool:
    """Run ``bench.run()`` so that Ctrl-C, SIGTERM or SIGHUP (even when started in the
    background) or a crash still end in ``bench.cleanup()``, and the cleanup itself survives
    a second Ctrl-C; warn about anything ``still_mounted()`` reports afterwards. Returns
    whether the run completed (an exception other than an interrupt is re-raised)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    os.makedirs(bench.work, exist_ok=True)
    ok = False
    try:
        bench.run()
        ok = True
    except KeyboardInterrupt:
        log(f"interrupted: {doing}")
    except Exception:
        log(f"failed: {doing}")
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.cleanup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        left = still_mounted()
        if left:
            log(f"WARNING: still mounted: {left}")
    return ok


def publish(ok: bool, bench, a, log, section_name: str, render, script: str,
            raw_argv: list[str]) -> int:
    """After ``guarded_run``: on success write ``render(bench, label, command)`` into the
    docs section ``section_name`` and the run's rows to ``a.results`` (or print the section
    with ``--no-docs``); after an interruption keep the partial rows and touch nothing.
    Returns the script's exit status."""
    if not ok:
        log(f"partial rows kept in {bench.jsonl_tmp}; docs not touched")
        return 130
    shown = [".venv/bin/python", script] + raw_argv
    if not a.no_docs:
        os.makedirs(os.path.dirname(a.results), exist_ok=True)
        shutil.copyfile(bench.jsonl_tmp, a.results)
        replace_section(section_name, render(bench, a.label, shown), a.docs)
        log(f"wrote {a.docs} (section {section_name}) and {a.results}")
    else:
        print(render(bench, a.label, shown))
    log(f"done in {bench.total_seconds / 60:.1f} min")
    return 0


class RowLog:
    """Mixin for a benchmark run: ``emit`` tags a row with ``self.run_id`` and appends it to
    ``self.rows`` and to ``self.jsonl_tmp`` at once, so an interrupted run keeps its rows."""

    def emit(self, row: dict) -> dict:
        row = dict(row, run_id=self.run_id)
        self.rows.append(row)
        with open(self.jsonl_tmp, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row


def pick_rows(rows: list[dict], **kw) -> list[dict]:
    """The rows whose fields equal every ``kw``."""
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def row_vals(rows: list[dict], key: str, **kw) -> list[float]:
    """``key`` of the matching rows that have it and recorded no errors."""
    return [r.get(key) for r in pick_rows(rows, **kw)
            if r.get(key) is not None and not r.get("errors")]
