"""The docs/benchmarks.md section of tools/bench/prefetch_bench.py (its rows -> markdown)."""

from __future__ import annotations

import functools

import common
from prefetch_bench import MOUNT_OF

MB = 1e6


def section(bench, label: str | None, argv: list[str]) -> str:
    rows = bench.rows
    a = bench.a
    pick = functools.partial(common.pick_rows, rows)
    vals = functools.partial(common.row_vals, rows)
    med = common.med
    num = common.num

    def dval(rs, key):
        return [(r.get("daemon") or {}).get(key) for r in rs
                if isinstance((r.get("daemon") or {}).get(key), (int, float))]

    def reads_of(r):
        return ((r.get("daemon") or {}).get("requests_by_op") or {}).get("read", 0)

    def per_file(rs, key):
        v = [(r["daemon"].get(key) or 0) / r["files"] for r in rs
             if r.get("daemon") and r.get("files")]
        return med(v)

    def cpu_us(rs):
        v = [r["fanstore_cpu_s"] / r["files"] * 1e6 for r in rs
             if r.get("fanstore_cpu_s") is not None and r.get("files")]
        return med(v)

    out: list[str] = []
    w = out.append
    w("## Prefetch mode on the kernel frontend (`tools/bench/prefetch_bench.py`)")
    w("")
    if label:
        w(f"> **{label}**")
        w("")
    st = pick(kind="store")[0]
    p = st["params"]
    w(f"Run {bench.run_id} ({common.now_utc()}), {bench.total_seconds / 60:.1f} min in all. "
      "Every mode of a phase was measured in this same run, interleaved (the order rotates "
      "from repetition to repetition); **only compare rows of this one run** (the machine is "
      "shared: cold passes spread by about ±20%). Raw rows: "
      f"`tools/bench/results/prefetch_bench.jsonl`. Rerun: `{' '.join(argv)}` (as root).")
    w("")
    w("### Machine")
    w("")
    w(bench.machine)
    w("")
    w("### Dataset")
    w("")
    w(f"`tools/gen_dataset.py` (seed {p['seed']}): {st['files']:,} files of "
      f"{p['min_kb']}-{p['max_kb']} kB in {p['classes']} class directories "
      f"({st['raw_bytes'] / MB:,.0f} MB), packed with `--partitions {p['partitions']} --codec "
      f"{p['codec']}` ({(st.get('stored_bytes') or 0) / MB:,.0f} MB stored, ratio "
      f"{st.get('ratio') or 0:.2f}). Prefetch mounts: `--mode prefetch --prefetch-mb "
      f"{st['prefetch_mb']}` = {st['prefetch_mb'] * 2**20 / max(1, st['raw_bytes']):.0%} of "
      "the dataset (what FanStore may hold decoded; the page cache the pushes fill is the "
      "kernel's). MB = 10^6 bytes. Every pass and epoch cold: `sync; echo 3 > "
      "/proc/sys/vm/drop_caches` and a fresh mount before it. The kernel frontend serves "
      "both modes (2 worker processes: the cores).")
    w("")

    # ------------------------------------------------------------------ targets
    factors = bench.factors or [None]
    tight = factors[0]
    w("### Targets")
    w("")
    w("| target | measured | goal | status |")
    w("| --- | --- | ---: | --- |")
    for f in factors:
        budget = "tight" if f == tight else "input-bound"
        for mode, ref in (("fuse-prefetch", "fuse-sync"), ("api-prefetch", "api-store")):
            s = med(vals("stall_s", kind="dl", mode=mode, factor=f))
            s0 = med(vals("stall_s", kind="dl", mode=ref, factor=f))
            if s is not None and s0:
                w(f"| DataLoader, {budget} (compute x{f:g} of the sync per-batch time): "
                  f"{mode} stall <= {ref} stall | {s:.3f} s vs {s0:.3f} s ({s / s0:.2f}x) | "
                  f"<= 1.00x | {common.check(s <= s0)} |")
    s_sync = med(vals("stall_s", kind="serial", mode="fuse-sync"))
    for mode in ("fuse-prefetch", "api-prefetch"):
        s = med(vals("stall_s", kind="serial", mode=mode))
        if s is not None and s_sync:
            removed = 1 - s / s_sync
            w(f"| a reader that does not pipeline (compute per file = the sync read time): "
              f"{mode} removes >= 80% of the sync stall | {removed:.0%} ({s:.2f} s vs "
              f"{s_sync:.2f} s) | >= 80% | {common.check(removed >= 0.8)} |")
    rs = pick(kind="pass", mode="fuse-prefetched", workers=4)
    sync4 = med(vals("files_per_s", kind="pass", mode="fuse-sync", workers=4))
    if rs and sync4:
        fps = med(vals("files_per_s", kind="pass", mode="fuse-prefetched", workers=4))
        w(f"| prefetched pass, no compute, 4 readers: files/s >= the sync mount's | "
          f"{fps / sync4:.2f}x ({fps:,.0f} vs {sync4:,.0f}) | >= 1.0x | "
          f"{common.check(fps >= sync4)} |")
        share = med([reads_of(r) / r["files"] for r in rs if r.get("files")])
        w(f"| same pass: READ requests that reach a worker, per file read (directories "
          f"listed first) | {share:.1%} | <= 5% | {common.check(share <= 0.05)} |")
    r1 = med(vals("stall_s", kind="ranks", ranks=1))
    r2 = med(vals("stall_s", kind="ranks", ranks=2))
    if r1 and r2 is not None:
        w(f"| 2 ranks, rank 0's prefetched epoch (half the files remote), compute per file: "
          f"stall <= 1.2x the 1-rank epoch | {r2 / r1:.2f}x ({r2:.2f} s vs {r1:.2f} s) | "
          f"<= 1.2x | {common.check(r2 <= 1.2 * r1)} |")
    model = pick(kind="model")
    comp_ms = {r.get("factor"): r["compute_ms"] for r in pick(kind="compute")}
    if model and model[0].get("files_per_s"):
        x = model[0]["files_per_s"]
        for f in factors:
            s = med(vals("stall_s", kind="dl", mode="fuse-prefetch", factor=f))
            nb = med(vals("batches", kind="dl", mode="fuse-prefetch", factor=f))
            nf = med(vals("files", kind="dl", mode="fuse-prefetch", factor=f))
            if s is None or not nb or not nf or comp_ms.get(f) is None:
                continue
            pred = max(0.0, nf / x - nb * comp_ms[f] / 1e3)
            w(f"| `fanstore select --mode prefetch` ({model[0]['codec']}: {x:,.0f} files/s "
              f"predicted) against the DataLoader, compute x{f:g}: predicted stall (beyond "
              f"start-up) vs measured fuse-prefetch stall | {pred:.2f} s vs {s:.2f} s | – | "
              "(info) |")
    mem = [r for r in rows if MOUNT_OF.get(r.get("mode")) == "prefetch"
           and r.get("rss_peak") and r.get("kind") in ("pass", "serial", "dl")]
    if mem:
        budget = st["prefetch_mb"] * 2**20
        worst = max(mem, key=lambda r: r["rss_peak"] - r["rss_base"])
        over = worst["rss_peak"] - worst["rss_base"]
        w(f"| memory: the FanStore processes' RSS (summed) <= base + `--prefetch-mb` + 10% "
          f"(worst pass or epoch) | base {worst['rss_base'] / MB:,.0f} MB, peak "
          f"{worst['rss_peak'] / MB:,.0f} MB: +{over / MB:,.0f} MB for a budget of "
          f"{budget / MB:,.0f} MB (PSS +{(worst['pss_peak'] - worst['pss_base']) / MB:,.0f} "
          f"MB) | <= +{budget * 1.1 / MB:,.0f} MB | {common.check(over <= budget * 1.1)} |")
    w("")

    # ------------------------------------------------------------------ read passes
    w("### Read passes: files/s for the same shuffled epoch (cold)")
    w("")
    w("Reader processes take round-robin shares of the order and start together behind a "
      "barrier; wall time from the release to the last reader done. `fuse-prefetch` and "
      "`api-prefetch` send the order when the readers start (its cost is in the pass, the "
      "`order s` column); `fuse-prefetched` lists the directories and sends the order "
      "before the pass and starts it once the prefetch is done (`prefetch s`, not in the "
      "pass). CPU % = the whole machine (2 cores); FanStore µs/file = the CPU of every "
      "FanStore process (daemon, frontend, workers) per file read, prefetching included; "
      "READs/file = READ requests that reached a worker. Cells: median (min–max) over "
      f"{a.reps} repetition(s).")
    w("")
    w("| mode | readers | files/s | MB/s | p50 / p99 ms | CPU % | FanStore µs/file | "
      "READs/file | order s / prefetch s | vs raw | vs fuse-sync |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for wk in a.workers:
        raw = med(vals("files_per_s", kind="pass", mode="raw", workers=wk))
        sync = med(vals("files_per_s", kind="pass", mode="fuse-sync", workers=wk))
        for mode in a.modes:
            q = dict(kind="pass", mode=mode, workers=wk)
            rs = pick(**q)
            if not rs:
                continue
            fs = vals("files_per_s", **q)
            err = sum(r.get("errors") or 0 for r in rs)
            rd = med([reads_of(r) / r["files"] for r in rs if r.get("files")]) \
                if MOUNT_OF.get(mode) else None
            extra = num(med(vals("order_send_s", **q)), 3) if mode in (
                "fuse-prefetch", "api-prefetch") else num(med(vals("prefetch_s", **q)), 2) \
                if mode == "fuse-prefetched" else "–"
            note = f" ⚠ {err} errors" if err else ""
            w(f"| {mode}{note} | {wk} | {common.spread(fs)} | "
              f"{common.spread(vals('MB_per_s', **q))} | "
              f"{num(med(vals('lat_ms_p50', **q)), 2)} / {num(med(vals('lat_ms_p99', **q)), 1)} "
              f"| {num(med(vals('cpu_busy_pct', **q)))} | {num(cpu_us(rs))} | "
              f"{'–' if rd is None else num(rd, 3)} | {extra} | "
              f"{common.ratio(med(fs), raw)} | {common.ratio(med(fs), sync)} |")
    w("")

    # ------------------------------------------------------------------ counters
    w("### Prefetch counters per file read")
    w("")
    w("Differences of the mount's `fanstore stats` across each pass or epoch, per file "
      "read (medians). `pushed` = files stored into the page cache ahead of the readers; "
      "`buffered` = pushes the kernel refused, kept in the shared buffer; `from buffer` = "
      "READs answered from it; `late` = a READ found its file being prefetched; `missed` = "
      "a READ found a file of the order nobody had started; `skipped` = files a reader got "
      "to first; `listed` = directories listed through the mount (to give the kernel their "
      "inodes); `READs` = READ requests that reached a worker.")
    w("")
    w("| phase | mode | readers / factor | pushed | buffered | from buffer | late | missed | "
      "skipped | listed | READs | MB evicted unused |")
    w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    groups = [("pass", m, {"workers": wk}, wk) for wk in a.workers for m in a.modes] + \
        [("serial", m, {}, 1) for m in getattr(a, "serial_modes", [])] + \
        [("dl", m, {"factor": f}, f"x{f:g}" if f is not None else "–")
         for f in factors for m in a.dl_modes]
    for kind, mode, extra, shown in groups:
        if MOUNT_OF.get(mode) != "prefetch":
            continue
        rs = [r for r in pick(kind=kind, mode=mode, **extra) if r.get("daemon")]
        if not rs:
            continue
        cells = [num(per_file(rs, k), 2) for k in (
            "prefetch_pushed", "prefetch_buffered", "prefetch_served_from_buffer",
            "prefetch_late", "prefetch_missed", "prefetch_skipped", "prefetch_listings")]
        rd = med([reads_of(r) / r["files"] for r in rs if r.get("files")])
        ev = med([x / MB for x in dval(rs, "prefetch_bytes_evicted_unused")] or [0])
        w(f"| {kind} | {mode} | {shown} | {' | '.join(cells)} | {num(rd, 3)} | "
          f"{num(ev, 1)} |")
    w("")

    # ------------------------------------------------------------------ serial
    if pick(kind="serial"):
        w("### A reader that does not pipeline")
        w("")
        w(f"One process reads the epoch's order file by file and sleeps "
          f"{num(bench.serial_compute_ms, 3)} ms after each (the sync mount's read time per "
          "file, one reader, from the read passes): a plain training loop, `num_workers=0`, "
          "an external source. Stall = the time spent reading (and sending the order, "
          "which the prefetch modes do first). Cells: median (min–max) over "
          f"{a.serial_reps} repetition(s). `removed` = 1 - stall / the sync mount's.")
        w("")
        w("| mode | epoch s | stall s | read p50 / p99 ms | FanStore µs/file | READs/file "
          "| removed |")
        w("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for mode in a.serial_modes:
            q = dict(kind="serial", mode=mode)
            rs = pick(**q)
            if not rs:
                continue
            s = med(vals("stall_s", **q))
            rd = med([reads_of(r) / r["files"] for r in rs if r.get("files")]) \
                if MOUNT_OF.get(mode) else None
            w(f"| {mode} | {common.spread(vals('epoch_s', **q), 2)} | "
              f"{common.spread(vals('stall_s', **q), 2)} | "
              f"{num(med(vals('read_ms_p50', **q)), 2)} / "
              f"{num(med(vals('read_ms_p99', **q)), 1)} | {num(cpu_us(rs))} | "
              f"{'–' if rd is None else num(rd, 3)} | "
              + (f"{1 - s / s_sync:.0%}" if s is not None and s_sync else "–") + " |")
        w("")

    # ------------------------------------------------------------------ DataLoader
    comp = pick(kind="compute")
    if comp:
        calib = comp[0]["sync_per_batch_ms"]
        cms = {r.get("factor"): r["compute_ms"] for r in comp}
        w("### DataLoader with a fixed compute time per batch")
        w("")
        w(f"`DataLoader(dataset, batch_size={a.batch}, num_workers={a.dl_workers})` (fork, "
          "prefetch_factor 2) over the epoch's order, `collate_fn` = the batch's byte count; "
          "the loop sleeps a fixed compute time per batch, a multiple of the per-batch time "
          "of a cold sync epoch without compute (calibration: "
          f"{', '.join(f'{x:.1f}' for x in calib)} ms/batch): x1 = tight (the sync pipeline "
          "just keeps up), x0.5 = input-bound. The prefetch modes wrap the sampler in "
          "`fanstore.torch.PrefetchSampler` (the order goes over from a thread when the "
          "epoch starts). Stall = time the loop waits in `next()`, `iter(loader)` included. "
          f"Cells: median (min–max) over {a.dl_reps} repetition(s).")
        w("")
        how = {"raw": "plain files, `open().read()`",
               "fuse-sync": "sync mount, `open().read()`",
               "fuse-prefetch": "prefetch mount, `open().read()`, `PrefetchSampler`",
               "api-prefetch": "`FanStoreDataset(open_store(MNT))`, `PrefetchSampler`",
               "api-store": "`FanStoreDataset(open_store(STORE))`"}
        for f in factors:
            cm = cms.get(f)
            nb = med(vals("batches", kind="dl", factor=f))
            ref = {"fuse-prefetch": "fuse-sync", "api-prefetch": "api-store"}
            w(f"**Compute {num(cm, 1)} ms per batch"
              + ("" if f is None else f" (x{f:g}" + (", tight)" if f == tight else ")"))
              + f"**; ideal epoch {num((nb or 0) * (cm or 0) / 1e3, 2)} s.")
            w("")
            w("| mode | dataset / reads | epoch s | stall s | first batch s | wait p50 / p99 "
              "ms | CPU % | FanStore µs/file | READs/file | stall vs |")
            w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for mode in a.dl_modes:
                q = dict(kind="dl", mode=mode, factor=f)
                rs = pick(**q)
                if not rs:
                    continue
                s = med(vals("stall_s", **q))
                r0 = ref.get(mode)
                s0 = med(vals("stall_s", kind="dl", mode=r0, factor=f)) if r0 else None
                rd = med([reads_of(r) / r["files"] for r in rs if r.get("files")]) \
                    if MOUNT_OF.get(mode) else None
                err = [r.get("first_error") for r in rs if r.get("errors")]
                w(f"| {mode}{' ⚠ ' + str(err[0])[:80] if err else ''} | {how[mode]} | "
                  f"{common.spread(vals('epoch_s', **q), 2)} | "
                  f"{common.spread(vals('stall_s', **q), 3)} | "
                  f"{num(med(vals('first_batch_s', **q)), 3)} | "
                  f"{num(med(vals('wait_ms_p50', **q)), 1)} / "
                  f"{num(med(vals('wait_ms_p99', **q)), 0)} | "
                  f"{num(med(vals('cpu_busy_pct', **q)))} | {num(cpu_us(rs))} | "
                  f"{'–' if rd is None else num(rd, 3)} | "
                  + (f"{s / s0:.2f}x {r0}" if s is not None and s0 else "–") + " |")
            w("")

    # ------------------------------------------------------------------ ranks
    if pick(kind="ranks"):
        w("### Two ranks: rank 0's prefetched epoch with half of the files remote")
        w("")
        w("The serial reader (compute "
          f"{num(bench.serial_compute_ms, 3)} ms per file) on rank 0 of `mpiexec -n 2 "
          "fanstore mount STORE JOB/mnt{rank} --local-dir JOB/local{rank} --mode prefetch` "
          "(each node: its leader, 2 worker ranks that serve the mount and the other node, "
          "a frontend process), against the same reader on a 1-rank mount with a local dir. "
          "FanStore µs/file = every FanStore process of the job (both nodes) per file of the "
          "epoch.")
        w("")
        w("| ranks | epoch s | stall s | read p50 / p99 ms | remote reads | pushed | READs/file "
          "| FanStore µs/file |")
        w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for n in (1, 2):
            q = dict(kind="ranks", ranks=n)
            rs = pick(**q)
            if not rs:
                continue
            w(f"| {n} | {common.spread(vals('epoch_s', **q), 2)} | "
              f"{common.spread(vals('stall_s', **q), 2)} | "
              f"{num(med(vals('read_ms_p50', **q)), 2)} / "
              f"{num(med(vals('read_ms_p99', **q)), 1)} | "
              f"{num(med(dval(rs, 'remote_reads')))} | {num(med(dval(rs, 'prefetch_pushed')))} "
              f"| {num(med([reads_of(r) / r['files'] for r in rs if r.get('files')]), 3)} | "
              f"{num(cpu_us(rs))} |")
        w("")

    # ------------------------------------------------------------------ the model
    if model:
        m0 = model[0]
        w("### What `fanstore select --mode prefetch` predicted")
        w("")
        w(f"`fanstore select DATA --mode prefetch --cores {m0.get('cores')} --reader mount` "
          f"on this dataset chose `{m0.get('chosen')}` "
          f"({num(m0.get('chosen_files_per_s'))} files/s per node) and predicts "
          f"{num(m0.get('files_per_s'))} files/s for `{m0.get('codec')}`, the store's codec. "
          f"It states its premise: *{m0.get('assumes')}*. A DataLoader epoch of N files in B "
          "batches with compute C per batch then takes max(B·C, N/X): the predicted stall "
          "beyond start-up is max(0, N/X − B·C).")
        w("")
        w("| compute per batch | predicted stall s | measured fuse-prefetch stall s | after "
          "the first batch s |")
        w("| --- | ---: | ---: | ---: |")
        x = m0.get("files_per_s")
        for f in factors:
            nb = med(vals("batches", kind="dl", mode="fuse-prefetch", factor=f))
            nf = med(vals("files", kind="dl", mode="fuse-prefetch", factor=f))
            if not (x and nb and nf and comp_ms.get(f) is not None):
                continue
            pred = max(0.0, nf / x - nb * comp_ms[f] / 1e3)
            w(f"| {num(comp_ms[f], 1)} ms (x{f:g}) | {pred:.2f} | "
              f"{num(med(vals('stall_s', kind='dl', mode='fuse-prefetch', factor=f)), 2)} | "
              f"{num(med(vals('stall_after_first_s', kind='dl', mode='fuse-prefetch', factor=f)), 2)} |")
        w("")

    # ------------------------------------------------------------------ memory
    if mem:
        w("### Memory of the FanStore processes (prefetch mounts)")
        w("")
        w("Sum over the daemon, the frontend process and the workers of RSS and PSS "
          "(`/proc/PID/smaps_rollup`), when the pass or epoch starts (base: the mount is "
          "ready) and the highest value sampled every 50 ms during it. The shared buffer's "
          "pages count in the RSS of the worker that wrote them; pages pushed into the page "
          "cache are the kernel's, in no process. Medians over the rows of each kind.")
        w("")
        w("| phase | mode | base RSS MB | peak RSS MB | peak - base | base PSS MB | peak PSS MB "
          "| budget MB |")
        w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for kind in ("pass", "serial", "dl"):
            for mode in ("fuse-prefetch", "fuse-prefetched", "api-prefetch"):
                rs = [r for r in mem if r["kind"] == kind and r["mode"] == mode]
                if not rs:
                    continue

                def m(key, rs=rs):
                    return med([r[key] / MB for r in rs])

                w(f"| {kind} | {mode} | {num(m('rss_base'))} | {num(m('rss_peak'))} | "
                  f"+{num(med([(r['rss_peak'] - r['rss_base']) / MB for r in rs]))} | "
                  f"{num(m('pss_base'))} | {num(m('pss_peak'))} | "
                  f"{st['prefetch_mb'] * 2**20 / MB:,.0f} |")
        w("")

    # ------------------------------------------------------------------ correctness
    w("### Correctness and errors")
    w("")
    for r in pick(kind="check"):
        for mode, res in r["results"].items():
            w(f"- {mode}: {res['checked']} files compared with the raw files: "
              + ("**error: " + res["error"] + "**" if res.get("error") else
                 ("all identical" if not res["differ"] else f"**{res['differ']} differ**")))
    errs = [r for r in rows if r.get("errors") and r.get("kind") in
            ("pass", "serial", "dl", "calib", "ranks")]
    w(f"- passes or epochs with errors: {len(errs)}"
      + (f" (first: {errs[0].get('first_error')})" if errs else ""))
    for r in rows:
        if r.get("daemon_died"):
            w(f"- **the daemon died during {r['kind']} {r.get('mode')} rep {r.get('rep')}**")
    w("")
    w("### Exact commands")
    w("")
    w("```")
    w("# every pass and epoch: sync; echo 3 > /proc/sys/vm/drop_caches after a fresh mount; "
      "WORK = the work directory, JOB = WORK/jobs/<job>")
    w("# fuse-prefetch sends {\"op\": \"prefetch\", \"paths\": ORDER} on the control socket "
      "(what `fanstore prefetch MNT --list WORK/lists/epoch-REP.txt` sends); "
      "fuse-prefetched first runs os.walk(MNT), sends the order and waits for "
      "`fanstore stats` to show it pushed")
    for c in bench.commands:
        w(c.replace(common.REPO + "/", ""))
    w("```")
    return "\n".join(out)
