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

import logging
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from precision_convert.conversion.analysis.activations import (
    ACTIVATION_MARGIN,
    CONTAINER,
    FP32_SHARE_LIMIT,
    LEAF,
    ActivationStats,
    Carriage,
    NearLimit,
    calibrate,
    carriage,
    losing_precision,
    near_limit,
    overflowing,
    search_islands,
)
from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.output import write_model
from precision_convert.conversion.plan import MEASURED, Island, ModelPlan
from precision_convert.conversion.runtime.baseline import load_fp32
from precision_convert.conversion.runtime.loader import load
from precision_convert.conversion.runtime.memory import free_model
from precision_convert.dtypes import FP16_MAX, Target
from precision_convert.names import module_of
from precision_convert.progress import expect, stage
from precision_convert.validation.probe.inputs.budgets import DEFAULT_LEVEL, budget_for
from precision_convert.validation.probe.inputs.sweep import SweepSettings
from precision_convert.validation.probe.inputs.tokenizers import tokenizer_for
from precision_convert.validation.probe.inputs.userdata import (
    CalibrationData,
    read_calibration_data,
)
from precision_convert.validation.probe.run.attention import attention
from precision_convert.validation.probe.run.execute import RUN_ERRORS, Coverage, run_probes
from precision_convert.validation.probe.run.parity import (
    compare_outputs,
    recipe_validation,
    thresholds_for,
)
from precision_convert.validation.probe.run.session import (
    PriorRuns,
    Swept,
    fp32_session,
    weights_digest,
)

logger = logging.getLogger(__name__)

#: Builds the plan with extra islands on top of the recipe's.
PlanWith = Callable[[Iterable[Island]], ModelPlan]
#: Candidate runs spent carrying near-limit tensors in fp32 (one island added per run), in all
#: and per tensor: a tensor still carried in fp16 after that many islands is reported instead.
WATCH_ROUNDS = 24
WATCH_TRIES = 4
#: Near-limit tensors named one by one in the warnings; the rest are counted.
WATCH_WARNINGS = 12
#: What became of a near-limit tensor (:attr:`Watched.outcome`).
CARRIED = "carried in fp32"
KEPT = "kept fp32 by an island"
STILL_LOW = "still carried in fp16"
UNCHECKED = "not checked"


def _near(peak: float) -> str:
    """Where ``peak`` lies against fp16's limit, in the words of a warning or an island rule."""
    if peak > FP16_MAX:
        return f"past fp16's {FP16_MAX:g}"
    return f"within {ACTIVATION_MARGIN:g}x of fp16's {FP16_MAX:g}"


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
) -> tuple[ModelPlan, Calibration]:
    """The plan for ``target`` with analysis islands, and the calibration behind it.

    The fp32 model runs on the layout its builders choose plus the ``coverage`` level's sweep
    (``quick``/``standard``/``thorough``, see
    :mod:`~precision_convert.validation.probe.inputs.sweep`) plus the probes of
    ``calibration_data`` (text lines or JSONL model inputs; ``component``
    names a pipeline's component, whose ``<component>/<argument>`` keys it takes and which
    skips data meant for another).
    """

    budget_for(coverage)  # an unknown level or unreadable data fails before the model loads
    data = (
        read_calibration_data(calibration_data)
        if calibration_data is not None and not isinstance(calibration_data, CalibrationData)
        else calibration_data
    )
    base = plan_with(())
    swept, stats = _fp32_sweep(
        model, target, SweepSettings(coverage, data), component, trust_remote_code, search
    )
    existing = {i.name: i for i in base.islands}
    free = [u for u in _execution_order(_float_units(base), stats) if u not in existing]
    near = near_limit(stats) if target.range_limited else []
    added = _analysis_islands(stats, base, target, free, near)
    validation = recipe_validation(base.recipe)
    task = str(validation.get("task", swept.task))
    candidates = _Search(
        model, plan_with, trust_remote_code, swept, thresholds_for(task, validation)
    )
    if search and target.range_limited:
        added = candidates.run(added, free, near, stats)
    plan = plan_with(added)
    watched = _watched(near, plan, candidates.carried)
    warnings = [*plan.warnings, *_watch_warnings(watched)]
    if candidates.passed is False:
        warnings.append(
            "even with every module in fp32 the fp16 candidate does not match fp32 "
            "(fp16 inputs or outputs overflow); use bf16-safe"
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
    )
    return replace(plan, warnings=tuple(warnings)), calibration


def _analysis_islands(
    stats: dict[str, ActivationStats],
    base: ModelPlan,
    target: Target,
    free: list[str],
    near: Sequence[NearLimit],
) -> list[Island]:
    """The islands the fp32 statistics call for among the ``free`` units: for fp16, every
    output and near-limit tensor of a single module; for bf16, every layer losing most of
    its mantissa."""
    if not target.range_limited:
        found = losing_precision(stats, free)
        return [Island(u, "precision", f"{MEASURED}{why}") for u, why in found.items()]
    found = overflowing(stats, free)
    added = [Island(u, "range", f"{MEASURED}{why}") for u, why in found.items()]
    existing = {i.name: i for i in base.islands}
    added += _range_from_watch(near, stats, existing, set(_float_units(base)), set(found))
    return added


def _share_warnings(plan: ModelPlan, target: Target) -> list[str]:
    if target.range_limited and plan.fp32_share > FP32_SHARE_LIMIT:
        return [
            f"{plan.fp32_share:.0%} of the parameters stay fp32 (over {FP32_SHARE_LIMIT:.0%}): "
            "fp16-safe saves little here; bf16-safe is recommended"
        ]
    return []


class _Search:
    """The fp16 candidates of one calibration: each written, loaded as users load it and
    compared with the fp32 session's outputs under every attention implementation the
    certificate judges (eager attention's masked scores overflow where sdpa's do not)."""

    def __init__(
        self,
        model: ModelSource,
        plan_with: PlanWith,
        trust_remote_code: bool,
        swept: Swept,
        thresholds: dict[str, float],
    ) -> None:
        self.model, self.plan_with, self.trust_remote_code = model, plan_with, trust_remote_code
        self.swept, self.thresholds = swept, thresholds
        self.evaluations = 0
        self.passed: bool | None = None  # the final candidate matched fp32 (None: not run)
        self.carried: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        self.last: dict[str, Any] = {}  # the last passing candidate: plan sha256, outputs
        #: (attention implementation, probe) pairs on which some candidate failed, newest
        #: last: each candidate runs them first, so one that fails the same way stops early.
        self.failed: dict[tuple[str | None, str], None] = {}

    def run(
        self,
        added: list[Island],
        free: list[str],
        near: Sequence[NearLimit],
        stats: dict[str, ActivationStats],
    ) -> list[Island]:
        """``added`` with the islands that make the candidate carry every near-limit tensor
        in fp32, then those the search over the other ``free`` units finds."""
        frozen = self.swept.resolved
        baselines: dict[str | None, Any] = {None: self.swept.outputs, **self.swept.by_attention}
        with tempfile.TemporaryDirectory(prefix="pc-candidate-") as scratch:
            if near:
                fixes, self.carried = _carry_in_fp32(
                    self.model,
                    self.plan_with,
                    added,
                    near,
                    stats,
                    Path(scratch),
                    self.trust_remote_code,
                    frozen,
                )
                added = [*added, *fixes]

            def passes(extra: frozenset[str]) -> bool:
                return _candidate_passes(
                    self.model,
                    self.plan_with([*added, *_searched(extra)]),
                    Path(scratch),
                    self.trust_remote_code,
                    frozen,
                    baselines,
                    self.thresholds,
                    self.last,
                    self.failed,
                )

            analysed = {i.name for i in added}
            result = search_islands([u for u in free if u not in analysed], passes)
        self.evaluations, self.passed = result.evaluations, result.passed
        return [*added, *_searched(result.added)]

    def prior(self, plan: ModelPlan) -> PriorRuns:
        """What validation may reuse: the fp32 session, and the last candidate's runs when
        it is the plan written."""
        last = self.last if self.last.get("plan") == plan.sha256 else {}
        return PriorRuns(
            self.swept, last.get("weights"), last.get("outputs"), last.get("by_attention", {})
        )


def _fp32_sweep(
    model: ModelSource,
    target: Target,
    settings: SweepSettings,
    component: str,
    trust_remote_code: bool,
    search: bool,
) -> tuple[Swept, dict[str, ActivationStats]]:
    """The fp32 model's session under recording hooks: the probes, their outputs and every
    module's statistics, all from one run (the outputs are validation's baseline too); with
    the fp16 search, the outputs under each other attention implementation too."""
    import torch

    simulate = None if target.range_limited else target.compute.torch
    searching = search and target.range_limited
    recorded: dict[str, dict[str, ActivationStats]] = {}
    used = Coverage()  # recorded too, so that validation can take this run as its baseline

    def run(fp32: Any, inputs: Any) -> Any:
        with used.track(fp32):
            stats, outputs = calibrate(
                fp32, lambda: run_probes(fp32, inputs, "cpu", torch.float32), simulate
            )
        recorded["stats"] = stats
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
        coverage=lambda: used.fraction,
        before=lambda inputs, others: _expect(len(inputs.probes), others, searching),
        attention=searching,
    )
    return swept, recorded["stats"]


def _expect(probes: int, attention: int, search: bool) -> None:
    """Say what calibration runs before it runs: the fp32 sweep (under each of ``attention``
    other implementations too when searching), and the first candidate's under each (the
    search may add more: each is as many forwards again)."""
    if search:
        runs = 1 + attention
        expect(
            2 * runs * probes,
            f"fp32 sweep {probes} x {runs}, first fp16 candidate {probes} x {runs} "
            "(x: attention implementations)",
        )
    else:
        expect(probes, f"fp32 sweep {probes}")


def _range_from_watch(
    near: Sequence[NearLimit],
    stats: dict[str, ActivationStats],
    existing: dict[str, Island],
    float_units: set[str],
    overflowing_units: set[str],
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
                f"{MEASURED}output{via} peaks at {item.peak:.4g} ({_near(item.peak)}); "
                f"was a precision island ({island.rule}): its fp32 output now flows on"
            )
        elif island is None:
            rule = f"{MEASURED}{item.side}{via} peaks at {item.peak:.4g} ({_near(item.peak)})"
            if item.side == "input":
                rule += ": kept fp32 so that what it receives is not cast to fp16"
        else:
            continue
        out.setdefault(unit, Island(unit, "range", rule))
    return list(out.values())


def _unit_of(module: str, stats: dict[str, ActivationStats], units: set[str]) -> str | None:
    """The plan unit deciding ``module``'s dtype: itself, or the unit it shares weights with."""
    if module in units:
        return module
    seen = stats.get(module)
    return next((m for m in seen.shares_weights_with if m in units), None) if seen else None


def _carry_in_fp32(
    model: ModelSource,
    plan_with: PlanWith,
    islands: Sequence[Island],
    near: Sequence[NearLimit],
    stats: dict[str, ActivationStats],
    scratch: Path,
    trust_remote_code: bool,
    inputs: Any,
) -> tuple[list[Island], dict[tuple[str, str], tuple[str, tuple[str, ...]]]]:
    """Range islands until the candidate carries every near-limit tensor in fp32.

    Each round loads the candidate as users do and runs it under dtype hooks; the earliest
    near-limit tensor still carried in fp16 gets one island (:func:`_fix_for`) and the
    candidate is checked again. Returns the islands added and, per ``(module, side)``, its
    outcome and the islands added for it.
    """
    fixes: list[Island] = []
    outcome: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
    pending = {(n.module, n.side): n for n in near}
    fixed_for: dict[tuple[str, str], list[str]] = {}
    seen = _candidate_carriage(model, plan_with(islands), scratch, trust_remote_code, inputs)
    rounds = 0
    while seen is not None:
        low = sorted((seen.low[key], key) for key in pending if key in seen.low)
        if not low:
            break
        _, key = low[0]
        plan = plan_with([*islands, *fixes])
        tries = len(fixed_for.get(key, ()))
        fix = rounds < WATCH_ROUNDS and tries < WATCH_TRIES
        unit = _fix_for(pending[key], seen, plan, stats) if fix else None
        if unit is None:
            outcome[key] = (STILL_LOW, tuple(fixed_for.get(key, ())))
            del pending[key]
            continue
        item = pending[key]
        fixes.append(
            Island(
                unit,
                "range",
                f"{MEASURED}{item.label} peaks at {item.peak:.4g} ({_near(item.peak)}); "
                "this island makes the candidate carry it in fp32",
            )
        )
        fixed_for.setdefault(key, []).append(unit)
        rounds += 1
        seen = _candidate_carriage(
            model, plan_with([*islands, *fixes]), scratch, trust_remote_code, inputs
        )
    for key in pending:
        state = UNCHECKED if seen is None else CARRIED
        outcome[key] = (state, tuple(fixed_for.get(key, ())))
    return fixes, outcome


def _fix_for(
    item: NearLimit, seen: Carriage, plan: ModelPlan, stats: dict[str, ActivationStats]
) -> str | None:
    """The unit whose fp32 island should make the candidate carry ``item`` in fp32.

    A weighted module's own output: its unit (the module, or the one it shares weights
    with). A container's output (the stream it hands on):
    the last weighted module in it that ran before the output was handed on and does not yet
    let fp32 flow (for a residual block, the projection added into the stream last). What a
    module receives, or a weightless module's output: the same, searched in the module's
    parent, then further up.
    """
    flowing = {i.name for i in plan.islands if i.reason != "precision"}
    units = {t.unit for t in plan.tensors if t.source.is_float} - flowing
    event = seen.low[(item.module, item.side)]

    def latest(scope: str) -> str | None:
        ran = [
            (seen.post[u], u)
            for u in units
            if u in seen.post and seen.post[u] < event and _within(u, scope)
        ]
        return max(ran)[1] if ran else None

    own = _unit_of(item.module, stats, units) if item.kind == LEAF else None
    if item.side == "output" and own is not None:
        return own
    if item.side == "output" and item.kind == CONTAINER:
        found = latest(item.module)
        if found is not None:
            return found
    scope = item.module
    while scope:
        scope = module_of(scope)
        found = latest(scope)
        if found is not None:
            return found
    return None


def _within(name: str, scope: str) -> bool:
    return not scope or name == scope or name.startswith(scope + ".")


def _candidate_carriage(
    model: ModelSource,
    plan: ModelPlan,
    scratch: Path,
    trust_remote_code: bool,
    inputs: Any,
) -> Carriage | None:
    """Write ``plan``, load it as a user would and record the dtypes it carries (None: the
    candidate does not run)."""
    import torch

    directory = scratch / "candidate"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    write_model(model, plan, directory)
    candidate = load(directory, trust_remote_code=trust_remote_code)
    try:
        with carriage(candidate) as seen, torch.no_grad():
            run_probes(candidate, inputs, "cpu", plan.compute.torch)
        return seen
    except RUN_ERRORS as exc:
        logger.info("candidate failed to run: %s", exc)
        return None
    finally:
        gone = weakref.ref(candidate)
        del candidate
        free_model(gone)


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


def _watch_warnings(watched: Sequence[Watched]) -> list[str]:
    """One warning per near-limit spike (the first :data:`WATCH_WARNINGS`), naming the
    innermost module it leaves or reaches, its peak and what the plan does about it; the rest
    counted in one more. (The calibration record keeps every module.)"""
    out: list[str] = []
    named = _innermost(watched)
    for item, also in named[:WATCH_WARNINGS]:
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
        peak = f"peaks at {item.peak:.4g}, {_near(item.peak)}"
        out.append(f"{item.module or '<model>'} ({item.kind}) {item.side} {peak}: {what}")
    rest = [item for item, _ in named[WATCH_WARNINGS:]]
    if rest:
        low = sum(1 for w in rest if w.outcome == STILL_LOW)
        out.append(
            f"{len(rest)} more module inputs/outputs come within {ACTIVATION_MARGIN:g}x of "
            f"fp16's {FP16_MAX:g} or past it (highest {max(w.peak for w in rest):.4g}; {low} "
            "still carried in fp16); --json lists every one (near_limit)"
        )
    return out


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


def _searched(units: Iterable[str]) -> list[Island]:
    return [Island(u, "search", "search: needed to match fp32") for u in units]


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


def _candidate_passes(
    model: ModelSource,
    plan: ModelPlan,
    scratch: Path,
    trust_remote_code: bool,
    inputs: Any,
    baselines: Mapping[str | None, Any],
    thresholds: dict[str, float],
    passing: dict[str, Any],
    failed: dict[tuple[str | None, str], None],
) -> bool:
    """Write ``plan``, load it as a user would, and compare with the fp32 outputs under each
    attention implementation of ``baselines`` (None: the one it loads with); a plan that
    passes leaves its sha256, its files' digest and its outputs under each implementation in
    ``passing`` (validation reuses them when the output's files are these). The candidate is freed
    (memory given back) before this returns.

    A candidate is judged probe by probe and stops at its first failure, which is added to
    ``failed``; the implementations and probes earlier candidates failed on run first (a
    bisection's failing candidates mostly fail where the last one did), so a failing candidate
    costs a few forwards and only a passing one runs every probe.
    """
    directory = scratch / "candidate"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    write_model(model, plan, directory)
    candidate: Any = None
    try:
        candidate = load(directory, trust_remote_code=trust_remote_code)
        by_attention: dict[str | None, Any] = {}
        for implementation in _failed_first(list(baselines), failed):
            first = [name for impl, name in reversed(failed) if impl == implementation]
            with attention(candidate, implementation):
                outputs, failure = _run_until_failure(
                    candidate,
                    _probes_first(inputs, first),
                    baselines[implementation],
                    thresholds,
                    plan.compute.torch,
                )
            if failure is not None:
                failed.pop((implementation, failure), None)
                failed[(implementation, failure)] = None
                return False
            by_attention[implementation] = outputs
        passing.update(
            plan=plan.sha256,
            weights=weights_digest(directory),
            outputs=by_attention.pop(None),
            by_attention=by_attention,
        )
        return True
    except RUN_ERRORS as exc:
        logger.info("candidate failed to run: %s", exc)
        return False
    finally:
        if candidate is not None:
            gone = weakref.ref(candidate)
            del candidate
            free_model(gone)


def _run_until_failure(
    candidate: Any, inputs: Any, baseline: Any, thresholds: dict[str, float], dtype: Any
) -> tuple[Any, str | None]:
    """``candidate``'s outputs on ``inputs``, each probe compared with ``baseline`` as it
    comes, and the first probe that failed (None: every one passed). The run stops there."""
    failure: list[str] = []

    def stop(name: str, outputs: dict[str, Any]) -> bool:
        rows = compare_outputs("", inputs, {name: baseline[name]}, {name: outputs}, thresholds)
        if not all(row.passed for row in rows):
            failure.append(name)
        return bool(failure)

    outputs = run_probes(candidate, inputs, "cpu", dtype, stop=stop)
    return outputs, failure[0] if failure else None


def _failed_first(
    implementations: list[str | None], failed: Mapping[tuple[str | None, str], None]
) -> list[str | None]:
    """``implementations`` with the one a candidate failed under most recently first."""
    latest = {impl: k for k, (impl, _) in enumerate(failed)}
    return sorted(implementations, key=lambda impl: -latest.get(impl, -1))


def _probes_first(inputs: Any, names: Sequence[str]) -> Any:
    """``inputs`` (resolved: no probe reads another's output) with the probes ``names`` first,
    in that order, then the rest in their own order."""
    if not names:
        return inputs
    rank = {name: k for k, name in enumerate(names)}
    order = sorted(inputs.probes, key=lambda p: rank.get(p.name, len(rank)))
    return replace(inputs, probes=tuple(order))
