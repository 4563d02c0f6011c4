"""A model with range islands, cast as a whole to float16, overflows again: said in the card's
first lines and in the warning ``pc.load``'s hooks log at its first forward after the cast."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from _loader_helpers import llama_with_overflow

import precision_convert as pc

ISLAND = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The overflowing Llama as fp16-safe, certified (its down_proj a range island)."""
    root = tmp_path_factory.mktemp("cast")
    source = llama_with_overflow(root / "llama")
    result = pc.convert(source, to="fp16-safe", output=root / "out", coverage="quick")
    assert result.passed
    return root / "out"


@pytest.mark.parametrize("cast", ["half", "to"])
def test_casting_a_loaded_model_whole_is_warned_once(
    cast: str, converted: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(6))
    model = pc.load(converted)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
        assert not caplog.records  # as loaded: nothing to say

        model.half() if cast == "half" else model.to(torch.float16)
        cast = model(input_ids=ids).logits
        model(input_ids=ids)

    assert not torch.isfinite(cast).all()  # what the warning is about really happens
    [record] = caplog.records  # once, not at every forward
    assert record.levelno == logging.WARNING
    assert ISLAND in record.getMessage() and ".half()" in record.getMessage()


def test_a_model_whose_islands_stay_fp32_is_not_warned_about(
    converted: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = pc.load(converted).to("cpu", torch.bfloat16)  # bf16 keeps fp32's range
    with caplog.at_level(logging.WARNING), torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert not caplog.records


def test_the_card_says_it_first(converted: Path) -> None:
    card = (converted / "README.md").read_text()
    body = card.split("---", 2)[2].lstrip().splitlines()
    top = "\n".join(body[:6])
    assert "Do not cast this model to float16 as a whole" in top
    assert "model.half()" in top and "dtype=torch.float16" in top
