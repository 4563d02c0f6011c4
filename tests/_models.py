"""Tiny real architectures built from configs and saved the way their libraries save them.

No weights can be downloaded here, so every test model is a real transformers / diffusers /
open_clip class with a small config, randomly initialized from a fixed seed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch


def _seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)


def t5_encoder(path: Path) -> Path:
    from transformers import T5Config, T5EncoderModel

    _seeded()
    config = T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
    )
    T5EncoderModel(config).save_pretrained(path)
    return path


def llama(path: Path, *, tie_word_embeddings: bool = True) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    _seeded()
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def bert(path: Path) -> Path:
    from transformers import BertConfig, BertModel

    _seeded()
    config = BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(path)
    return path


def clip(path: Path) -> Path:
    from transformers import CLIPConfig, CLIPModel

    _seeded()
    config = CLIPConfig(
        text_config={
            "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
        },
        projection_dim=16,
    )
    CLIPModel(config).save_pretrained(path)
    return path


OPEN_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 128, "width": 32, "heads": 2, "layers": 2},
}


def open_clip_model(path: Path) -> Path:
    """An OpenCLIP model in the Hub layout open_clip itself reads (config + safetensors)."""
    import open_clip
    from safetensors.torch import save_file

    _seeded()
    model = open_clip.model.CLIP(**OPEN_CLIP_CFG)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_cfg": OPEN_CLIP_CFG,
        "preprocess_cfg": {"mean": [0.48, 0.46, 0.41], "std": [0.27, 0.26, 0.28]},
    }
    (path / "open_clip_config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, path / "open_clip_model.safetensors")
    return path


def cogvideox_transformer(path: Path) -> Path:
    from diffusers import CogVideoXTransformer3DModel

    _seeded()
    CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=8, text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8,
    ).save_pretrained(path)
    return path


def unet(path: Path) -> Path:
    from diffusers import UNet2DConditionModel

    _seeded()
    UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=16,
        attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    ).save_pretrained(path)
    return path


def vae(path: Path) -> Path:
    from diffusers import AutoencoderKL

    _seeded()
    AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
        norm_num_groups=4, layers_per_block=1, sample_size=32,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    ).save_pretrained(path)
    return path


def clip_tokenizer(path: Path) -> Path:
    """A real CLIPTokenizer over a tiny byte-level vocabulary (no download)."""
    from transformers import CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in letters + [f"{c}</w>" for c in letters]:
        vocab[token] = len(vocab)
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(path)
    return path


def sd_pipeline(path: Path) -> Path:
    """A whole Stable-Diffusion-style pipeline: UNet, VAE, CLIP text encoder, tokenizer."""
    from diffusers import (
        AutoencoderKL,
        PNDMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    work = path.parent / f"{path.name}-parts"
    _seeded()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=16, projection_dim=16,
            bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )
    )
    pipe = StableDiffusionPipeline(
        unet=UNet2DConditionModel.from_pretrained(unet(work / "unet")),
        vae=AutoencoderKL.from_pretrained(vae(work / "vae")),
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(clip_tokenizer(work / "tokenizer")),
        scheduler=PNDMScheduler(skip_prk_steps=True, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)
    return path


#: Every single-model builder, by the name tests parametrize over.
MODEL_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "t5": t5_encoder,
    "llama": llama,
    "bert": bert,
    "clip": clip,
    "cogvideox": cogvideox_transformer,
    "unet": unet,
    "vae": vae,
}
