"""What validation works on and produces, shared by whole-model and block-wise runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.plan import PlanRecord
from precision_convert.core.errors import CannotValidateError
from precision_convert.validation.certify.certificate import ComponentRecord, LoadPath
from precision_convert.validation.probe.inputs.arguments import argument_ranges
from precision_convert.validation.probe.inputs.contexts import triggers
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.positions import reach
from precision_convert.validation.probe.run.execute import Outputs
from precision_convert.validation.probe.run.metrics import Measurement
from precision_convert.validation.probe.run.parity import recipe_validation, thresholds_for
from precision_convert.validation.probe.run.session import SEED

__all__ = ["SEED", "Component", "ComponentResult", "check_baseline", "component_record"]


@dataclass(frozen=True)
class Component:
    """One model to validate: a single model, or one component of a pipeline."""

    name: str
    converted: ModelSource
    baseline_dir: Path
    record: PlanRecord  # empty when the model carries none
    trust_remote_code: bool = False  # the user allowed the model's own code (auto_map) to run
    #: Module patterns ``--allow-unexercised`` named: recorded as not covered if no probe ran them.
    allow_unexercised: tuple[str, ...] = ()

    @property
    def compute_dtype(self) -> torch.dtype:
        found = self.record.compute
        return found.torch if found is not None else torch.float32

    @property
    def fp32_bytes(self) -> int:
        return sum(4 * math.prod(t.shape) for t in self.converted.tensors() if t.dtype.is_float)


@dataclass
class ComponentResult:
    record: ComponentRecord
    metrics: list[Measurement]
    errors: list[str]
    load_paths: list[LoadPath] = field(default_factory=list)  # every way of loading it
    notes: list[str] = field(default_factory=list)  # for the certificate's notes


def component_record(
    component: Component, inputs_task: str, inputs: ModelInputs, mode: str, **extra: Any
) -> tuple[ComponentRecord, dict[str, float]]:
    """The certificate record of one component and the thresholds it is judged by.

    The task is the recipe's ``[validation] task`` when it names one, else the inputs' own.
    """
    validation = recipe_validation(component.record.recipe)
    task = str(validation.get("task", inputs_task))
    record = ComponentRecord(
        name=component.name,
        class_name=component.converted.class_name,
        library=component.converted.library,
        task=task,
        mode=mode,
        recipe=component.record.recipe,
        plan_sha256=component.record.plan_sha256,
        inputs=_with_reach(inputs),
        **extra,
    )
    return record, thresholds_for(task, validation)


def _with_reach(inputs: ModelInputs) -> dict[str, Any]:
    """The probes' record, with what they reached and left untested, the range of each forward
    argument they fed, and which kinds of trigger they searched."""
    reached = reach(inputs)
    arguments = (
        {"arguments": argument_ranges(inputs.probes, inputs.forward_arguments)}
        if inputs.forward_arguments
        else {}
    )
    return {
        **inputs.describe(),
        **arguments,
        "reach": reached,
        "triggers": triggers(inputs, reached),
    }


def check_baseline(outputs: Outputs, component: Component, hint: str = "") -> None:
    """Refuse to certify against a baseline that is itself not finite: nothing to match."""
    for probe, tensors in outputs.items():
        for name, tensor in tensors.items():
            if not torch.isfinite(tensor).all():
                raise CannotValidateError(
                    f"cannot validate {component.name or component.converted.class_name}: the "
                    f"fp32 baseline's {probe}/{name} holds NaN/Inf{hint}"
                )
