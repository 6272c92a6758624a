"""``bench scale --plot``: the 2x2 figure of the curves (needs matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import os

from tigana.tools.bench.scale.workload import CURVES, KINDS

PLOT_EXTRA = "pip install 'tigana[plot]'  (matplotlib>=3.8)"


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"tigana bench scale --plot needs matplotlib, the optional `plot` extra: {PLOT_EXTRA}"
                         ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(lines: list[dict], path: str | os.PathLike, plt=None) -> None:
    """A 2x2 figure (shards, clients, resident rows, batch): rows/s (solid, left axis) and CPU-s per M rows
    (dashed, right axis) of pull, push and step against the curve's variable."""
    plt = plt or _require_matplotlib()
    titles = {"shards": ("shard daemons", "shards"), "clients": ("client processes", "clients"),
              "rows": ("resident rows", "rows"), "batch": ("ids per batch", "batch")}
    colors = {"pull": "tab:blue", "push": "tab:orange", "step": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.2))
    for ax, curve in zip(axes.ravel(), CURVES, strict=True):
        title, key = titles[curve]
        mine = [d for d in lines if d.get("curve") == curve and d["case"] != "scale.rows.memory"]
        if not mine:
            ax.set_axis_off()
            ax.set_title(f"{title}: not run")
            continue
        cpu_ax = ax.twinx()
        for kind in KINDS:
            for unit, axis, style in (("rows/s", ax, "-o"), ("cpu_s/M rows", cpu_ax, "--s")):
                pts = sorted((d[key], d["value"]) for d in mine if d["case"].endswith("." + kind) and d["unit"] == unit)
                xs, ys = zip(*pts, strict=True)
                axis.plot(xs, [y / 1e6 if unit == "rows/s" else y for y in ys], style, color=colors[kind],
                          label=f"{kind} {'M rows/s' if unit == 'rows/s' else 'CPU-s/M rows'}", markersize=4)
        ax.set_xscale("log", base=2 if curve in ("shards", "clients", "batch") else 10)
        xs = sorted({d[key] for d in mine})
        ax.set_xticks(xs)
        ax.set_xticklabels([_short(x, binary=curve == "batch") for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(title)
        ax.set_ylabel("M rows/s (solid)")
        cpu_ax.set_ylabel("CPU-s per M rows (dashed)")
        ax.set_ylim(bottom=0)
        cpu_ax.set_ylim(bottom=0)
        ax.set_title(f"against {title}")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[k], label=k) for k in KINDS] + [
        plt.Line2D([], [], color="gray", linestyle="-", marker="o", label="rows/s"),
        plt.Line2D([], [], color="gray", linestyle="--", marker="s", label="CPU-s per M rows (client + servers)")]
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False)
    first = next(iter(lines), {})
    fig.suptitle(f"tigana bench scale: dim {first.get('dim', '?')} fp32, Adagrad, Zipf({first.get('zipf', '?')}) "
                 "ids, CPU of client and server processes")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _short(x: int, binary: bool = False) -> str:
    """4096 -> "4k" (binary), 1000000 -> "1M"."""
    base = 1024 if binary else 1000
    for power, suffix in ((3, "B"), (2, "M"), (1, "k")):
        if x >= base ** power and x % base ** power == 0:
            return f"{x // base ** power}{suffix}"
    return f"{x:,}"
