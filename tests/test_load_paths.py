"""Every way users load a converted checkpoint is certified or flagged.

Tiny real models, real conversions, real library loads: the numbers are compared with the fp32
source, and the files are re-opened the way a user would (``from_pretrained`` with default
arguments, ``dtype="auto"``, the explicit compute dtype, ``DiffusionPipeline.from_pretrained``).
Range islands are planted by scaling weights until fp16 really overflows.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _loader_helpers import record
from _models import generate, make, sd_pipeline
from huggingface_hub import ModelCard
from typer.testing import CliRunner

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.core.errors import CannotValidateError
from precision_convert.validation.certify.card import PC_LOAD_ONLY_TAG, PLAIN_TAG, render
from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    CERTIFICATE_NAME,
    Certificate,
)
from precision_convert.validation.certify.load_ways import RESAVED
from precision_convert.validation.certify.runner import validate
from precision_convert.validation.certify.verify import verify_files

#: Weight scale that makes a layer's outputs (and weights) leave fp16's range.
OVERFLOW = 1e6
#: Validation here needs no sweep: the point is how the files load, not the input space.
COVERAGE = "quick"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def psnr(image: torch.Tensor, reference: torch.Tensor, peak: float = 1.0) -> float:
    """PSNR in dB of images in [0, 1], as pipelines return them."""
    mse = (image.double() - reference.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def set_config_dtype(directory: Path, dtype: str) -> None:
    """What config.json said before plain loads were certified: the compute dtype, whatever
    the islands."""
    data = config(directory)
    data["dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(data, indent=2))


def ways(certificate: Certificate, component: str | None = None) -> dict[str, Any]:
    return {
        p.label: p for p in certificate.load_paths if component is None or p.component == component
    }


# --------------------------------------------------------------------------- transformers


def t5_with_range_island(path: Path) -> Path:
    """A T5 encoder whose first attention output projection overflows fp16 (x1e6).

    T5's ``wo`` would not do: transformers itself keeps it fp32 (``_keep_in_fp32_modules``),
    so flattening cannot hurt it. ``o`` is an island only this plan knows.
    """
    model = make("t5-encoder")
    with torch.no_grad():
        model.encoder.block[0].layer[0].SelfAttention.o.weight.mul_(OVERFLOW)
    model.save_pretrained(path)
    return path


def test_fp16_safe_t5_with_a_range_island_loads_plainly(tmp_path: Path) -> None:
    from transformers import T5EncoderModel

    source = t5_with_range_island(tmp_path / "src")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False)
    island = "encoder.block.0.layer.0.SelfAttention.o"
    written = config(out)
    assert written["precision_convert"]["islands"][island] == "range"
    assert written["precision_convert"]["compute_dtype"] == "float16"  # the record is the truth
    assert written["dtype"] == "float32"  # what a plain load reads

    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = T5EncoderModel.from_pretrained(source).eval()(input_ids=ids).last_hidden_state
        for kwargs in ({}, {"dtype": "auto"}):
            plain = T5EncoderModel.from_pretrained(out, **kwargs).eval()
            assert {p.dtype for p in plain.parameters()} == {torch.float32}
            got = plain(input_ids=ids).last_hidden_state
            assert torch.isfinite(got).all(), kwargs
            assert cosine(got, expected) >= 0.999, kwargs
        loaded = pc.load(out)
        assert loaded.get_submodule(island).weight.dtype == torch.float32
        assert torch.isfinite(loaded(input_ids=ids).last_hidden_state).all()

        # What the compute dtype in config.json gave before: islands flattened, all NaN.
        old = tmp_path / "old"
        shutil.copytree(out, old)
        set_config_dtype(old, "float16")
        broken = T5EncoderModel.from_pretrained(old).eval()(input_ids=ids).last_hidden_state
        assert not torch.isfinite(broken).any()

    certificate = validate(out, baseline=source, coverage=COVERAGE)
    assert certificate.verdict == "pass", certificate.failures
    found = ways(certificate, "")
    assert set(found) == {
        "pc.load",
        "plain",
        "auto",
        "compute",
        *RESAVED.values(),
        "pc.load+eager",
        "plain+eager",
    }
    assert found["plain+eager"].call == (
        'T5EncoderModel.from_pretrained("<repo>", attn_implementation="eager")'
    )
    assert found["plain+eager"].verdict == "pass" and found["plain+eager"].decides
    assert found["pc.load"].verdict == "pass" and found["pc.load"].decides
    assert set(found["pc.load"].dtypes) == {"float16", "float32"}
    assert found["plain"].verdict == "pass" and found["plain"].decides
    assert set(found["plain"].dtypes) == {"float32"}
    assert found["plain"].call == 'T5EncoderModel.from_pretrained("<repo>")'
    assert found["auto"].verdict == "pass" and not found["auto"].decides
    cosines = [m for m in found["plain"].metrics if m.metric == "cosine"]
    assert cosines and cosines[0].value >= 0.99 and cosines[0].threshold is not None
    # The explicit fp16 load flattens the island: recorded, shown, but not the verdict.
    assert found["compute"].verdict == "fail" and not found["compute"].decides
    assert "NaN/Inf" in found["compute"].failures[0]
    assert found["compute"].call.endswith("dtype=torch.float16)")
    # The user's round trip: pc.load, save_pretrained, load again; shown, never deciding.
    for way in RESAVED.values():
        assert found[way].verdict == "pass" and not found[way].decides, way
        assert "checked on 1 of" in (found[way].detail or "")
    assert found["resave:plain"].call == (
        'precision_convert.load("<repo>").save_pretrained("<dir>"); '
        'T5EncoderModel.from_pretrained("<dir>")'
    )
    assert set(found["resave:plain"].dtypes) == {"float32"}  # as the converted files' plain load
    assert found["resave:pc.load"].dtypes == found["pc.load"].dtypes

    on_disk = Certificate.read(out)
    assert on_disk.to_dict() == certificate.to_dict()
    assert verify_files(out, on_disk) == []
    card = ModelCard.load(out / CARD_NAME)
    assert PLAIN_TAG in card.data.tags
    assert card.data.to_dict()["precision_convert"]["loading"]["model"]["compute"] == "fail"
    assert "the memory saving is lost" in card.text
    assert "fp32 islands flattened" in card.text


def test_fp16_safe_t5_stays_fp16_where_transformers_keeps_the_island(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """T5's own ``wo`` range islands are kept fp32 by transformers: the plain load keeps
    the memory saving (config dtype float16) and stays finite."""
    from transformers import T5EncoderModel

    source = tiny_model("t5-encoder")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False)
    islands = config(out)["precision_convert"]["islands"]
    assert islands["encoder.block.0.layer.1.DenseReluDense.wo"] == "range"
    assert config(out)["dtype"] == "float16"
    plain = T5EncoderModel.from_pretrained(out).eval()
    assert plain.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    assert plain.shared.weight.dtype == torch.float16

    certificate = validate(out, baseline=source, coverage=COVERAGE)
    assert certificate.verdict == "pass", certificate.failures
    found = ways(certificate)
    assert found["plain"].verdict == "pass" and found["plain"].dtypes["float16"] > 0
    # transformers' default dtype is "auto": the same load, not run twice.
    assert found["auto"].verdict == "pass" and "same tensors" in (found["auto"].detail or "")


# --------------------------------------------------------------------------- diffusers


def sd3_with_range_island(path: Path) -> Path:
    model = make("sd3-transformer")
    with torch.no_grad():
        model.transformer_blocks[0].ff.net[2].weight.mul_(OVERFLOW)
    model.save_pretrained(path)
    return path


def test_fp16_safe_sd3_with_a_range_island_loads_plainly(tmp_path: Path) -> None:
    from diffusers import SD3Transformer2DModel

    source = sd3_with_range_island(tmp_path / "src")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False)
    assert record(out)["islands"]["transformer_blocks.0.ff.net.2"] == "range"

    generator = torch.Generator().manual_seed(2)
    inputs = {
        "hidden_states": torch.randn(1, 4, 16, 16, generator=generator),
        "encoder_hidden_states": torch.randn(1, 6, 32, generator=generator),
        "pooled_projections": torch.randn(1, 16, generator=generator),
        "timestep": torch.tensor([999]),
    }
    with torch.no_grad():
        expected = SD3Transformer2DModel.from_pretrained(source).eval()(**inputs).sample
        # diffusers' plain load upcasts to fp32: finite and close, the memory saving gone.
        plain = SD3Transformer2DModel.from_pretrained(out).eval()
        assert {p.dtype for p in plain.parameters()} == {torch.float32}
        got = plain(**inputs).sample
        assert torch.isfinite(got).all() and cosine(got, expected) >= 0.999
        # The explicit compute dtype flattens the range island: NaN/Inf.
        half = SD3Transformer2DModel.from_pretrained(out, dtype=torch.float16).eval()
        halved = {k: v.half() if v.is_floating_point() else v for k, v in inputs.items()}
        assert not torch.isfinite(half(**halved).sample).all()

    certificate = validate(out, baseline=source, coverage=COVERAGE)
    assert certificate.verdict == "pass", certificate.failures
    found = ways(certificate)
    assert found["plain"].verdict == "pass" and set(found["plain"].dtypes) == {"float32"}
    assert found["auto"].verdict == "not-checked"
    assert found["auto"].detail == "diffusers has no 'auto' dtype"
    assert found["compute"].verdict == "fail" and "NaN/Inf" in found["compute"].failures[0]
    card = ModelCard.load(out / CARD_NAME).text
    assert "not checked: diffusers has no 'auto' dtype" in card


def test_fp16_safe_pipeline_generates_like_fp32_through_plain_diffusers(tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    source = sd_pipeline(tmp_path / "src")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False)
    text_encoder = config(out / "text_encoder")
    assert text_encoder["precision_convert"]["compute_dtype"] == "float16"
    assert text_encoder["dtype"] == "float32"  # diffusers' components plain-load in fp32 too

    with torch.no_grad():
        expected = generate(DiffusionPipeline.from_pretrained(source))
        plain = DiffusionPipeline.from_pretrained(out)
        assert plain.unet.dtype == torch.float32 and plain.text_encoder.dtype == torch.float32
        for pipe in (plain, pc.load(out)):
            images = generate(pipe)
            assert torch.isfinite(images).all()
            assert psnr(images.float(), expected) >= 30

        # The compute dtype in the text encoder's config (before): fp16 prompt embeddings make
        # fp16 latents, and the UNet diffusers upcast to fp32 refuses them.
        old = tmp_path / "old"
        shutil.copytree(out, old)
        set_config_dtype(old / "text_encoder", "float16")
        with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
            generate(DiffusionPipeline.from_pretrained(old))

    certificate = validate(out, baseline=source, coverage=COVERAGE)
    assert certificate.verdict == "pass", certificate.failures
    whole = ways(certificate, "pipeline")
    assert whole["plain"].call == 'DiffusionPipeline.from_pretrained("<repo>")'
    assert whole["plain"].verdict == "pass" and whole["pc.load"].verdict == "pass"
    assert set(whole["plain"].dtypes) == {"float32"}
    assert any(m.metric == "psnr" and m.passed for m in whole["plain"].metrics)
    assert whole["auto"].verdict == "not-checked"
    for component in ("text_encoder", "unet", "vae"):
        assert ways(certificate, component)["plain"].verdict == "pass", component
        assert "resave:plain" not in ways(certificate, component)  # re-saved whole, below
    assert whole["resave:plain"].verdict == whole["resave:pc.load"].verdict == "pass"
    assert "resave:auto" in whole and whole["resave:auto"].verdict == "not-checked"
    card = ModelCard.load(out / CARD_NAME)
    assert PLAIN_TAG in card.data.tags
    assert "| pipeline | plain default | `DiffusionPipeline.from_pretrained" in card.text


# --------------------------------------------------------------------------- verdict and card


def test_a_broken_plain_load_fails_the_certificate(tmp_path: Path) -> None:
    """pc.load alone passing is not enough: the plain default load decides too."""
    source = t5_with_range_island(tmp_path / "src")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False)
    set_config_dtype(out, "float16")  # the plain load now flattens the range island
    certificate = validate(out, baseline=source, coverage=COVERAGE)
    found = ways(certificate)
    assert found["pc.load"].verdict == "pass"
    assert found["plain"].verdict == "fail" and "NaN/Inf" in found["plain"].failures[0]
    assert certificate.verdict == "fail"
    assert any("plain load `T5EncoderModel.from_pretrained" in f for f in certificate.failures)
    tags = ModelCard.load(out / CARD_NAME).data.tags
    assert PLAIN_TAG not in tags and PC_LOAD_ONLY_TAG not in tags


def test_blockwise_leaves_plain_loads_not_checked(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    source = tiny_model("llama")
    out = tmp_path / "out"
    convert(source, to="bf16-safe", output=out, validate=False)
    certificate = validate(out, baseline=source, max_memory="300KB", coverage=COVERAGE)
    assert certificate.components[0].mode == "blockwise"
    assert certificate.verdict == "pass", certificate.failures
    found = ways(certificate)
    assert found["pc.load"].verdict == "pass"
    for way in ("plain", "auto", "compute", *RESAVED.values()):
        assert found[way].verdict == "not-checked"
        assert "block by block" in (found[way].detail or "")
    tags = ModelCard.load(out / CARD_NAME).data.tags
    assert PC_LOAD_ONLY_TAG in tags and PLAIN_TAG not in tags


def test_open_clip_records_its_own_factory(tmp_path: Path) -> None:
    pytest.importorskip("open_clip", reason="open_clip_torch is not installed")
    from _models import open_clip_model

    source = open_clip_model(tmp_path / "src")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False)
    certificate = validate(out, baseline=source, coverage=COVERAGE)
    assert certificate.verdict == "pass", certificate.failures
    found = ways(certificate)
    assert found["plain"].call == 'open_clip.create_model("local-dir:<dir>")'
    assert found["plain"].verdict == "pass" and set(found["plain"].dtypes) == {"float32"}
    assert found["auto"].verdict == "not-checked"
    assert found["compute"].verdict == "pass" and "float16" in found["compute"].dtypes


def test_certificates_without_load_paths_still_read(tmp_path: Path) -> None:
    source = make("bert")
    source.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", to="bf16-safe", output=tmp_path / "out", validate=False)
    certificate = validate(tmp_path / "out", baseline=tmp_path / "src", coverage=COVERAGE)
    data = certificate.to_dict()
    assert Certificate.from_dict(data).to_dict() == data
    del data["load_paths"]  # as written before load paths existed
    old = Certificate.from_dict(data)
    assert old.load_paths == [] and old.passed
    card = ModelCard(render(old))
    assert PC_LOAD_ONLY_TAG in card.data.tags and PLAIN_TAG not in card.data.tags
    assert "Only `precision_convert.load` was checked" in card.text


# --------------------------------------------------------------------------- cannot validate


def ltx_video(path: Path) -> Path:
    """LTX-Video's transformer needs an ``encoder_attention_mask`` no input builder makes."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    ).save_pretrained(path)
    return path


def test_unvalidatable_model_still_gets_a_failing_certificate(tmp_path: Path) -> None:
    source = ltx_video(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(CannotValidateError, match="encoder_attention_mask"):
        convert(source, to="bf16-safe", output=out)
    certificate = Certificate.read(out)
    assert certificate.verdict == "fail"
    assert "encoder_attention_mask" in certificate.failures[0]
    assert "--inputs FILE" in certificate.failures[1]  # how to give it what is missing
    assert certificate.components[0].mode == "not-run"
    assert verify_files(out, certificate) == []  # every converted file hashed
    assert certificate.source["files"]
    card = ModelCard.load(out / CARD_NAME)
    assert not {PLAIN_TAG, PC_LOAD_ONLY_TAG} & set(card.data.tags)
    assert "## Why it failed" in card.text and "encoder_attention_mask" in card.text


def test_cli_model_exits_1_with_a_failing_certificate(tmp_path: Path) -> None:
    from precision_convert.cli.main import app

    source = ltx_video(tmp_path / "src")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["model", str(source), "--to", "bf16-safe", "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert "cannot validate" in result.stderr and "encoder_attention_mask" in result.stderr
    assert CERTIFICATE_NAME in result.stderr  # says where the explanation went
    assert Certificate.read(out).verdict == "fail"
    assert (out / CARD_NAME).is_file()


def test_remote_code_model_is_validated_only_when_trusted(tmp_path: Path) -> None:
    """A model that ships its own code: without --trust-remote-code validation cannot build it
    and says how to allow it (exit 1, failing certificate); with it the baseline, pc.load and
    the user's own ``AutoModel.from_pretrained(..., trust_remote_code=True)`` are all run."""
    from _loader_helpers import cogvlm_style
    from safetensors.torch import save_file

    from precision_convert.cli.main import app

    source = cogvlm_style(tmp_path / "source")
    generator = torch.Generator().manual_seed(0)
    inputs = tmp_path / "inputs.safetensors"
    save_file(
        {
            "input_ids": torch.randint(0, 64, (2, 5), generator=generator),
            "pixel_values": torch.randn(2, 3, 8, 8, generator=generator),
        },
        inputs,
    )
    out = tmp_path / "out"
    convert(source, to="bf16-safe", output=out, validate=False, trust_remote_code=True)
    command = ["validate", str(out), "--baseline", str(source), "--inputs", str(inputs)]

    refused = CliRunner().invoke(app, command)
    assert refused.exit_code == 1, refused.output
    certificate = Certificate.read(out)
    assert certificate.verdict == "fail"
    assert any("--trust-remote-code" in line for line in certificate.failures)

    trusted = CliRunner().invoke(app, [*command, "--trust-remote-code"])
    assert trusted.exit_code == 0, trusted.output
    certificate = Certificate.read(out)
    assert certificate.verdict == "pass", certificate.failures
    found = ways(certificate)
    assert found["plain"].call == 'AutoModel.from_pretrained("<repo>", trust_remote_code=True)'
    assert found["plain"].verdict == "pass" and found["pc.load"].verdict == "pass"
