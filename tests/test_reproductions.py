"""Reproductions: the dtype-boundary failures users hit with low-precision copies (T5's fp32
``wo`` before a fused RMSNorm, CogVLM's fp16 weights with fp32 biases, OpenCLIP's bf16 LayerNorm,
OneTrainer's fp32 side inputs), each shown failing without the loader and running with it.

Every model is a real transformers / diffusers / open_clip architecture with a tiny config; every
conversion goes through the real converter (API or CLI); every overflow is real arithmetic on
scaled weights, never a faked output.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import _models
import pytest
import torch
from _loader_helpers import (
    FusedRMSNorm,
    cogvlm_style,
    convert_to,
    cosine,
    fp32_reference,
    llama_with_overflow,
    psnr,
    record,
    stored_dtypes,
    t5_with_fused_norm,
)

import precision_convert as pc
from precision_convert.conversion.runtime.boundaries import (
    CAST_INPUTS,
    CAST_OUTPUTS,
    PROMOTE_MIXED,
    boundary_hooks,
    find_boundaries,
    hook_names,
)
from precision_convert.core.errors import InputError

#: CPU and CUDA spell the fused-norm dtype refusal differently.
NORM_REFUSES = r"expect parameter to have scalar type of Float|expected scalar type Float"


def test_t5_fp32_wo_meets_a_fused_norm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CogVideoX: an fp32 ``wo`` promotes T5's residual stream; a fused fp16 norm refuses it."""
    from transformers import T5EncoderModel
    from transformers.models.t5 import modeling_t5

    monkeypatch.setattr(modeling_t5, "T5LayerNorm", FusedRMSNorm)
    source = t5_with_fused_norm(tmp_path / "t5")
    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = T5EncoderModel.from_pretrained(source).eval()(input_ids=ids).last_hidden_state

        # transformers' own fp16 load keeps wo in fp32 (_keep_in_fp32_modules): the real error.
        plain = T5EncoderModel.from_pretrained(source, dtype=torch.float16).eval()
        assert plain.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
        with pytest.raises(RuntimeError, match=NORM_REFUSES):
            plain(input_ids=ids)

        converted = convert_to(source, "fp16-safe", tmp_path / "t5-fp16-safe")
        loaded = pc.load(converted)
        assert isinstance(loaded.encoder.final_layer_norm, FusedRMSNorm)
        got = loaded(input_ids=ids).last_hidden_state
    assert got.dtype == torch.float16
    assert torch.isfinite(got).all()
    assert cosine(got, expected) >= 0.999


def test_cogvlm_fp16_weights_with_fp32_biases(tmp_path: Path) -> None:
    """CogVLM / CogAgent: a module whose weight is fp16 and whose bias is fp32."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = cogvlm_style(tmp_path / "cogvlm")
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 5), generator=generator)
    pixels = torch.randn(2, 3, 8, 8, generator=generator)
    reference = fp32_reference(source)
    with torch.no_grad():
        expected = reference(input_ids=ids, pixel_values=pixels)

        # The stored dtypes as they are: the real error.
        raw = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
        raw.load_state_dict(load_file(source / "model.safetensors"), assign=True)
        with pytest.raises(RuntimeError, match=r"Input type \(c10::Half\) and bias type"):
            raw(input_ids=ids, pixel_values=pixels.half())

    hazards = pc.inspect(source).components[0].hazards
    flagged = {h.name for h in hazards if h.kind == "mixed-dtype"}
    assert {"patch_embed", "vision_proj", "mlp", "lm_head", "norm"} <= flagged
    with pytest.raises(InputError, match=r"patch_embed.*different dtypes"):
        pc.load(source, trust_remote_code=True)

    converted = convert_to(source, "fp16-safe", tmp_path / "cogvlm-fp16-safe",
                           trust_remote_code=True)  # fmt: skip
    per_module: dict[str, set[torch.dtype]] = {}
    for name, dtype in stored_dtypes(converted).items():
        per_module.setdefault(name.rpartition(".")[0], set()).add(dtype)
    assert all(len(dtypes) == 1 for dtypes in per_module.values()), per_module

    with pytest.raises(InputError, match="trust_remote_code"):
        pc.load(converted)
    loaded = pc.load(converted, trust_remote_code=True)
    with torch.no_grad():
        got = loaded(input_ids=ids, pixel_values=pixels)  # fp32 pixels into an fp16 conv
    assert torch.isfinite(got).all()
    assert cosine(got, expected) >= 0.999


def test_openclip_bf16_outside_layernormfp32(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """OpenCLIP: weights cast to bf16 around LayerNormFp32 make it refuse its input."""
    open_clip = pytest.importorskip("open_clip", reason="open_clip_torch is not installed")
    source = tiny_model("openclip")
    generator = torch.Generator().manual_seed(3)
    image = torch.randn(2, 3, 32, 32, generator=generator)
    text = torch.randint(2, 128, (2, 16), generator=generator)
    with torch.no_grad():
        reference = open_clip.create_model(f"local-dir:{source}").eval()
        expected = reference.encode_image(image), reference.encode_text(text)

        broken = open_clip.create_model(f"local-dir:{source}", precision="bf16")
        broken = broken.to(torch.bfloat16).eval()
        with pytest.raises(RuntimeError, match=NORM_REFUSES):
            broken.encode_image(image.bfloat16())

        converted = convert_to(source, "bf16-safe", tmp_path / "openclip-bf16-safe")
        loaded = pc.load(converted)
        assert loaded.visual.ln_pre.weight.dtype == torch.float32
        assert loaded.visual.conv1.weight.dtype == torch.bfloat16
        ours = loaded.encode_image(image), loaded.encode_text(text)

        own = open_clip.create_model(f"local-dir:{converted}", precision="bf16").eval()
        theirs = own.encode_image(image.bfloat16()), own.encode_text(text)
    for got in (*ours, *theirs):
        assert torch.isfinite(got).all()
    for got, want in zip(ours, expected, strict=True):
        assert cosine(got, want) >= 0.999
    for got, want in zip(theirs, expected, strict=True):
        assert cosine(got, want) >= 0.999


def _masked_unet(path: Path) -> Path:
    """An inpainting-style UNet: 4 latent channels plus 1 mask channel in, 4 out."""
    torch.manual_seed(0)
    _models.unet(
        in_channels=5, block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=16
    ).save_pretrained(path)
    return path


def test_onetrainer_fp32_side_inputs(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    """OneTrainer: fp32 timesteps, text states and a mask concatenated to fp16 latents."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    unet_source, vae_source = _masked_unet(tmp_path / "unet"), tiny_model("autoencoder-kl")
    generator = torch.Generator().manual_seed(4)
    latents = torch.randn(1, 4, 16, 16, generator=generator).half()
    mask = (torch.rand(1, 1, 16, 16, generator=generator) > 0.5).float()
    sample = torch.cat([latents, mask], dim=1)  # type promotion: fp32
    timestep = torch.tensor([500.0])
    text = torch.randn(1, 6, 16, generator=generator)
    z = torch.randn(1, 4, 16, 16, generator=generator)
    assert sample.dtype == torch.float32
    with torch.no_grad():
        expected = UNet2DConditionModel.from_pretrained(unet_source)(sample, timestep, text).sample
        expected_image = AutoencoderKL.from_pretrained(vae_source).decode(z).sample

        plain_unet = UNet2DConditionModel.from_pretrained(unet_source, dtype=torch.float16)
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 must have the same dtype|bias type"):
            plain_unet(sample, timestep, text)
        plain_vae = AutoencoderKL.from_pretrained(vae_source, dtype=torch.float16)
        with pytest.raises(RuntimeError, match=r"Input type \(float\) and bias type"):
            plain_vae.decode(z)

        unet = pc.load(convert_to(unet_source, "fp16-safe", tmp_path / "unet-fp16-safe"))
        vae = pc.load(convert_to(vae_source, "fp16-safe", tmp_path / "vae-fp16-safe"))
        assert unet.time_embedding.linear_1.weight.dtype == torch.float32
        assert unet.conv_in.weight.dtype == torch.float16
        got = unet(sample, timestep, encoder_hidden_states=text).sample
        image = vae.decode(z).sample
    assert torch.isfinite(got).all() and torch.isfinite(image).all()
    assert cosine(got, expected) >= 0.99
    assert psnr(image.float().clamp(-1, 1), expected_image.clamp(-1, 1)) >= 30


def test_user_island_on_an_attention_output(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """An island no recipe knows: ``--keep-fp32`` on one attention ``o`` inside an fp16 T5."""
    from transformers import T5EncoderModel
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    source, island = tiny_model("t5-encoder"), "encoder.block.0.layer.0.SelfAttention.o"
    converted = tmp_path / "t5-fp16-safe"
    result = CliRunner().invoke(
        app,
        ["model", str(source), "--to", "fp16-safe", "-o", str(converted), "--no-validate",
         "--keep-fp32", island],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert record(converted)["islands"][island] == "user"

    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = T5EncoderModel.from_pretrained(source).eval()
        expected = reference(input_ids=ids).last_hidden_state

        plain = T5EncoderModel.from_pretrained(source).half().eval()
        plain.get_submodule(island).float()
        with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype"):
            plain(input_ids=ids)

        loaded = pc.load(converted)
        got = loaded(input_ids=ids).last_hidden_state
    # A user island is treated like a range island: its fp32 output flows on, uncast.
    assert hook_names(loaded.get_submodule(island)) == (CAST_INPUTS,)
    assert PROMOTE_MIXED in hook_names(loaded.get_submodule(island.rpartition(".")[0]))
    assert torch.isfinite(got).all()
    assert cosine(got, expected) >= 0.999


def test_range_island_output_flows_in_fp32(tmp_path: Path) -> None:
    """A module whose outputs really exceed 65504 stays fp32, and so must its output."""
    from transformers import LlamaForCausalLM

    source = llama_with_overflow(tmp_path / "llama")
    island = "model.layers.0.mlp.down_proj"
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(6))
    peaks: list[float] = []
    with torch.no_grad():
        reference = LlamaForCausalLM.from_pretrained(source).eval()
        handle = reference.get_submodule(island).register_forward_hook(
            lambda module, args, output: peaks.append(output.abs().max().item())
        )
        expected = reference(input_ids=ids).logits
        handle.remove()
        assert peaks[0] > 65504, "the island's activations must really leave fp16's range"

        plain = LlamaForCausalLM.from_pretrained(source, dtype=torch.float16).eval()
        assert not torch.isfinite(plain(input_ids=ids).logits).all()

        converted = convert_to(source, "fp16-safe", tmp_path / "llama-fp16-safe")
        islands = record(converted)["islands"]
        assert islands[island] == "range"
        loaded = pc.load(converted)
        got = loaded(input_ids=ids).logits
        assert hook_names(loaded.get_submodule(island)) == (CAST_INPUTS,)
        assert torch.isfinite(got).all()
        assert cosine(got, expected) >= 0.999

        # Handing the island's output back in fp16, as a precision island would, overflows.
        cast_back = find_boundaries(
            loaded, compute=torch.float16, reasons={**islands, island: "precision"}
        )
        with boundary_hooks(loaded, cast_back):
            assert CAST_OUTPUTS in hook_names(loaded.get_submodule(island))
            assert not torch.isfinite(loaded(input_ids=ids).logits).all()
