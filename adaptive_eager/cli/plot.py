"""`--plot FILE`: pictures of what the emulated device did, drawn with matplotlib.

matplotlib is an optional extra (`pip install 'adaptive-eager[plot]'`): nothing here
imports it at module level, and `require_matplotlib` is called before any work starts, so
a missing extra fails in a second rather than after a long run.
"""
from __future__ import annotations

import os

PLOT_HINT = "--plot needs matplotlib: pip install 'adaptive-eager[plot]'"

# One colour per part of the device time, the same in every picture.
_PART_COLOURS = {"launch overhead": "#d62728", "kernels (compute/memory)": "#1f77b4", "transfers": "#2ca02c"}
_MODE_COLOURS = {"eager": "#ff7f0e", "adaptive": "#1f77b4"}


class PlotError(RuntimeError):
    """--plot cannot work (matplotlib missing, or a target directory that does not exist)."""


def require_matplotlib(path: str) -> None:
    """Fail early, with the fix, when the picture could not be written at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotError(PLOT_HINT) from e
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise PlotError(f"--plot {path}: the directory {directory} does not exist; create it or "
                        f"pick another file name.")


def _figure(width: float, height: float):
    # A bare Figure renders through Agg when saved: no pyplot, no GUI backend, no global state.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _split_bars(ax, labels: list[str], splits: list[dict], unit: str) -> None:
    """Stacked horizontal bars, one per label, of the device-time parts in `splits`."""
    left = [0.0] * len(labels)
    for part, colour in _PART_COLOURS.items():
        values = [s.get(part, 0.0) for s in splits]
        ax.barh(labels, values, left=left, color=colour, label=part)
        left = [a + b for a, b in zip(left, values)]
    for y, (total, split) in enumerate(zip(left, splits)):
        share = split.get("launch overhead", 0.0) / total if total else 0.0
        ax.annotate(f"{total:,.1f} {unit}  ({share:.0%} launch overhead)", (total, y),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, max(left, default=1.0) * 1.8 or 1.0)  # room for the annotation
    ax.set_xlabel(f"emulated device time ({unit})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8)  # below: clear of the bars


def plot_run(path: str, title: str, stats, split: dict) -> None:
    """`run`: where the device time went, and how many launches the ops needed."""
    fig = _figure(10, 3.6)
    fig.suptitle(title, fontsize=10)
    time_ax, count_ax = fig.subplots(1, 2, width_ratios=[3, 2])
    _split_bars(time_ax, ["device time"], [split], "us")
    time_ax.set_title("device time by part", fontsize=9)
    names = ["ops", "launches"]
    fused = [stats.fused_ops, stats.fused_launches]
    other = [max(0, stats.ops - stats.fused_ops), max(0, stats.launches - stats.fused_launches)]
    count_ax.bar(names, other, color="#ff7f0e", label="not fused (one op per launch, or no launch)")
    count_ax.bar(names, fused, bottom=other, color="#1f77b4", label="fused")
    totals = [a + b for a, b in zip(fused, other)]
    for x, total in enumerate(totals):
        count_ax.annotate(f"{total:,}", (x, total), xytext=(0, 2), textcoords="offset points",
                          ha="center", fontsize=8)
    count_ax.set_ylim(0, max(totals, default=1) * 1.35 or 1)  # room for the legend above the bars
    count_ax.set_title("ops and the launches that ran them", fontsize=9)
    count_ax.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=110)


def plot_demo(path: str, title: str, launches_per_step: dict, splits_per_step: dict) -> None:
    """`demo`: launches per step for each mode (warm-up, then steady state), and the device
    time per step split into launch overhead, kernels and transfers."""
    fig = _figure(11, 4)
    fig.suptitle(title, fontsize=10)
    steps_ax, time_ax = fig.subplots(1, 2, width_ratios=[3, 2])
    for mode, series in launches_per_step.items():
        steps = range(1, len(series) + 1)
        steps_ax.plot(steps, series, marker="o", markersize=3, label=mode, color=_MODE_COLOURS.get(mode))
    # eager launches ~100x more than adaptive's steady state: only a log scale shows both;
    # symlog because a step may end with its fused launch still pending (0 launches).
    steps_ax.set_yscale("symlog", linthresh=1)
    steps_ax.set_ylim(bottom=0)
    from matplotlib.ticker import ScalarFormatter

    steps_ax.yaxis.set_major_formatter(ScalarFormatter())  # 1, 10, 100 rather than 10^0 ...
    steps_ax.set_xlabel("training step")
    steps_ax.set_ylabel("kernel launches in the step")
    steps_ax.set_title("launches per step: warm-up, then steady state", fontsize=9)
    steps_ax.grid(True, which="major", alpha=0.3)
    steps_ax.legend(fontsize=8)
    modes = list(splits_per_step)
    _split_bars(time_ax, modes, [splits_per_step[m] for m in modes], "us/step")
    time_ax.set_title("device time per step (whole run)", fontsize=9)
    fig.savefig(path, dpi=110)


def write_demo_plot(path: str, results: dict, args) -> None:
    """The demo's picture from its PhaseResults (mode -> result), one per mode."""
    from adaptive_eager.stats import device_time_split

    launches = {mode: r.launches_per_step for mode, r in results.items()}
    splits = {mode: {part: us / r.steps for part, us in device_time_split(r.stats).items()}
              for mode, r in results.items()}
    title = (f"adaptive-eager demo: MLP {args.layers}x{args.width}, batch {args.batch}, AdamW, "
             f"{args.steps} steps per mode")
    plot_demo(path, title, launches, splits)
