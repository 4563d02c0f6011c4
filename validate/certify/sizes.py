"""Sizes a certificate speaks for without running them: the fp32 baseline's growth fits
(``inputs.sizes.growth``, :func:`~..probe.run.growth.size_growth`) name the modules whose peak,
predicted inside a size family's claimed range, comes within the activation margin of fp16's
limit. An output that computes such a module in fp16 fails there, though no probe reached that
size; every output's record says up to which size of each family it is predicted safe."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from precision_convert.conversion.analysis.activations import LEAF
from precision_convert.core.dtypes import FP32
from precision_convert.core.names import module_of
from precision_convert.validation.certify.components import Component


def predictions_decide(component: Component) -> bool:
    """Whether a size's predicted peaks can fail ``component``: only where it computes in
    fp16 (bf16 has fp32's range); elsewhere the size fits are a record."""
    return component.compute_dtype == torch.float16


def _in_fp16(component: Component, growth: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each ``(family, prediction)`` near fp16's limit that the float16 output does not keep
    fp32: a weighted module whose own weights are fp16, or a stream (a container's or a
    function's output) in an output that keeps no fp32 island at all."""
    if not predictions_decide(component):
        return
    near = [(f, item) for f, entry in growth.items() for item in entry.get("near_limit", ())]
    if not near:
        return
    kept = {module_of(t.name) for t in component.converted.tensors() if t.dtype == FP32}
    for family, item in near:
        module, kind = str(item["module"]), str(item.get("kind", LEAF))
        if (module not in kept) if kind == LEAF else not kept:
            yield family, item


def judge_sizes(component: Component, sizes: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``sizes`` (a component's record of them) with each fitted family's
    ``largest_predicted_safe`` for this output: the top of its claimed range, or below it the
    largest size at which every module the output computes in fp16 is predicted outside the
    margin; and one failure per module predicted near fp16's limit that it computes in fp16."""
    growth = {k: dict(v) for k, v in (sizes.get("growth") or {}).items()}
    if not growth:
        return sizes, []
    for entry in growth.values():
        entry["largest_predicted_safe"] = entry["claimed"][1]
    who = f"{component.name}: " if component.name else ""
    failures = []
    for family, item in _in_fp16(component, growth):
        entry = growth[family]
        entry["largest_predicted_safe"] = min(entry["largest_predicted_safe"], item["safe_up_to"])
        module, kind = str(item["module"]), str(item.get("kind", LEAF))
        failures.append(f"{who}{module or '<model>'} ({kind}): {item['rule']}; fp16 here")
    return {**sizes, "growth": growth}, failures
