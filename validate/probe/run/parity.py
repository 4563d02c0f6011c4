"""Judging a candidate's outputs against the baseline's, by the thresholds of its task.

Thresholds live in ``recipes/tasks.toml`` (per task) and a recipe's ``[validation]`` table
(overrides); calibration's search and validation judge with the same numbers.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from typing import Any

import torch

from precision_convert.core.errors import InputError
from precision_convert.core.progress import ledger_span
from precision_convert.recipes import get as get_recipe
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.run.execute import Outputs
from precision_convert.validation.probe.run.metrics import (
    METRICS,
    Measurement,
    compare,
    intermediate_states,
    kind_of,
    measure,
)


@cache
def _task_table() -> Mapping[str, Mapping[str, float]]:
    text = resources.files("precision_convert.recipes").joinpath("tasks.toml").read_text("utf-8")
    return tomllib.loads(text)


def recipe_validation(recipe: str | None) -> Mapping[str, Any]:
    """The ``[validation]`` table of the recipe a conversion used (empty when unknown)."""
    if not recipe:
        return {}
    try:
        return get_recipe(recipe).validation
    except InputError:
        return {}  # a recipe file that has since moved: the task defaults apply


def thresholds_for(task: str, validation: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Thresholds of ``task``: ``[defaults]``, then ``[task]``, then the recipe's overrides."""
    table = _task_table()
    overrides = (validation or {}).get("thresholds", {})
    merged = {**table.get("defaults", {}), **table.get(task, {}), **overrides}
    unknown = set(merged) - set(METRICS)
    if unknown:
        raise InputError(
            f"unknown validation thresholds {sorted(unknown)} (task {task!r}); "
            f"known: {', '.join(METRICS)}"
        )
    return {k: float(v) for k, v in merged.items()}


def compare_outputs(
    component: str,
    inputs: ModelInputs,
    baseline: Outputs,
    candidate: Outputs,
    thresholds: Mapping[str, float],
    probe_label: Callable[[str], str] = str,
) -> list[Measurement]:
    """Judge every output of every probe; a missing or reshaped output is itself a failure."""
    with ledger_span("compare"):
        return _compared(component, inputs, baseline, candidate, thresholds, probe_label)


def _compared(
    component: str,
    inputs: ModelInputs,
    baseline: Outputs,
    candidate: Outputs,
    thresholds: Mapping[str, float],
    probe_label: Callable[[str], str],
) -> list[Measurement]:
    rows: list[Measurement] = []
    images = {p.name: p.images for p in inputs.probes}
    finite_only = {p.name for p in inputs.probes if p.finite_only}
    for probe, outputs in baseline.items():
        inner = intermediate_states(outputs)
        for name, base in outputs.items():
            got = candidate.get(probe, {}).get(name)
            label = probe_label(probe)
            if got is None or got.shape != base.shape:
                rows.append(
                    Measurement(component, label, name, "nonfinite", None, 0.0, "max", False)
                )
                continue
            if probe in finite_only:  # a free generation may choose other tokens than fp32
                values = {"nonfinite": float((~torch.isfinite(got)).sum())}
            else:
                kind = kind_of(name, images=images.get(probe, False))
                values = compare(base, got, kind, intermediate=name in inner)
            rows += measure(component, label, name, values, thresholds)
    return rows
