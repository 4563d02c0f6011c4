"""The picture of a calibration: per-module peak |activation| against fp16's limit.

One bar per module that owns weights, in execution order, on a log scale, with the fp16 limit
drawn across and fp32 islands highlighted: the chart a user looks at to see where their model
runs out of fp16 range. Rendered on a bare ``Figure`` with its own Agg canvas (no display
needed): pyplot and matplotlib's process-wide backend are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN, ActivationStats
from precision_convert.dtypes import FP16_MAX

#: File name of the chart beside a model's weights; the model card shows it when present.
CHART_NAME = "precision_activations.png"
#: Beyond this many bars labels become unreadable; only every n-th module is labelled.
_MAX_LABELS = 40


def activation_chart(
    stats: Mapping[str, ActivationStats],
    modules: Sequence[str],
    islands: Mapping[str, str],
    path: Path,
    title: str,
) -> Path:
    """Write a PNG chart of ``modules``' peak activations to ``path`` and return it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    shown = sorted((stats[m] for m in modules if m in stats), key=lambda s: s.order)
    peaks = [max(s.max_out, s.max_in, 1e-12) for s in shown]
    colors = [
        "#d62728"
        if islands.get(s.module) == "range"
        else "#9467bd"
        if islands.get(s.module) == "search"
        else "#ff7f0e"
        if s.module in islands
        else "#1f77b4"
        for s in shown
    ]
    width = min(24.0, max(8.0, len(shown) * 0.18))
    fig = Figure(figsize=(width, 7.0), dpi=110)
    FigureCanvasAgg(fig)  # attaches itself to the figure; no pyplot, no global backend
    ax = fig.subplots()
    ax.bar(range(len(shown)), peaks, color=colors, width=0.85)
    ax.set_yscale("log")
    ax.axhline(FP16_MAX, color="black", linestyle="--", linewidth=1.2)
    ax.axhline(FP16_MAX / ACTIVATION_MARGIN, color="grey", linestyle=":", linewidth=1)
    ax.text(len(shown) - 0.5, FP16_MAX * 1.15, f"fp16 max {FP16_MAX:g}", fontsize=9, ha="right")
    step = max(1, len(shown) // _MAX_LABELS)
    ax.set_xticks(range(0, len(shown), step))
    ax.set_xticklabels(
        [shown[i].module for i in range(0, len(shown), step)], rotation=90, fontsize=7
    )
    ax.set_ylabel("peak |activation| (fp32 run)")
    ax.set_title(title)
    ax.legend(
        handles=[
            Patch(color="#1f77b4", label="compute dtype"),
            Patch(color="#ff7f0e", label="fp32 island: precision (recipe/norm)"),
            Patch(color="#d62728", label="fp32 island: range"),
            Patch(color="#9467bd", label="fp32 island: found by search"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
