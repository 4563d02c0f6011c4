"""Calibrated plans: the recipe's islands, plus what the model's own activations demand.

For ``fp16-safe`` the fp32 model runs once on the validation inputs under recording hooks, and
every module is watched (:func:`~.activations.near_limit`): each module's output, containers
included (a decoder layer's output is the residual stream, which no weighted module outputs),
and what each weighted module receives. Near fp16's limit (within the activation margin):

* a weighted module's output makes it a ``range`` island (its fp32 output flows on);
* a precision island's output (a norm, a recipe's timestep embedding) upgrades it to ``range``:
  the loader would cast that fp32 output back to fp16, recreating the overflow;
* a compute-dtype weighted module's input makes it a ``range`` island: the loader casts what a
  module receives to the module's own dtype;
* a bound (:mod:`~precision_convert.conversion.analysis.factors`) on what a gated MLP's down
  projection or an attention's output projection could receive or hand on, if the largest
  factors the sweep saw met in one context, makes that projection a ``range`` island, and
  with it the factor projection (a gated MLP's ``up``) whose fp32 output makes the product be
  formed in fp32;
* any other tensor (a container's stream, what a norm receives) must be carried in fp32 by the
  candidate as loaded. The candidate runs under dtype hooks; while one such tensor is still
  carried in fp16, the latest weighted module that ran before it in its scope becomes a
  ``range`` island (for a residual stream: the projection added into it, after which the
  stream flows in fp32), and the candidate is checked again.

Every near-limit tensor is named in a warning with its peak and what became of it. The candidate
plan is then compared with the fp32 outputs; while it fails,
:func:`~.analysis.search_islands` bisects for the modules that must also stay fp32 (``search``
islands). For ``bf16-safe`` the same pass recomputes each weighted layer in bf16 and keeps those
that lose most of their mantissa (bf16 has fp32's range: nothing is watched for overflow).

The fp32 model is freed before any candidate loads: one model is resident at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from precision_convert.conversion.analysis.activations import (
    FP32_SHARE_LIMIT,
    LEAF,
    ActivationStats,
    NearLimit,
    losing_precision,
    near_limit,
    overflowing,
    recording,
)
from precision_convert.conversion.analysis.factors import Bound
from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.plan import MEASURED, Island, ModelPlan
from precision_convert.conversion.runtime.baseline import load_fp32
from precision_convert.conversion.runtime.memory import large_allocations_mapped
from precision_convert.core.dtypes import WATCHED_RANGE, FiniteRange, Target
from precision_convert.core.names import module_of
from precision_convert.core.progress import expect, stage
from precision_convert.validation.calibration.search import PlanWith, _Search
from precision_convert.validation.calibration.watch import (
    Watched,
    _near,
    _unit_of,
    _watch_warnings,
    _watched,
    accounted_warnings,
)
from precision_convert.validation.probe.inputs.budgets import DEFAULT_LEVEL, budget_for
from precision_convert.validation.probe.inputs.context_probes import CONTEXT_KIND
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.spots import attention_spot
from precision_convert.validation.probe.inputs.sweep import SweepSettings
from precision_convert.validation.probe.inputs.tokenizers import tokenizer_for
from precision_convert.validation.probe.inputs.userdata import (
    CalibrationData,
    read_calibration_data,
)
from precision_convert.validation.probe.run.contexts import near_bounds
from precision_convert.validation.probe.run.execute import Coverage, all_finite
from precision_convert.validation.probe.run.growth import (
    Predicted,
    SizedRun,
    run_sized,
    size_growth,
)
from precision_convert.validation.probe.run.parity import (
    recipe_validation,
    thresholds_for,
)
from precision_convert.validation.probe.run.session import (
    PriorRuns,
    Swept,
    fp32_session,
)
from precision_convert.validation.probe.run.time_budget import half_precision_pace


@dataclass(frozen=True)
class Calibration:
    """What analysis found for one model."""

    stats: dict[str, ActivationStats]
    islands: tuple[Island, ...]  # added by analysis and search, on top of the recipe's
    evaluations: int  # candidate plans checked against fp32
    passed: bool | None  # the final candidate matched fp32 (None: not checked)
    task: str
    warnings: tuple[str, ...] = ()
    #: Every module output (containers included) and weighted module input whose fp32 peak
    #: came within the margin of fp16's limit, in execution order (``fp16-safe`` only).
    near_limit: tuple[Watched, ...] = ()
    #: What ran, for this conversion's validation to reuse (not part of the result).
    runs: PriorRuns | None = field(default=None, compare=False, repr=False)
    #: Those of ``warnings`` about spikes the plan keeps in fp32: no action asked of a reader.
    accounted: tuple[str, ...] = ()


@stage("calibration")
def calibrated_plan(
    model: ModelSource,
    target: Target,
    plan_with: PlanWith,
    *,
    search: bool = True,
    trust_remote_code: bool = False,
    coverage: str = DEFAULT_LEVEL,
    calibration_data: str | Path | CalibrationData | None = None,
    component: str = "",
    budget: float | None = None,
) -> tuple[ModelPlan, Calibration]:
    """The plan for ``target`` with analysis islands, and the calibration behind it.

    The fp32 model runs on the layout its builders choose plus the ``coverage`` level's sweep
    (``quick``/``standard``/``thorough``, see
    :mod:`~precision_convert.validation.probe.inputs.sweep`) plus the probes of
    ``calibration_data`` (text lines or JSONL model inputs; ``component``
    names a pipeline's component, whose ``<component>/<argument>`` keys it takes and which
    skips data meant for another); ``budget`` (seconds, ``--budget``) cuts the sweep to what
    the certificate can afford, and validation reuses it.
    """

    budget_for(coverage)  # an unknown level or unreadable data fails before the model loads
    data = (
        read_calibration_data(calibration_data)
        if calibration_data is not None and not isinstance(calibration_data, CalibrationData)
        else calibration_data
    )
    base = plan_with(())
    swept, stats, predicted = _fp32_sweep(
        model, target, SweepSettings(coverage, data, budget), component, trust_remote_code, search
    )
    existing = {i.name: i for i in base.islands}
    free = [u for u in _execution_order(_float_units(base), stats) if u not in existing]
    limit = target.range  # None: the target's range never binds (bf16)
    near = [*near_limit(stats, limit), *_predicted_near(predicted, stats, limit)] if limit else []
    added = _predicted_islands(predicted, stats, base) if limit else []
    found = {i.name for i in added}
    added += [i for i in _analysis_islands(stats, base, limit, free, near) if i.name not in found]
    if limit:
        added += _bound_islands(swept.bounds, existing, set(free), {i.name for i in added}, limit)
    validation = recipe_validation(base.recipe)
    task = str(validation.get("task", swept.task))
    candidates = _Search(
        model, plan_with, trust_remote_code, swept, thresholds_for(task, validation)
    )
    if search and limit:
        added = candidates.run(added, free, near, stats, limit)
    plan = plan_with(added)
    watched = _watched(near, plan, candidates.carried)
    warnings = [*plan.warnings, *_watch_warnings(watched, limit)] if limit else [*plan.warnings]
    warnings += [
        f"{p.module or '<model>'} ({p.kind}) stream: {p.rule}; not a module's own: judged by "
        "the candidate's probes only"
        for p in predicted
        if p.kind != LEAF and limit
    ]
    if candidates.passed is False:
        warnings.append(
            f"even with every module in fp32 the {target.compute.short} candidate does not match "
            f"fp32 ({target.compute.short} inputs or outputs overflow); use bf16-safe"
        )
    warnings += _share_warnings(plan, target)
    calibration = Calibration(
        stats,
        tuple(added),
        candidates.evaluations,
        candidates.passed,
        task,
        tuple(warnings),
        tuple(watched),
        candidates.prior(plan),
        tuple(accounted_warnings(watched, limit)) if limit else (),
    )
    return replace(plan, warnings=tuple(warnings)), calibration


def _analysis_islands(
    stats: dict[str, ActivationStats],
    base: ModelPlan,
    limit: FiniteRange | None,
    free: list[str],
    near: Sequence[NearLimit],
) -> list[Island]:
    """The islands the fp32 statistics call for among the ``free`` units: for a target whose
    range binds (fp16), every output and near-limit tensor of a single module; otherwise
    (bf16), every layer losing most of its mantissa."""
    if limit is None:
        found = losing_precision(stats, free)
        return [Island(u, "precision", f"{MEASURED}{why}") for u, why in found.items()]
    found = overflowing(stats, free, limit)
    added = [Island(u, "range", f"{MEASURED}{why}") for u, why in found.items()]
    existing = {i.name: i for i in base.islands}
    added += _range_from_watch(near, stats, existing, set(_float_units(base)), set(found), limit)
    return added


def _share_warnings(plan: ModelPlan, target: Target) -> list[str]:
    if target.range_limited and plan.fp32_share > FP32_SHARE_LIMIT:
        return [
            f"{plan.fp32_share:.0%} of the parameters stay fp32 (over {FP32_SHARE_LIMIT:.0%}): "
            "fp16-safe saves little here; bf16-safe is recommended"
        ]
    return []


def _fp32_sweep(
    model: ModelSource,
    target: Target,
    settings: SweepSettings,
    component: str,
    trust_remote_code: bool,
    search: bool,
) -> tuple[Swept, dict[str, ActivationStats], list[Predicted]]:
    """The fp32 model's session under recording hooks: the probes, their outputs and every
    module's statistics, all from one run (the outputs are validation's baseline too); with
    the fp16 search, the outputs under each other attention implementation too. The same run
    keeps each module's peak per probe size: the session's inputs come back with the growth
    fits in ``sizes.growth``, beside the modules predicted near fp16's limit at a size not
    run (:func:`~.growth.size_growth`)."""
    import torch

    simulate = None if target.range_limited else target.compute.torch
    searching = search and target.range_limited
    recorded: dict[str, Any] = {}
    used = Coverage()  # recorded too, so that validation can take this run as its baseline

    def run(fp32: Any, inputs: Any) -> Any:
        with (
            used.track(fp32),
            large_allocations_mapped(),
            recording(fp32, simulate) as recorder,
            torch.no_grad(),
        ):
            outputs, sized = run_sized(
                fp32,
                inputs,
                "cpu",
                torch.float32,
                seen=recorder.seen,
                paused=lambda: recorder.paused,
            )
            if not all_finite(outputs):
                used.unjudged()
        stats = recorder.stats()
        if all(p.sweep.get("kind") == CONTEXT_KIND for p in inputs.probes):
            # The worst contexts run after the sweep: their peaks join the sweep's; the growth
            # fits stay the sweep's (contexts run at the sweep's sizes).
            recorded["stats"] = _joined(recorded["stats"], stats)
        else:
            recorded["stats"], recorded["sized"] = stats, sized
        return outputs

    # The chosen layout, then the coverage sweep and user data: one run records them all.
    swept = fp32_session(
        lambda: load_fp32(model.root, trust_remote_code=trust_remote_code).eval(),
        run,
        settings,
        source=model.root,
        device=torch.device("cpu"),
        tokenizer=tokenizer_for(model.root),
        component=component,
        usage=lambda: used.usage,
        before=lambda inputs, others: _expect(inputs, others, searching),
        per_probe=lambda inputs, others: _per_probe(
            inputs, others, searching, half_precision_pace("cpu", target.compute.torch)
        ),
        attention=searching,
    )
    sized: SizedRun = recorded["sized"]
    inputs, predicted = size_growth(swept.inputs, sized, target.range or WATCHED_RANGE)
    return replace(swept, inputs=inputs), recorded["stats"], predicted


def _predicted_near(
    predicted: Sequence[Predicted], stats: dict[str, ActivationStats], limit: FiniteRange
) -> list[NearLimit]:
    """The tensors predicted near ``limit`` at a size not run, watched like those measured
    there: the candidate must carry them in fp32 (what a container or a function computes on
    the way to them included)."""
    measured = {(n.module, n.side) for n in near_limit(stats, limit)}
    return [
        NearLimit(p.module, p.side, p.peak, p.kind, stats[p.module].order, p.where)
        for p in predicted
        if p.module in stats and (p.module, p.side) not in measured
    ]


def _predicted_islands(
    predicted: Sequence[Predicted], stats: dict[str, ActivationStats], base: ModelPlan
) -> list[Island]:
    """Range islands for the weighted modules whose output or input, predicted at a size not
    run, comes within the margin of fp16's limit (those not kept fp32 already)."""
    kept = {i.name for i in base.islands if i.reason != "precision"}
    units = set(_float_units(base))
    out: dict[str, Island] = {}
    for item in predicted:
        unit = _unit_of(item.module, stats, units) if item.kind == LEAF else None
        if unit is not None and unit not in kept:
            out.setdefault(unit, Island(unit, "range", f"{MEASURED}{item.rule}"))
    return list(out.values())


def _joined(
    first: dict[str, ActivationStats], then: dict[str, ActivationStats]
) -> dict[str, ActivationStats]:
    """``first``'s statistics with the peaks ``then`` reached beyond them."""
    out = dict(first)
    for name, seen in then.items():
        had = out.get(name)
        out[name] = (
            seen
            if had is None
            else replace(
                had,
                max_in=max(had.max_in, seen.max_in),
                max_out=max(had.max_out, seen.max_out),
                main_out=max(had.main_out, seen.main_out),
                low_precision_error=max(had.low_precision_error, seen.low_precision_error),
            )
        )
    return out


def _bound_islands(
    bounds: Sequence[Bound],
    existing: dict[str, Island],
    free: set[str],
    taken: set[str],
    limit: FiniteRange,
) -> list[Island]:
    """Range islands for the bounds near ``limit``: the bounded projection, so it receives
    and hands on fp32, and its factor projections, so the product or sum is formed in fp32.
    Units already islands (or not free) are left as they are."""
    out: dict[str, Island] = {}
    for bound in near_bounds(bounds, limit):
        rule = (
            f"{MEASURED}{bound.side} bound {bound.bound:.4g} ({_near(bound.bound, limit)}; "
            f"observed {bound.observed:.4g}) if {bound.conditional_on}"
        )
        for unit in (bound.module, *bound.factors):
            if unit in free and unit not in taken and unit not in existing:
                out.setdefault(unit, Island(unit, "range", rule))
    return list(out.values())


def _expect(inputs: ModelInputs, attention: int, search: bool) -> None:
    """Say what calibration runs before it runs: the fp32 sweep (searching, the probes of
    :func:`attention_spot` under each of ``attention`` other implementations too), and the
    first candidate's under each (the search may add more: each is as many forwards again)."""
    probes = len(inputs.probes)
    if search:
        again = len(attention_spot(inputs).probes)
        runs = 1 + attention
        fp32 = probes + attention * again
        expect(
            fp32 + runs * probes,
            f"fp32 sweep {probes} + {again} x {attention}, first fp16 candidate "
            f"{probes} x {runs} (x: attention implementations)",
            fp32=fp32,
        )
    else:
        expect(probes, f"fp32 sweep {probes}", fp32=probes)


def _per_probe(inputs: ModelInputs, attention: int, search: bool, pace: float) -> float:
    """What one fp32 second of a probe costs the certificate (for ``--budget``): calibration's
    fp32 sweep, then at the candidate's ``pace`` its first candidate (searching) and
    validation's deciding loads after it (the plain load on every probe, and ``pc.load``
    when calibration did not run it), over the probes."""
    probes = max(1, len(inputs.probes))
    fp32 = probes + attention * len(attention_spot(inputs).probes)
    candidate = (1 + attention) * probes * search + probes * (1 + (not search))
    return (fp32 + pace * candidate) / probes


def _range_from_watch(
    near: Sequence[NearLimit],
    stats: dict[str, ActivationStats],
    existing: dict[str, Island],
    float_units: set[str],
    overflowing_units: set[str],
    limit: FiniteRange,
) -> list[Island]:
    """Range islands that near-limit tensors of single modules call for, beyond the weighted
    outputs :func:`overflowing` already found.

    A precision island whose output comes near the limit is upgraded (the same name with
    reason ``range`` outranks the recipe's ``precision`` in the plan), so the loader lets its
    fp32 output flow instead of casting it back. A compute-dtype weighted module whose output
    (a head tied to the embedding: its unit is the embedding) or input comes near the limit is
    kept fp32 with reason ``range``: the loader casts a module's inputs to its own dtype, so in
    fp16 it would overflow on what it receives.
    """
    out: dict[str, Island] = {}
    for item in near:
        unit = _unit_of(item.module, stats, float_units)
        if item.kind != LEAF or unit is None or unit in overflowing_units:
            continue
        via = "" if unit == item.module else f" of {item.module}, which shares its weights,"
        island = existing.get(unit)
        if item.side == "output" and island is not None and island.reason == "precision":
            rule = (
                f"{MEASURED}output{via} peaks at {item.peak:.4g} ({_near(item.peak, limit)}); "
                f"was a precision island ({island.rule}): its fp32 output now flows on"
            )
        elif island is None:
            where = _near(item.peak, limit)
            rule = f"{MEASURED}{item.side}{via} peaks at {item.peak:.4g} ({where})"
            if item.side == "input":
                rule += f": kept fp32 so that what it receives is not cast to {limit.name}"
        else:
            continue
        out.setdefault(unit, Island(unit, "range", rule))
    return list(out.values())


def _float_units(plan: ModelPlan) -> list[str]:
    seen: dict[str, None] = {}
    for tensor in plan.tensors:
        if tensor.source.is_float:
            seen.setdefault(tensor.unit, None)
    return list(seen)


def _execution_order(units: Sequence[str], stats: dict[str, ActivationStats]) -> list[str]:
    """Units sorted by when their module first ran; a tensor unit follows its container."""
    never = len(stats) + 1

    def order(unit: str) -> int:
        for name in (unit, module_of(unit)):
            if name in stats:
                return stats[name].order
        return never

    return sorted(units, key=order)
