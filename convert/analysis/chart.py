"""The picture of a calibration: peak |activation| per module against fp16's limit, as heatmaps.

One bar per module stops being readable long before a real model (an SDXL UNet has over a
thousand weighted modules), so modules are folded into layer roles (see
:mod:`precision_convert.core.folding`): each panel is one repeated structure (``model.layers.{}``,
``down_blocks.{}.attentions.{}``), rows are the roles inside it (``self_attn.q_proj``),
columns the layer indices, and a strip below holds the modules outside repeated layers. The
colour is the peak |activation| of the fp32 run on a log scale relative to fp16's 65504
(red beyond it), and fp32 islands are marked by their reason.

:func:`heatmap_data` is the pure part (names and numbers in, panels out; tested as data), and
:func:`activation_chart` draws it on a bare ``Figure`` with its own Agg canvas (no display
needed): pyplot and matplotlib's process-wide backend are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN, ActivationStats
from precision_convert.core.dtypes import WATCHED_RANGE
from precision_convert.core.folding import Role, fold

#: File name of the chart beside a model's weights; the model card shows it when present.
CHART_NAME = "precision_activations.png"
#: The colour scale spans this many decades below fp16's limit (smaller peaks share a colour).
DECADES = 6
#: Modules outside repeated layers per strip row.
STRIP_WIDTH = 40
#: Most tick labels on a panel's index axis.
MAX_TICKS = 40
#: How each island reason is marked: (marker, label).
MARKERS = {
    "precision": ("o", "fp32 island: precision (recipe, norms)"),
    "range": ("X", "fp32 island: range (activations beyond fp16)"),
    "search": ("D", "fp32 island: found by the search"),
    "user": ("P", "fp32 island: --keep-fp32"),
}


@dataclass(frozen=True)
class Panel:
    """One heatmap: ``rows`` x ``columns`` cells of peak |activation| (None: no such module,
    or it never ran) and each cell's island reason (None: not an island)."""

    title: str
    rows: tuple[str, ...]
    columns: tuple[str, ...]
    peaks: tuple[tuple[float | None, ...], ...]
    islands: tuple[tuple[str | None, ...], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "rows": list(self.rows),
            "columns": list(self.columns),
            "peaks": [list(r) for r in self.peaks],
            "islands": [list(r) for r in self.islands],
        }


@dataclass(frozen=True)
class HeatmapData:
    """Panels of repeated structure, then strips of the modules outside it."""

    panels: tuple[Panel, ...]
    strips: tuple[Panel, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "panels": [p.to_json() for p in self.panels],
            "strips": [s.to_json() for s in self.strips],
        }


def _split_role(role: Role) -> tuple[str, str, tuple[tuple[int, ...], ...]]:
    """(panel title, row label, the varying indices of each member) of a repeated role.

    Slots that hold one value across the role (``transformer_blocks.0``) are written out; the
    title runs up to the last varying slot (``down_blocks.{}.attentions.{}``), the row label
    is the rest (``transformer_blocks.0.attn1.to_q``).
    """
    slots = [i for i, part in enumerate(role.template) if part == "{}"]
    varying = role.varying
    constant = {slots[k]: str(role.indices[0][k]) for k in range(len(slots)) if k not in varying}
    parts = [constant.get(i, part) for i, part in enumerate(role.template)]
    cut = slots[varying[-1]] + 1
    label = ".".join(parts[cut:]) or "(itself)"
    return ".".join(parts[:cut]), label, tuple(tuple(i[k] for k in varying) for i in role.indices)


def heatmap_data(
    peaks: Mapping[str, float], modules: Sequence[str], islands: Mapping[str, str]
) -> HeatmapData:
    """Fold ``modules`` (in execution order) into heatmap panels.

    ``peaks``: each module's peak |activation| (a module missing there never ran);
    ``islands``: module -> island reason. Roles with the same structure and the same indices
    share a panel; panels and rows come in the order their first module ran.
    """
    Row = tuple[str, Role, tuple[tuple[int, ...], ...]]  # label, role, each member's indices
    grouped: dict[tuple[str, tuple[tuple[int, ...], ...]], list[Row]] = {}
    singles: list[str] = []
    for role in fold(modules):
        if not role.repeated:
            singles.append(role.members[0])
            continue
        title, label, indices = _split_role(role)
        grouped.setdefault((title, tuple(sorted(set(indices)))), []).append((label, role, indices))
    panels = []
    for (title, columns), roles in grouped.items():
        position = {c: i for i, c in enumerate(columns)}
        rows_peaks, rows_islands = [], []
        for _, role, indices in roles:
            cells: list[float | None] = [None] * len(columns)
            marks: list[str | None] = [None] * len(columns)
            for member, index in zip(role.members, indices, strict=True):
                cells[position[index]] = peaks.get(member)
                marks[position[index]] = islands.get(member)
            rows_peaks.append(tuple(cells))
            rows_islands.append(tuple(marks))
        panels.append(
            Panel(
                title,
                tuple(label for label, _, _ in roles),
                tuple(".".join(map(str, c)) for c in columns),
                tuple(rows_peaks),
                tuple(rows_islands),
            )
        )
    strips = tuple(
        Panel(
            "outside repeated layers",
            ("",),
            tuple(chunk),
            (tuple(peaks.get(m) for m in chunk),),
            (tuple(islands.get(m) for m in chunk),),
        )
        for chunk in (singles[i : i + STRIP_WIDTH] for i in range(0, len(singles), STRIP_WIDTH))
    )
    return HeatmapData(tuple(panels), strips)


def activation_chart(
    stats: Mapping[str, ActivationStats],
    modules: Sequence[str],
    islands: Mapping[str, str],
    path: Path,
    title: str,
) -> Path:
    """Write the heatmap PNG of ``modules``' peak activations to ``path`` and return it."""
    order = {m: stats[m].order if m in stats else len(stats) + i for i, m in enumerate(modules)}
    ordered = sorted(modules, key=order.__getitem__)
    peaks = {m: max(stats[m].max_out, stats[m].max_in) for m in ordered if m in stats}
    draw(heatmap_data(peaks, ordered, islands), path, title)
    return path


def draw(data: HeatmapData, path: Path, title: str) -> None:
    """Render ``data``: one heatmap per panel, the strips, one colour bar and a marker legend."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    blocks = [*data.panels, *data.strips]
    widest = max((len(b.columns) for b in blocks), default=1)
    # Panels get height by rows; a strip row needs room for its rotated module names.
    heights = [0.6 + 0.22 * len(p.rows) for p in data.panels] + [0.3 for _ in data.strips]
    fig = Figure(
        figsize=(
            min(22.0, max(9.0, 5.0 + 0.16 * widest)),
            1.6 + sum(heights) + 1.6 * len(data.strips),
        ),
        dpi=100,
        layout="constrained",
    )
    FigureCanvasAgg(fig)  # attaches itself to the figure; no pyplot, no global backend
    if not blocks:
        fig.text(0.5, 0.5, "no module was calibrated", ha="center")
        fig.savefig(path)
        return
    axes = fig.subplots(len(blocks), 1, height_ratios=heights, squeeze=False)[:, 0]
    cmap = colormaps["viridis"].with_extremes(over="#d62728", bad="#e6e6e6")
    norm = LogNorm(vmin=10.0**-DECADES, vmax=1.0)
    image = None
    for ax, block in zip(axes, blocks, strict=True):
        values = [
            [
                float("nan") if v is None else max(v / WATCHED_RANGE.finite_max, 10.0**-DECADES)
                for v in row
            ]
            for row in block.peaks
        ]
        image = ax.imshow(values, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        _mark_islands(ax, block)
        ax.set_yticks(range(len(block.rows)), block.rows, fontsize=7)
        is_strip = block in data.strips
        step = 1 if is_strip else max(1, -(-len(block.columns) // MAX_TICKS))
        ticks = range(0, len(block.columns), step)
        ax.set_xticks(
            ticks,
            [block.columns[i] for i in ticks],
            fontsize=7,
            rotation=90 if is_strip or len(block.columns[0]) > 2 else 0,
        )
        if is_strip:  # cells as wide as a full strip's, however few modules are left over
            ax.set_xlim(-0.5, max(len(block.columns), min(widest, STRIP_WIDTH)) - 0.5)
        ax.set_title(block.title, fontsize=9, loc="left")
        ax.tick_params(length=2)
    assert image is not None
    bar = fig.colorbar(image, ax=list(axes), extend="max", shrink=0.6, aspect=30)
    decades = [10.0**-k for k in range(DECADES, -1, -1)]
    peaks = [WATCHED_RANGE.finite_max * d for d in decades]
    bar.set_ticks(decades, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in peaks])
    beyond = f"beyond {WATCHED_RANGE.name}'s {WATCHED_RANGE.finite_max:g}"
    bar.set_label(
        f"peak |activation| in the fp32 run (top: {WATCHED_RANGE.name}'s max)", fontsize=8
    )
    bar.ax.axhline(1.0 / ACTIVATION_MARGIN, color="white", linewidth=1)
    bar.ax.tick_params(labelsize=7)
    fig.legend(
        handles=[
            Line2D([], [], marker=m, linestyle="", markerfacecolor="white", color="black", label=t)
            for m, t in MARKERS.values()
        ]
        + [Line2D([], [], marker="s", linestyle="", color="#d62728", label=beyond)],
        loc="outside lower center",
        fontsize=8,
        ncols=2,
    )
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def _mark_islands(ax: Any, block: Panel) -> None:
    """One scatter per island reason over the cells it marks."""
    for reason, (marker, _) in MARKERS.items():
        cells = [
            (x, y)
            for y, row in enumerate(block.islands)
            for x, mark in enumerate(row)
            if mark == reason
        ]
        if cells:
            xs, ys = zip(*cells, strict=True)
            size = 16 if len(block.columns) > MAX_TICKS else 28
            ax.scatter(xs, ys, marker=marker, s=size, c="white", edgecolors="black", linewidths=0.6)
