"""Diffusers pipelines as published: every component's config shrunk in depth and width only.

Each pipeline is assembled from its published components (cited per config) and written with
``save_pretrained``, so ``model_index.json``, the component folders, the schedulers' configs
and the tokenizers are laid out as the Hub repository's are. Widths that one component hands
another stay consistent (a UNet's ``cross_attention_dim`` is its text encoders' hidden sizes,
SDXL's ``projection_class_embeddings_input_dim`` is the pooled projection plus six time
embeddings), as they are in the published checkpoints.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._build import dtype_of, scaled, seeded, transformers_model
from .encoders import (
    CLIP_BIGG_TEXT,
    CLIP_L14,
    CLIP_L14_TEXT,
    CLIP_L14_VISION,
    T5_V1_1_XXL_ENCODER,
    clip_text,
    clip_tokenizer,
    t5_tokenizer,
)

# --- shared VAE and text-encoder sizes ---------------------------------------------------------
#: CLIP text towers in pipelines: 32 wide (ViT-L/14's and bigG's alike).
CLIP_HIDDEN = 32
#: T5 XXL's encoder in pipelines: 64 wide, so SD3's 2 x 32 CLIP states fit its joint width.
T5_SIZES = {
    "d_model": 64,
    "d_ff": 160,
    "d_kv": 8,
    "num_heads": 8,
    "num_layers": 2,
    "num_decoder_layers": 2,
}
#: The Stable Diffusion VAE family shrunk: four levels as published, 8 channels each in 2
#: GroupNorm groups (4 channels a group, as the published first level's 128 in 32), one
#: ResNet per level. Decoding full-size images (video frames) is most of a pipeline's CPU time.
VAE_SIZES = {"block_out_channels": [8, 8, 8, 8], "norm_num_groups": 2, "layers_per_block": 1}


def diffusers_model(cls: type, config: dict[str, Any], seed: int) -> Any:
    """``cls`` from ``config`` (``_``-keys ignored), seeded, stored in its ``torch_dtype``."""
    values = {k: v for k, v in config.items() if not k.startswith("_") and k != "torch_dtype"}
    with seeded(seed):
        model = cls.from_config(values)
    # diffusers' own ``to(dtype)`` warns that modules "should be kept in float32: []" even
    # when the class keeps none; the module's cast of its floating-point tensors is the same.
    return torch.nn.Module.to(model, dtype_of(config.get("torch_dtype"))).eval()


TokenizerWriter = Callable[[Path], None]


def _loaded(write: TokenizerWriter) -> Any:
    """The tokenizer ``write`` makes, loaded as a pipeline loads it."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        write(Path(folder))
        return AutoTokenizer.from_pretrained(folder)


def _save(pipe: Any, path: Path, tokenizers: dict[str, TokenizerWriter], **kwargs: Any) -> Path:
    """Save ``pipe``, then replace each tokenizer folder by the files the family ships (e.g.
    CogVideoX's slow-only T5 tokenizer, which ``save_pretrained`` would add a tokenizer.json to).
    """
    pipe.save_pretrained(path, **kwargs)
    for folder, write in tokenizers.items():
        shutil.rmtree(path / folder)
        write(path / folder)
    return path


def _reshard(model: Any, folder: Path, max_shard_size: str) -> None:
    """Re-save one component in shards with an index, as the published repository has it."""
    for old in folder.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(folder, max_shard_size=max_shard_size)


def _clip(pad_token: str = "<|endoftext|>") -> TokenizerWriter:
    return lambda folder: clip_tokenizer(folder, pad_token)


def _t5(*, fast: bool, model_max_length: int = 512) -> TokenizerWriter:
    return lambda folder: t5_tokenizer(folder, fast=fast, model_max_length=model_max_length)


# --- Stable Diffusion 1.5 -------------------------------------------------------------------
# https://huggingface.co/stable-diffusion-v1-5/stable-diffusion-v1-5 (formerly
# runwayml/stable-diffusion-v1-5): unet/config.json as mirrored with "_name_or_path":
# "runwayml/stable-diffusion-v1-5" in
# https://huggingface.co/Norod78/sd15-muppet-blip/blame/51d953df/unet/config.json.
SD15_UNET: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": [
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ],
    "upcast_attention": False,
    "use_linear_projection": False,
}
# vae/config.json of the same repository.
SD15_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
# scheduler/scheduler_config.json of the same repository.
SD15_SCHEDULER: dict[str, Any] = {
    "_class_name": "PNDMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# The safety checker: https://huggingface.co/CompVis/stable-diffusion-safety-checker (CLIP
# ViT-L/14's configs under "StableDiffusionSafetyChecker").
SAFETY_CHECKER: dict[str, Any] = {
    **CLIP_L14,
    "architectures": ["StableDiffusionSafetyChecker"],
}
#: The SD 1.x UNet shrunk: four levels of 32/64/64/64 channels (GroupNorm's 32 groups kept),
#: one ResNet per level, cross-attention at the text encoder's width.
SD15_UNET_SIZES = {
    "block_out_channels": [32, 64, 64, 64],
    "layers_per_block": 1,
    "cross_attention_dim": CLIP_HIDDEN,
}


def _safety_checker(seed: int) -> Any:
    from diffusers.pipelines.stable_diffusion.safety_checker import (
        StableDiffusionSafetyChecker,
    )
    from transformers import CLIPConfig

    values = {
        **SAFETY_CHECKER,
        "projection_dim": 16,
        "text_config": scaled(CLIP_L14_TEXT, projection_dim=16, **CLIP_SIZES_TEXT),
        "vision_config": scaled(CLIP_L14_VISION, projection_dim=16, **CLIP_SIZES_VISION),
    }
    config = CLIPConfig(**{k: v for k, v in values.items() if k != "torch_dtype"})
    with seeded(seed):
        return StableDiffusionSafetyChecker(config).eval()


CLIP_SIZES_TEXT = {
    "hidden_size": CLIP_HIDDEN,
    "intermediate_size": 4 * CLIP_HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
CLIP_SIZES_VISION = {
    "hidden_size": 32,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def stable_diffusion_1_5(path: Path) -> Path:
    """Stable Diffusion 1.5: UNet, VAE, CLIP ViT-L/14 text encoder, PNDM scheduler, safety
    checker and its image processor; fp32 as the repository's main weights are."""
    from diffusers import (
        AutoencoderKL,
        PNDMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPImageProcessor

    text = {**clip_text(CLIP_L14_TEXT), "architectures": ["CLIPTextModel"]}
    pipe = StableDiffusionPipeline(
        unet=diffusers_model(UNet2DConditionModel, scaled(SD15_UNET, **SD15_UNET_SIZES), 0),
        vae=diffusers_model(AutoencoderKL, scaled(SD15_VAE, **VAE_SIZES), 1),
        text_encoder=transformers_model(text, 2),
        tokenizer=_loaded(_clip()),
        scheduler=PNDMScheduler.from_config(SD15_SCHEDULER),
        safety_checker=_safety_checker(3),
        feature_extractor=CLIPImageProcessor(crop_size=224, size=224),
        requires_safety_checker=True,
    )
    return _save(pipe, path, {"tokenizer": _clip()})


# --- Stable Diffusion XL ----------------------------------------------------------------------
# https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0: unet/config.json as
# mirrored with "_name_or_path": "stabilityai/stable-diffusion-xl-base-1.0" in
# https://huggingface.co/GiantAnalytics/sdxl_fine_tuned_model_aditya_2/commit/8b19acf0.
SDXL_UNET: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "class_embed_type": None,
    "class_embeddings_concat": False,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "cross_attention_dim": 2048,
    "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default",
    "sample_size": 128,
    "time_cond_proj_dim": None,
    "time_embedding_act_fn": None,
    "time_embedding_dim": None,
    "time_embedding_type": "positional",
    "timestep_post_act": None,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None,
    "use_linear_projection": True,
}
# vae/config.json of the same repository (madebyollin's fp16-unsafe SDXL VAE: force_upcast).
SDXL_VAE: dict[str, Any] = {
    **SD15_VAE,
    "force_upcast": True,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
}
# scheduler/scheduler_config.json of the same repository.
SDXL_SCHEDULER: dict[str, Any] = {
    "_class_name": "EulerDiscreteScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
#: SDXL's time conditioning width shrunk; the UNet's added-embedding input is bigG's pooled
#: projection plus six of them (original size, crop, target size), as 1280 + 6 x 256 = 2816.
SDXL_TIME_DIM = 8


def stable_diffusion_xl(path: Path) -> Path:
    """SDXL base: UNet with text-time conditioning, VAE with ``force_upcast``, CLIP ViT-L/14
    and bigG text encoders (the second with projection, its tokenizer padding with ``!``)."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    unet = scaled(
        SDXL_UNET,
        block_out_channels=[32, 64, 128],
        attention_head_dim=[1, 2, 4],  # heads per level: 32-wide heads, as the published 64
        transformer_layers_per_block=[1, 1, 2],
        layers_per_block=1,
        cross_attention_dim=2 * CLIP_HIDDEN,  # both text encoders' hidden states, concatenated
        addition_time_embed_dim=SDXL_TIME_DIM,
        projection_class_embeddings_input_dim=CLIP_HIDDEN + 6 * SDXL_TIME_DIM,
    )
    text = {**clip_text(CLIP_L14_TEXT), "architectures": ["CLIPTextModel"]}
    text_2 = clip_text(CLIP_BIGG_TEXT, projection_dim=CLIP_HIDDEN)
    tokenizers = {"tokenizer": _clip(), "tokenizer_2": _clip("!")}
    pipe = StableDiffusionXLPipeline(
        unet=diffusers_model(UNet2DConditionModel, unet, 0),
        vae=diffusers_model(AutoencoderKL, scaled(SDXL_VAE, **VAE_SIZES), 1),
        text_encoder=transformers_model(text, 2),
        text_encoder_2=transformers_model(text_2, 3),
        scheduler=EulerDiscreteScheduler.from_config(SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
        **{name: _loaded(write) for name, write in tokenizers.items()},
    )
    return _save(pipe, path, tokenizers)


# --- Stable Diffusion 3 -----------------------------------------------------------------------
# https://huggingface.co/stabilityai/stable-diffusion-3-medium-diffusers: transformer/config.json
# as re-uploaded in https://huggingface.co/v2ray/stable-diffusion-3-medium-diffusers ("a
# reupload from the official repo").
SD3_TRANSFORMER: dict[str, Any] = {
    "_class_name": "SD3Transformer2DModel",
    "attention_head_dim": 64,
    "caption_projection_dim": 1536,
    "in_channels": 16,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 24,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 192,
    "sample_size": 128,
    "torch_dtype": "float16",
}
# vae/config.json of the same repository: 16 latent channels, no quant convs.
SD3_VAE: dict[str, Any] = {
    **SD15_VAE,
    "force_upcast": True,
    "latent_channels": 16,
    "latents_mean": None,
    "latents_std": None,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
    "torch_dtype": "float16",
}
SD3_SCHEDULER: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
}


def stable_diffusion_3(path: Path) -> Path:
    """SD3 medium: MMDiT transformer, 16-channel VAE, CLIP-L and bigG (both with projection)
    and T5 XXL's encoder; fp16 as published."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    heads, head_dim = 2, 16
    transformer = scaled(
        SD3_TRANSFORMER,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        num_layers=2,
        caption_projection_dim=heads * head_dim,
        joint_attention_dim=T5_SIZES["d_model"],
        pooled_projection_dim=2 * CLIP_HIDDEN,  # both CLIP projections, concatenated
    )
    fp16 = {"torch_dtype": "float16"}
    text = {
        **clip_text(CLIP_L14_TEXT, projection_dim=CLIP_HIDDEN),
        "architectures": ["CLIPTextModelWithProjection"],
        **fp16,
    }
    text_2 = {**clip_text(CLIP_BIGG_TEXT, projection_dim=CLIP_HIDDEN), **fp16}
    text_3 = {**scaled(T5_V1_1_XXL_ENCODER, **T5_SIZES), **fp16}
    tokenizers = {"tokenizer": _clip(), "tokenizer_2": _clip("!"), "tokenizer_3": _t5(fast=True)}
    pipe = StableDiffusion3Pipeline(
        transformer=diffusers_model(SD3Transformer2DModel, transformer, 0),
        vae=diffusers_model(AutoencoderKL, scaled(SD3_VAE, **VAE_SIZES), 1),
        text_encoder=transformers_model(text, 2),
        text_encoder_2=transformers_model(text_2, 3),
        text_encoder_3=transformers_model(text_3, 4),
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(SD3_SCHEDULER),
        **{name: _loaded(write) for name, write in tokenizers.items()},
    )
    return _save(pipe, path, tokenizers)


# --- Flux -------------------------------------------------------------------------------------
# https://huggingface.co/black-forest-labs/FLUX.1-dev: transformer/config.json as mirrored
# from its snapshot 0ef5fff7 in
# https://huggingface.co/reshamgaire/flux-dev-orignal/blob/main/transformer/config.json.
FLUX_TRANSFORMER: dict[str, Any] = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
    "torch_dtype": "bfloat16",
}
FLUX_VAE: dict[str, Any] = {
    **SD3_VAE,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "torch_dtype": "bfloat16",
}
FLUX_SCHEDULER: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def flux_1_dev(path: Path) -> Path:
    """FLUX.1-dev: double- and single-stream blocks with 3-axis rope and guidance embedding,
    16-channel VAE, CLIP-L (pooled) and T5 XXL text encoders; bf16, the transformer and T5
    sharded as published."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    transformer = scaled(
        FLUX_TRANSFORMER,
        attention_head_dim=16,
        num_attention_heads=2,
        num_layers=1,
        num_single_layers=2,
        axes_dims_rope=[4, 6, 6],  # sums to the head width, as 16 + 56 + 56 = 128
        joint_attention_dim=T5_SIZES["d_model"],
        pooled_projection_dim=CLIP_HIDDEN,  # CLIP-L's pooled output
    )
    bf16 = {"torch_dtype": "bfloat16"}
    text = {**clip_text(CLIP_L14_TEXT), "architectures": ["CLIPTextModel"], **bf16}
    text_2 = {**scaled(T5_V1_1_XXL_ENCODER, **T5_SIZES), **bf16}
    tokenizers = {"tokenizer": _clip(), "tokenizer_2": _t5(fast=True)}
    pipe = FluxPipeline(
        transformer=diffusers_model(FluxTransformer2DModel, transformer, 0),
        vae=diffusers_model(AutoencoderKL, scaled(FLUX_VAE, **VAE_SIZES), 1),
        text_encoder=transformers_model(text, 2),
        text_encoder_2=transformers_model(text_2, 3),
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(FLUX_SCHEDULER),
        **{name: _loaded(write) for name, write in tokenizers.items()},
    )
    _save(pipe, path, tokenizers)
    _reshard(pipe.transformer, path / "transformer", "80KB")
    _reshard(pipe.text_encoder_2, path / "text_encoder_2", "1MB")
    return path


# --- CogVideoX --------------------------------------------------------------------------------
# https://huggingface.co/THUDM/CogVideoX-5b: transformer/config.json as mirrored from its
# snapshot 8fc5b281 in
# https://huggingface.co/thu-ml/CogVideoX-RIFLEx-diffusers/blob/refs%2Fpr%2F1/transformer/config.json.
COGVIDEOX_5B_TRANSFORMER: dict[str, Any] = {
    "_class_name": "CogVideoXTransformer3DModel",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 64,
    "dropout": 0.0,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 16,
    "max_text_seq_length": 226,
    "norm_elementwise_affine": True,
    "norm_eps": 1e-05,
    "num_attention_heads": 48,
    "num_layers": 42,
    "out_channels": 16,
    "patch_size": 2,
    "sample_frames": 49,
    "sample_height": 60,
    "sample_width": 90,
    "spatial_interpolation_scale": 1.875,
    "temporal_compression_ratio": 4,
    "temporal_interpolation_scale": 1.0,
    "text_embed_dim": 4096,
    "time_embed_dim": 512,
    "timestep_activation_fn": "silu",
    "use_learned_positional_embeddings": False,
    "use_rotary_positional_embeddings": True,
    "torch_dtype": "bfloat16",
}
# vae/config.json of the same repository.
COGVIDEOX_5B_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKLCogVideoX",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 256, 512],
    "down_block_types": ["CogVideoXDownBlock3D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "latents_mean": None,
    "latents_std": None,
    "layers_per_block": 3,
    "norm_eps": 1e-06,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_height": 480,
    "sample_width": 720,
    "scaling_factor": 0.7,
    "shift_factor": None,
    "temporal_compression_ratio": 4,
    "up_block_types": ["CogVideoXUpBlock3D"] * 4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
    "torch_dtype": "bfloat16",
}
# scheduler/scheduler_config.json of the same repository.
COGVIDEOX_SCHEDULER: dict[str, Any] = {
    "_class_name": "CogVideoXDDIMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "clip_sample_range": 1.0,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "sample_max_value": 1.0,
    "set_alpha_to_one": True,
    "snr_shift_scale": 1.0,
    "steps_offset": 0,
    "timestep_spacing": "trailing",
    "trained_betas": None,
}


def cogvideox_5b(path: Path) -> Path:
    """CogVideoX-5B: 3-D transformer with rotary positions, causal 3-D VAE, T5 XXL's encoder
    with the slow T5 tokenizer only (226 tokens); bf16 as published."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    transformer = scaled(
        COGVIDEOX_5B_TRANSFORMER,
        attention_head_dim=16,
        num_attention_heads=2,
        num_layers=2,
        text_embed_dim=T5_SIZES["d_model"],
        time_embed_dim=16,
    )
    vae = scaled(COGVIDEOX_5B_VAE, **VAE_SIZES)
    text = {**scaled(T5_V1_1_XXL_ENCODER, **T5_SIZES), "torch_dtype": "bfloat16"}
    tokenizer = _t5(fast=False, model_max_length=226)
    pipe = CogVideoXPipeline(
        transformer=diffusers_model(CogVideoXTransformer3DModel, transformer, 0),
        vae=diffusers_model(AutoencoderKLCogVideoX, vae, 1),
        text_encoder=transformers_model(text, 2),
        tokenizer=_loaded(tokenizer),
        scheduler=CogVideoXDDIMScheduler.from_config(COGVIDEOX_SCHEDULER),
    )
    return _save(pipe, path, {"tokenizer": tokenizer})
