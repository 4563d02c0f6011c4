"""``--keep-fp32`` names modules as the model shows them: a head tied to the embedding
(``lm_head`` of a small Llama, which the checkpoint stores once, as ``model.embed_tokens``) is
kept fp32 with the weight it shares, and every way of loading the output keeps the tie."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import precision_convert as pc
from precision_convert.cli.main import app

#: Relative L2 distance of the logits from the fp32 source's that a bf16-safe model stays within.
CLOSE = 0.02


@pytest.fixture(scope="module")
def converted(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    source = tiny_model("llama")
    assert json.loads((source / "config.json").read_text())["tie_word_embeddings"] is True
    out = tmp_path_factory.mktemp("tied") / "llama-bf16-safe"
    done = CliRunner().invoke(
        app,
        [
            "model",
            str(source),
            "--to",
            "bf16-safe",
            "--keep-fp32",
            "lm_head",
            "-o",
            str(out),
            "--coverage",
            "quick",
        ],
    )
    assert done.exit_code == 0, done.output
    return source, out


def test_the_shared_weight_is_stored_once_in_fp32(converted: tuple[Path, Path]) -> None:
    _, out = converted
    with safe_open(out / "model.safetensors", "pt") as stored:
        names = stored.keys()
        dtypes = {name: stored.get_slice(name).get_dtype() for name in names}
        record = json.loads(stored.metadata()["precision_convert"])
    assert "lm_head.weight" not in dtypes  # tied: stored once, under the embedding's name
    assert dtypes["model.embed_tokens.weight"] == "F32"
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "BF16"
    assert record["islands"]["model.embed_tokens"] == "user"
    config = json.loads((out / "config.json").read_text())
    assert config["precision_convert"]["islands"] == record["islands"]
    certificate = json.loads((out / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "pass"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 33).reshape(2, 16) % 256
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("how", ["pc.load", "from_pretrained"])
def test_both_loads_keep_the_tie_and_the_fp32_numbers(
    converted: tuple[Path, Path], how: str
) -> None:
    from transformers import AutoModelForCausalLM

    source, out = converted
    reference = _logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval())
    model = pc.load(out) if how == "pc.load" else AutoModelForCausalLM.from_pretrained(out).eval()
    head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
    assert head.data_ptr() == embedding.data_ptr()  # still one tensor
    if how == "pc.load":  # the stored dtypes, as the record says
        assert head.dtype == torch.float32
        assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    logits = _logits(model)
    assert torch.isfinite(logits).all()
    assert float((logits - reference).norm() / reference.norm()) < CLOSE


def test_a_name_no_module_answers_to_is_still_refused(
    converted: tuple[Path, Path], tmp_path: Path
) -> None:
    source, _ = converted
    done = CliRunner().invoke(
        app,
        [
            "model",
            str(source),
            "--to",
            "bf16",
            "--keep-fp32",
            "lm_heads",
            "-o",
            str(tmp_path / "o"),
        ],
    )
    assert done.exit_code == 2
    assert done.stderr.strip() == (
        "precision-convert: --keep-fp32 'lm_heads' matches no module of the model"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("pattern", "head_bias"),
    [("lm_head", False), ("lm_head", True), ("model.embed_tokens", True)],
    ids=["head", "head-with-bias", "embedding"],
)
def test_a_pattern_naming_either_tied_module_keeps_both(pattern: str, head_bias: bool) -> None:
    """A head with a bias of its own beside the shared weight is a unit too: it must follow
    the weight into fp32, or the loaded head would hold two dtypes."""
    from precision_convert.conversion.io.tensors import MemoryTensor
    from precision_convert.conversion.plan import build_plan
    from precision_convert.core.dtypes import FP32
    from precision_convert.recipes import Recipe

    shapes = {"model.embed_tokens.weight": (16, 4), "model.layers.0.mlp.weight": (4, 4)}
    if head_bias:
        shapes["lm_head.bias"] = (16,)
    tensors = [MemoryTensor(n, FP32, s, torch.zeros(s)) for n, s in shapes.items()]
    recipe = Recipe(name="plain", description="", library="any", keep_normalization=False)
    plan = build_plan(
        tensors,
        target="bf16",
        recipe=recipe,
        keep_fp32=[pattern],
        tied={"lm_head": "model.embed_tokens"},
    )
    kept = {"model.embed_tokens", "lm_head"} if head_bias else {"model.embed_tokens"}
    assert {i.name for i in plan.islands} == kept
    stored = {t.name: t.stored for t in plan.tensors}
    assert stored["model.layers.0.mlp.weight"] != FP32
    assert {n for n, dtype in stored.items() if dtype == FP32} == set(shapes) - {
        "model.layers.0.mlp.weight"
    }
