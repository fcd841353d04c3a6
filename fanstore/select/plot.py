"""The selection's plot (``fanstore select --plot FILE``, the ``plot`` extra): ratio against
rate per node, measured where a finalist was measured, the budget line, the choice marked.
"""

from __future__ import annotations

from fanstore.errors import FanStoreError
from fanstore.select.result import SelectionResult

MB = 1e6


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise FanStoreError("--plot needs matplotlib, which is not installed: "
                            "pip install 'fanstore[plot]'") from None


def plot(res: SelectionResult, path: str) -> None:
    """Ratio against each candidate's rate per node (measured or modelled), the budget
    line, the choice marked."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = res.budget
    cands = [c for c in res.candidates if c.kinds is None]
    fig, ax = plt.subplots(figsize=(9, 6))
    for ok, color, name in ((True, "tab:green", "meets the budget"),
                            (False, "tab:gray", "too slow")):
        for how, marker in (("measured", "o"), ("model", "x")):
            xs = [c.rate / MB for c in cands if c.meets == ok and c.rate_from == how]
            ys = [c.cost.ratio for c in cands if c.meets == ok and c.rate_from == how]
            if xs:
                ax.scatter(xs, ys, color=color, marker=marker, label=f"{name} ({how})",
                           zorder=3)
    for c in cands:
        ax.annotate(c.label, (c.rate / MB, c.cost.ratio), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    chosen = res.candidate(res.chosen)
    ax.scatter([chosen.rate / MB], [chosen.cost.ratio], marker="*", s=300,
               color="tab:red", label=f"chosen: {chosen.label}", zorder=4)
    if res.per_kind is not None and res.per_kind_cost is not None:
        ax.scatter([(res.per_kind_rate or 0) / MB], [res.per_kind_cost.ratio], marker="P",
                   s=160, color="tab:purple", label="per-kind mix", zorder=4)
    ax.axvline(b.required / MB, color="tab:red", linestyle="--",
               label=f"budget {b.required / MB:,.0f} MB/s")
    ax.set_xscale("log")
    ax.set_xlabel(f"read rate per node, MB/s ({res.mode}, {b.cores} cores; measured for "
                  "the finalists, modelled for the others)")
    ax.set_ylabel("compression ratio")
    ax.set_title(f"codec selection for {res.source}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["plot", "require_matplotlib"]
