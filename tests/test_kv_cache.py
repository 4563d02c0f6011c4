"""Generation with the KV cache through fp32 range islands.

``generate`` keeps keys and values from earlier steps in a cache: a dynamic one grows with
``torch.cat``, a static one is allocated once, and eager attention reads it with plain
matmuls. With ``v_proj`` kept fp32 (its outputs pass 65504), the cached values are fp32 while
the keys are fp16, and ``o_proj`` (also fp32) receives fp32. Every way must keep the values
in fp32 and match the fp32 model token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.core.dtypes import FP16_MAX
from precision_convert.validation.certify.certificate import Certificate
from precision_convert.validation.probe.run.attention import attention

#: v_proj's weights are scaled up by this and o_proj's down by it: fp32 computes the same
#: function, but the values (up to ~1.5e5) pass fp16's limit; no weight does.
SCALE = 2e5


def _llama() -> Any:
    torch.manual_seed(0)
    model = _models.llama(max_position_embeddings=128).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(SCALE)
            layer.self_attn.o_proj.weight.div_(SCALE)
    return model


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kv-cache")
    _llama().save_pretrained(root / "source")
    out = root / "fp16-safe"
    convert(root / "source", to="fp16-safe", output=out, coverage="quick")
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_values_pass_fp16s_limit_and_stay_in_fp32_islands(certified: Path) -> None:
    model = _llama()
    peak = 0.0

    def watch(_: Any, __: Any, output: torch.Tensor) -> None:
        nonlocal peak
        peak = max(peak, float(output.abs().max()))

    handle = model.model.layers[0].self_attn.v_proj.register_forward_hook(watch)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)))
    handle.remove()
    assert peak > FP16_MAX
    cert = Certificate.read(certified)
    assert cert.verdict == "pass", cert.failures
    loaded = pc.load(certified)
    for layer in loaded.model.layers:
        assert layer.self_attn.v_proj.weight.dtype == torch.float32
        assert layer.self_attn.o_proj.weight.dtype == torch.float32


@pytest.mark.parametrize(
    ("cache", "implementation"),
    [("dynamic", None), ("static", None), ("dynamic", "eager"), ("static", "eager")],
)
def test_generate_with_the_cache_matches_fp32(
    certified: Path, cache: str, implementation: str | None
) -> None:
    ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    settings: dict[str, Any] = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": 8,
        "do_sample": False,
        "output_scores": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }
    if cache == "static":
        settings["cache_implementation"] = "static"
    reference, loaded = _llama(), pc.load(certified)
    with attention(reference, implementation), torch.no_grad():
        want = reference.generate(ids, **settings)
    with attention(loaded, implementation), torch.no_grad():
        got = loaded.generate(ids, **settings)
    scores = torch.stack(got.scores).float()
    assert torch.isfinite(scores).all()
    assert torch.equal(got.sequences, want.sequences)
    assert _cosine(scores, torch.stack(want.scores)) > 0.9999
