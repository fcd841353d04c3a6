"""``fanstore select SRC``: print the report (table or JSON), draw the plot, set the status;
``fanstore select --check STORE_OR_MOUNT``: read a packed store as the report predicted.

Exit status 3 (:class:`BudgetNotMetError`) when no codec meets the budget (or, with
``--check``, when the store read slower than the budget it was chosen for); the report is
printed first, so ``--json`` output is complete either way.
"""

from __future__ import annotations

import json
import signal
import sys

from fanstore.cli.common import add_select_budget_args, nonneg_int, size
from fanstore.errors import BudgetNotMetError, UsageError


def add_parsers(sub, common) -> None:
    s = sub.add_parser("select", parents=[common], help="benchmark codecs and pick one",
                       description="Benchmark codecs on a sample of SRC, measure the "
                                   "finalists the way the budget is defined, and pick the best "
                                   "ratio that meets it. With --check, read a packed store "
                                   "the way a selection predicted and compare.")
    s.add_argument("src", metavar="SRC", nargs="?")
    add_select_budget_args(s, for_pack=False)
    s.add_argument("--local-capacity", type=size, default=None, metavar="SIZE",
                   help="also say how many copies of the store packed with the chosen codec "
                        "fit in SIZE per node (500G, 1.5T, 800M or bytes)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--plot", metavar="FILE", help="draw ratio vs rate per node (matplotlib)")
    g = s.add_argument_group("checking a choice")
    g.add_argument("--check", metavar="STORE_OR_MOUNT",
                   help="read this packed store (cold, through a temporary mount) or live "
                        "mount once, every file, the way the prediction was made, and print "
                        "predicted vs measured (instead of selecting)")
    g.add_argument("--report", metavar="FILE",
                   help="with --check: the prediction, a saved 'fanstore select --json' "
                        "(default: the selection a --codec auto pack recorded, if any)")
    g.add_argument("--check-files", type=nonneg_int, default=0, metavar="N",
                   help="with --check: read a random N of the files (default: all)")
    s.set_defaults(func=cmd_select)


def _stop_cleanly_on_sigterm() -> None:
    """SIGTERM (a job's time limit, ``kill``) unwinds like Ctrl-C: the trials' temporary
    mounts and stores are removed on the way out (``fanstore: interrupted``, status 130)."""

    def handler(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_select(args) -> int:
    _stop_cleanly_on_sigterm()
    if getattr(args, "check", None):
        return _check(args)
    if getattr(args, "report", None) or getattr(args, "check_files", 0):
        raise UsageError("--report and --check-files go with --check STORE_OR_MOUNT")
    if not args.src:
        raise UsageError("give SRC (the data to select a codec for) or --check "
                         "STORE_OR_MOUNT")
    from fanstore.select.plot import plot, require_matplotlib
    from fanstore.select.report import check_met, table, to_json
    from fanstore.select.selector import run_selection

    if getattr(args, "plot", None):
        require_matplotlib()  # fail before the long measurement, not after
    options = selection_options(args)
    result = run_selection(args.src, options)
    capacity = getattr(args, "local_capacity", None) or None
    if getattr(args, "json", False):
        json.dump(to_json(result, capacity), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(result, capacity))
    sys.stdout.flush()
    if getattr(args, "plot", None):
        plot(result, args.plot)
        print(f"fanstore: plot written to {args.plot}", file=sys.stderr)
    check_met(result)
    return 0


def _check(args) -> int:
    from fanstore.select.check import report_lines, run_check, to_json

    if args.src:
        raise UsageError("give SRC or --check STORE_OR_MOUNT, not both")
    res = run_check(args.check, args.mode, args.cores, args.reader, args.report,
                    args.check_files, args.seed)
    if args.json:
        json.dump(to_json(res), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n".join(report_lines(res)))
    sys.stdout.flush()
    if res.met is False:
        p = res.prediction
        assert p is not None and p.required_bytes_per_s
        raise BudgetNotMetError(f"{args.check} read at {res.bytes_per_s / 1e6:,.0f} MB/s, "
                                f"{res.bytes_per_s / p.required_bytes_per_s:.0%} of the "
                                f"budget of {p.required_bytes_per_s / 1e6:,.0f} MB/s")
    return 0


def selection_options(args):
    """The :class:`~fanstore.select.options.SelectionOptions` of ``fanstore select`` /
    ``fanstore pack --codec auto`` arguments."""
    from fanstore.select.options import ROUNDS, TRIALS, SelectionOptions

    return SelectionOptions(
        mode=getattr(args, "mode", "sync") or "sync",
        files_per_sec=getattr(args, "files_per_sec", None),
        mb_per_sec=getattr(args, "mb_per_sec", None),
        cores=getattr(args, "cores", None),
        sample_mb=getattr(args, "sample_mb", None) or 200.0,
        seed=getattr(args, "seed", 0) or 0,
        per_kind=bool(getattr(args, "per_kind", False)),
        storage_mb_per_sec=getattr(args, "storage_mb_per_sec", None),
        storage_latency_us=getattr(args, "storage_latency_us", None),
        reader=getattr(args, "reader", None) or _default_reader(),
        reader_default=not getattr(args, "reader", None),
        chunk_size=(getattr(args, "chunk_kb", None) or 1024) * 1024,
        progress=False if getattr(args, "no_progress", False) else None,
        trials=TRIALS if getattr(args, "trials", None) is None else args.trials,
        rounds=getattr(args, "rounds", None) or ROUNDS,
    )


def _default_reader() -> str:
    """``mount`` where FUSE works here, else ``api`` (said once on stderr)."""
    from fanstore.select.calibrate import fuse_problem

    problem = fuse_problem()
    if problem:
        print(f"fanstore: --reader api (no FUSE here: {problem})", file=sys.stderr)
        return "api"
    return "mount"
