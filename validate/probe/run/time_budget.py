"""A time budget (``--budget``) fitted before the sweep runs: which probes it affords.

The sweep's probes are ordered by what each kind has caught
(:data:`~precision_convert.validation.probe.inputs.budgets.CAUGHT_FIRST`), the first probe of
each kind is timed on the fp32 model, and every other probe is estimated from its kind's
pace and its size. The certificate's seconds for a probe are its fp32 seconds times what the
caller says one probe costs the whole certificate (the fp32 sweep, the candidate's loads,
each in its precision's pace). Probes are kept in order while the estimate fits; the rest are
not run, and the record says which (``ModelInputs.budget``), so the certificate lists them as
not covered rather than dropping them.

The smallest certificate is the layout's probe and one probe of each kind: a budget below it
is refused, with the estimate, before the sweep's forwards run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from precision_convert.core.errors import InputError
from precision_convert.core.nested import leaves, tensors_in
from precision_convert.core.progress import say
from precision_convert.core.units import duration
from precision_convert.validation.probe.inputs.budgets import caught_rank
from precision_convert.validation.probe.inputs.model_inputs import FromOutput, ModelInputs, Probe
from precision_convert.validation.probe.run.execute import RUN_ERRORS, Outputs

#: How a session runs probes on the fp32 model.
Run = Callable[[Any, ModelInputs], Outputs]


@dataclass(frozen=True)
class Group:
    """Sweep probes that run together: one, with those that read its outputs (a VAE's
    decode of its encode)."""

    probes: tuple[Probe, ...]

    @property
    def kind(self) -> str:
        return str(self.probes[0].sweep.get("kind", ""))

    @property
    def size(self) -> int:
        """Elements the probes feed the model: what a forward's time grows with."""
        return sum(_elements(p.kwargs) for p in self.probes)


def fit_to_budget(
    model: Any,
    chosen: ModelInputs,
    swept: ModelInputs,
    run: Run,
    *,
    seconds: float,
    began: float,
    per_probe: float,
) -> ModelInputs:
    """``swept`` cut to what ``seconds`` afford, counted from ``began`` (``time.
    perf_counter()`` when the certificate's work started), one fp32 second of a probe
    costing the certificate ``per_probe`` seconds; ordered by what each kind has caught.

    Raises:
        InputError: ``seconds`` do not afford the smallest certificate (the layout's probe
            and one probe of each kind); the message gives its estimate.
    """
    taken = {p.name for p in chosen.probes}
    groups = sorted(_groups([p for p in swept.probes if p.name not in taken]), key=_rank)
    first: dict[str, Group] = {}
    for group in groups:
        first.setdefault(group.kind, group)
    paces = {kind: _timed(model, chosen, swept, group, run) for kind, group in first.items()}
    minimum = list(first.values())
    spent = time.perf_counter() - began
    smallest = spent + per_probe * sum(_cost(g, first, paces) for g in minimum)
    if smallest > seconds:
        raise InputError(
            f"--budget {_given(seconds)} is below the smallest certificate of this model, "
            f"about {duration(smallest)} (the layout's probe and one probe of each kind, on "
            "fp32 and every deciding load); give a longer --budget, or leave it out"
        )
    estimate = smallest
    kept: list[Group] = []
    left: list[Group] = []
    for group in groups:
        cost = per_probe * _cost(group, first, paces)
        if first.get(group.kind) is group:
            kept.append(group)
        elif estimate + cost <= seconds:
            kept.append(group)
            estimate += cost
        else:
            left.append(group)
    left_out = [p for g in left for p in g.probes]
    record = {
        "seconds": round(seconds, 1),
        "estimate_seconds": round(estimate, 1),
        "minimum_seconds": round(smallest, 1),
        "left_out": [p.name for p in left_out],
        "left_out_kinds": dict(Counter(str(p.sweep.get("kind", "")) for p in left_out)),
    }
    probes = (*chosen.probes, *(p for g in kept for p in g.probes))
    say(
        f"--budget {_given(seconds)}: {len(probes)} of {len(swept.probes)} probes fit, "
        f"about {duration(estimate)} in all (the smallest certificate: about "
        f"{duration(smallest)}); {len(left_out)} not run, listed as not covered"
    )
    return replace(swept, probes=probes, budget=record)


def _given(seconds: float) -> str:
    """A budget as the user gave it, near enough: a few seconds keep their decimals."""
    return f"{seconds:g} s" if seconds < 10 else duration(seconds)


def _rank(group: Group) -> int:
    return caught_rank(group.kind)


def _cost(group: Group, first: Mapping[str, Group], paces: Mapping[str, float]) -> float:
    """fp32 seconds ``group`` should take: its kind's timed pace, scaled by its size."""
    timed = first[group.kind]
    return paces[group.kind] * group.size / max(1, timed.size)


def _timed(model: Any, chosen: ModelInputs, swept: ModelInputs, group: Group, run: Run) -> float:
    """fp32 seconds ``group`` takes (with the layout's probes it reads from); a group the
    model rejects takes none here (the sweep drops it with a note)."""
    needed = _references(group.probes)
    before = tuple(p for p in chosen.probes if p.name in needed)
    began = time.perf_counter()
    try:
        run(model, replace(swept, probes=(*before, *group.probes), budget=None))
    except RUN_ERRORS:
        return 0.0
    return time.perf_counter() - began


def _groups(probes: list[Probe]) -> list[Group]:
    """``probes`` in groups: each probe with those reading its outputs, in sweep order."""
    members: dict[str, list[Probe]] = {}
    order: list[list[Probe]] = []
    for probe in probes:
        home = next((members[n] for n in _references((probe,)) if n in members), None)
        if home is None:
            home = []
            order.append(home)
        home.append(probe)
        members[probe.name] = home
    return [Group(tuple(group)) for group in order]


def _references(probes: tuple[Probe, ...]) -> set[str]:
    return {ref.probe for p in probes for ref in leaves(p.kwargs) if isinstance(ref, FromOutput)}


def _elements(kwargs: Mapping[str, Any]) -> int:
    return sum(v.numel() for v in tensors_in(kwargs)) or 1


def half_precision_pace(device: torch.device | str, dtype: torch.dtype | None) -> float:
    """How many fp32 seconds one second of work in ``dtype`` takes on ``device``, measured on
    a transformer block's operations (a matmul, GELU, layer norm, softmax) at a small size:
    a CPU without fast half-precision kernels runs fp16 several times slower than fp32, one
    with them (AMX bf16) faster. 1 for fp32 or no dtype."""
    if dtype is None or dtype == torch.float32:
        return 1.0
    with torch.no_grad():
        fp32 = _block_seconds(device, torch.float32)
        try:
            half = _block_seconds(device, dtype)
        except RUN_ERRORS:  # no kernel for it here: the candidate's own run will say so
            return 1.0
    return min(PACE_RANGE[1], max(PACE_RANGE[0], half / max(fp32, 1e-6)))


#: The measured pace is kept within this range: a few milliseconds of timing are noisy.
PACE_RANGE = (0.25, 8.0)


def _block_seconds(device: torch.device | str, dtype: torch.dtype) -> float:
    """The fastest of three runs of a small block's operations in ``dtype``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=generator).to(device, dtype)
    w = torch.randn(256, 256, generator=generator).to(device, dtype) / 16
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(4):
            h = torch.nn.functional.gelu(x @ w)
            h = torch.nn.functional.layer_norm(h, (256,))
            torch.softmax(h @ h.T, dim=-1)
        if str(device).startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return best
