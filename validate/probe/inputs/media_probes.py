"""Sweep probes of the families fed no token ids: denoisers, autoencoders, vision and speech.

- diffusion denoisers: timesteps across the schedule, including its first step (t=999 on the
  usual scale, sigma 1.0 for models taking t in [0, 1]), and realistic conditioning magnitudes;
- autoencoders: larger images, each encoded and its latents decoded;
- vision encoders: normalized-image contrast (speech encoders: :mod:`.audio_probes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from precision_convert.validation.probe.inputs.budgets import Budget
from precision_convert.validation.probe.inputs.layouts import (
    VAE_SCALE,
    at_latent_side,
    scales_timestep,
    smooth_image,
)
from precision_convert.validation.probe.inputs.model_inputs import (
    FromOutput,
    ModelInputs,
    Probe,
    seeded_generator,
)

#: Training schedule length assumed when no scheduler says otherwise (DDPM/flow-matching).
TRAIN_TIMESTEPS = 1000
#: Magnitude of the outlier channels in the realistic conditioning probe: CLIP text encoders'
#: hidden states carry a few channels near +-30, the rest near unit scale.
CONDITIONING_OUTLIER = 30.0
#: SDXL's crop in the conditioning probe: a quarter of the image side from the top left.
CROP_FRACTION = 4


def timestep_values(model: Any, budget: Budget, train_timesteps: int | None) -> list[Any]:
    """The timesteps ``budget`` sweeps, on the scale the model takes them.

    Most denoisers take the scheduler's integer timesteps (0..999): they are fed as int64,
    as DDPM/DDIM/PNDM schedulers hand them on, so a bf16 candidate sees 999 and not its bf16
    rounding (1000). Models that scale t in [0, 1] themselves (Flux) get sigma values that are
    exact in bf16 and fp16 — and stay exact once the model multiplies them by 1000.
    """
    steps = int(train_timesteps or TRAIN_TIMESTEPS)
    if scales_timestep(model):
        exact = (1.0, 0.5, 0.25, 0.125, 0.0)
        wanted = {min(exact, key=lambda e: abs(e - f)) for f in budget.timesteps}
        return sorted(wanted, reverse=True)
    return sorted({round(f * (steps - 1)) for f in budget.timesteps}, reverse=True)


def timestep_probes(
    model: Any, chosen: ModelInputs, budget: Budget, train_timesteps: int | None
) -> list[Probe]:
    """The chosen denoiser probe at the budget's other timesteps, and (``conditioning``
    budgets) at the first step with text-encoder-like conditioning."""
    first = chosen.probes[0]
    template = first.kwargs
    current = template["timestep"]
    batch = int(current.shape[0]) if isinstance(current, torch.Tensor) and current.dim() else 1
    scaled = scales_timestep(model)
    probes = []
    values = timestep_values(model, budget, train_timesteps)
    chosen_value = float(current.flatten()[0]) if isinstance(current, torch.Tensor) else None
    for t in values:
        if chosen_value is not None and float(t) == chosen_value:
            continue  # the chosen probe already runs at this timestep
        value = torch.full((batch,), float(t)) if scaled else torch.full((batch,), int(t))
        probes.append(
            Probe(
                f"forward:t={t:g}",
                "forward",
                {**template, "timestep": value},
                sweep={"kind": "timestep", "timestep": t, "train_timesteps": train_timesteps},
                max_output=budget.max_output,
            )
        )
    if budget.conditioning:
        first_step = values[0]
        value = (
            torch.full((batch,), float(first_step))
            if scaled
            else torch.full((batch,), int(first_step))
        )
        kwargs = {**template, "timestep": value}
        changed = []
        for key in ("encoder_hidden_states", "pooled_projections", "encoder_hidden_states_image"):
            tensor = kwargs.get(key)
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                kwargs[key] = realistic_conditioning(
                    tensor.shape, seeded_generator(chosen.seed, key)
                )
                changed.append(key)
        latent = next(iter(template.values()))
        added = kwargs.get("added_cond_kwargs")
        crop: dict[str, Any] = {}
        if isinstance(added, Mapping) and "time_ids" in added and isinstance(latent, torch.Tensor):
            # SDXL's time ids with a crop off the origin (users crop; the default call does not).
            height, width = (int(n) for n in latent.shape[-2:])
            offset = (VAE_SCALE * height // CROP_FRACTION, VAE_SCALE * width // CROP_FRACTION)
            kwargs = at_latent_side(kwargs, height, width, crop=offset)
            crop = {"crop": list(offset)}
            changed.append("added_cond_kwargs.time_ids")
        if changed:
            probes.append(
                Probe(
                    "forward:conditioning",
                    "forward",
                    kwargs,
                    sweep={
                        "kind": "conditioning",
                        "timestep": first_step,
                        "arguments": changed,
                        "seed": chosen.seed,
                        "outlier": CONDITIONING_OUTLIER,
                        **crop,
                    },
                    max_output=budget.max_output,
                )
            )
    return probes


def realistic_conditioning(shape: Sequence[int], g: torch.Generator) -> torch.Tensor:
    """Text-encoder-like states: unit-scale values plus two outlier channels near +-30."""
    values = torch.randn(*shape, generator=g)
    if len(shape) >= 2 and shape[-1] >= 4:
        channels = torch.randperm(shape[-1], generator=g)[:2]
        signs = torch.tensor([1.0, -1.0])
        values[..., channels] = CONDITIONING_OUTLIER * signs + 0.5 * values[..., channels]
    return values


def image_size_probes(chosen: ModelInputs, budget: Budget) -> list[Probe]:
    """Autoencoder encode/decode pairs on images larger than the built one by each of the
    budget's ``image_scales``."""
    encode = chosen.probes[0]
    decode = next((p for p in chosen.probes if p.method == "decode"), None)
    name, image = next(
        ((k, v) for k, v in encode.kwargs.items() if isinstance(v, torch.Tensor)), (None, None)
    )
    if name is None or image is None or decode is None:
        return []
    probes: list[Probe] = []
    *lead, h, w = image.shape
    for scale in budget.image_scales:
        side = f"{h * scale}x{w * scale}"
        g = seeded_generator(chosen.seed, f"image-{side}")
        bigger = smooth_image(g, *lead, h * scale, w * scale)
        how = {"kind": "image-size", "height": h * scale, "width": w * scale, "seed": chosen.seed}
        probes += encode_decode(f"@{side}", {name: bigger}, decode, how, budget)
    return probes


def encode_decode(
    label: str, kwargs: dict[str, Any], decode: Probe | None, how: dict[str, Any], budget: Budget
) -> list[Probe]:
    """An autoencoder probe pair: ``encode`` on ``kwargs``, then ``decode`` of its latents (the
    chosen layout's decode probe, re-pointed at this encode)."""
    probes = [Probe(f"encode{label}", "encode", kwargs, sweep=how, max_output=budget.max_output)]
    if decode is not None:
        z_name = next(k for k, v in decode.kwargs.items() if isinstance(v, FromOutput))
        probes.append(
            Probe(
                f"decode{label}",
                "decode",
                {**decode.kwargs, z_name: FromOutput(f"encode{label}")},
                images=True,
                sweep=how,
                max_output=budget.max_output,
            )
        )
    return probes


#: ImageNet-normalized pixels span about [-2.1, 2.6]; the built images span [-1, 1].
NORMALIZED_SPAN = 2.4


def contrast_probes(chosen: ModelInputs, budget: Budget) -> list[Probe]:
    """Vision inputs at the full range of normalized pixels (high-contrast images)."""
    if budget.level == "quick":
        return []
    template = chosen.probes[0].kwargs
    key = next(
        (k for k in ("pixel_values", "image") if isinstance(template.get(k), torch.Tensor)), None
    )
    if key is None:
        return []
    kwargs = {**template, key: (template[key] * NORMALIZED_SPAN).clamp(-2.1, 2.6)}
    how = {"kind": "contrast", "scale": NORMALIZED_SPAN, "clamp": [-2.1, 2.6]}
    return [Probe("forward:contrast", "forward", kwargs, sweep=how, max_output=budget.max_output)]
