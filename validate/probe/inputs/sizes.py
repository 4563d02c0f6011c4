"""Probes at the sizes a model declares: the image side and frame count users generate at.

Overflow can grow with size: a GroupNorm normalises a localized feature by the whole image's
spread, so its peak grows with the side, and position embeddings grow with the frame index.
Probes at small sizes then pass a model that is NaN at 1024 px or 49 frames. So, besides the
small built probes, a sweep runs:

- an autoencoder's encode and decode at its ``sample_size`` (pixels a side);
- a denoiser at its declared latent frames (``sample_frames`` through the temporal
  compression, or ``num_frames``), always, and at its ``sample_size`` (``sample_height`` /
  ``sample_width``) latents a side.

A side runs where the level runs declared sides (:attr:`~.budgets.Budget.declared_sides`:
``standard``, the default, and ``thorough``) and one forward's largest activation fits its
:attr:`~.budgets.Budget.declared_activation_bytes`; otherwise the record says why it was not
run.
Declared-size probes run at batch 1: the size is what they test, not batching. What ran is
:func:`sizes_record`'s record, kept in the certificate's ``inputs.sizes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from precision_convert.validation.probe.inputs.budgets import Budget, bytes_per_token
from precision_convert.validation.probe.inputs.layouts import smooth_image
from precision_convert.validation.probe.inputs.media_probes import encode_decode
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    config_value,
    seeded_generator,
)

#: Bytes of one fp32 activation element.
FP32 = 4
#: The sweep kind of a probe at a declared size: every way of loading runs it.
DECLARED = "declared-size"


def _first(value: Any) -> int | None:
    """An int from a config value that may be a [height, width] pair."""
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return int(value) if isinstance(value, int | float) and value > 0 else None


def declared_side(config: Any) -> int | None:
    """The side the config declares (``sample_size`` or ``sample_height``), if any."""
    return _first(config_value(config, "sample_size", "sample_height"))


def declared_frames(config: Any) -> int | None:
    """Latent frames a video denoiser declares: ``sample_frames`` through the temporal
    compression (CogVideoX: 49 frames, 4x: 13 latent frames), else ``num_frames``."""
    frames = _first(config_value(config, "sample_frames"))
    ratio = _first(config_value(config, "temporal_compression_ratio"))
    if frames is not None and ratio is not None:
        return (frames - 1) // ratio + 1
    return frames if frames is not None else _first(config_value(config, "num_frames"))


def autoencoder_bytes(config: Any, side: int) -> int:
    """The largest fp32 activation of an autoencoder pass at ``side`` pixels (batch 1): each
    level's channels at its resolution, halved per level."""
    channels = config_value(config, "block_out_channels") or [128]
    return max(FP32 * int(c) * (side >> i) ** 2 for i, c in enumerate(channels))


def _at_batch_one(value: Any) -> Any:
    """``value`` with every batched tensor cut to its first sample."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] > 1:
        return value[:1]
    if isinstance(value, Mapping):
        return {k: _at_batch_one(v) for k, v in value.items()}
    return value


def _fits(activation_bytes: int, budget: Budget) -> bool:
    """Whether a declared side whose largest activation takes ``activation_bytes`` runs."""
    return budget.declared_sides and activation_bytes <= budget.declared_activation_bytes


def _size(declared: int | None, run: int, budget: Budget) -> dict[str, Any]:
    """A size's record; a declared side larger than the one run says why it was not run."""
    record: dict[str, Any] = {"declared": declared, "run": run}
    if declared is not None and declared > run:
        record["not_run"] = (
            f"the {budget.level} level runs no declared sides (standard and thorough do)"
            if not budget.declared_sides
            else f"one forward is over the {budget.level} level's declared_activation_bytes "
            f"({budget.declared_activation_bytes >> 20} MiB for one activation)"
        )
    return record


def declared_size_probes(
    model: Any, chosen: ModelInputs, budget: Budget
) -> tuple[list[Probe], dict[str, Any]]:
    """Probes at the sizes ``model`` declares beyond the built ones, and the sizes record."""
    config = getattr(model, "config", None)
    first = chosen.probes[0] if chosen.probes else None
    if config is None or first is None:
        return [], {}
    if chosen.task == "vae" and first.method == "encode":
        return _autoencoder(config, chosen, budget)
    if chosen.task == "denoise" and first.method == "forward" and "img_ids" not in first.kwargs:
        return _denoiser(model, config, chosen, budget)
    return [], {}


def _autoencoder(
    config: Any, chosen: ModelInputs, budget: Budget
) -> tuple[list[Probe], dict[str, Any]]:
    encode = chosen.probes[0]
    decode = next((p for p in chosen.probes if p.method == "decode"), None)
    name, image = next(
        ((k, v) for k, v in encode.kwargs.items() if isinstance(v, torch.Tensor)), (None, None)
    )
    declared = declared_side(config)
    if name is None or image is None or image.dim() != 4 or declared is None:
        return [], {}
    built = int(image.shape[-1])
    if declared <= built or not _fits(autoencoder_bytes(config, declared), budget):
        return [], {"image_side": _size(declared, built, budget)}
    side = f"{declared}x{declared}"
    g = seeded_generator(chosen.seed, f"declared-{side}")
    pixels = smooth_image(g, 1, int(image.shape[1]), declared, declared)
    how = {"kind": DECLARED, "height": declared, "width": declared, "seed": chosen.seed}
    probes = encode_decode(f"@{side}", {name: pixels}, decode, how, budget)
    return probes, {"image_side": _size(declared, declared, budget)}


def _denoiser(
    model: Any, config: Any, chosen: ModelInputs, budget: Budget
) -> tuple[list[Probe], dict[str, Any]]:
    template = chosen.probes[0].kwargs
    latent_name = next(iter(template))
    latent = template[latent_name]
    if not isinstance(latent, torch.Tensor) or latent.dim() not in (4, 5):
        return [], {}
    channels = int(config_value(config, "in_channels") or latent.shape[1])
    # (B, C, F, H, W) or (B, F, C, H, W): the frame axis is the one that is not the channels'.
    frame_axis = (2 if latent.shape[1] == channels else 1) if latent.dim() == 5 else None
    built_side, built_frames = (
        int(latent.shape[-1]),
        (int(latent.shape[frame_axis]) if frame_axis is not None else None),
    )
    side = declared_side(config)
    frames = declared_frames(config) if frame_axis is not None else None
    run_frames = max(frames or 0, built_frames or 0) or None
    patch = _first(config_value(config, "patch_size")) or 1
    tokens = (run_frames or 1) * ((side or built_side) // patch) ** 2
    fits = _fits(tokens * bytes_per_token(model, logits=False), budget)
    run_side = side if side is not None and side > built_side and fits else built_side
    record: dict[str, Any] = {"latent_side": _size(side, run_side, budget)}
    if frame_axis is not None:
        record["latent_frames"] = {"declared": frames, "run": run_frames}
    if run_side == built_side and run_frames == built_frames:
        return [], record
    shape = list(latent.shape)
    shape[0], shape[-2], shape[-1] = 1, run_side, run_side
    if frame_axis is not None:
        shape[frame_axis] = int(run_frames or 1)
    label = f"{run_side}x{run_side}" + (f"x{run_frames}f" if frame_axis is not None else "")
    bigger = torch.randn(*shape, generator=seeded_generator(chosen.seed, f"declared-{label}"))
    kwargs = {**_at_batch_one(dict(template)), latent_name: bigger}
    how = {
        "kind": DECLARED,
        "latent_side": run_side,
        **({"latent_frames": run_frames} if frame_axis is not None else {}),
        "seed": chosen.seed,
    }
    probe = Probe(f"forward@{label}", "forward", kwargs, sweep=how, max_output=budget.max_output)
    return [probe], record
