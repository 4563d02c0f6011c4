"""Calibrated plans: the recipe's islands, plus what the model's own activations demand.

For ``fp16-safe`` the fp32 model runs once on the validation inputs under recording hooks;
every module whose activations come near fp16's limit becomes a ``range`` island. The
candidate plan is then written to a scratch directory, loaded exactly as users load it and
compared with the fp32 outputs; while it fails, :func:`~.analysis.search_islands` bisects for
the modules that must also stay fp32 (``search`` islands). For ``bf16-safe`` the same pass
recomputes each weighted layer in bf16 and keeps those that lose most of their mantissa.

The fp32 model is freed before any candidate loads: one model is resident at a time.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from precision_convert.conversion.analysis.activations import (
    FP32_SHARE_LIMIT,
    ActivationStats,
    calibrate,
    losing_precision,
    overflowing,
    search_islands,
)
from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.output import write_model
from precision_convert.conversion.plan import Island, ModelPlan
from precision_convert.conversion.runtime.baseline import load_fp32
from precision_convert.conversion.runtime.loader import load
from precision_convert.conversion.runtime.memory import free_model
from precision_convert.names import module_of
from precision_convert.validation.probe.execute import RUN_ERRORS, run_probes, select_inputs
from precision_convert.validation.probe.execute import resolve as resolve_inputs
from precision_convert.validation.probe.inputs import input_candidates
from precision_convert.validation.probe.parity import (
    compare_outputs,
    recipe_validation,
    thresholds_for,
)
from precision_convert.validation.probe.tokenizers import tokenizer_for

logger = logging.getLogger(__name__)

#: Builds the plan with extra islands on top of the recipe's.
PlanWith = Callable[[Iterable[Island]], ModelPlan]


@dataclass(frozen=True)
class Calibration:
    """What analysis found for one model."""

    stats: dict[str, ActivationStats]
    islands: tuple[Island, ...]  # added by analysis and search, on top of the recipe's
    evaluations: int  # candidate plans checked against fp32
    passed: bool | None  # the final candidate matched fp32 (None: not checked)
    task: str
    warnings: tuple[str, ...] = ()


def calibrated_plan(
    model: ModelSource,
    target: str,
    plan_with: PlanWith,
    *,
    search: bool = True,
    trust_remote_code: bool = False,
) -> tuple[ModelPlan, Calibration]:
    """The plan for ``target`` with analysis islands, and the calibration behind it."""
    import torch

    base = plan_with(())
    fp32 = load_fp32(model.root, trust_remote_code=trust_remote_code).eval()
    simulate = torch.bfloat16 if target == "bf16-safe" else None
    recorded: dict[str, dict[str, ActivationStats]] = {}

    def run(candidate_model: Any, inputs: Any) -> Any:
        stats, outputs = calibrate(
            candidate_model,
            lambda: run_probes(candidate_model, inputs, "cpu", torch.float32),
            simulate,
        )
        recorded["stats"] = stats
        return outputs

    tokenizer = tokenizer_for(model.root)
    chosen, baseline = select_inputs(fp32, input_candidates(fp32, seed=0, tokenizer=tokenizer), run)
    stats = recorded["stats"]
    frozen = resolve_inputs(chosen, baseline)
    gone = weakref.ref(fp32)
    del fp32
    free_model(gone)

    existing = {i.name for i in base.islands}
    float_units = _float_units(base)
    ordered = _execution_order(float_units, stats)
    free = [u for u in ordered if u not in existing]
    if target == "fp16-safe":
        found = overflowing(stats, free)
        added = [Island(u, "range", f"calibration: {why}") for u, why in found.items()]
    else:
        found = losing_precision(stats, free)
        added = [Island(u, "precision", f"calibration: {why}") for u, why in found.items()]
    plan = plan_with(added)
    validation = recipe_validation(base.recipe)
    task = str(validation.get("task", chosen.task))
    thresholds = thresholds_for(task, validation)
    evaluations, passed = 0, None
    if search and target == "fp16-safe":
        with tempfile.TemporaryDirectory(prefix="pc-candidate-") as scratch:

            def passes(extra: frozenset[str]) -> bool:
                return _candidate_passes(
                    model,
                    plan_with([*added, *_searched(extra)]),
                    Path(scratch),
                    trust_remote_code,
                    frozen,
                    baseline,
                    thresholds,
                )

            result = search_islands([u for u in free if u not in found], passes)
        evaluations, passed = result.evaluations, result.passed
        added += _searched(result.added)
        plan = plan_with(added)
    warnings = list(plan.warnings)
    if passed is False:
        warnings.append(
            "even with every module in fp32 the fp16 candidate does not match fp32 "
            "(fp16 inputs or outputs overflow); use bf16-safe"
        )
    if target == "fp16-safe" and plan.fp32_share > FP32_SHARE_LIMIT:
        warnings.append(
            f"{plan.fp32_share:.0%} of the parameters stay fp32 (over {FP32_SHARE_LIMIT:.0%}): "
            "fp16-safe saves little here; bf16-safe is recommended"
        )
    calibration = Calibration(stats, tuple(added), evaluations, passed, task, tuple(warnings))
    return replace(plan, warnings=tuple(warnings)), calibration


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


def _run_candidate(directory: Path, inputs: Any, plan: ModelPlan, trust_remote_code: bool) -> Any:
    """The candidate's outputs; it is freed (memory given back) before this returns."""
    candidate = load(directory, trust_remote_code=trust_remote_code)
    try:
        return run_probes(candidate, inputs, "cpu", plan.compute.torch)
    finally:
        gone = weakref.ref(candidate)
        del candidate
        free_model(gone)


def _candidate_passes(
    model: ModelSource,
    plan: ModelPlan,
    scratch: Path,
    trust_remote_code: bool,
    inputs: Any,
    baseline: Any,
    thresholds: dict[str, float],
) -> bool:
    """Write ``plan``, load it as a user would, and compare with the fp32 outputs."""
    directory = scratch / "candidate"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    write_model(model, plan, directory)
    try:
        outputs = _run_candidate(directory, inputs, plan, trust_remote_code)
    except RUN_ERRORS as exc:
        logger.info("candidate failed to run: %s", exc)
        return False
    rows = compare_outputs("", inputs, baseline, outputs, thresholds)
    return all(row.passed for row in rows)
