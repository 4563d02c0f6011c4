"""Activation analysis: fp16-safe finds overflowing modules itself, checks and searches.

Every overflow here is real: weights of tiny real architectures are scaled until the fp32
activations exceed fp16's 65504, and the plain fp16 model is shown to break on them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _models
import torch
from safetensors.torch import load_file, save_file

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.core.dtypes import FP16_MAX


def _scaled(source: Path, dest: Path, scales: dict[str, float]) -> Path:
    shutil.copytree(source, dest)
    weights = next(dest.glob("*.safetensors"))
    state = load_file(weights)
    for name, scale in scales.items():
        state[name] = state[name] * scale
    save_file(state, weights, metadata={"format": "pt"})
    return dest


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
    )


def _t5_overflowing(tmp_path: Path) -> Path:
    """T5 v1.1 whose feed-forward outputs (recipe case) and block 1's attention output
    projection (a case no recipe names) both really exceed fp16."""
    source = _models.save("t5-encoder", tmp_path / "t5")
    scales = {f"encoder.block.{i}.layer.1.DenseReluDense.wo.weight": 3e5 for i in range(2)}
    # Weights stay inside fp16 (max |w| ~ 3e4): only the activations overflow.
    scales["encoder.block.1.layer.0.SelfAttention.o.weight"] = 5e4
    return _scaled(source, tmp_path / "t5-scaled", scales)


def _t5_run(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state.float()


def test_t5_fp16_safe_finds_recipe_and_unnamed_islands(tmp_path: Path) -> None:
    from transformers import T5EncoderModel

    source = _t5_overflowing(tmp_path)
    reference = _t5_run(T5EncoderModel.from_pretrained(source).eval())
    assert reference.isfinite().all()
    calibrated_peak = max(
        s.max_out
        for s in pc.inspect(source, calibrate=True, chart=tmp_path / "c.png")
        .components[0]
        .calibration.stats.values()
    )
    assert calibrated_peak > FP16_MAX, "the scaled weights must really overflow fp16"

    plain = _t5_run(T5EncoderModel.from_pretrained(source).half().eval())
    assert not plain.isfinite().all() or _cosine(plain, reference) < 0.99

    result = convert(source, to="fp16-safe", output=tmp_path / "safe", validate=False)
    islands = {i.name: i for i in result.components[0].plan.islands}
    o_proj = "encoder.block.1.layer.0.SelfAttention.o"
    assert islands[o_proj].reason == "range" and "calibration" in islands[o_proj].rule
    assert islands["encoder.block.0.layer.1.DenseReluDense.wo"].reason == "range"
    assert "encoder.block.0.layer.0.SelfAttention.o" not in islands  # unscaled: stays fp16
    converted = _t5_run(pc.load(tmp_path / "safe"))
    assert converted.isfinite().all()
    assert _cosine(converted, reference) >= 0.9999


def _cogvideox_scaled(tmp_path: Path) -> tuple[Path, set[str]]:
    source = _models.save("cogvideox-transformer", tmp_path / "cogvideox")
    overflowing = {"transformer_blocks.1.ff.net.2"}
    return _scaled(
        source, tmp_path / "cog-scaled", {f"{m}.weight": 2e6 for m in overflowing}
    ), overflowing


def _cogvideox_run(model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    kwargs = {
        "hidden_states": torch.randn(1, 2, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),  # text_embed_dim
        "timestep": torch.tensor([500]),
    }
    kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kwargs.items()}
    with torch.no_grad():
        return model(**kwargs, return_dict=False)[0].float()


def test_cogvideox_fp16_safe_keeps_only_the_overflowing_blocks(tmp_path: Path) -> None:
    from diffusers import CogVideoXTransformer3DModel

    source, overflowing = _cogvideox_scaled(tmp_path)
    reference = _cogvideox_run(CogVideoXTransformer3DModel.from_pretrained(source), torch.float32)
    plain = _cogvideox_run(
        CogVideoXTransformer3DModel.from_pretrained(source, torch_dtype=torch.float16),
        torch.float16,
    )
    assert torch.isnan(plain).any(), "plain fp16 must really produce NaN"

    recipe_only = convert(source, to="bf16-safe", output=tmp_path / "bf16", validate=False)
    result = convert(source, to="fp16-safe", output=tmp_path / "fp16", validate=False)
    recipe_islands = set(recipe_only.components[0].plan.fp32_modules)
    added = set(result.components[0].plan.fp32_modules) - recipe_islands
    assert overflowing <= added
    assert all(name.startswith("transformer_blocks.1.") for name in added)
    assert len(added) <= len(overflowing) + 2
    converted = _cogvideox_run(pc.load(tmp_path / "fp16"), torch.float16)
    assert converted.isfinite().all()
    assert _cosine(converted, reference) >= 0.999


def test_an_overflow_between_weighted_modules_is_found(tmp_path: Path) -> None:
    """T5's gated feed-forward multiplies wi_0's and wi_1's outputs in functional code: each
    stays far below fp16's limit, their product does not. No weighted module's output shows
    it; calibration sees it at the dropout's output and at wo's input (every module is
    watched), and the candidate check against fp32 confirms the island it adds."""
    from transformers import T5EncoderModel

    source = _models.save("t5-encoder", tmp_path / "t5")
    ff = "encoder.block.1.layer.1.DenseReluDense"
    scaled = _scaled(
        source, tmp_path / "scaled", {f"{ff}.wi_0.weight": 200.0, f"{ff}.wi_1.weight": 200.0}
    )
    stats = (
        pc.inspect(scaled, calibrate=True, chart=tmp_path / "c.png").components[0].calibration.stats
    )
    assert max(stats[f"{ff}.wi_0"].max_out, stats[f"{ff}.wi_1"].max_out) < FP16_MAX / 2
    assert stats[f"{ff}.wo"].max_in > FP16_MAX  # the product, computed between modules

    result = convert(scaled, to="fp16-safe", output=tmp_path / "out", validate=False)
    component = result.components[0]
    added = {i.name for i in component.plan.islands if i.rule.startswith(("calibration", "search"))}
    assert added and added <= {f"{ff}.wi_0", f"{ff}.wi_1"}
    assert component.calibration is not None and component.calibration.evaluations >= 1
    reference = _t5_run(T5EncoderModel.from_pretrained(scaled).eval())
    assert _cosine(_t5_run(pc.load(tmp_path / "out")), reference) >= 0.9999


def test_too_many_islands_recommends_bf16_safe(tmp_path: Path) -> None:
    source = _models.save("llama", tmp_path / "llama")
    scales = {
        f"model.layers.{i}.mlp.{p}.weight": 3000.0
        for i in range(2)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    result = convert(
        _scaled(source, tmp_path / "big", scales),
        to="fp16-safe",
        output=tmp_path / "out",
        validate=False,
    )
    plan = result.components[0].plan
    assert plan.fp32_share > 0.25
    assert any("bf16-safe is recommended" in w for w in plan.warnings)


def test_inspect_calibrate_draws_the_chart(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    source = _t5_overflowing(tmp_path)
    chart = tmp_path / "chart.png"
    result = CliRunner().invoke(
        app, ["inspect", str(source), "--calibrate", "--chart", str(chart), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["components"][0]["calibration"]
    over = [row for row in report["modules"] if row["max_abs"] > FP16_MAX]
    assert {row["module"] for row in over} >= {"encoder.block.1.layer.0.SelfAttention.o"}
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


_CANCELLING_MLP = "model.layers.1.mlp"


def _cancelling_llama(path: Path, terms: tuple[float, float]) -> Path:
    """A Llama whose layer-1 down projection adds ``terms[0] * a`` and ``terms[1] * a`` for
    one intermediate activation ``a``: nearly equal large terms, whose sum bf16 gets wrong."""
    source = _models.save("llama", path)
    weights = source / "model.safetensors"
    state = load_file(weights)
    mlp = _CANCELLING_MLP
    for proj in ("gate_proj", "up_proj"):  # intermediate channels 0 and 1 become identical
        state[f"{mlp}.{proj}.weight"][1] = state[f"{mlp}.{proj}.weight"][0]
    down = state[f"{mlp}.down_proj.weight"]
    down.mul_(0.01)
    down[:, 0], down[:, 1] = terms
    save_file(state, weights, metadata={"format": "pt"})
    return source


def test_bf16_safe_calibration_keeps_a_cancelling_layer(tmp_path: Path) -> None:
    """bf16 keeps 8 significant bits: a layer whose output is the difference of two nearly
    equal large terms loses it. Calibration recomputes each layer in bf16 and keeps that one."""
    from transformers import LlamaForCausalLM

    # 100.3 is 100.5 in bf16: the 0.3 is lost
    source = _cancelling_llama(tmp_path / "llama", (100.3, -100.0))
    mlp = _CANCELLING_MLP
    plain = convert(source, to="bf16-safe", output=tmp_path / "plain", validate=False)
    assert plain.components[0].calibration is None  # bf16-safe calibrates only when asked
    result = convert(
        source, to="bf16-safe", output=tmp_path / "out", validate=False, calibrate=True
    )
    added = {i.name: i for i in result.components[0].calibration.islands}
    assert set(added) == {f"{mlp}.down_proj"} and added[f"{mlp}.down_proj"].reason == "precision"

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

    def logits(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()

    reference = logits(LlamaForCausalLM.from_pretrained(source))
    error = {
        name: float((logits(pc.load(tmp_path / name)) - reference).norm() / reference.norm())
        for name in ("plain", "out")
    }
    assert error["out"] < error["plain"] / 2


def test_a_failing_uncalibrated_conversion_is_told_to_calibrate(tmp_path: Path) -> None:
    """bf16-safe calibrates only when asked; when its certificate then fails, the command says
    which option finds the islands the recipe missed, and that option does certify it."""
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    # 300.9 and -300 are 300 and -300 in bf16: their sum, 0.9 of the activation, is lost
    source = _cancelling_llama(tmp_path / "llama", (300.9, -300.0))
    command = ["model", str(source), "--to", "bf16-safe", "--coverage", "quick"]
    failed = CliRunner().invoke(app, [*command, "-o", str(tmp_path / "plain")])
    assert failed.exit_code == 1, failed.output
    assert "not certified" in failed.stderr and "--calibrate" in failed.stderr
    calibrated = CliRunner().invoke(app, [*command, "-o", str(tmp_path / "out"), "--calibrate"])
    assert calibrated.exit_code == 0, calibrated.output


def test_bf16_calibration_measures_a_weight_normed_conv(tmp_path: Path) -> None:
    """wav2vec2's positional conv is weight-normed: its weight lives in a parametrization's
    container, a child module, and the file names it `...conv.parametrizations.weight.original0`.
    Calibration still recomputes the conv in bf16 and, where that is wrong, keeps the conv
    (not the container) fp32. At 8 channels per group oneDNN's bf16 grouped conv is wrong on
    CPUs with AMX: there the uncalibrated plan fails its certificate and the calibrated one
    passes, with the plain load upcast to fp32 so that it keeps the island's numbers too;
    elsewhere the conv is measured, within bounds, and stays bf16."""
    from precision_convert.conversion.analysis.activations import BF16_LOSS_LIMIT, LEAF

    source = tmp_path / "wav2vec2"
    torch.manual_seed(0)
    _models.wav2vec2(hidden_size=32).eval().save_pretrained(source)
    conv = "encoder.pos_conv_embed.conv"

    result = convert(source, to="bf16-safe", output=tmp_path / "out", calibrate=True)
    calibration = result.components[0].calibration
    measured = calibration.stats[conv]
    assert measured.kind == LEAF and measured.low_precision_error > 0
    wrong_here = measured.low_precision_error > BF16_LOSS_LIMIT
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    islands = config["precision_convert"]["islands"]
    assert (islands.get(conv) == "precision") is wrong_here
    assert not any("parametrizations" in name for name in islands)
    assert result.certificate.verdict == "pass", result.certificate.failures
    assert config["dtype"] == ("float32" if wrong_here else "bfloat16")

    plain = convert(source, to="bf16-safe", output=tmp_path / "plain")
    assert plain.certificate.verdict == ("fail" if wrong_here else "pass")


def test_a_tensor_changed_in_place_after_it_was_recorded_is_recorded_again() -> None:
    """The recorder reduces each tensor once per forward (an input is mostly another module's
    output); one changed in place since (a residual added into it) must not keep its old
    reduction: here the block's output is its linear's output scaled past fp16's limit."""
    from precision_convert.conversion.analysis.activations import calibrate

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).mul_(1e6)

    block = Block()
    x = torch.ones(2, 4)
    stats, out = calibrate(block, lambda: block(x))
    assert stats["linear"].max_out < 10
    assert stats[""].max_out == float(out.abs().max()) > FP16_MAX
    assert stats[""].main_out == stats[""].max_out
