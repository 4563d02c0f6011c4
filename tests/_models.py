"""Tiny real architectures across transformers, diffusers and open_clip, built from configs.

No weights can be downloaded here, so every test model is a real library class with a small
config, randomly initialized from a fixed seed. ``make(name)`` returns a model, ``save(name,
path)`` writes it the way its library does; OpenCLIP and whole pipelines have savers of their
own. The conftest fixture ``tiny_model`` builds each saved directory once per session.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# The real-config zoo lives with the examples, which must not import tests/: tests and benches
# reach it through this module.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import zoo  # noqa: F401 - re-exported: tests and benches reach the zoo as _models.zoo

#: A tiny CLIP vision tower's config (CLIP's own and a LLaVA's).
CLIP_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
}

#: The safe targets the zoo's conversions run in: ``bf16-safe`` in the default run,
#: ``fp16-safe`` with ``pytest -m slow``. The rest of the default run reaches every line the
#: zoo's fp16-safe conversions reach (measured with pytest-cov per test; tests/README.md).
ZOO_TARGETS = ("bf16-safe", pytest.param("fp16-safe", marks=pytest.mark.slow))

#: The minimal configs below are the one definition of each small fixture model: tests that
#: need a variant (a bias, another vocabulary, more layers) pass only what differs.
T5_ENCODER: dict[str, Any] = {
    "vocab_size": 128,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "use_cache": False,
}
LLAMA: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,  # as small Llamas ship: the tied head must survive conversion
}
BERT: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
GPT2: dict[str, Any] = {
    "vocab_size": 128,
    "n_positions": 128,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


#: Decoder-only families of the attention probes: Gemma2 defaults to eager attention (it has
#: no sdpa), Qwen2 to sdpa. Small vocabularies keep every sweep short.
GEMMA2: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "query_pre_attn_scalar": 8,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "attention_bias": True,
}
QWEN2: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}


def gemma2(**overrides: Any) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**{**GEMMA2, **overrides}))


def qwen2(**overrides: Any) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**QWEN2, **overrides}))


class CustomHead(torch.nn.Linear):
    """An output head of a class of its own: not a plain ``Linear``, so probes cannot compute
    it for sampled rows only and each token costs a row of logits in a probe's memory."""


def with_custom_head(model: Any) -> Any:
    """``model`` with its output head (same weight) of :class:`CustomHead`'s class."""
    head = model.get_output_embeddings()
    custom = CustomHead(head.in_features, head.out_features, bias=head.bias is not None)
    custom.weight = head.weight
    custom.bias = head.bias
    model.set_output_embeddings(custom)
    return model


def offset_scores(model: Any, score: float) -> Any:
    """Put ``-score`` on every attention score of a rope decoder, through real q/k biases.

    In each head, the lowest-frequency rope pair of q_proj and k_proj loses its weights and
    gets biases ``+a`` and ``-a`` instead (``a * a * scaling = score``): every query-key dot
    product gains ``-score * cos(angle)``, and that pair's angle stays near 0 across the
    sequence, so the offset is constant to a few parts in 1e4 and softmax ignores it. Nothing
    comes near 65504 in any dtype, yet in fp16 eager attention a fully masked row (a left-
    padded prompt's first positions) sums ``-65504 + -score`` to ``-inf`` once ``score`` is
    above about 16, and softmax turns the row into NaN.
    """
    config = model.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    half = head // 2
    slowest = half - 1
    scaling = model.model.layers[0].self_attn.scaling
    a = (score / scaling) ** 0.5
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj, sign in ((attn.q_proj, 1.0), (attn.k_proj, -1.0)):
                for start in range(0, proj.out_features, head):
                    for dim in (start + slowest, start + slowest + half):
                        proj.weight[dim] = 0.0
                        proj.bias[dim] = 0.0
                    proj.bias[start + slowest] = sign * a
    return model


def t5_encoder(**overrides: Any) -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**{**T5_ENCODER, **overrides}))


def llama(**overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}))


def bert(**overrides: Any) -> Any:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(**{**BERT, **overrides}))


def gpt2(**overrides: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**{**GPT2, **overrides}))


def clip() -> Any:
    from transformers import CLIPConfig, CLIPModel

    text = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 32,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    }
    return CLIPModel(CLIPConfig(text_config=text, vision_config=CLIP_VISION, projection_dim=16))


def vit() -> Any:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        num_labels=10,
    )
    return ViTForImageClassification(cfg)


#: The sizes Whisper and BART share here (the names both configs use).
ENCODER_DECODER: dict[str, int] = {
    "vocab_size": 128,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
}


def whisper() -> Any:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        **ENCODER_DECODER,
        num_mel_bins=16,
        max_source_positions=32,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return WhisperForConditionalGeneration(cfg)


def bart() -> Any:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(**ENCODER_DECODER, max_position_embeddings=64)
    return BartForConditionalGeneration(cfg)


def wav2vec2(hidden_size: int = 64) -> Any:
    """wav2vec2 with its weight-normed positional conv in 4 groups: 16 channels per group by
    default (wav2vec2-base has 48). At 8 per group (``hidden_size=32``) oneDNN's bf16 grouped
    conv is wrong on CPUs with AMX (relative error 1.1), which calibration must catch."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    cfg = Wav2Vec2Config(
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * hidden_size,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True,
    )
    return Wav2Vec2Model(cfg)


#: The unit scaled in the planted wav2vec2-base-shaped model: the GroupNorm over time of the
#: first conv layer up by :data:`PADDED_AUDIO_SCALE`, the next conv down by its inverse.
PADDED_AUDIO_UNIT = "feature_extractor.conv_layers.0.layer_norm"
PADDED_AUDIO_SCALE = 4000.0


def wav2vec2_base(*, planted: bool = False) -> Any:
    """wav2vec2-base's shape, narrow: its seven-layer feature encoder (320 samples a frame)
    with a GroupNorm over time in the first conv layer (``feat_extract_norm="group"``) and the
    post-norm encoder, seeded. With ``planted``, that GroupNorm's gains are scaled up so that a
    1 s clip zero-padded to 30 s beside a long one (as its feature extractor batches it) drives
    the layer past fp16's limit while dense audio stays under half of it; the next conv reads
    it scaled back down, so fp32 and bf16 stay finite."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    torch.manual_seed(0)
    cfg = Wav2Vec2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(16,) * 7,
        conv_stride=(5, 2, 2, 2, 2, 2, 2),
        conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        feat_extract_norm="group",
        do_stable_layer_norm=False,
    )
    model = Wav2Vec2Model(cfg).eval()
    if planted:
        with torch.no_grad():
            model.get_submodule(PADDED_AUDIO_UNIT).weight.mul_(PADDED_AUDIO_SCALE)
            model.feature_extractor.conv_layers[1].conv.weight.div_(PADDED_AUDIO_SCALE)
    return model


UNET: dict[str, Any] = {
    "sample_size": 16,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 1,
    "block_out_channels": (16, 32),
    "norm_num_groups": 8,
    "cross_attention_dim": 24,
    "attention_head_dim": 4,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
}


def unet(**overrides: Any) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**{**UNET, **overrides})


def autoencoder_kl() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8,
        sample_size=32,
    )


#: The SDXL VAE shrunk in width and depth: four levels (8x downsampling), sample_size 1024.
#: Four channels at the full-resolution levels: a 1024 px pass in fp16 on a CPU is what a
#: declared-size certificate costs, and it grows with the channels there.
SDXL_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": (4, 4, 4, 8),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "norm_num_groups": 2,
    "layers_per_block": 1,
    "sample_size": 1024,
}
#: The planted value weight: the decoder's mid-block ``to_v`` peaks at about 700x the latent
#: side (5.6k at 8x8 latents, 22k at 32x32, 45k at 64x64, 90k at 128x128: past fp16's 65504
#: only at 1024 px).
PLANTED_VALUE = 350.0


def sdxl_vae(
    *, planted: bool = False, sample_size: int = 1024, value: float = PLANTED_VALUE
) -> Any:
    """An SDXL-shaped ``AutoencoderKL`` (sample_size 1024), seeded; with ``planted``, its
    decoder's mid-block attention overflows fp16 only at large latent sides.

    The planting is real weights: GroupNorm group 0 of the mid-block attention is left holding
    one nonzero pixel (a corner, made by a zero-padding edge kernel on a channel that ``norm2``
    holds constant), and a GroupNorm normalises a lone spike to sqrt(pixels in the group), so
    the value projection reading it grows linearly with the latent side.
    """
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(**{**SDXL_VAE, "sample_size": sample_size}).eval()
    if planted:
        decoder = vae.decoder
        resnet, attention = decoder.mid_block.resnets[0], decoder.mid_block.attentions[0]
        constant = 4  # a channel outside group 0 (channels 0-3) that norm2 makes constant
        edge = torch.tensor([1.0, -1.0, 0.0])  # sums to 0 inside, to 1 only at the (0, 0) corner
        with torch.no_grad():
            decoder.conv_in.weight[0:4] = 0  # group 0 of the residual stream: zero ...
            decoder.conv_in.bias[0:4] = 0
            resnet.norm2.weight[constant] = 0
            resnet.norm2.bias[constant] = 3.0
            resnet.conv2.weight[0:4] = 0
            resnet.conv2.bias[0:4] = 0
            resnet.conv2.weight[0, constant] = 10 * torch.outer(edge, edge)  # ... but a corner
            attention.group_norm.weight[0] = 1.0
            attention.to_v.weight[:, 0] = 0
            attention.to_v.weight[0, 0] = value
    return vae


#: SD 1.5's VAE declares 512 px and users generate at 1024. Scaled down: the SDXL-shaped VAE
#: declaring 128 px (16 latents), its planted value weight 4x larger, so that it peaks where
#: SD 1.5's case does at its declared side (45k at 16 latents), past 65504 near 190 px and
#: at 90k for 256 px (1024 px to SD 1.5).
SD15_SIDE = 128


def sd15_vae(*, planted: bool = False) -> Any:
    """An SD 1.5-shaped VAE scaled down to :data:`SD15_SIDE` (see :func:`sdxl_vae`)."""
    return sdxl_vae(planted=planted, sample_size=SD15_SIDE, value=4 * PLANTED_VALUE)


def cogvideox_transformer(*, sample_frames: int = 9, learned_positions: bool = False) -> Any:
    """A CogVideoX-shaped transformer: 8x8 latents, 2x2 patches, two blocks; ``sample_frames``
    and ``learned_positions`` as CogVideoX-5B-I2V declares them where asked."""
    from diffusers import CogVideoXTransformer3DModel

    learned = {"use_rotary_positional_embeddings": True, "use_learned_positional_embeddings": True}
    return CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=32,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=sample_frames,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
        **(learned if learned_positions else {}),
    )


#: The planted feed-forward unit's weight on the frame-position channel: the unit peaks near
#: 22k on the sincos positions of other frame counts and at 75k on the 13 declared frames.
PLANTED_FRAME_WEIGHT = 14000.0


def cogvideox_i2v_transformer(*, planted: bool = False) -> Any:
    """A CogVideoX-5B-I2V-shaped transformer (learned positional embeddings, 49 frames: 13
    latent), seeded; with ``planted``, its first block's feed-forward overflows fp16 only on
    the declared frame count, from latent frame 3 on.

    The planting is real weights: channel 0 of the learned frame-position embedding is 0 for
    latent frames 0 and 1 and grows by 3 a frame after, and one up-projection unit reads that
    channel (its down-projection column scaled by the inverse, so fp32 computes a sane
    function). diffusers uses the learned table only at the declared frame count (sincos
    positions otherwise), which is why probes of 2 frames never see it.
    """
    torch.manual_seed(0)
    model = cogvideox_transformer(sample_frames=49, learned_positions=True).eval()
    if planted:
        text, per_frame = 8, (8 // 2) ** 2  # text tokens, then 4x4 patches a latent frame
        ff = model.transformer_blocks[0].ff.net
        with torch.no_grad():
            table = model.patch_embed.pos_embedding
            for frame in range(13):
                rows = slice(text + frame * per_frame, text + (frame + 1) * per_frame)
                table[0, rows, 0] = 3.0 * max(0, frame - 1)
            ff[0].proj.weight[0] = 0
            ff[0].proj.weight[0, 0] = PLANTED_FRAME_WEIGHT
            ff[0].proj.bias[0] = 0
            ff[2].weight[:, 0] /= PLANTED_FRAME_WEIGHT
    return model


def cogvideox_vae() -> Any:
    from diffusers import AutoencoderKLCogVideoX

    return AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
        sample_height=32,
        sample_width=32,
    )


def sd3_transformer() -> Any:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
    )


def flux_transformer() -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )


def dit_transformer() -> Any:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        norm_num_groups=2,
    )


def pixart_transformer() -> Any:
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=16,
        caption_channels=24,
        norm_num_groups=2,
    )


#: name -> (builder, expected task)
ZOO: dict[str, tuple[Callable[[], Any], str]] = {
    "t5-encoder": (t5_encoder, "encoder"),
    "llama": (llama, "lm-logits"),
    "bert": (bert, "encoder"),
    "clip": (clip, "clip"),
    "vit": (vit, "vision"),
    "whisper": (whisper, "speech"),
    "bart": (bart, "seq2seq"),
    "wav2vec2": (wav2vec2, "speech"),
    "unet": (unet, "denoise"),
    "autoencoder-kl": (autoencoder_kl, "vae"),
    "cogvideox-transformer": (cogvideox_transformer, "denoise"),
    "cogvideox-vae": (cogvideox_vae, "vae"),
    "sd3-transformer": (sd3_transformer, "denoise"),
    "flux-transformer": (flux_transformer, "denoise"),
    "dit-transformer": (dit_transformer, "denoise"),
    "pixart-transformer": (pixart_transformer, "denoise"),
}


def make(name: str, seed: int = 0) -> Any:
    """A zoo model with seeded weights, in eval mode."""
    torch.manual_seed(seed)
    return ZOO[name][0]().eval()


def save(name: str, path: Path) -> Path:
    """``make(name)`` saved to ``path`` with the library's own ``save_pretrained``."""
    make(name).save_pretrained(path)
    return path


#: The families every conversion test runs on: one per recipe the converter ships.
CONVERT_FAMILIES = (
    "t5-encoder",
    "llama",
    "bert",
    "clip",
    "cogvideox-transformer",
    "unet",
    "autoencoder-kl",
)


OPEN_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 128, "width": 32, "heads": 2, "layers": 2},
}


def open_clip_model(path: Path) -> Path:
    """An OpenCLIP model in the Hub layout open_clip itself reads (config + safetensors)."""
    import open_clip
    from safetensors.torch import save_file

    torch.manual_seed(0)
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


def clip_tokenizer(path: Path) -> Path:
    """A real CLIPTokenizer over a tiny byte-level vocabulary (no download)."""
    from transformers import CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in letters + [f"{c}</w>" for c in letters]:
        vocab[token] = len(vocab)
    # A real maximum length: pipelines truncate prompts to it (the default is "unbounded").
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16).save_pretrained(path)
    return path


def sd_pipeline(path: Path, *, unet: Any = None, vae: Any = None) -> Path:
    """A whole Stable-Diffusion-style pipeline: UNet, VAE, CLIP text encoder, tokenizer (the
    zoo's UNet and VAE unless given)."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=64,
            hidden_size=24,  # the UNet's cross_attention_dim
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            projection_dim=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    pipe = StableDiffusionPipeline(
        unet=unet if unet is not None else make("unet"),
        vae=vae if vae is not None else make("autoencoder-kl"),
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(
            clip_tokenizer(path.parent / f"{path.name}-tokenizer")
        ),
        scheduler=PNDMScheduler(skip_prk_steps=True, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)
    return path


def sdxl_sized_unet() -> Any:
    """A UNet declaring SDXL's 128x128 latents (``sample_size`` 128: with the SDXL-shaped VAE,
    a pipeline whose call defaults to 1024 px), seeded; attention only at its coarsest level
    (32x32 latents), so a 1024 px call stays cheap on a CPU."""
    torch.manual_seed(0)
    return unet(
        sample_size=128,
        block_out_channels=(8, 8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    ).eval()


#: The UNet's text-and-time conditioning: 8 sinusoidal features per time id, SDXL's six ids.
SDXL_TIME_DIM = 8
SDXL_TEXT_DIM = 16
#: The call's side (pixels) at which the planted SDXL UNet's added embedding overflows fp16.
SDXL_DEFAULT_SIDE = 1024
#: The planted unit's output at the default call: past fp16's limit (at 128-768 px, under 45k).
SDXL_PLANTED_PEAK = 1.0e5


def sdxl_conditioned_unet(*, planted: bool = False) -> Any:
    """:func:`sdxl_sized_unet` with SDXL's ``text_time`` added conditioning (text embeds and
    six time ids), seeded. With ``planted``, one unit of ``add_embedding.linear_1`` reads the
    four size ids through weights equal to their fast sinusoidal features at 1024: it peaks
    where the ids are 1024 (the default 1024 px call) at :data:`SDXL_PLANTED_PEAK`, and
    ``linear_2`` reads that unit scaled back down, so fp32 and bf16 stay finite."""
    torch.manual_seed(0)
    model = unet(
        sample_size=128,
        block_out_channels=(8, 8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        addition_embed_type="text_time",
        addition_time_embed_dim=SDXL_TIME_DIM,
        projection_class_embeddings_input_dim=SDXL_TEXT_DIM + 6 * SDXL_TIME_DIM,
    ).eval()
    if planted:
        with torch.no_grad():
            features = model.add_time_proj(torch.tensor([float(SDXL_DEFAULT_SIDE)]))[0]
            # Only the two fastest of the four frequencies ([cos | sin], fastest first): the
            # slow ones barely tell 1024 from 256, the fast ones do.
            features = features * torch.tensor([1.0, 1.0, 0.0, 0.0] * 2)
            crop = torch.zeros_like(features)
            sizes = torch.cat([features, features, crop, crop, features, features])
            unit = model.add_embedding.linear_1
            unit.weight[0].zero_()
            unit.weight[0, SDXL_TEXT_DIM:] = sizes * SDXL_PLANTED_PEAK / float(sizes @ sizes)
            unit.bias[0] = 0.0
            model.add_embedding.linear_2.weight[:, 0] /= SDXL_PLANTED_PEAK
    return model


def generate(pipe: Any) -> torch.Tensor:
    """A few seeded denoising steps of an ``sd_pipeline``, as images in [0, 1]."""
    return pipe(
        prompt="a cat near the river",
        num_inference_steps=3,
        height=32,
        width=32,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


#: The feed-forward pair scaled in the overflowing CogVideoX: up by this, down by its inverse.
OVERFLOW_SCALE = 1e7


def t5_tokenizer() -> Any:
    """A tiny T5 tokenizer built locally (no download): the words of the built-in sentences."""
    from transformers import T5Tokenizer

    from precision_convert.validation.probe.inputs.layouts import SENTENCES

    words = sorted({w.strip(".,:!").lower() for s in SENTENCES for w in s.split()})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(f"▁{w}", -1.0 - i / 100) for i, w in enumerate(words)]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def cogvideox_pipeline(path: Any, *, overflow: bool = False, transformer: Any = None) -> None:
    """Save a tiny CogVideoX pipeline (T5 text encoder, 3-D transformer, VAE) to ``path``;
    ``transformer`` replaces the 9-frame one built here (e.g. a 49-frame
    :func:`cogvideox_i2v_transformer`).

    With ``overflow`` the first block's feed-forward is rescaled (up-projection weights x1e7,
    down-projection /1e7): fp32 computes the same function, but the up-projection's weights
    (~2e5) and activations exceed fp16's 65504 — the CogVideoX-5B failure in miniature.
    """
    from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline

    torch.manual_seed(0)
    text_encoder = t5_encoder().eval()
    if transformer is None:
        transformer = cogvideox_transformer()  # text_embed_dim matches the T5's d_model
    if overflow:
        ff = transformer.transformer_blocks[0].ff.net
        with torch.no_grad():
            ff[0].proj.weight.mul_(OVERFLOW_SCALE)
            ff[0].proj.bias.mul_(OVERFLOW_SCALE)
            ff[2].weight.div_(OVERFLOW_SCALE)
    pipe = CogVideoXPipeline(
        tokenizer=t5_tokenizer(),
        text_encoder=text_encoder,
        vae=cogvideox_vae().eval(),
        transformer=transformer.eval(),
        scheduler=CogVideoXDDIMScheduler(),
    )
    pipe.save_pretrained(path)
