"""The input of a whole diffusers pipeline: seeded end-to-end calls, small and at its defaults.

Two calls of a prompt, two denoising steps and a decode:

- ``pipeline``: the pipeline's own sizes made small (the coverage level's latent side, two
  latent frames for video), so that validation runs the fp32 pipeline and the converted one
  end to end in seconds (the re-save round trip runs on this one only);
- ``pipeline@<height>x<width>[x<frames>f]``: the sizes the call defaults to, where users
  generate (SD-style: ``unet.config.sample_size * vae_scale_factor``, 1024 px for SDXL's
  declaration; CogVideoX: ``sample_frames``, 49). Overflow can grow with the image side and
  frame count, so a run at small sizes alone passes a pipeline that is NaN at its defaults.
  The default frame count runs where the call at the small sides fits
  :attr:`~.budgets.Budget.declared_activation_bytes`; the default side where the level runs
  declared sides (:attr:`~.budgets.Budget.declared_sides`) and the largest fp32 activation of
  the call (the denoiser's tokens, the VAE's decode) fits it, else the small side; the sizes
  record says why. The call is the library's default: untiled unless the pipeline tiles by
  default.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from precision_convert.validation.probe.inputs.budgets import Budget, bytes_per_token
from precision_convert.validation.probe.inputs.layouts import (
    DECLARED_LENGTH_CAP,
    LATENT_FRAMES,
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
from precision_convert.validation.probe.inputs.sizes import DECLARED, _size, autoencoder_bytes

#: Denoising steps of the end-to-end run: two exercise the scheduler's update and the
#: transformer on its own output, which one step would not.
PIPELINE_STEPS = 2
#: The name of the small end-to-end call.
SMALL = "pipeline"


def pipeline_inputs(pipe: Any, budget: Budget, *, seed: int = 0) -> ModelInputs:
    """Seeded end-to-end calls of a diffusers pipeline (prompt, 2 steps, decode): at small
    sizes (at most the level's ``pipeline_latent_side`` latents a side, two latent frames),
    then at the sizes the call defaults to where they differ (see the module's docstring);
    the record of sizes says which ran."""
    params = parameters_of(pipe.__call__)
    kwargs = _common(params, seed)
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
    config = denoiser.config if denoiser is not None else None
    text_tokens = config_get(config, "max_text_seq_length")
    if "max_sequence_length" in params and text_tokens:
        kwargs["max_sequence_length"] = _side(text_tokens, 0, DECLARED_LENGTH_CAP)
    small, default = dict(kwargs), dict(kwargs)
    sizes: dict[str, Any] = {}
    sides = bool(scale and "height" in params and "width" in params and config is not None)
    small_side = {
        axis: _side(
            config_get(config, f"sample_{axis}") or config_get(config, "sample_size"),
            budget.pipeline_latent_side,
            budget.pipeline_latent_side,
        )
        * int(scale or 1)
        for axis in (("height", "width") if sides else ())
    }
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    if "num_frames" in params and temporal:
        small["num_frames"] = default["num_frames"] = 1 + int(temporal) * (LATENT_FRAMES - 1)
        frames = _default_frames(params, config)
        if frames is not None:
            # Sized by what runs: the declared count where the call at the small sides fits.
            if not sides or (
                _activation_bytes(pipe, denoiser, small_side, frames, int(scale or 1))
                <= budget.declared_activation_bytes
            ):
                default["num_frames"] = frames
            run = max(default["num_frames"], small["num_frames"])
            sizes["frames"] = _size(frames, run, budget, side=False)
    if sides:
        side_of: dict[str, int] = {}
        declared: dict[str, int | None] = {}
        for axis in ("height", "width"):
            value = config_get(config, f"sample_{axis}") or config_get(config, "sample_size")
            small[axis] = small_side[axis]
            declared[axis] = _side(value, 0, 1 << 30) * int(scale or 1) or None
            side_of[axis] = declared[axis] or small[axis]
        fits = budget.declared_sides and (
            _activation_bytes(pipe, denoiser, side_of, default.get("num_frames"), int(scale or 1))
            <= budget.declared_activation_bytes
        )
        for axis in ("height", "width"):
            default[axis] = side_of[axis] if fits else small[axis]
            sizes[axis] = _size(declared[axis], max(default[axis], small[axis]), budget)
    image_side = 8 * budget.pipeline_latent_side  # an image input's side without a height
    probes = [_probe(SMALL, small, params, seed, image_side)]
    if default != small:
        label = "x".join(str(default[k]) for k in ("height", "width") if k in default) + (
            f"x{default['num_frames']}f" if "num_frames" in default else ""
        )
        how = {"kind": DECLARED, **_sizes_of(default), "seed": seed}
        probes.append(_probe(f"{SMALL}@{label}", default, params, seed, image_side, how))
    return ModelInputs("pipeline", tuple(probes), seed, coverage=budget.level, sizes=sizes)


def _common(params: dict[str, inspect.Parameter], seed: int) -> dict[str, Any]:
    """The arguments every end-to-end call shares: prompt, steps, seed, tensor output."""
    kwargs: dict[str, Any] = {"num_inference_steps": PIPELINE_STEPS}
    if "prompt" in params:
        kwargs["prompt"] = SENTENCES[0]
    if "class_labels" in params:
        kwargs["class_labels"] = [1]
    if "generator" in params:
        kwargs["generator"] = Seeded(seed)
    if "output_type" in params:
        kwargs["output_type"] = "pt"
    return kwargs


def _default_frames(params: dict[str, inspect.Parameter], config: Any) -> int | None:
    """The frame count the call defaults to: its own default, else (CogVideoX: ``None``
    there) the denoiser's ``sample_frames``, as the pipeline falls back to it."""
    default = params["num_frames"].default
    if isinstance(default, int) and default > 0:
        return default
    frames = config_get(config, "sample_frames")
    return int(frames) if isinstance(frames, int) and frames > 0 else None


def _activation_bytes(
    pipe: Any, denoiser: Any, sides: dict[str, int], frames: int | None, scale: int
) -> int:
    """The largest fp32 activation of the call at ``sides`` pixels and ``frames`` (batch 1,
    as the declared-size probes of one model count it): the denoiser's tokens or the VAE's
    decode, whichever is larger."""
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    latent_frames = (frames - 1) // int(temporal) + 1 if frames and temporal else 1
    patch = scale * (config_get(denoiser.config, "patch_size") or 1)  # pixels a token
    tokens = latent_frames * (sides["height"] // patch) * (sides["width"] // patch)
    denoise = tokens * bytes_per_token(denoiser, logits=False)
    vae = getattr(pipe, "vae", None)
    side = max(sides.values())
    decode = autoencoder_bytes(vae.config, side) * (frames or 1) if vae is not None else 0
    return max(denoise, decode)


def _sizes_of(kwargs: dict[str, Any]) -> dict[str, int]:
    return {k: kwargs[k] for k in ("height", "width", "num_frames") if k in kwargs}


def _probe(
    name: str,
    kwargs: dict[str, Any],
    params: dict[str, inspect.Parameter],
    seed: int,
    image_side: int,
    how: dict[str, Any] | None = None,
) -> Probe:
    """One end-to-end call; an image-to-image pipeline gets a smooth seeded image of the
    call's size (``image_side`` a side when the call takes no height)."""
    kwargs = dict(kwargs)
    if "image" in params and params["image"].default is inspect.Parameter.empty:
        side = kwargs.get("height", image_side)
        image = smooth_image(
            torch.Generator().manual_seed(seed), 1, 3, side, kwargs.get("width", side)
        )
        kwargs["image"] = (image + 1) / 2  # pipelines take images in [0, 1]
    return Probe(name, "__call__", kwargs, images=True, sweep=how or {})
