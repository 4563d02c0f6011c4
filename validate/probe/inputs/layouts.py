"""Seeded inputs for any model, derived from its class, forward signature and config.

Validation and activation analysis both need to run a model on inputs it accepts without
being told how. Rather than a list of known architectures, each forward parameter name that
libraries share (``input_ids``, ``pixel_values``, ``input_features``, ``hidden_states``,
``encoder_hidden_states``, ``timestep``, ``img_ids``…) has one builder that reads the sizes it
needs from the config (searching sub-configs such as ``text_config``). Where a convention is
ambiguous — a video latent laid out ``(B, C, F, H, W)`` or ``(B, F, C, H, W)``, a spectrogram
``(B, mel, T)`` or ``(B, T, mel)`` — the builder offers several layouts in order of
likelihood and :func:`~.execute.build_inputs` keeps the first the model accepts.

A model is exercised by one or more :class:`Probe` calls: ``forward`` for most models,
``encode`` then ``decode`` for autoencoders (the decoder is fed the encoder's baseline latents,
so it sees realistic values), ``__call__`` for a whole diffusers pipeline.

Example:
    >>> inputs = build_inputs(model, seed=0)
    >>> outputs = run_probes(model, inputs)
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from precision_convert.core.errors import CannotValidateError
from precision_convert.validation.probe.inputs.images import processor_prompt, smooth_image
from precision_convert.validation.probe.inputs.model_inputs import (
    FromOutput,
    ModelInputs,
    Probe,
    config_get,
    is_open_clip,
    library_of,
    parameters_of,
    seeded_generator,
)
from precision_convert.validation.probe.inputs.tokenizers import (
    ProbeTokenizer,
    pad_rows,
    probe_tokenizer,
)

#: Sentences tokenized when the model ships a tokenizer: ordinary prose plus digits and
#: punctuation, so embeddings of frequent and rarer tokens are both exercised.
SENTENCES: tuple[str, ...] = (
    "A red fox jumps over the sleeping dog near the river bank.",
    "Precision matters: 65504 is the largest finite half-precision number!",
)
#: Two samples per batch: enough to catch batch-mixing bugs, cheap on any model size.
BATCH = 2
#: Tokens per random text sequence: long enough for attention to matter, short enough for CPUs.
TEXT_LEN = 12
#: Latent side used when a model's native sample size is larger: divisible by every
#: downsampling/patching factor in use (2..32), and 32x32 latents keep a big DiT cheap.
LATENT_SIDE = 32
#: Pixel side for autoencoders: 64 survives six 2x downsamplings yet decodes in milliseconds.
PIXEL_SIDE = 64
#: Latent frames for video models; 2 also differs from any channel count, which is what tells
#: the (B, C, F, H, W) and (B, F, C, H, W) layouts apart.
LATENT_FRAMES = 2
#: Most a length read from a config may size a layout's tensor to (conditioning tokens,
#: spectrogram frames, a temporal compression): far above any real model's (CogVideoX's 226
#: text tokens, an audio transformer's 1024 frames), so only a hostile number is cut.
DECLARED_LENGTH_CAP = 1 << 14
#: The same for raw audio samples (wav2vec2's conv strides multiply to 320 a frame).
DECLARED_SAMPLES_CAP = 1 << 20
#: Denoising timestep fed to diffusion models: mid-schedule on the usual 0..1000 scale, and
#: exact in fp16 and bf16 so baseline and candidate see the same value.
TIMESTEP = 500.0
#: Pixels a latent of the SD-family autoencoders spans (their four levels halve three times):
#: the pipeline's ``vae_scale_factor``, which turns latents into the call's pixel size.
VAE_SCALE = 8
#: Most candidate layouts tried before giving up on a model.
MAX_CANDIDATES = 8

_SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


# --------------------------------------------------------------------------- context


class _Ctx:
    """What the builders read: the model's config, its signature and a seeded generator."""

    def __init__(self, model: Any, seed: int, tokenizer: ProbeTokenizer | None) -> None:
        self.model = model
        self.config = getattr(model, "config", None)
        self.seed = seed
        self.tokenizer = tokenizer if tokenizer is not None and tokenizer.usable else None
        self.params = parameters_of(model.forward)

    def cfg(self, *keys: str, prefer: Sequence[str] = ()) -> Any:
        """The first key set in the config, then in its sub-configs (``prefer`` first)."""
        configs = [self.config]
        order = [*prefer, *(s for s in _SUBCONFIGS if s not in prefer)]
        configs += [config_get(self.config, s) for s in order]
        for config in configs:
            for key in keys:
                value = config_get(config, key)
                if value is not None:
                    return value
        return None

    def gen(self, name: str) -> torch.Generator:
        """A generator per tensor name, so adding one input never changes another."""
        return seeded_generator(self.seed, name)

    def randn(self, name: str, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen(name))

    def randint(self, name: str, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen(name))


def _side(value: Any, default: int, cap: int) -> int:
    """A size from a config value (int or [h, w]), capped to keep inference cheap."""
    if isinstance(value, list | tuple):
        value = value[0]
    side = int(value) if value else default
    return side if side <= cap else cap


def _is_autoencoder(model: Any) -> bool:
    return (
        callable(getattr(model, "encode", None))
        and callable(getattr(model, "decode", None))
        and (config_get(model.config, "latent_channels") is not None)
    )


# --------------------------------------------------------------------------- transformers


def _token_ids(ctx: _Ctx) -> tuple[dict[str, torch.Tensor], str]:
    """Token ids and mask of :data:`SENTENCES` through the tokenizer (right-padded by hand,
    so no pad token is needed), else seeded random ids."""
    vocab = ctx.cfg("vocab_size", prefer=("text_config",))
    positions = ctx.cfg(
        "max_position_embeddings", "n_positions", "max_text_len", prefer=("text_config",)
    )
    length = min(TEXT_LEN, int(positions) - 2) if positions else TEXT_LEN
    if ctx.tokenizer is not None:  # one whose ids fit the vocabulary (input_candidates)
        width = max(length, 8)
        rows = [ctx.tokenizer.encode(sentence, width) for sentence in SENTENCES]
        ids, mask = pad_rows(rows, ctx.tokenizer.pad()[0], width=width)
        return {"input_ids": ids, "attention_mask": mask}, "tokenizer"
    if vocab is None:
        raise CannotValidateError("the config has no vocab_size for token ids; pass --inputs")
    # Id 0 is often padding; stay clear of it so every position carries a real embedding.
    ids = ctx.randint("input_ids", 1, int(vocab), BATCH, length)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "builder"


def _fits_vocabulary(ctx: _Ctx) -> bool:
    """Whether the tokenizer's ids for real text fall inside the model's vocabulary (a
    tokenizer of another model does not; a config without vocab_size cannot tell)."""
    vocab = ctx.cfg("vocab_size", prefer=("text_config",))
    if ctx.tokenizer is None or not isinstance(vocab, int):
        return True
    return max(ctx.tokenizer.encode(" ".join(SENTENCES), TEXT_LEN * 8)) < vocab


def _pixel_values(ctx: _Ctx) -> torch.Tensor:
    channels = ctx.cfg("num_channels", "in_channels", prefer=("vision_config",)) or 3
    side = _side(ctx.cfg("image_size", "img_size", prefer=("vision_config",)), 224, 1024)
    return smooth_image(ctx.gen("pixel_values"), BATCH, int(channels), side, side)


def _image_prompt(ctx: _Ctx, text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Text with an image in it, as a vision-language model's processor makes it: the image
    token its config names repeated once per image feature, after the first text token, and
    the image's ``pixel_values`` at the vision tower's size. None when the config names no
    image token (the model cannot be told where an image goes)."""
    token = ctx.cfg("image_token_index", "image_token_id")
    patch = ctx.cfg("patch_size", prefer=("vision_config",))
    side = ctx.cfg("image_size", prefer=("vision_config",))
    vocab = ctx.cfg("vocab_size", prefer=("text_config",))
    if not isinstance(token, int) or not patch or not side or "input_ids" not in ctx.params:
        return None
    if isinstance(vocab, int) and not 0 <= token < vocab:  # no id the model can embed
        return None
    # LLaVA's default strategy drops the CLS feature; "full" keeps it.
    features = (_side(side, 224, 1024) // int(patch)) ** 2
    features += ctx.cfg("vision_feature_select_strategy") == "full"
    ids = text["input_ids"]
    ids = torch.where(ids == token, torch.ones_like(ids), ids)  # no stray image token
    image = torch.full((ids.shape[0], features), token, dtype=ids.dtype)
    prompt = {"input_ids": torch.cat([ids[:, :1], image, ids[:, 1:]], dim=1)}
    if "attention_mask" in text:
        mask = text["attention_mask"]
        prompt["attention_mask"] = torch.cat([mask[:, :1], torch.ones_like(image), mask[:, 1:]], 1)
    return {**prompt, "pixel_values": _pixel_values(ctx)}


def _speech_layouts(ctx: _Ctx) -> list[dict[str, torch.Tensor]]:
    """Spectrogram or waveform inputs, in the layouts speech models use."""
    layouts: list[dict[str, torch.Tensor]] = []
    mel = ctx.cfg("num_mel_bins", "feature_size", prefer=("audio_config",))
    if "input_features" in ctx.params:
        per_channel = ctx.cfg("input_feat_per_channel")
        feats = int(per_channel) * int(ctx.cfg("input_channels") or 1) if per_channel else mel
        if feats:
            source_positions = ctx.cfg("max_source_positions", prefer=("audio_config",))
            # Whisper-style encoders want exactly 2 frames per source position (two convs).
            frames = 2 * int(source_positions) if source_positions else 64
            layouts.append(
                {"input_features": ctx.randn("input_features", BATCH, int(feats), frames)}
            )
            layouts.append({"input_features": ctx.randn("input_features", BATCH, 64, int(feats))})
    if "input_values" in ctx.params:
        strides = ctx.cfg("conv_stride", prefer=("audio_config",))
        if strides:
            # Raw audio: enough samples for ~24 output frames of the conv feature encoder.
            samples = math.prod(strides) * 24 + sum(ctx.cfg("conv_kernel") or [0])
            samples = min(samples, DECLARED_SAMPLES_CAP)
            layouts.append({"input_values": 0.1 * ctx.randn("input_values", BATCH, samples)})
        if mel:
            frames = _side(ctx.cfg("max_length"), 64, DECLARED_LENGTH_CAP)
            layouts.append({"input_values": ctx.randn("input_values", BATCH, frames, int(mel))})
    return layouts


def _transformers_candidates(ctx: _Ctx) -> Iterator[ModelInputs]:
    params = ctx.params
    model = ctx.model
    name = type(model).__name__
    modalities: list[list[tuple[dict[str, torch.Tensor], str]]] = []
    origin = "builder"
    prompts: list[dict[str, torch.Tensor]] = []
    if "input_ids" in params:
        ids, origin = _token_ids(ctx)
        if "token_type_ids" in params and ctx.cfg("type_vocab_size"):
            ids["token_type_ids"] = torch.zeros_like(ids["input_ids"])
        if "attention_mask" not in params:
            ids.pop("attention_mask", None)
        if "pixel_values" in params:  # the processor's prompt first, then the config's
            made = (
                processor_prompt(ctx.tokenizer, SENTENCES[:BATCH], ctx.gen, PIXEL_SIDE, ctx.params),
                _image_prompt(ctx, ids),
            )
            prompts = [prompt for prompt in made if prompt is not None]
        modalities.append([(ids, "text")])
    if "pixel_values" in params:
        modalities.append([({"pixel_values": _pixel_values(ctx)}, "vision")])
    if "clip_input" in params and "images" in params:
        # diffusers' Stable Diffusion safety checker: CLIP pixels of the decoded images, and
        # the images (B, H, W, C in [0, 1]) it hands back, blacked out where it flags them.
        images = (smooth_image(ctx.gen("images"), BATCH, 3, PIXEL_SIDE, PIXEL_SIDE) + 1) / 2
        checked = {"clip_input": _pixel_values(ctx), "images": images.permute(0, 2, 3, 1)}
        modalities.append([(checked, "vision")])
    speech = _speech_layouts(ctx)
    if speech:
        modalities.append([(layout, "speech") for layout in speech])
    if not modalities:
        raise CannotValidateError(
            f"cannot validate {name}: none of its inputs ({', '.join(params)}) can be built; "
            "pass --inputs"
        )
    extras: dict[str, Any] = {}
    if "decoder_input_ids" in params and ctx.cfg("is_encoder_decoder"):
        start = ctx.cfg("decoder_start_token_id", "bos_token_id", "pad_token_id") or 0
        vocab = int(ctx.cfg("vocab_size", prefer=("text_config",)))
        dec = ctx.randint("decoder_input_ids", 1, vocab, BATCH, TEXT_LEN // 2)
        dec[:, 0] = int(start)
        extras["decoder_input_ids"] = dec
    if "use_cache" in params:
        extras["use_cache"] = False
    # A prompt holding an image first; every modality the signature offers; then each alone,
    # so a model that refuses a combination still gets validated (the modules it leaves
    # unreached then fail the coverage check, named).
    image: dict[str, torch.Tensor] = {}  # the prompt holds the pixels
    subsets = [[[(prompt, "text")], [(image, "vision")]] for prompt in prompts]
    subsets += [modalities] + ([[m] for m in modalities] if len(modalities) > 1 else [])
    for subset in subsets:
        for combo in itertools.product(*subset):
            kwargs = {k: v for part, _ in combo for k, v in part.items()}
            kinds = {kind for _, kind in combo}
            yield ModelInputs(
                task=_transformers_task(model, kinds, "decoder_input_ids" in extras),
                probes=(Probe("forward", "forward", {**kwargs, **extras}),),
                seed=ctx.seed,
                origin=origin if "text" in kinds else "builder",
            )


#: Class-name endings of heads whose ``logits`` are over the vocabulary.
_LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration", "WithLMHead")


def _transformers_task(model: Any, kinds: set[str], seq2seq: bool) -> str:
    lm_head = type(model).__name__.endswith(_LM_HEADS)
    if {"text", "vision"} <= kinds and lm_head and not seq2seq:
        return "lm-logits"  # a vision-language model: logits over the vocabulary
    if {"text", "vision"} <= kinds:
        return "clip"
    if "speech" in kinds:
        return "speech"
    if "vision" in kinds:
        return "vision"
    if seq2seq:
        return "seq2seq"
    return "lm-logits" if lm_head else "encoder"


# --------------------------------------------------------------------------- diffusers


def scales_timestep(model: Any) -> bool:
    """Whether the forward multiplies the timestep by 1000 itself (Flux-style, t in [0, 1]).

    Feeding such a model t=500 would make 500000, which fp16 cannot hold: a false failure.
    """
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "timestep" in source and "* 1000" in source


def _text_dim(ctx: _Ctx) -> int | None:
    dim = ctx.cfg(
        "encoder_hid_dim",
        "joint_attention_dim",
        "text_embed_dim",
        "caption_channels",
        "text_dim",
        "cross_attention_dim",
    )
    if isinstance(dim, list | tuple):
        dim = dim[0]
    return int(dim) if dim else None


def _latent_layouts(ctx: _Ctx, name: str) -> list[dict[str, Any]]:
    """The denoiser's latent input in every layout diffusers models use, likeliest first.

    Packed-sequence models (those taking ``img_ids``) get the 2x2-packed tokens and their ids;
    video models (a frame count or temporal patch in the config) get both 5-D orders.
    """
    c = int(ctx.cfg("in_channels", "num_channels_latents") or 4)
    side_h = _side(ctx.cfg("sample_height", "sample_size"), LATENT_SIDE, LATENT_SIDE)
    side_w = _side(ctx.cfg("sample_width", "sample_size"), LATENT_SIDE, LATENT_SIDE)
    if "img_ids" in ctx.params:
        h, w = side_h // 2, side_w // 2
        axes = len(ctx.cfg("axes_dims_rope") or (16, 56, 56))
        ids = torch.zeros(h, w, axes)
        ids[..., 1] = torch.arange(h).view(h, 1)
        ids[..., 2] = torch.arange(w).view(1, w)
        return [
            {
                name: ctx.randn(name, BATCH, h * w, c),
                "img_ids": ids.view(h * w, axes),
                "txt_ids": torch.zeros(_text_tokens(ctx), axes),
            }
        ]
    layouts: list[dict[str, Any]] = []
    video = any(
        ctx.cfg(k) is not None
        for k in (
            "sample_frames",
            "num_frames",
            "patch_size_t",
            "temporal_compression_ratio",
            "num_layers_t",
        )
    )
    four = {name: ctx.randn(name, BATCH, c, side_h, side_w)}
    cf = {name: ctx.randn(name, BATCH, c, LATENT_FRAMES, side_h, side_w)}
    fc = {name: ctx.randn(name, BATCH, LATENT_FRAMES, c, side_h, side_w)}
    layouts += [cf, fc, four] if video else [four, cf, fc]
    return layouts


def _text_tokens(ctx: _Ctx) -> int:
    """Text length of a denoiser's conditioning: fixed where positional embeddings need it
    (CogVideoX's ``max_text_seq_length``), short otherwise."""
    return _side(ctx.cfg("max_text_seq_length"), TEXT_LEN // 2 + 2, DECLARED_LENGTH_CAP)


def _encoder_states(ctx: _Ctx) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    dim = _text_dim(ctx)
    if "encoder_hidden_states" in ctx.params and dim:
        # Text-encoder states have unit-ish scale; 0.5 keeps them in the range T5/CLIP produce.
        out["encoder_hidden_states"] = 0.5 * ctx.randn(
            "encoder_hidden_states", BATCH, _text_tokens(ctx), dim
        )
    pooled = ctx.cfg("pooled_projection_dim")
    if "pooled_projections" in ctx.params and pooled:
        out["pooled_projections"] = 0.5 * ctx.randn("pooled_projections", BATCH, int(pooled))
    image_dim = ctx.cfg("image_dim")
    if "encoder_hidden_states_image" in ctx.params and image_dim:
        out["encoder_hidden_states_image"] = 0.5 * ctx.randn(
            "encoder_hidden_states_image", BATCH, 16, int(image_dim)
        )
    return out


def _conditioning(ctx: _Ctx, latent: torch.Tensor) -> list[dict[str, Any]]:
    """Optional conditioning the config says the model consumes (class labels, guidance…)."""
    out: dict[str, Any] = {}
    params = ctx.params
    classes = ctx.cfg("num_class_embeds", "num_embeds_ada_norm")
    class_type = ctx.cfg("class_embed_type")
    if "class_labels" in params:
        if classes and class_type is None:
            out["class_labels"] = ctx.randint("class_labels", 0, int(classes), BATCH)
        elif class_type == "timestep":
            out["class_labels"] = torch.full((BATCH,), TIMESTEP)
        elif class_type in ("projection", "simple_projection"):
            dim = int(ctx.cfg("projection_class_embeddings_input_dim"))
            out["class_labels"] = ctx.randn("class_labels", BATCH, dim)
    if "timestep_cond" in params and ctx.cfg("time_cond_proj_dim"):
        out["timestep_cond"] = ctx.randn("timestep_cond", BATCH, int(ctx.cfg("time_cond_proj_dim")))
    if "guidance" in params and ctx.cfg("guidance_embeds"):
        out["guidance"] = torch.full((BATCH,), 3.5)
    if "ofs" in params and ctx.cfg("ofs_embed_dim"):
        out["ofs"] = torch.full((BATCH,), 2.0)
    if "added_time_ids" in params:
        out["added_time_ids"] = torch.tensor([[6.0, 127.0, 0.02]] * BATCH)
    if "controlnet_cond" in params:
        channels = int(ctx.cfg("conditioning_channels") or 3)
        h, w = latent.shape[-2:]
        out["controlnet_cond"] = smooth_image(
            ctx.gen("controlnet_cond"), BATCH, channels, 8 * h, 8 * w
        )
    if "added_cond_kwargs" not in params:
        return [out]
    # The dict's keys depend on the family: SDXL's text/time embeddings, PixArt's resolution.
    options: list[dict[str, Any] | None] = []
    if ctx.cfg("addition_embed_type") == "text_time":
        time_dim = int(ctx.cfg("addition_time_embed_dim"))
        text = int(ctx.cfg("projection_class_embeddings_input_dim")) - 6 * time_dim
        height, width = (VAE_SCALE * int(n) for n in latent.shape[-2:])
        options.append(
            {
                "text_embeds": 0.5 * ctx.randn("text_embeds", BATCH, text),
                "time_ids": sdxl_time_ids(height, width, batch=BATCH),
            }
        )
    options.append(None)  # most models: nothing extra
    options.append(
        {"resolution": torch.tensor([[256.0, 256.0]] * BATCH), "aspect_ratio": torch.ones(BATCH, 1)}
    )
    return [
        {**out, "added_cond_kwargs": option} if option is not None else out for option in options
    ]


def sdxl_time_ids(
    height: int, width: int, *, crop: tuple[int, int] = (0, 0), batch: int = 1
) -> torch.Tensor:
    """SDXL's micro-conditioning at a call of ``height`` x ``width`` pixels, as diffusers'
    ``StableDiffusionXLPipeline._get_add_time_ids`` builds it: ``original_size +
    crops_coords_top_left + target_size``, where the call's defaults are ``original_size =
    target_size = (height, width)`` and a crop at (0, 0)."""
    row = [float(height), float(width), float(crop[0]), float(crop[1]), float(height), float(width)]
    return torch.tensor([row] * batch)


def at_latent_side(
    kwargs: Mapping[str, Any], height: int, width: int, *, crop: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    """A denoiser's ``kwargs`` with the conditioning that depends on the call's size (SDXL's
    ``time_ids``) recomputed for latents ``height`` x ``width``, as the pipeline computes it
    at that size; other arguments unchanged."""
    added = kwargs.get("added_cond_kwargs")
    if not isinstance(added, Mapping) or not isinstance(added.get("time_ids"), torch.Tensor):
        return dict(kwargs)
    batch = int(added["time_ids"].shape[0])
    ids = sdxl_time_ids(VAE_SCALE * height, VAE_SCALE * width, crop=crop, batch=batch)
    return {**kwargs, "added_cond_kwargs": {**added, "time_ids": ids}}


def _denoiser_candidates(ctx: _Ctx) -> Iterator[ModelInputs]:
    latent_name = next(iter(ctx.params))
    t = TIMESTEP / 1000 if scales_timestep(ctx.model) else TIMESTEP
    states = _encoder_states(ctx)
    for layout in _latent_layouts(ctx, latent_name):
        for cond in _conditioning(ctx, layout[latent_name]):
            kwargs = {**layout, "timestep": torch.full((BATCH,), t), **states, **cond}
            yield ModelInputs("denoise", (Probe("forward", "forward", kwargs),), ctx.seed)


def _autoencoder_candidates(ctx: _Ctx) -> Iterator[ModelInputs]:
    channels = int(ctx.cfg("in_channels") or 3)
    side = _side(ctx.cfg("sample_size", "sample_height"), PIXEL_SIDE, PIXEL_SIDE)
    frames = 1 + _side(ctx.cfg("temporal_compression_ratio"), 4, DECLARED_LENGTH_CAP)
    video = ctx.cfg("temporal_compression_ratio") is not None
    four = smooth_image(ctx.gen("sample"), BATCH, channels, side, side)
    five = smooth_image(ctx.gen("sample"), BATCH, channels, frames, side, side)
    # diffusers names the arguments x/sample and z/latents depending on the class.
    x_name = next(iter(parameters_of(ctx.model.encode)))
    z_name = next(iter(parameters_of(ctx.model.decode)))
    for image in [five, four] if video else [four, five]:
        encode = Probe("encode", "encode", {x_name: image})
        decode = Probe("decode", "decode", {z_name: FromOutput("encode")}, images=True)
        yield ModelInputs("vae", (encode, decode), ctx.seed)


# --------------------------------------------------------------------------- open_clip


def _open_clip_candidates(ctx: _Ctx) -> Iterator[ModelInputs]:
    model = ctx.model
    size = getattr(model.visual, "image_size", 224)
    side = _side(size, 224, 1024)
    vocab = int(getattr(model, "vocab_size", 49408))
    length = int(getattr(model, "context_length", 77))
    text = ctx.randint("text", 1, vocab - 1, BATCH, length)
    # OpenCLIP pools at the highest id (the end-of-text token): put it where a sentence ends.
    text[:, TEXT_LEN:] = 0
    text[:, TEXT_LEN - 1] = vocab - 1
    kwargs = {"image": smooth_image(ctx.gen("image"), BATCH, 3, side, side), "text": text}
    yield ModelInputs("clip", (Probe("forward", "forward", kwargs),), ctx.seed)


# --------------------------------------------------------------------------- public API


def infer_task(model: Any) -> str:
    """The validation task of a model, as named in ``recipes/tasks.toml``."""
    return next(input_candidates(model)).task


def input_candidates(
    model: Any, *, seed: int = 0, tokenizer: Any | None = None
) -> Iterator[ModelInputs]:
    """Every plausible set of inputs for ``model``, likeliest first (at most MAX_CANDIDATES).

    ``tokenizer``: the model's own (a library tokenizer or a :class:`ProbeTokenizer`); one
    that cannot be used is a note on every candidate, and token ids are seeded instead.

    Raises:
        CannotValidateError: no builder knows how to feed this architecture.
    """
    tok = probe_tokenizer(tokenizer)
    ctx = _Ctx(model, seed, tok)
    if tok is not None and ctx.tokenizer is not None and not _fits_vocabulary(ctx):
        vocab = ctx.cfg("vocab_size", prefer=("text_config",))
        tok = ProbeTokenizer.unusable(
            tok.where, f"gives ids past the model's vocabulary of {vocab} (another model's?)"
        )
        ctx = _Ctx(model, seed, tok)
    library = library_of(model)
    if library == "transformers":
        found = _transformers_candidates(ctx)
    elif library == "diffusers" and _is_autoencoder(model):
        found = _autoencoder_candidates(ctx)
    elif library == "diffusers" and "timestep" in ctx.params:
        found = _denoiser_candidates(ctx)
    elif is_open_clip(model):
        found = _open_clip_candidates(ctx)
    else:
        raise CannotValidateError(
            f"cannot validate {type(model).__name__}: no input builder for this model; "
            "pass --inputs"
        )
    notes = (tok.note,) if tok is not None and tok.note else ()
    record = tok.describe() if tok is not None else None
    for index, inputs in enumerate(itertools.islice(found, MAX_CANDIDATES)):
        yield replace(inputs, layout=index, notes=(*inputs.notes, *notes), tokenizer=record)


def inputs_from_tensors(
    model: Any, tensors: Mapping[str, torch.Tensor], *, seed: int = 0
) -> ModelInputs:
    """User-supplied tensors (``--inputs FILE``) as the keyword arguments of one forward call.

    The task still comes from the model when a builder recognises it, so the right metric
    thresholds apply; otherwise the generic ``default`` task is used.
    """
    try:
        task = infer_task(model)
    except CannotValidateError:
        task = "default"
    params = parameters_of(model.forward)
    unknown = sorted(set(tensors) - set(params)) if not _accepts_kwargs(model.forward) else []
    if unknown:
        raise CannotValidateError(
            f"--inputs names {', '.join(unknown)}, which "
            f"{type(model).__name__}.forward does not take"
        )
    kwargs: dict[str, Any] = dict(tensors)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return ModelInputs(task, (Probe("forward", "forward", kwargs),), seed, origin="file")


def _accepts_kwargs(fn: Callable[..., Any]) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
