"""Sizes a certificate speaks for without running them: the fp32 baseline's growth fits
(``inputs.sizes.growth``, :func:`~..probe.run.growth.size_growth`) name the modules whose peak,
predicted at the declared size, comes within the activation margin of fp16's limit. An output
that computes such a module in fp16 fails there, though no probe reached that size."""

from __future__ import annotations

from typing import Any

import torch

from precision_convert.conversion.analysis.activations import LEAF
from precision_convert.core.dtypes import FP32
from precision_convert.core.names import module_of
from precision_convert.validation.certify.components import Component
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs


def predictions_decide(component: Component) -> bool:
    """Whether a size's predicted peaks can fail ``component``: only where it computes in
    fp16 (bf16 has fp32's range); elsewhere the size fits are a record."""
    return component.compute_dtype == torch.float16


def predicted_failures(component: Component, inputs: ModelInputs) -> list[str]:
    """One failure per module predicted near fp16's limit that the float16 output does not
    keep fp32: a weighted module whose own weights are fp16, or a stream (a container's or a
    function's output) in an output that keeps no fp32 island at all."""
    if not predictions_decide(component):
        return []
    growth: dict[str, Any] = dict((inputs.sizes or {}).get("growth") or {})
    near = [item for entry in growth.values() for item in entry.get("near_limit", ())]
    if not near:
        return []
    kept = {module_of(t.name) for t in component.converted.tensors() if t.dtype == FP32}
    who = f"{component.name}: " if component.name else ""
    failures = []
    for item in near:
        module, kind = str(item["module"]), str(item.get("kind", LEAF))
        if (module not in kept) if kind == LEAF else not kept:
            failures.append(f"{who}{module or '<model>'} ({kind}): {item['rule']}; fp16 here")
    return failures
