"""The input of a whole diffusers pipeline: one short seeded end-to-end call.

A prompt, two denoising steps and a decode, at the pipeline's own sizes made small (the
coverage level's latent side, two latent frames for video), so that validation can run the
fp32 pipeline and the converted one end to end in seconds.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from precision_convert.validation.probe.inputs.layouts import (
    LATENT_FRAMES,
    LATENT_SIDE,
    SENTENCES,
    _side,
    smooth_image,
)
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    Seeded,
    config_get,
    parameters_of,
)

#: Denoising steps of the end-to-end run: two exercise the scheduler's update and the
#: transformer on its own output, which one step would not.
PIPELINE_STEPS = 2


def pipeline_inputs(pipe: Any, *, seed: int = 0, latent_side: int = LATENT_SIDE) -> ModelInputs:
    """A short seeded end-to-end call of a diffusers pipeline: prompt, 2 steps, decode.

    Sizes are the pipeline's own defaults, made small: at most ``latent_side`` latents a side
    (the coverage level's) and two latent frames for video, so a real checkpoint runs in
    seconds on a GPU.
    """
    params = parameters_of(pipe.__call__)
    kwargs: dict[str, Any] = {"num_inference_steps": PIPELINE_STEPS}
    if "prompt" in params:
        kwargs["prompt"] = SENTENCES[0]
    if "class_labels" in params:
        kwargs["class_labels"] = [1]
    if "generator" in params:
        kwargs["generator"] = Seeded(seed)
    if "output_type" in params:
        kwargs["output_type"] = "pt"
    denoiser = next(
        (
            getattr(pipe, n)
            for n in ("transformer", "unet", "prior")
            if getattr(pipe, n, None) is not None
        ),
        None,
    )
    scale = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(
        pipe, "vae_scale_factor", None
    )
    if denoiser is not None and scale and "height" in params and "width" in params:
        config = denoiser.config
        latent_h = _side(
            config_get(config, "sample_height") or config_get(config, "sample_size"),
            latent_side,
            latent_side,
        )
        latent_w = _side(
            config_get(config, "sample_width") or config_get(config, "sample_size"),
            latent_side,
            latent_side,
        )
        kwargs["height"], kwargs["width"] = latent_h * int(scale), latent_w * int(scale)
    text_tokens = (
        config_get(denoiser.config, "max_text_seq_length") if denoiser is not None else None
    )
    if "max_sequence_length" in params and text_tokens:
        kwargs["max_sequence_length"] = int(text_tokens)
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    if "num_frames" in params and temporal:
        kwargs["num_frames"] = 1 + int(temporal) * (LATENT_FRAMES - 1)
    if "image" in params and params["image"].default is inspect.Parameter.empty:
        side = kwargs.get("height", 8 * latent_side)
        image = smooth_image(
            torch.Generator().manual_seed(seed), 1, 3, side, kwargs.get("width", side)
        )
        kwargs["image"] = (image + 1) / 2  # pipelines take images in [0, 1]
    probe = Probe("pipeline", "__call__", kwargs, images=True)
    return ModelInputs("pipeline", (probe,), seed)
