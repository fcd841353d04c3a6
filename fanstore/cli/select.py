"""``fanstore select SRC``: print the report (table or JSON), draw the plot, set the status.

Exit status 3 (:class:`BudgetNotMetError`) when no codec meets the budget; the report is
printed first, so ``--json`` output is complete either way.
"""

from __future__ import annotations

import json
import sys

from fanstore.cli.common import add_select_budget_args, size


def add_parsers(sub, common) -> None:
    s = sub.add_parser("select", parents=[common], help="benchmark codecs and pick one",
                       description="Benchmark codecs on a sample of SRC and pick the best "
                                   "ratio that meets the decompression budget.")
    s.add_argument("src", metavar="SRC")
    add_select_budget_args(s, for_pack=False)
    s.add_argument("--local-capacity", type=size, default=None, metavar="SIZE",
                   help="also say how many copies of the store packed with the chosen codec "
                        "fit in SIZE per node (500G, 1.5T, 800M or bytes)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--plot", metavar="FILE", help="draw ratio vs decode rate (matplotlib)")
    s.set_defaults(func=cmd_select)


def cmd_select(args) -> int:
    from fanstore.select.options import selection_options
    from fanstore.select.report import check_met, plot, require_matplotlib, table, to_json
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
