"""The metrics as the model card and the CLI's report show them: folded tables and per-probe bars.

A sweep judges every output on every probe and a block-wise run every block; the card lists
each metric once per output (or layer role) with its worst value and where that was
(:func:`folded_metrics`); the CLI's full report draws the parity metric of every swept output
per probe as a small log-scaled bar chart (:func:`probe_series`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from precision_convert.core.folding import fold
from precision_convert.validation.certify.card_text import code, escape
from precision_convert.validation.probe.run.metrics import Measurement

#: Most metric rows in the card; the certificate keeps all of them.
MAX_ROWS = 60
#: Probe name prefix of a block-wise comparison (one block fed the baseline's activations).
BLOCK = "block:"
#: The metric drawn per probe: every output kind has it, and it reads the same everywhere.
SERIES_METRIC = "rel_l2"
#: Width of a per-probe bar, and the decades below the bound its empty end stands for.
BAR_WIDTH = 20
BAR_DECADES = 4
#: The bar column's heading: what a full or an empty bar means.
BAR_LABEL = f"share of the bound (log scale, 10^-{BAR_DECADES} to 1)"


def _fmt(value: float | None) -> str:
    if value is None:
        return "NaN/Inf"
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _rows(metrics: Iterable[Measurement]) -> list[str]:
    rows = ["| where | metric | worst | bound | | worst probe |", "|---|---|---|---|---|---|"]
    folded = folded_metrics(metrics)
    for row in folded[:MAX_ROWS]:
        rows.append(
            f"| {code(row.where)} | {escape(row.metric)} | {_fmt(row.value)} | "
            f"{row.bound_text or '—'} | {'✅' if row.passed else '❌'} | "
            f"{escape(row.worst_probe)} |"
        )
    if len(folded) > MAX_ROWS:
        rows.append(f"| … | {len(folded) - MAX_ROWS} more in the certificate | | | | |")
    return rows


@dataclass(frozen=True)
class MetricRow:
    """One metric of one output folded over every probe (or every block of a layer role):
    its worst value, and where that was."""

    where: str
    metric: str
    value: float | None  # None: NaN/Inf
    threshold: float | None
    bound: str
    passed: bool  # every folded measurement passed
    worst_probe: str  # the probe (or block index) of the worst value, "(of n)" when folded

    @property
    def bound_text(self) -> str:
        if self.threshold is None:
            return ""
        return f"{'≤' if self.bound == 'max' else '≥'} {self.threshold:g}"


def _badness(m: Measurement) -> tuple[bool, float]:
    """Sort key, worst first: failures, then NaN, then the value on the wrong side."""
    if m.value is None:
        return (m.passed, -math.inf)
    return (m.passed, -m.value if m.bound == "max" else m.value)


def folded_metrics(metrics: Iterable[Measurement]) -> list[MetricRow]:
    """Measurements folded to one row per component, output and metric (block-wise ones per
    layer role, ``block:model.layers.{0..79}``), worst value first, failing rows first.

    A sweep judges every output on every probe and a block-wise run every block: listing
    them all buries the one that matters; the worst of each and where it was do not.
    """
    measured = list(metrics)
    blocks = [m.probe.removeprefix(BLOCK) for m in measured if m.probe.startswith(BLOCK)]
    role_of = {name: role for role in fold(dict.fromkeys(blocks)) for name in role.members}
    groups: dict[tuple[str, str, str], list[Measurement]] = {}
    for m in measured:
        role = role_of.get(m.probe.removeprefix(BLOCK)) if m.probe.startswith(BLOCK) else None
        place = f"{BLOCK}{role.label}" if role is not None else ""
        where = "/".join(p for p in (m.component, place, m.output) if p)
        groups.setdefault((where, m.metric, role.label if role else ""), []).append(m)
    rows = []
    for (where, metric, _), group in groups.items():
        worst = min(group, key=_badness)
        probe = worst.probe
        if probe.startswith(BLOCK) and (role := role_of.get(probe.removeprefix(BLOCK))):
            probe = f"block {role.describe([probe.removeprefix(BLOCK)]) or probe}"
        rows.append(
            MetricRow(
                where,
                metric,
                worst.value,
                worst.threshold,
                worst.bound,
                all(m.passed for m in group),
                f"{probe} (of {len(group)})" if len(group) > 1 else probe,
            )
        )
    return sorted(rows, key=lambda r: r.passed)


@dataclass(frozen=True)
class ProbeSeries:
    """:data:`SERIES_METRIC` of one output on every probe that was swept."""

    where: str
    metric: str
    threshold: float | None
    values: tuple[tuple[str, float | None], ...]  # (probe, value) in the order they ran

    def rows(self) -> list[tuple[str, str, str]]:
        """(probe, value, bar): the bar is log-scaled from 10^-4 of the bound to the bound, so
        a probe near its limit stands out however small the others are."""
        out = []
        for probe, value in self.values:
            if value is None or self.threshold is None or self.threshold <= 0:
                bar = "NaN/Inf" if value is None else ""
            else:
                ratio = value / self.threshold
                level = 0.0 if ratio <= 0 else math.log10(ratio) / BAR_DECADES + 1
                filled = round(BAR_WIDTH * min(1.0, max(0.0, level)))
                over = ": over" if ratio > 1 else ""
                bar = "█" * filled + "·" * (BAR_WIDTH - filled) + f" {ratio:.2g}× the bound{over}"
            out.append((probe, _fmt(value), bar))
        return out


def probe_series(metrics: Iterable[Measurement]) -> list[ProbeSeries]:
    """The parity metric per probe for each output judged on more than one probe (block-wise
    comparisons excluded: they are blocks, not probes)."""
    found: dict[str, list[Measurement]] = {}
    for m in metrics:
        if m.metric == SERIES_METRIC and not m.probe.startswith(BLOCK):
            found.setdefault("/".join(p for p in (m.component, m.output) if p), []).append(m)
    return [
        ProbeSeries(
            where, SERIES_METRIC, group[0].threshold, tuple((m.probe, m.value) for m in group)
        )
        for where, group in found.items()
        if len({m.probe for m in group}) > 1
    ]
