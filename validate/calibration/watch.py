"""The near-limit watch of ``fp16-safe``: tensors whose fp32 peak came near fp16's limit, what
became of each, and the warnings that name them.

One spike reaches many modules (a projection's output is its MLP's, its layer's and the next
module's input): the warnings name it once, where it comes from, with how many more modules
carry the same tensor; the calibration record keeps every one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from precision_convert.conversion.analysis.activations import (
    ACTIVATION_MARGIN,
    LEAF,
    ActivationStats,
    NearLimit,
)
from precision_convert.conversion.plan import ModelPlan
from precision_convert.core.dtypes import FiniteRange

#: Near-limit tensors named one by one in the warnings; the rest are counted.
WATCH_WARNINGS = 12
#: What became of a near-limit tensor (:attr:`Watched.outcome`).
CARRIED = "carried in fp32"
KEPT = "kept fp32 by an island"
STILL_LOW = "still carried in fp16"
UNCHECKED = "not checked"


def _near(peak: float, limit: FiniteRange) -> str:
    """Where ``peak`` lies against ``limit``, in the words of a warning or an island rule."""
    if peak > limit.finite_max:
        return f"past {limit.name}'s {limit.finite_max:g}"
    return f"within {ACTIVATION_MARGIN:g}x of {limit.name}'s {limit.finite_max:g}"


@dataclass(frozen=True)
class Watched:
    """A tensor whose fp32 peak came near fp16's limit, and what the plan does about it."""

    module: str
    side: str  # "output" or "input"
    kind: str  # "leaf", "container" or "function"
    peak: float
    outcome: str  # CARRIED, KEPT, STILL_LOW or UNCHECKED
    islands: tuple[str, ...] = ()  # islands added for it

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "side": self.side,
            "kind": self.kind,
            "peak": self.peak,
            "outcome": self.outcome,
            "islands": list(self.islands),
        }


def _unit_of(module: str, stats: dict[str, ActivationStats], units: set[str]) -> str | None:
    """The plan unit deciding ``module``'s dtype: itself, or the unit it shares weights with."""
    if module in units:
        return module
    seen = stats.get(module)
    return next((m for m in seen.shares_weights_with if m in units), None) if seen else None


def _watched(
    near: Sequence[NearLimit],
    plan: ModelPlan,
    carried: dict[tuple[str, str], tuple[str, tuple[str, ...]]],
) -> list[Watched]:
    flowing = {i.name for i in plan.islands if i.reason != "precision"}
    out: list[Watched] = []
    for item in near:
        state, fixes = carried.get((item.module, item.side), (UNCHECKED, ()))
        if item.module in flowing and not fixes and state in (UNCHECKED, CARRIED):
            state = KEPT  # the module is a flowing island itself
        out.append(Watched(item.module, item.side, item.kind, item.peak, state, fixes))
    return out


def _watch_warnings(watched: Sequence[Watched], limit: FiniteRange) -> list[str]:
    """One warning per near-limit spike (the first :data:`WATCH_WARNINGS`), naming the
    innermost module it leaves or reaches, its peak and what the plan does about it; the rest
    counted in one more. (The calibration record keeps every module.)"""
    named = _innermost(watched)
    out = [_watch_line(item, also, limit) for item, also in named[:WATCH_WARNINGS]]
    rest = [item for item, _ in named[WATCH_WARNINGS:]]
    if rest:
        low = sum(1 for w in rest if w.outcome == STILL_LOW)
        out.append(
            f"{len(rest)} more module inputs/outputs come within {ACTIVATION_MARGIN:g}x of "
            f"{limit.name}'s {limit.finite_max:g} or past it "
            f"(highest {max(w.peak for w in rest):.4g}; {low} "
            "still carried in fp16); --json lists every one (near_limit)"
        )
    return out


def accounted_warnings(watched: Sequence[Watched], limit: FiniteRange) -> list[str]:
    """The warnings of :func:`_watch_warnings` about spikes the plan keeps in fp32 (a range
    island, or carried in fp32 by one): what the fp16-safe candidate and its certificate are
    judged with, which a command may sum up in one line."""
    named = _innermost(watched)[:WATCH_WARNINGS]
    return [
        _watch_line(item, also, limit) for item, also in named if item.outcome in (CARRIED, KEPT)
    ]


def _watch_line(item: Watched, also: int, limit: FiniteRange) -> str:
    """The warning about one near-limit spike against ``limit``; ``also``: the more module
    inputs and outputs the same tensor reaches."""
    what = {
        CARRIED: "the fp16-safe candidate carries it in fp32",
        KEPT: "kept in fp32 (range island)",
        STILL_LOW: "the fp16-safe candidate still carries it in fp16; use bf16-safe",
        UNCHECKED: "not checked against a candidate",
    }[item.outcome]
    if item.islands:
        what += f" (islands added: {', '.join(item.islands)})"
    if also:
        more = "input/output" if also == 1 else "inputs/outputs"
        what += f"; the same tensor reaches {also} more module {more}"
    peak = f"peaks at {item.peak:.4g}, {_near(item.peak, limit)}"
    return f"{item.module or '<model>'} ({item.kind}) {item.side} {peak}: {what}"


def _innermost(watched: Sequence[Watched]) -> list[tuple[Watched, int]]:
    """The near-limit tensors worth a warning each, in order, with how many more module inputs
    and outputs carry the same tensor.

    One spike leaves a projection, then the MLP holding it, the dropout or activation after
    it, the layer and the block, and the next module receives it: the same tensor (the same
    peak, to the bit), one warning, at :func:`_origin`. A tensor the candidate still carries in
    fp16 is always named: that one needs attention.
    """
    groups: dict[float, list[Watched]] = {}
    for item in watched:
        groups.setdefault(item.peak, []).append(item)
    named: dict[int, tuple[Watched, int]] = {}
    for group in groups.values():
        origin = _origin(group)
        kept = [w for w in group if w is origin or w.outcome == STILL_LOW]
        for w in kept:
            named[id(w)] = (w, len(group) - len(kept) if w is origin else 0)
    return [named[id(w)] for w in watched if id(w) in named]


def _origin(group: Sequence[Watched]) -> Watched:
    """Where one tensor comes from: the first weighted module whose output it is (in execution
    order), else the innermost module handing it on, else the first that receives it."""
    outputs = [w for w in group if w.side == "output"]
    leaves = [w for w in outputs if w.kind == LEAF]
    if leaves:
        return leaves[0]
    if outputs:
        return max(outputs, key=lambda w: len(w.module.split(".")))
    return group[0]
