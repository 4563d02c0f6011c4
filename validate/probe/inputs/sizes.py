"""Probes at the sizes a model declares: the image side and frame count users generate at.

Overflow can grow with size: a GroupNorm normalises a localized feature by the whole image's
spread, so its peak grows with the side, and position embeddings grow with the frame index.
Probes at small sizes then pass a model that is NaN at 1024 px or 49 frames. So, besides the
small built probes, a sweep runs:

- an autoencoder's encode and decode at its ``sample_size`` (pixels a side);
- a raw-audio model on batches its feature extractor pads, up to 30 s (:mod:`.audio_probes`);
- a denoiser at its declared latent frames (``sample_frames`` through the temporal
  compression, or ``num_frames``), at every level where one forward at the built side fits
  :attr:`~.budgets.Budget.declared_activation_bytes`, and at its ``sample_size``
  (``sample_height`` / ``sample_width``) latents a side.

A side runs where the level runs declared sides (:attr:`~.budgets.Budget.declared_sides`:
``standard``, the default, and ``thorough``) and one forward's largest activation fits its
:attr:`~.budgets.Budget.declared_activation_bytes`; otherwise the record says why it was not
run.
Declared-size probes run at batch 1: the size is what they test, not batching. What ran is
the record :func:`declared_size_probes` returns, kept in the certificate's ``inputs.sizes``.

So that calibration can fit how each module's peak grows with size
(:mod:`~precision_convert.conversion.analysis.growth`) and predict it at a declared size not
run, every level also runs cheap intermediate sizes (``size-growth`` probes, batch 1) where
the declared size is larger than the built one: 2x and 4x the built side and frame count,
below the declared one (a side halved instead where fewer fit), while one activation stays
under :data:`GROWTH_ACTIVATION_BYTES`. :func:`probe_sizes` names each probe's size per family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from precision_convert.validation.probe.inputs.audio_probes import FAMILY as AUDIO
from precision_convert.validation.probe.inputs.audio_probes import padded_audio_probes
from precision_convert.validation.probe.inputs.budgets import Budget, bytes_per_token
from precision_convert.validation.probe.inputs.images import smooth_image
from precision_convert.validation.probe.inputs.layouts import at_latent_side
from precision_convert.validation.probe.inputs.media_probes import encode_decode
from precision_convert.validation.probe.inputs.model_inputs import (
    FromOutput,
    ModelInputs,
    Probe,
    config_value,
    seeded_generator,
)

#: Bytes of one fp32 activation element.
FP32 = 4
#: Sweep kinds of the probes made here: at a declared size, and at an intermediate one.
DECLARED = "declared-size"
GROWTH = "size-growth"
#: Intermediate sizes, as multiples of the built one (those below the declared size run).
GROWTH_SCALES = (2, 4)
#: Smallest image side (pixels: an 8x autoencoder's 4 latents) and latent side an
#: intermediate size may halve down to.
SMALLEST_IMAGE_SIDE = 32
SMALLEST_LATENT_SIDE = 8
#: Bytes the largest fp32 activation of one intermediate-size probe may take: these run at
#: every level, so they stay cheap (an SD-1.5-sized VAE at 256 px takes 32 MiB).
GROWTH_ACTIVATION_BYTES = 256 << 20
#: The size families probes vary, as the certificate's ``inputs.sizes`` names them.
FAMILIES = ("image_side", "latent_side", "latent_frames", "sequence_length", AUDIO)


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


def _growth_sizes(built: int, declared: int | None, smallest: int) -> list[int]:
    """The intermediate sizes a fit takes when the declared size is larger than the built one:
    the :data:`GROWTH_SCALES` multiples of the built size below the declared one, and where
    those are fewer, halvings of the built size down to ``smallest`` (so that the family runs
    at three sizes or more)."""
    if declared is None or declared <= built:
        return []
    above = [built * k for k in GROWTH_SCALES if built * k < declared]
    below: list[int] = []
    size = built
    while len(above) + len(below) < len(GROWTH_SCALES) and size // 2 >= smallest:
        size //= 2
        below.insert(0, size)
    return below + above


def _cheap(activation_bytes: int) -> bool:
    return activation_bytes <= GROWTH_ACTIVATION_BYTES


def _size(
    declared: int | None,
    run: int | None,
    budget: Budget,
    *,
    side: bool = True,
    limit: int | None = None,
) -> dict[str, Any]:
    """A size's record; a declared size larger than the one run says why it was not run
    (``side``: a side, which a level may run none of; frame counts run at every level), and
    the largest size the model can run at where its config bounds it (``limit``)."""
    record: dict[str, Any] = {"declared": declared, "run": run}
    if limit is not None:
        record["limit"] = limit
    if declared is not None and declared > (run or 0):
        record["not_run"] = (
            f"the {budget.level} level runs no declared sides (standard and thorough do)"
            if side and not budget.declared_sides
            else f"one forward is over the {budget.level} level's declared_activation_bytes "
            f"({budget.declared_activation_bytes >> 20} MiB for one activation)"
        )
    return record


def declared_size_probes(
    model: Any, chosen: ModelInputs, budget: Budget, directory: Path | None = None
) -> tuple[list[Probe], dict[str, Any]]:
    """Probes at the sizes ``model`` declares beyond the built ones, and the sizes record
    (``directory``: where the model was loaded from, whose feature extractor pads audio)."""
    config = getattr(model, "config", None)
    first = chosen.probes[0] if chosen.probes else None
    if config is None or first is None:
        return [], {}
    audio = first.kwargs.get("input_values")
    if chosen.task == "speech" and isinstance(audio, torch.Tensor) and audio.dim() == 2:
        return padded_audio_probes(config, chosen, budget, directory, cheap=GROWTH_ACTIVATION_BYTES)
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
    runs = declared > built and _fits(autoencoder_bytes(config, declared), budget)
    sides = [
        s
        for s in _growth_sizes(built, declared, SMALLEST_IMAGE_SIDE)
        if _cheap(autoencoder_bytes(config, s))
    ]
    probes: list[Probe] = []
    for side, kind in [*((s, GROWTH) for s in sides), *([(declared, DECLARED)] if runs else [])]:
        label = f"{side}x{side}"
        g = seeded_generator(chosen.seed, f"declared-{label}")
        pixels = smooth_image(g, 1, int(image.shape[1]), side, side)
        how = {"kind": kind, "height": side, "width": side, "seed": chosen.seed}
        probes += encode_decode(f"@{label}", {name: pixels}, decode, how, budget)
    return probes, {"image_side": _size(declared, declared if runs else built, budget)}


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
    patch = _first(config_value(config, "patch_size")) or 1
    per_token = bytes_per_token(model, logits=False)
    # Declared frames run at every level, at the built side, where one forward fits: a
    # config may declare a million frames, and the probe is sized by what runs, not by it.
    frames_fit = (frames or 0) * (built_side // patch) ** 2 * per_token
    if frames is not None and frames_fit > budget.declared_activation_bytes:
        run_frames = built_frames
    else:
        run_frames = max(frames or 0, built_frames or 0) or None
    fits = _fits((run_frames or 1) * ((side or built_side) // patch) ** 2 * per_token, budget)
    run_side = side if side is not None and side > built_side and fits else built_side
    record: dict[str, Any] = {
        "latent_side": _size(side, run_side, budget, limit=_side_limit(config, side, patch))
    }
    if frame_axis is not None:
        record["latent_frames"] = _size(frames, run_frames, budget, side=False)
    made = Latents(template, latent_name, latent.shape, frame_axis, chosen.seed, budget)
    probes = [
        made.probe(s, built_frames, GROWTH)
        for s in _growth_sizes(built_side, side, SMALLEST_LATENT_SIDE)
        if _cheap(per_token * (built_frames or 1) * (s // patch) ** 2)
    ]
    if frame_axis is not None and built_frames is not None:
        probes += [
            made.probe(built_side, f, GROWTH)
            for f in _growth_sizes(built_frames, frames, built_frames)
            if _cheap(per_token * f * (built_side // patch) ** 2)
        ]
    if run_side != built_side or run_frames != built_frames:
        probes.append(made.probe(run_side, run_frames, DECLARED))
    return probes, record


def _side_limit(config: Any, declared: int | None, patch: int) -> int | None:
    """The largest latent side a denoiser runs at: a cropped position table's
    (``pos_embed_max_size`` patches, SD3), or the declared side where learned positions fix
    it (CogVideoX-5B-I2V)."""
    most = _first(config_value(config, "pos_embed_max_size"))
    if most is not None:
        return most * patch
    return declared if config_value(config, "use_learned_positional_embeddings") else None


@dataclass(frozen=True)
class Latents:
    """Makes a denoiser's probes at other latent sides and frame counts from its chosen one."""

    template: Mapping[str, Any]
    name: str  # the latent argument
    shape: torch.Size  # the chosen latents'
    frame_axis: int | None
    seed: int
    budget: Budget

    def probe(self, side: int, frames: int | None, kind: str) -> Probe:
        """The chosen probe at batch 1 on seeded latents ``side`` a side (and ``frames``)."""
        shape = list(self.shape)
        shape[0], shape[-2], shape[-1] = 1, side, side
        if self.frame_axis is not None:
            shape[self.frame_axis] = int(frames or 1)
        label = f"{side}x{side}" + (f"x{frames}f" if self.frame_axis is not None else "")
        g = seeded_generator(self.seed, f"declared-{label}")
        kwargs = {**_at_batch_one(dict(self.template)), self.name: torch.randn(*shape, generator=g)}
        kwargs = at_latent_side(kwargs, side, side)  # SDXL's time ids: the call at this size
        how = {
            "kind": kind,
            "latent_side": side,
            **({"latent_frames": frames} if self.frame_axis is not None else {}),
            "seed": self.seed,
        }
        return Probe(
            f"forward@{label}", "forward", kwargs, sweep=how, max_output=self.budget.max_output
        )


def probe_sizes(config: Any, inputs: ModelInputs) -> dict[str, dict[str, int]]:
    """Per probe, its size in each family it varies: an autoencoder's image side (a decode
    takes its encode's), a denoiser's latent side and frames, a padded audio batch's length
    (samples), a token model's sequence
    length (rows given ``position_ids`` offsets left out: their positions, not their length,
    are what they probe)."""
    out: dict[str, dict[str, int]] = {}
    argument = (inputs.limits or {}).get("argument")
    channels = config_value(config, "in_channels") if config is not None else None
    for probe in inputs.probes:
        found: dict[str, int] = {}
        tensors = [v for v in probe.kwargs.values() if isinstance(v, torch.Tensor)]
        if inputs.task == "vae" and probe.method == "encode":
            image = next((t for t in tensors if t.dim() == 4), None)
            if image is not None:
                found["image_side"] = int(image.shape[-1])
        elif inputs.task == "vae":
            source = next((v for v in probe.kwargs.values() if isinstance(v, FromOutput)), None)
            found = dict(out.get(source.probe, {})) if source is not None else {}
        elif inputs.task == "denoise" and probe.method == "forward":
            latent = next(iter(probe.kwargs.values()), None)
            if isinstance(latent, torch.Tensor) and latent.dim() in (4, 5):
                found["latent_side"] = int(latent.shape[-1])
                if latent.dim() == 5:
                    found["latent_frames"] = int(
                        latent.shape[2 if latent.shape[1] == channels else 1]
                    )
        elif AUDIO in probe.sweep:
            found[AUDIO] = int(probe.sweep[AUDIO])
        elif argument and probe.method == "forward" and "position_ids" not in probe.kwargs:
            ids = probe.kwargs.get(argument)
            lead = (probe.prefix or {}).get(argument)  # rows continuing a cached prefix
            if isinstance(ids, torch.Tensor) and ids.dim():
                extra = int(lead.shape[-1]) if isinstance(lead, torch.Tensor) else 0
                found["sequence_length"] = int(ids.shape[-1]) + extra
        if found:
            out[probe.name] = found
    return out


def declared_bounds(inputs: ModelInputs) -> dict[str, tuple[int | None, int | None]]:
    """Per size family, the size the model declares as its default and the largest it
    declares it runs at (None where it declares none): a token model's limit is its
    position limit."""
    sizes = inputs.sizes or {}
    out: dict[str, tuple[int | None, int | None]] = {}
    for family in FAMILIES:
        record = sizes.get(family)
        if isinstance(record, Mapping):
            out[family] = (record.get("declared") or None, record.get("limit") or None)
    limit = (inputs.limits or {}).get("position_limit")
    if isinstance(limit, int) and limit > 0:
        out["sequence_length"] = (None, limit)
    return out
