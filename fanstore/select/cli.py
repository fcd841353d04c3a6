"""``fanstore select SRC``: print the report (table or JSON), draw the plot, set the status.

Exit status 3 (:class:`BudgetNotMetError`) when no codec meets the budget; the report is
printed first, so ``--json`` output is complete either way.
"""

from __future__ import annotations

import json
import sys

from fanstore.select.report import capacity_json, capacity_line, plot, require_matplotlib, table
from fanstore.select.selector import run_selection, selection_options


def run_select_command(args) -> int:
    if getattr(args, "plot", None):
        require_matplotlib()  # fail before the long measurement, not after
    options = selection_options(args)
    result = run_selection(args.src, options)
    capacity = getattr(args, "local_capacity", None)
    fits = capacity_json(result, capacity) if capacity else None
    if getattr(args, "json", False):
        doc = result.to_json()
        if fits is not None:
            doc["local_capacity"] = fits
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(result))
        if fits is not None:
            print(capacity_line(fits))
    sys.stdout.flush()
    if getattr(args, "plot", None):
        plot(result, args.plot)
        print(f"fanstore: plot written to {args.plot}", file=sys.stderr)
    result.check_met()
    return 0
