"""The generic input builders feed every family of the zoo without a per-family rule."""

from __future__ import annotations

import pytest
import torch
from _models import ZOO, make

from precision_convert.validation.probe.run.execute import build_inputs, run_probes


@pytest.mark.parametrize("name", sorted(ZOO))
def test_builders_feed_every_family(name: str) -> None:
    model = make(name)
    inputs = build_inputs(model, seed=0)
    assert inputs.task == ZOO[name][1]
    outputs = run_probes(model, inputs)
    tensors = [t for probe in outputs.values() for t in probe.values()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors)
