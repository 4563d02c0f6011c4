"""One builder: what validation runs is what ``pc.load`` returns.

Whole-model validation, block-wise validation and the fp32 baseline are spied on while they
validate a real conversion with fp32 islands; the models they actually ran are compared with
``pc.load``'s: the same module tree, the same tensors in the same dtypes (fp32 for the
baseline), and — for the converted model — the same boundary hooks in the same places.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.conversion.runtime.boundaries import hooked_modules
from precision_convert.validation.certify import blockwise, runner, whole


def _tensors(model: nn.Module) -> dict[str, torch.dtype]:
    return {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}


def _modules(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules()]


@pytest.fixture(scope="module")
def converted(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("builders") / "t5-fp16-safe"
    convert(tiny_model("t5-encoder"), to="fp16-safe", output=out, validate=False)
    return out


def test_whole_validation_runs_what_pc_load_returns(
    converted: Path, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: dict[str, Any] = {}
    real_load, real_fp32 = whole.load, whole.load_fp32

    def spy_load(path: Path, **kwargs: Any) -> Any:
        model = real_load(path, **kwargs)
        ran["candidate"] = (_modules(model), _tensors(model), hooked_modules(model))
        return model

    def spy_fp32(path: Path, **kwargs: Any) -> Any:
        model = real_fp32(path, **kwargs)
        ran["baseline"] = (_modules(model), _tensors(model))
        return model

    monkeypatch.setattr(whole, "load", spy_load)
    monkeypatch.setattr(whole, "load_fp32", spy_fp32)
    certificate = runner.validate(converted, baseline=tiny_model("t5-encoder"))
    assert certificate.verdict == "pass", certificate.failures

    loaded = pc.load(converted)
    islands = {n for n, d in _tensors(loaded).items() if d == torch.float32}
    assert islands and any(d == torch.float16 for d in _tensors(loaded).values())
    assert ran["candidate"] == (_modules(loaded), _tensors(loaded), hooked_modules(loaded))
    base_modules, base_tensors = ran["baseline"]
    assert base_modules == _modules(loaded)
    assert base_tensors == {n: torch.float32 for n in _tensors(loaded)}


def test_blockwise_validation_runs_what_pc_load_returns(
    converted: Path, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    streamers: list[blockwise.Streamer] = []
    real = blockwise._streamed

    def spy(*args: Any, **kwargs: Any) -> Any:
        streamer, placeholders = real(*args, **kwargs)
        streamers.append(streamer)
        return streamer, placeholders

    monkeypatch.setattr(blockwise, "_streamed", spy)
    certificate = runner.validate(converted, baseline=tiny_model("t5-encoder"), max_memory="20KB")
    assert certificate.verdict == "pass", certificate.failures
    assert certificate.components[0].mode == "blockwise"

    base, candidate = streamers  # the baseline pass, then the converted model's
    loaded = pc.load(converted)
    for streamer in (base, candidate):  # materialize every weight to read its dtype
        streamer.load_keys("all", list(streamer.owners))
    assert _modules(candidate.model) == _modules(loaded)
    assert _tensors(candidate.model) == _tensors(loaded)
    assert hooked_modules(candidate.model) == hooked_modules(loaded)
    assert _modules(base.model) == _modules(loaded)
    assert _tensors(base.model) == {n: torch.float32 for n in _tensors(loaded)}
