"""The bench harness of tools/bench: what every benchmark script shares (the standard
library and ``fanstore.process``; other FanStore modules are imported where used).

- ``Bench``: one run: its rows (``emit``, kept in a JSONL file as they come), the commands
  it ran (``cmd``), FanStore mounts (``mount`` / ``umount``) and MPI jobs (``Job``), reader
  subprocesses (``sub``), cleanup on errors and signals, and publishing (``main``).
- process metrics: CPU seconds of a process tree (``fanstore.process``'s walk), RSS/PSS,
  the machine's busy time; ``drop_caches`` (the page cache).
- tables: ``table`` renders rows as markdown, ``spread`` / ``ratio`` / ``num`` format cells,
  ``Bench.cells`` makes a row's cells from specs (``spread:files_per_s``, ``p:lat_ms``);
  ``section`` puts a caption, the tables, the machine and the commands together, and
  ``replace_section`` writes it between the markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.append(REPO)  # fanstore, when this python has it not installed
from fanstore.process import cpu_seconds, descendants, pid_alive  # noqa: E402,F401

DOCS = os.path.join(REPO, "docs", "benchmarks.md")
RESULTS_DIR = os.path.join(REPO, "tools", "bench", "results")
HERE = os.path.dirname(os.path.abspath(__file__))
READER = os.path.join(HERE, "reader.py")
GEN = os.path.join(REPO, "tools", "gen_dataset.py")
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def shown(argv) -> str:
    return " ".join(shlex.quote(str(x)) for x in argv)


# ------------------------------------------------------------------------------ docs


def replace_section(name: str, body: str, path: str = DOCS) -> None:
    """Put ``body`` between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in ``path``;
    everything outside the markers is kept; a missing section is appended."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    i = text.find(begin)
    j = text.find(end, i + len(begin)) if i >= 0 else -1
    if i >= 0 and j >= 0:
        text = text[:i] + block + text[j + len(end):]
    elif i >= 0:  # a BEGIN without its END: refuse rather than eat the rest of the file
        raise RuntimeError(f"{path}: '{begin}' has no matching '{end}'")
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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


def _out(*argv: str) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        return (p.stdout or p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _field(path: str, key: str, sep: str = ":") -> str:
    for line in _read(path).splitlines():
        if line.startswith(key):
            return line.split(sep, 1)[1].strip()
    return "?"


def git_commit(repo: str = REPO) -> str:
    """The checked-out commit, read from .git (worktrees too); no git command is run."""
    git = common_dir = os.path.join(repo, ".git")
    if os.path.isfile(git):
        link = _read(git).strip()
        if link.startswith("gitdir: "):
            git = os.path.join(repo, link[8:])
            common_dir = os.path.join(git, _read(os.path.join(git, "commondir")).strip() or ".")
    head = _read(os.path.join(git, "HEAD")).strip()
    if not head.startswith("ref: "):
        return head[:12] or "?"
    ref = head[5:]
    sha = _read(os.path.join(common_dir, ref)).strip()
    for line in ([] if sha else _read(os.path.join(common_dir, "packed-refs")).splitlines()):
        if line.endswith(" " + ref):
            sha = line.split()[0]
    return f"{sha[:12]} ({ref.rsplit('/', 1)[-1]}; uncommitted changes not shown)" if sha else "?"


def machine_table(work_dir: str) -> str:
    mem = int(_field("/proc/meminfo", "MemTotal:").split()[0]) * 1024
    fs = _out("findmnt", "-T", work_dir, "-n", "-o", "SOURCE,FSTYPE")
    disk, src = "?", fs.split()[0] if fs else ""
    if src.startswith("/dev/"):
        dev = os.path.basename(src).rstrip("0123456789") or os.path.basename(src)
        rota = _read(f"/sys/block/{dev}/queue/rotational").strip()
        if rota:
            disk = f"{dev}, rotational={rota}" + (" (virtio)" if dev.startswith("vd") else "")
    fuse = _out("fusermount3", "-V") or "fusermount3 ?"
    return table(["item", "value"], [
        ("CPU", f"{_field('/proc/cpuinfo', 'model name')}, nproc = {os.cpu_count()}"),
        ("RAM", f"{mem / 2**30:.1f} GiB"),
        ("kernel", f"{platform.release()} {platform.machine()}"),
        ("OS", _field("/etc/os-release", "PRETTY_NAME=", "=").strip('"')),
        ("work dir", f"{work_dir} on {fs or '?'}"),
        ("disk", disk),
        ("load average at start", " ".join(_read("/proc/loadavg").split()[:3])
         + " (the machine is shared)"),
        ("software", f"Python {platform.python_version()}; {fuse}"),
        ("FanStore commit", git_commit())], align="ll")


def drop_caches() -> bool:
    """sync; echo 3 > /proc/sys/vm/drop_caches (False when not allowed)."""
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
    return sum(os.lstat(os.path.join(t, n)).st_size for t, _d, ns in os.walk(path) for n in ns)


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


# ------------------------------------------------------------------------------ processes


def proc_cpu(pid: int) -> float | None:
    """utime + stime of a process (all its threads) in seconds; None when it is gone."""
    try:
        rest = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / CLK_TCK
    except (IndexError, ValueError):
        return None


def fanstore_processes(root_pid: int | None) -> list[int]:
    """``root_pid`` and its descendants, or with None every process running FanStore code
    (an MPI job: leaders, worker ranks, frontend processes)."""
    if root_pid:
        return descendants(root_pid)
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            argv = _read(f"/proc/{name}/cmdline").split("\0")
            if any(x.endswith("bin/fanstore") or x.startswith("fanstore.") for x in argv[:3]):
                out.append(int(name))
    return out


def memory(pids: list[int]) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) of ``pids`` in bytes (/proc/PID/smaps_rollup)."""
    rss = pss = 0
    for p in pids:
        for line in _read(f"/proc/{p}/smaps_rollup").splitlines():
            if line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss += int(line.split()[1]) * 1024
    return rss, pss


def machine_cpu() -> tuple[int, int, int] | None:
    """(total, idle, iowait) jiffies of the whole machine from /proc/stat."""
    fields = [int(x) for x in _read("/proc/stat").split("\n", 1)[0].split()[1:]]
    if not fields:
        return None
    return sum(fields[:8]), fields[3], fields[4] if len(fields) > 4 else 0


def busy_between(a, b) -> tuple[float | None, float | None]:
    """Busy and iowait % of the machine between two ``machine_cpu()`` readings."""
    if a is None or b is None or b[0] <= a[0]:
        return None, None
    total, idle, iowait = b[0] - a[0], b[1] - a[1], b[2] - a[2]
    return round(100.0 * (total - idle - iowait) / total, 1), round(100.0 * iowait / total, 1)


def percentile_ms(sorted_values: list[float], p: float) -> float | None:
    """The p-th percentile of sorted seconds, in ms."""
    if not sorted_values:
        return None
    k = round(p / 100.0 * (len(sorted_values) - 1))
    return round(sorted_values[min(len(sorted_values) - 1, max(0, k))] * 1e3, 3)


def _forked(setup, share, barrier, queue) -> None:
    try:
        work = setup(share)  # before the barrier: not timed
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        queue.put({"setup_error": f"{type(exc).__name__}: {exc}"})
        barrier.abort()
        return
    try:
        barrier.wait()
    except Exception:  # noqa: BLE001 - a broken barrier: the parent reports it
        return
    start = time.perf_counter()
    row = work()
    queue.put(dict(row, start=start, end=time.perf_counter()))


def fork_pass(setup, shares: list, on_release=None, timeout: float = 300) -> dict:
    """One forked process per share: ``setup(share)`` returns a ``work()``, which runs when
    every reader is set up (a barrier) and returns the reader's dict. The clock runs from
    the earliest release seen to the last reader done. ``on_release()`` runs in the parent
    at the release. Returns {results, wall, busy, iowait, released}; raises if a reader
    fails."""
    import multiprocessing as mp
    import queue as _queue

    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(len(shares) + 1), ctx.Queue()
    procs = [ctx.Process(target=_forked, args=(setup, s, barrier, q), daemon=True)
             for s in shares]
    for p in procs:
        p.start()
    results: list[dict] = []
    done = False
    try:
        cpu0 = machine_cpu()
        try:
            barrier.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - a reader's setup failed: say which
            time.sleep(0.2)
            while not q.empty():
                results.append(q.get())
            errs = [r["setup_error"] for r in results if r.get("setup_error")]
            raise RuntimeError(errs[0] if errs else "the readers did not start") from None
        t0 = time.perf_counter()
        released = on_release() if on_release else None
        while len(results) < len(shares):
            try:
                results.append(q.get(timeout=1.0))
            except _queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"reader died (exit code {dead[0].exitcode})") from None
        # The parent may run only after the readers started (2 cores, N+1 processes): the
        # clock starts at the earliest moment any party saw the barrier open.
        t0 = min([t0] + [r["start"] for r in results])
        busy, iowait = busy_between(cpu0, machine_cpu())
        done = True
    finally:
        for p in procs:
            if not done and p.is_alive():
                p.terminate()
            p.join(timeout=30)
    wall = max(max(r["end"] for r in results) - t0, 1e-9)
    return {"results": results, "wall": wall, "busy": busy, "iowait": iowait,
            "released": released}


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; wall seconds and CPU seconds (user+sys of it and its children)."""
    before = os.times()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    after = os.times()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    cpu = (after.children_user - before.children_user) + \
        (after.children_system - before.children_system)
    return {"wall": wall, "cpu": cpu, "stdout": proc.stdout, "stderr": proc.stderr}


def run_json(argv: list[str], timeout: float, **kw) -> dict:
    """Run ``argv`` in its own process group (killed whole on an interrupt); the last JSON
    line it prints, or a row with its error."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {"errors": 1, "first_error": f"exit {proc.returncode}: {err.strip()[-400:]}"}


# ------------------------------------------------------------------------------ FanStore


def find_fanstore() -> str:
    cand = os.path.join(os.path.dirname(PY), "fanstore")
    found = cand if os.access(cand, os.X_OK) else shutil.which("fanstore")
    if not found:
        sys.exit("no 'fanstore' command (run with .venv/bin/python, or --fanstore)")
    return found


def is_mounted(path: str) -> bool:
    """True if ``path`` is a mount point, also when its FUSE daemon died (ENOTCONN)."""
    from fanstore import mounttable

    return os.path.abspath(path) in mounttable.mounts()


def state_pid(mnt: str) -> int | None:
    """The pid of the FanStore daemon serving ``mnt``."""
    from fanstore import runtime

    try:
        pid = (runtime.read_state(mnt) or {}).get("pid")
        return int(pid) if pid else None
    except Exception:  # noqa: BLE001 - no state: no daemon
        return None


def control(mnt: str | None, req: dict, timeout: float = 30.0) -> dict | None:
    """One request on a mount's control socket (``{"op": "stats"}`` = `fanstore stats`)."""
    from fanstore import control as ctl

    try:
        return ctl.control(mnt, req, timeout=timeout) if mnt else None
    except Exception:  # noqa: BLE001 - a dead daemon: the caller reports it
        return None


def diff_stats(after: dict | None, before: dict | None) -> dict | None:
    """Numeric counters (and requests by op) of ``fanstore stats``: after - before."""
    if not before or not after:
        return None
    out = {k: round(after[k] - before[k], 6) for k in after
           if isinstance(after.get(k), (int, float)) and not isinstance(after.get(k), bool)
           and isinstance(before.get(k), (int, float))}
    ops_a, ops_b = after.get("requests_by_op") or {}, before.get("requests_by_op") or {}
    out["requests_by_op"] = {k: ops_a.get(k, 0) - ops_b.get(k, 0) for k in ops_a
                             if ops_a.get(k, 0) != ops_b.get(k, 0)}
    return out


def stamped(stamp: str, want: dict) -> bool:
    """True if the JSON file ``stamp`` holds ``want`` (what made a dataset or a store)."""
    try:
        with open(stamp) as f:
            return json.load(f) == want
    except (OSError, ValueError):
        return False


def ensure_dataset(work: str, files: int, classes: int, min_kb: int = 50, max_kb: int = 150,
                   seed: int = 20240601, large: int = 0, large_mb: int = 64
                   ) -> tuple[str, list[str], str]:
    """A tools/gen_dataset.py dataset under WORK/data (reused when its parameters match):
    (data dir, sorted relative paths of its small files, the generating command)."""
    data, stamp = os.path.join(work, "data"), os.path.join(work, "dataset.json")
    want = dict(files=files, classes=classes, min_kb=min_kb, max_kb=max_kb, seed=seed,
                large=large, large_mb=large_mb)
    argv = [PY, GEN, data, "--files", files, "--classes", classes, "--min-kb", min_kb,
            "--max-kb", max_kb, "--seed", seed, "--subdir", "small"]
    argv = [str(x) for x in argv + (["--large", large, "--large-mb", large_mb] if large else [])]
    if not (stamped(stamp, want) and os.path.isdir(data)):
        log(f"generating dataset: {files} files of {min_kb}-{max_kb} kB + {large} large")
        shutil.rmtree(data, ignore_errors=True)
        if os.path.exists(stamp):
            os.unlink(stamp)
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        os.sync()
        with open(stamp, "w") as f:
            json.dump(want, f)
    small = []
    for top, dirs, names in os.walk(os.path.join(data, "small")):
        dirs.sort()
        small += [os.path.relpath(os.path.join(top, n), data) for n in sorted(names)]
    return data, small, shown(argv)


def pack_store(fanstore: str, data: str, dest: str, partitions: int, codec: str, jobs: int,
               reuse: bool) -> tuple[dict, str]:
    """``fanstore pack`` of ``data`` into ``dest``, timed after dropping the page cache
    (skipped when ``reuse`` and a store with the same parameters exists): (info, command)."""
    argv = [fanstore, "pack", data, dest, "--partitions", str(partitions), "--codec", codec,
            "--jobs", str(jobs), "--no-progress", "--force"]
    stamp, want = dest + ".params.json", dict(partitions=partitions, codec=codec, data=data)
    seconds = None
    if not (reuse and stamped(stamp, want) and os.path.exists(f"{dest}/fanstore.idx")):
        shutil.rmtree(dest, ignore_errors=True)
        drop_caches()
        log(f"pack: {shown(argv[1:])}")
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, text=True)
        os.sync()
        seconds = time.perf_counter() - t0
        with open(stamp, "w") as f:
            json.dump(want, f)
    info = json.loads(subprocess.run([fanstore, "info", dest, "--json"], check=True,
                                     capture_output=True, text=True).stdout)
    info["pack_seconds"] = seconds
    return info, shown(argv)


def placement_sets(store: str, ranks: int) -> dict[int, list[str]]:
    """Files (relative paths) by the rank holding their partition (p mod n, replicas 1)."""
    from fanstore.format.index import read_index

    index = read_index(store)
    part, first, count = index.chunks["part"], index.entries["first"], index.entries["count"]
    out: dict[int, list[str]] = {r: [] for r in range(ranks)}
    for entry in index.file_entries().tolist():
        if int(count[entry]):
            p = int(part[int(first[entry])])
            if not index.partitions[p].broadcast:
                out[p % ranks].append(os.fsdecode(index.path(entry)))
    return out


def export_revision(rev: str, work: str) -> str:
    """The fanstore/ and compressors/ of git revision ``rev`` in a directory for
    PYTHONPATH (the installed dependencies are the same): the code before a change."""
    out = os.path.join(work, f"code-{rev}")
    if not os.path.isdir(out):
        os.makedirs(out)
        archive = subprocess.run(["git", "-C", REPO, "archive", rev, "fanstore", "compressors"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-C", out, "-xf", "-"], input=archive, check=True)
    return out


# ------------------------------------------------------------------------------ MPI jobs


class Job:
    """``mpiexec -n N*K fanstore mount STORE DIR/mnt{rank} --local-dir DIR/local{rank}
    --ranks-per-node K ARGS``: ``ranks`` nodes of K ranks each (one machine simulates the
    nodes); one node of one rank: ``fanstore mount`` without a launcher. ``stop()`` tears
    down what this job started, by pid and its own paths only."""

    def __init__(self, bench: "Bench", ranks: int, tag: str, extra: list[str] | None = None,
                 env: dict | None = None, per_node: int = 1) -> None:
        self.bench, self.ranks, self.extra = bench, ranks, list(extra or [])
        self.per_node = per_node
        self.dir = os.path.join(bench.work, "jobs", tag)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc: subprocess.Popen | None = None
        self.pids: dict[int, int] = {}
        self.log_path = os.path.join(self.dir, "mpiexec.log")
        self._logf = None
        self.ready_seconds: float | None = None

    def mnt(self, r: int) -> str:
        return os.path.join(self.dir, f"mnt{r}")

    def argv(self) -> list[str]:
        b = self.bench
        if self.ranks == 1 and self.per_node == 1:
            return [b.fanstore, "mount", b.store, self.mnt(0), "--local-dir",
                    os.path.join(self.dir, "local0")] + self.extra
        return [b.mpiexec, "-n", str(self.ranks * self.per_node), b.fanstore, "mount",
                b.store, os.path.join(self.dir, "mnt{rank}"), "--local-dir",
                os.path.join(self.dir, "local{rank}"), "--ranks-per-node",
                str(self.per_node)] + self.extra

    def shown(self) -> str:
        return shown(self.argv()).replace(self.dir, "JOB")

    def start(self, timeout: float = 180.0) -> None:
        b = self.bench
        shutil.rmtree(self.dir, ignore_errors=True)
        for r in range(self.ranks):
            os.makedirs(self.mnt(r), exist_ok=True)
        b.jobs.append(self)
        t0 = time.perf_counter()
        self._logf = open(self.log_path, "ab")
        if self.ranks == 1 and self.per_node == 1:
            p = subprocess.run(self.argv(), stdout=self._logf, stderr=subprocess.STDOUT,
                               env=self.env, timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"fanstore mount failed: {self.output()[-800:]}")
        else:  # own session: hydra and its proxies are ours to kill if the daemons hang
            self.proc = subprocess.Popen(self.argv(), stdout=self._logf, env=self.env,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            for r in range(self.ranks):
                left = max(1.0, timeout - (time.perf_counter() - t0))
                w = subprocess.run([b.fanstore, "wait", self.mnt(r), "--timeout",
                                    f"{left:.0f}"], capture_output=True, text=True)
                if w.returncode != 0:
                    self._remember_pids()
                    raise RuntimeError(f"rank {r} not ready: {w.stderr.strip()}\n"
                                       f"{self.output()[-800:]}")
        self.ready_seconds = time.perf_counter() - t0
        self._remember_pids()

    def _remember_pids(self) -> None:
        for r in range(self.ranks):
            pid = state_pid(self.mnt(r))
            if pid:
                self.pids[r] = pid

    def pid_list(self) -> list[int]:
        return [self.pids[r] for r in sorted(self.pids)]

    def stats(self, r: int) -> dict | None:
        return control(self.mnt(r), {"op": "stats"})

    def output(self) -> str:
        return _read(self.log_path)

    def alive(self) -> bool:
        return len(self.pids) == self.ranks and all(pid_alive(p) for p in self.pids.values())

    def stop(self) -> None:
        """SIGTERM our daemons (one stops every rank), wait; then force what is left."""
        self._remember_pids()
        b = self.bench
        if self.ranks == 1 and pid_alive(self.pids.get(0)):
            subprocess.run([b.fanstore, "umount", self.mnt(0)], capture_output=True, timeout=90)
        _signal_all(self.pids.values(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.pids.values()):
            time.sleep(0.05)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
        _signal_all([p for p in self.pids.values() if pid_alive(p)], signal.SIGKILL)
        for r in range(self.ranks):
            if is_mounted(self.mnt(r)):
                subprocess.run(["fusermount3", "-u", "-z", "--", self.mnt(r)],
                               capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        if self in b.jobs:
            b.jobs.remove(self)


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, TypeError):
            pass


# ------------------------------------------------------------------------------ tables


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def num(v: float | None, digits: int = 0) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def spread(values, digits: int = 0) -> str:
    """'median (min–max)', or the value when there is one."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return num(values[0] if values else None, digits)
    return (f"{num(statistics.median(values), digits)} "
            f"({num(min(values), digits)}–{num(max(values), digits)})")


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return "–" if a is None or not b else f"{a / b:.{digits}f}x"


def err_tag(rows: list[dict]) -> str:
    """' ⚠ N errors' when ``rows`` recorded read errors."""
    n = sum(r.get("errors") or 0 for r in rows)
    return f" ⚠ {n} errors" if n else ""


def errors_line(rows: list[dict], kinds: tuple[str, ...]) -> str:
    """'- read errors during the measurements: N (first: ...)' over rows of ``kinds``."""
    bad = [r for r in rows if r.get("errors") and r.get("kind") in kinds]
    return (f"- read errors during the measurements: {sum(r['errors'] for r in bad)}"
            + (f" (first: {bad[0].get('first_error')})" if bad else ""))


def check(ok: bool | None) -> str:
    return "–" if ok is None else ("**met**" if ok else "**missed**")


def pick_rows(rows: list[dict], **kw) -> list[dict]:
    """The rows whose fields equal every ``kw``."""
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def row_vals(rows: list[dict], key: str, **kw) -> list:
    """``key`` of the matching rows that have it and recorded no errors."""
    return [r.get(key) for r in pick_rows(rows, **kw)
            if r.get(key) is not None and not r.get("errors")]


def table(header: list[str], rows, align: str = "", title: str = "") -> str:
    """A markdown table; ``align`` one letter a column (l / r; default: first l, rest r)."""
    align = align or "l" + "r" * (len(header) - 1)
    out = [f"### {title}", ""] if title else []
    out += ["| " + " | ".join(header) + " |",
            "| " + " | ".join("---" if a == "l" else "---:" for a in align) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def section(bench: "Bench", label: str | None, argv: list[str], parts: list[str]) -> str:
    """A docs section: a one-line caption, the tables, the machine, the exact commands."""
    out = [f"> **{label}**", ""] if label else []
    out += [f"Run {bench.run_id} ({now_utc()}), {bench.total_seconds / 60:.1f} min; "
            f"`{' '.join(argv)}`; raw rows `tools/bench/results/{bench.name}.jsonl`.", ""]
    out += [p + "\n" for p in parts if p]
    if bench.machine:
        out += [bench.machine, ""]
    if bench.commands:
        out += ["```"] + [c.replace(REPO + "/", "") for c in bench.commands] + ["```"]
    return "\n".join(out)


# ------------------------------------------------------------------------------ a run


class Bench:
    """One benchmark run. A script subclasses it with ``run()`` (the passes) and passes a
    ``render(bench, label, argv)`` to ``main``."""

    name = "bench"

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = os.path.abspath(a.work)
        self.lists = os.path.join(self.work, "lists")
        self.store = os.path.join(self.work, "store")
        self.mnt_root = os.path.join(self.work, "mnt")
        self.py = PY
        self.fanstore = getattr(a, "fanstore", None) or find_fanstore()
        self.mpiexec = getattr(a, "mpiexec", None) or os.path.join(os.path.dirname(PY),
                                                                   "mpiexec")
        self.rows: list[dict] = []
        self.commands: list[str] = []
        self.mounted: dict[str, int | None] = {}  # mount point -> daemon pid
        self.jobs: list[Job] = []
        self.run_id = time.strftime("%Y%m%dT%H%M%S")
        self.t_start = time.time()
        self.t_end: float | None = None
        self.jsonl_tmp = os.path.join(self.work, f"{self.name}-{self.run_id}.jsonl")
        self.machine = ""

    def small_store(self, files: int, seed: int, partitions: int = 32) -> None:
        """``files`` random files of up to 64 KB in 8 directories, packed (zstd:1) into
        ``partitions`` at ``self.store`` unless it is there: the store of the fault
        benches, whose point is the processes, not the data."""
        import random

        if os.path.isdir(self.store):
            return
        src = os.path.join(self.work, "src")
        rng = random.Random(seed)
        for i in range(files):
            d = os.path.join(src, f"d{i % 8}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"f{i:03d}"), "wb") as f:
                f.write(rng.randbytes(rng.randint(1, 64_000)))
        argv = [self.fanstore, "pack", src, self.store, "--partitions", str(partitions),
                "--codec", "zstd:1", "--no-progress"]
        self.cmd(argv)
        subprocess.run(argv, check=True, capture_output=True)

    @property
    def total_seconds(self) -> float:
        return (self.t_end or time.time()) - self.t_start

    def emit(self, row: dict) -> dict:
        """Tag a row with the run id, keep it, and append it to the run's JSONL at once."""
        row = dict(row, run_id=self.run_id)
        self.rows.append(row)
        with open(self.jsonl_tmp, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def cmd(self, text, **replace: str) -> None:
        """Record a command (an argv or a string) for the docs, WORK for the work dir."""
        text = text if isinstance(text, str) else shown(text)
        for old, new in replace.items():
            text = text.replace(new, old)
        text = text.replace(self.work, "WORK")
        if text not in self.commands:
            self.commands.append(text)

    def write_list(self, name: str, items: list[str]) -> str:
        os.makedirs(self.lists, exist_ok=True)
        path = os.path.join(self.lists, name)
        with open(path, "w") as f:
            f.write("".join(p + "\n" for p in items))
        return path

    def vals(self, key: str, **kw) -> list:
        return row_vals(self.rows, key, **kw)

    def pick(self, **kw) -> list[dict]:
        return pick_rows(self.rows, **kw)

    def cells(self, q: dict, *specs: str) -> list[str]:
        """Table cells over the rows matching ``q``, one a spec ``how:key[:digits]``: how is
        ``spread`` (median (min–max)), ``med`` (the median) or ``p`` (``key_p50 / key_p99``,
        digits 2 / 1 unless given)."""
        out = []
        for spec in specs:
            how, key, *d = spec.split(":")
            if how == "p":
                d50, d99 = (int(x) for x in d) if d else (2, 1)
                out.append(f"{num(med(self.vals(key + '_p50', **q)), d50)} / "
                           f"{num(med(self.vals(key + '_p99', **q)), d99)}")
            else:
                v, d = self.vals(key, **q), int(d[0]) if d else 0
                out.append(spread(v, d) if how == "spread" else num(med(v), d))
        return out

    # -------------------------------------------------------------- mounts
    def mount(self, store: str, mnt: str, args: list[str] = (), timeout: float = 120
              ) -> int | None:
        """A fresh ``fanstore mount STORE MNT ARGS``; the daemon's pid. Raises on failure."""
        self.umount(mnt)
        os.makedirs(mnt, exist_ok=True)
        argv = [self.fanstore, "mount", store, mnt, *args]
        self.cmd(argv)
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not is_mounted(mnt):
            raise RuntimeError(f"fanstore mount failed: {p.stderr.strip()[-500:]}")
        self.mounted[mnt] = state_pid(mnt)
        return self.mounted[mnt]

    def umount(self, mnt: str) -> None:
        """``fanstore umount`` (else a lazy ``fusermount3 -u -z``), waiting for the daemon."""
        pid = self.mounted.pop(mnt, None)
        if not is_mounted(mnt):
            return
        self.cmd(f"{self.fanstore} umount {mnt}")
        p = subprocess.run([self.fanstore, "umount", mnt], capture_output=True, text=True,
                           timeout=90)
        if p.returncode != 0 or is_mounted(mnt):
            log(f"  fanstore umount {mnt} failed ({p.stderr.strip()}); fusermount3 -u -z")
            subprocess.run(["fusermount3", "-u", "-z", "--", mnt], capture_output=True)
        deadline = time.monotonic() + 30
        while pid and pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def sub(self, argv: list[str], timeout: float | None = None, **kw) -> dict:
        """Run a reader subprocess (own process group); its JSON row."""
        return run_json(argv, timeout or getattr(self.a, "pass_limit", 600) + 120, **kw)

    def still_mounted(self) -> list[str]:
        return [ln.split()[1] for ln in _read("/proc/self/mounts").splitlines()
                if len(ln.split()) > 1 and ln.split()[1].startswith(self.work + "/")]

    def cleanup(self) -> None:
        """Stop every job and mount of this run (also after an error or a signal); remove the
        empty mount points."""
        for job in list(self.jobs):
            try:
                job.stop()
            except Exception as exc:  # noqa: BLE001 - keep cleaning the rest
                log(f"  stopping job {job.dir} failed: {exc}")
        for mnt in list(self.mounted):
            try:
                self.umount(mnt)
            except Exception as exc:  # noqa: BLE001
                log(f"  umount {mnt} failed: {exc}")
                subprocess.run(["fusermount3", "-u", "-z", "--", mnt], capture_output=True)
        for d in os.listdir(self.mnt_root) if os.path.isdir(self.mnt_root) else []:
            try:  # the mount points, once empty
                os.rmdir(os.path.join(self.mnt_root, d))
            except OSError:
                pass
        if getattr(self.a, "clean", False):
            shutil.rmtree(self.work, ignore_errors=True)

    def run(self) -> None:
        raise NotImplementedError


def args(ap: argparse.ArgumentParser, name: str, work: str, fanstore: bool = True) -> None:
    """The options every benchmark has: work dir, docs, results, label, fanstore."""
    ap.add_argument("--work", default=work, help=f"work directory (default {work})")
    ap.add_argument("--label", help="a note shown at the top of the docs section")
    ap.add_argument("--docs", default=DOCS, help="markdown file the section is written to")
    ap.add_argument("--results", default=os.path.join(RESULTS_DIR, f"{name}.jsonl"),
                    help="where the raw JSON rows go")
    ap.add_argument("--no-docs", action="store_true",
                    help="print the section; touch neither --docs nor --results")
    if fanstore:
        ap.add_argument("--fanstore", help="the fanstore command (default: next to python)")
        ap.add_argument("--clean", action="store_true", help="delete the work dir at the end")


def dataset_args(ap: argparse.ArgumentParser, partitions: int | None = 8,
                 pass_limit: float = 600.0, codec: str | None = "zstd:3") -> None:
    """The dataset (tools/gen_dataset.py), store and pass options of the read benchmarks."""
    ap.add_argument("--files", type=int, help="small files in the dataset")
    ap.add_argument("--classes", type=int, help="class directories")
    ap.add_argument("--min-kb", type=int, default=50)
    ap.add_argument("--max-kb", type=int, default=150)
    ap.add_argument("--seed", type=int, default=20240601, help="dataset seed")
    if codec:
        ap.add_argument("--codec", default=codec, help=f"store codec (default {codec})")
    ap.add_argument("--partitions", type=int, default=partitions, help="store partitions")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="fanstore pack --jobs")
    ap.add_argument("--pass-limit", type=float, default=pass_limit,
                    help=f"seconds after which a read pass is cut short (default {pass_limit:g})")
    ap.add_argument("--reuse-store", action="store_true",
                    help="keep an existing store packed with the same parameters (not timed)")


def presets(a: argparse.Namespace, table_: dict, smoke: str = "quick") -> argparse.Namespace:
    """Fill the options left unset from the chosen preset; label a smoke run as such."""
    for key, value in table_[a.preset].items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    if getattr(a, "label", None) is None and a.preset == smoke:
        a.label = ("SMOKE RUN (--preset quick, on a shared machine): it shows the harness "
                   "works; the numbers are not results.")
    return a


def load_rows(path: str) -> list[dict]:
    """The JSON rows of a JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_list(path: str) -> list[str]:
    """A file list: one path a line."""
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def ints(text) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def words(text) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(bench: Bench, render, raw_argv: list[str], section_name=None) -> int:
    """Run ``bench`` so that Ctrl-C, SIGTERM, SIGHUP or a crash still end in its cleanup;
    then write ``render(bench, label, argv)`` into its docs section and its rows to
    ``--results`` (or print it with ``--no-docs``). Returns the exit status."""
    a, name = bench.a, section_name or bench.name
    if os.geteuid() != 0:
        print(f"{name}: run as root (drop_caches and FUSE mounts)", file=sys.stderr)
        return 2
    for sig, handler in ((signal.SIGINT, signal.default_int_handler),
                         (signal.SIGTERM, _raise_interrupt), (signal.SIGHUP, _raise_interrupt)):
        signal.signal(sig, handler)
    os.makedirs(bench.work, exist_ok=True)
    bench.machine = machine_table(bench.work)
    ok = False
    try:
        bench.run()
        ok = True
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
    except Exception:
        log("failed: cleaning up")
        raise
    finally:
        bench.t_end = time.time()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        bench.cleanup()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        left = bench.still_mounted()
        if left:
            log(f"WARNING: still mounted: {left}")
    if not ok:
        log(f"partial rows kept in {bench.jsonl_tmp}; docs not touched")
        return 130
    script = os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else name
    argv = [".venv/bin/python", script] + list(raw_argv)
    if a.no_docs:
        print(render(bench, a.label, argv))
    else:
        os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
        if os.path.exists(bench.jsonl_tmp):
            shutil.copyfile(bench.jsonl_tmp, a.results)
        replace_section(name, render(bench, a.label, argv), a.docs)
        log(f"wrote {a.docs} (section {name}) and {a.results}")
    log(f"done in {bench.total_seconds / 60:.1f} min")
    return 0
