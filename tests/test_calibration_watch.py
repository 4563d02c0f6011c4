"""Calibration watches everything that can overflow fp16.

Every module's output is judged, containers included (a decoder layer's output is the residual
stream, which no weighted module outputs), and so is what each weighted module receives. A
precision island whose fp32 output comes near 65504 becomes a range island, so the loader lets
that output flow in fp32 instead of casting it back.

Every overflow here is real: weights of tiny real architectures are set or scaled until the
fp32 activations pass the limit, and the plain fp16 model (or the old cast-back treatment) is
shown to break on the very inputs the converted model handles.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import _models
import pytest
import torch
from _loader_helpers import record

import precision_convert as pc
from precision_convert.api.conversion import convert, plan_model
from precision_convert.conversion.analysis.activations import (
    CONTAINER,
    LEAF,
    ActivationStats,
    calibrate,
    overflowing,
)
from precision_convert.conversion.io.source import open_source
from precision_convert.conversion.plan import Island
from precision_convert.conversion.runtime.boundaries import find_boundaries, install
from precision_convert.core.dtypes import FP16_MAX, FP16_RANGE
from precision_convert.validation.calibration.watch import CARRIED

NEAR = FP16_MAX / 2  # the activation margin: within 2x of fp16's limit


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
    )


def _stats(model: torch.nn.Module, run: Any) -> dict[str, ActivationStats]:
    stats, _ = calibrate(model, lambda: run(model))
    return stats


# --- (a) a residual stream near the limit that no weighted module outputs ------------------

LAYER0 = "model.layers.0"


def _residual_llama(path: Path) -> Path:
    """A Llama whose residual stream passes fp16's limit while every weighted module's own
    output stays below the 2x margin: channel 0 of the embedding (15k), of layer 0's attention
    output (15k) and MLP output (30k) and of layer 1's MLP output (10k) add up to 60k after
    layer 0 and 70k after layer 1, only in the stream (the residual adds are functional code)."""
    torch.manual_seed(0)
    model = _models.llama(tie_word_embeddings=False, attention_bias=True, mlp_bias=True).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 15000.0
        model.model.layers[0].self_attn.o_proj.bias[0] = 15000.0
        model.model.layers[0].mlp.down_proj.bias[0] = 30000.0
        model.model.layers[1].mlp.down_proj.bias[0] = 10000.0
    model.save_pretrained(path)
    return path


_IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_IDS).logits.float()


def test_residual_stream_near_the_limit_is_watched_and_carried_in_fp32(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    source = _residual_llama(tmp_path / "llama")
    fp32 = LlamaForCausalLM.from_pretrained(source).eval()
    stats = _stats(fp32, _logits)
    leaves = [s for s in stats.values() if s.kind == LEAF]
    # Real numbers: every weighted module's own output stays below the margin (30k at most)…
    assert max(s.max_out for s in leaves) < NEAR
    # The old rule sees nothing:
    assert overflowing(stats, [s.module for s in leaves], FP16_RANGE) == {}
    # …while the decoder layers' outputs, the residual stream, reach 60k and 70k.
    assert stats[LAYER0].kind == CONTAINER and NEAR < stats[LAYER0].main_out < FP16_MAX
    assert stats["model.layers.1"].main_out > FP16_MAX
    reference = _logits(fp32)
    assert reference.isfinite().all()
    plain = _logits(LlamaForCausalLM.from_pretrained(source).half().eval())
    assert not plain.isfinite().all()  # plain fp16 really overflows on these ids

    # inspect --calibrate names the decoder layer and its peak.
    report = pc.inspect(source, calibrate=True, chart=tmp_path / "c.png").components[0]
    assert report.calibration is not None
    assert any(
        w.startswith(f"{LAYER0} (container) output peaks at 6e+04")
        for w in report.calibration.warnings
    ), report.calibration.warnings

    result = convert(source, to="fp16-safe", output=tmp_path / "out", validate=False)
    component = result.components[0]
    calibration = component.calibration
    assert calibration is not None
    watched = {(w.module, w.side): w for w in calibration.near_limit}
    layer0 = watched[(LAYER0, "output")]
    assert layer0.kind == CONTAINER and layer0.peak == pytest.approx(60000, rel=1e-3)
    # Layer 0's MLP output projection, added into the stream last, now lets fp32 flow: the
    # stream is fp32 from there on, so layer 1 needs nothing.
    down = f"{LAYER0}.mlp.down_proj"
    assert layer0.outcome == CARRIED and layer0.islands == (down,)
    islands = {i.name: i for i in component.plan.islands}
    assert islands[down].reason == "range" and LAYER0 in islands[down].rule
    assert not any(
        n.startswith("model.layers.1.") and i.reason == "range" for n, i in islands.items()
    )
    assert all(w.outcome == CARRIED for w in calibration.near_limit)
    assert any(
        w.startswith(f"{LAYER0} (container) output peaks at 6e+04") for w in component.plan.warnings
    )
    assert calibration.passed is True

    converted = _logits(pc.load(tmp_path / "out"))
    assert converted.isfinite().all()
    assert _cosine(converted, reference) >= 0.99

    # bf16 has fp32's range: nothing is watched there, and the conversion stays close.
    bf16 = convert(source, to="bf16-safe", output=tmp_path / "bf16", validate=False, calibrate=True)
    assert bf16.components[0].calibration is not None
    assert bf16.components[0].calibration.near_limit == ()
    assert _cosine(_logits(pc.load(tmp_path / "bf16")), reference) >= 0.99


# --- (b) precision islands whose fp32 output overflows fp16 --------------------------------


def _reinstall_as_precision(model: torch.nn.Module, directory: Path, name: str) -> None:
    """The old treatment: the loader's hooks with ``name`` back as a precision island (its
    fp32 output cast to fp16), on the very same weights."""
    reasons = {**record(directory)["islands"], name: "precision"}
    install(model, find_boundaries(model, compute=torch.float16, reasons=reasons))


def _upgraded(result: Any, directory: Path, name: str) -> Island:
    plan = result.components[0].plan
    island = next(i for i in plan.islands if i.name == name)
    assert island.reason == "range" and island.rule.startswith("calibration: output peaks at")
    written = record(directory)
    assert written["islands"][name] == "range" and written["plan_sha256"] == plan.sha256
    # The upgrade is in the digest: the same plan with the precision island hashes otherwise.
    downgraded = tuple(
        replace(i, reason="precision") if i.name == name else i for i in plan.islands
    )
    assert replace(plan, islands=downgraded).sha256 != plan.sha256
    return island


K = 2e5  # time-embedding scale: its output reaches 8.3e4; every weight stays inside fp16


def _unet_overflowing_time_embedding(path: Path) -> Path:
    """A UNet whose time embedding (a precision island by the recipe) outputs 8.3e4: its
    last linear is scaled by K and each resnet's projection of it by 1/K."""
    model = _models.make("unet")
    with torch.no_grad():
        model.time_embedding.linear_2.weight.mul_(K)
        for name, module in model.named_modules():
            if name.endswith("time_emb_proj"):
                module.weight.div_(K)
    model.save_pretrained(path)
    return path


def _denoise(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 16, 16, generator=generator)
    states = torch.randn(2, 8, 24, generator=generator)
    with torch.no_grad():
        return model(sample, torch.full((2,), 500.0), encoder_hidden_states=states).sample.float()


def test_the_command_sums_up_the_spikes_its_islands_carry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The residual stream the islands carry in fp32 is what the verdict judges: ``model``
    says so in one line before the verdict (no warning each); ``--report full`` names each."""
    from precision_convert.cli._reports import print_conversion

    source = _residual_llama(tmp_path / "llama")
    result = convert(source, to="fp16-safe", output=tmp_path / "out", validate=False)
    calibration = result.components[0].calibration
    assert calibration is not None and calibration.accounted
    assert set(calibration.accounted) <= set(result.components[0].plan.warnings)
    assert any(w.startswith(f"{LAYER0} (container) output") for w in calibration.accounted)
    capsys.readouterr()
    print_conversion(result)
    said = capsys.readouterr().err
    assert not [w for w in calibration.accounted if w in said], said
    count = len(calibration.accounted)
    assert f"note: {count} activations near or past fp16's limit are kept in fp32" in said
    print_conversion(result, full=True)
    said = capsys.readouterr().err
    assert all(f"warning: {w}" in said for w in calibration.accounted), said


def test_precision_time_embedding_that_overflows_becomes_a_range_island(tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    source = _unet_overflowing_time_embedding(tmp_path / "unet")
    linear_2 = "time_embedding.linear_2"
    base, _ = plan_model(open_source(source), "fp16-safe")
    assert {i.name: i.reason for i in base.islands}[linear_2] == "precision"  # the recipe's
    fp32 = UNet2DConditionModel.from_pretrained(source).eval()
    stats = _stats(fp32, _denoise)
    assert stats[linear_2].max_out > FP16_MAX  # 8.3e4, really beyond fp16
    reference = _denoise(fp32)
    assert reference.isfinite().all()

    out = tmp_path / "out"
    result = convert(source, to="fp16-safe", output=out, validate=False)
    _upgraded(result, out, linear_2)
    calibration = result.components[0].calibration
    assert calibration is not None and calibration.passed is True
    assert any(w.startswith(f"{linear_2} (leaf) output peaks at 8.3") for w in calibration.warnings)

    converted = pc.load(out)
    assert next(converted.time_embedding.parameters()).dtype == torch.float32
    fixed = _denoise(converted)
    assert fixed.isfinite().all()
    assert _cosine(fixed, reference) >= 0.99
    _reinstall_as_precision(converted, out, linear_2)  # cast back to fp16: 8.3e4 -> inf
    assert not _denoise(converted).isfinite().all()


def test_normalization_island_that_overflows_becomes_a_range_island(tmp_path: Path) -> None:
    """A final RMSNorm (kept fp32 as a normalization layer) whose weight, 5e4, fits fp16 but
    whose output reaches ~1.5e5."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    source = _models.save("llama", tmp_path / "llama")
    weights = source / "model.safetensors"
    state = load_file(weights)
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], 5e4)
    save_file(state, weights, metadata={"format": "pt"})
    fp32 = LlamaForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))

    def logits(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()

    assert _stats(fp32, logits)["model.norm"].max_out > FP16_MAX
    reference = logits(fp32)

    out = tmp_path / "out"
    result = convert(source, to="fp16-safe", output=out, validate=False)
    island = _upgraded(result, out, "model.norm")
    assert "normalization layer" in island.rule
    converted = pc.load(out)
    fixed = logits(converted)
    assert fixed.isfinite().all()
    assert _cosine(fixed, reference) >= 0.99
    _reinstall_as_precision(converted, out, "model.norm")
    assert not logits(converted).isfinite().all()


# --- (c) both cases through the certificate ----------------------------------------------


@pytest.mark.parametrize("case", ["residual-stream", "precision-island"])
def test_overflow_cases_are_judged_by_the_certificate(tmp_path: Path, case: str) -> None:
    """What a user sees: plain fp16 is refused by its own certificate (NaN/Inf named),
    fp16-safe is certified (calibration made the islands that keep it finite), and bf16-safe
    is certified."""
    if case == "residual-stream":
        source = _residual_llama(tmp_path / "source")
    else:
        source = _unet_overflowing_time_embedding(tmp_path / "source")
    verdicts = {}
    for target in ("fp16", "fp16-safe", "bf16-safe"):
        result = convert(source, to=target, output=tmp_path / target, coverage="quick")
        assert result.certificate is not None
        verdicts[target] = result.certificate
    assert verdicts["fp16"].verdict == "fail"
    assert any("NaN/Inf" in line for line in verdicts["fp16"].failures), verdicts["fp16"].failures
    for target in ("fp16-safe", "bf16-safe"):
        assert verdicts[target].verdict == "pass", (target, verdicts[target].failures)
        assert verdicts[target].load_path("plain").verdict == "pass"
