"""Raw-audio probes batched the way speech models' documentation batches them.

A wav2vec2-style feature extractor pads the short clips of a batch with zeros to the longest
one and, for models trained without an attention mask (wav2vec2-base:
``return_attention_mask`` false), normalises each padded row over its whole length: a 1 s
clip beside a 30 s one is scaled up about sqrt(30) and followed by 29 s of near-silence. A
normalisation over time in the feature encoder (the GroupNorm of its first conv layer) then
divides the clip by the spread of a mostly silent row, so its peak grows with the padded
length, which dense noise never shows.

The probes go through the model's own feature extractor (``preprocessor_config.json`` next to
its weights) where it has one that makes ``input_values``, else through the library's
``Wav2Vec2FeatureExtractor`` at its defaults (the same padding rule). Each is a batch of a
:data:`CLIP_SECONDS` clip padded beside a longer one; the longer one's length (samples) is
the ``audio_length`` size family: intermediate lengths (:data:`GROWTH_SECONDS`, ``padded-audio``
probes) while one activation stays cheap, and the declared length (:data:`DECLARED_SECONDS`,
a ``declared-size`` probe) at every level where one forward fits
:attr:`~.budgets.Budget.declared_activation_bytes`; the growth fit predicts past what ran.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from precision_convert.validation.probe.inputs.budgets import Budget
from precision_convert.validation.probe.inputs.layouts import BATCH, DECLARED_SAMPLES_CAP
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    config_value,
    seeded_generator,
)

#: The short clip of the padded batch (the documentation's example pads a 1 s clip).
CLIP_SECONDS = 1
#: The length a batch is padded to that the certificate speaks for: a 30 s chunk, the longest
#: clip speech pipelines batch by default.
DECLARED_SECONDS = 30
#: Intermediate padded lengths the growth fit takes (below the declared one).
GROWTH_SECONDS = (2, 8)
#: Sampling rate when no feature extractor says one (wav2vec2's, HuBERT's, WavLM's).
SAMPLING_RATE = 16_000
#: The size family these probes vary, as the certificate's ``inputs.sizes`` names it.
FAMILY = "audio_length"
#: Sweep kind of the padded batches below the declared length (the ledger's and a time
#: budget's name for them); the declared one is a ``declared-size`` probe.
GROWTH_KIND = "padded-audio"
#: Bytes of one fp32 activation element.
FP32 = 4


def feature_extractor(directory: Path | None) -> Any:
    """The model's own raw-audio feature extractor (one that makes ``input_values``) from
    ``directory``, else ``Wav2Vec2FeatureExtractor`` at its defaults: zero padding, each row
    normalised over its padded length, no attention mask."""
    from transformers import AutoFeatureExtractor, Wav2Vec2FeatureExtractor

    if directory is not None and (directory / "preprocessor_config.json").is_file():
        try:
            found = AutoFeatureExtractor.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError):
            found = None  # an unreadable config: the library's own padding rule still holds
        if found is not None and list(getattr(found, "model_input_names", []))[:1] == [
            "input_values"
        ]:
            return found
    return Wav2Vec2FeatureExtractor()


def _sampling_rate(extractor: Any) -> int:
    rate = getattr(extractor, "sampling_rate", None)
    rate = int(rate) if isinstance(rate, int) and rate > 0 else SAMPLING_RATE
    return min(rate, DECLARED_SAMPLES_CAP // DECLARED_SECONDS)


def padded_batch(extractor: Any, samples: int, seed: int) -> dict[str, torch.Tensor]:
    """A :data:`CLIP_SECONDS` clip and one of ``samples`` through ``extractor``: the short one
    padded to the long one's length, with the attention mask only where it makes one."""
    rate = _sampling_rate(extractor)
    g = seeded_generator(seed, f"padded-audio-{samples}")
    clips = [(0.1 * torch.randn(n, generator=g)).numpy() for n in (CLIP_SECONDS * rate, samples)]
    made = extractor(clips, sampling_rate=rate, padding="longest", return_tensors="pt")
    out = {"input_values": made["input_values"].float()}
    if "attention_mask" in made:
        out["attention_mask"] = made["attention_mask"]
    return out


def audio_bytes(config: Any, samples: int) -> int:
    """The largest fp32 activation of a padded batch of ``samples``: the first conv layer's
    output or the encoder's attention scores, whichever is larger."""
    channels = config_value(config, "conv_dim") or [512]
    strides = config_value(config, "conv_stride") or [5]
    heads = int(config_value(config, "num_attention_heads") or 1)
    frames = samples // math.prod(int(s) for s in strides)
    first = FP32 * BATCH * int(channels[0]) * (samples // int(strides[0]))
    return max(first, FP32 * BATCH * heads * frames * frames)


def padded_audio_probes(
    config: Any,
    chosen: ModelInputs,
    budget: Budget,
    directory: Path | None,
    *,
    cheap: int,
) -> tuple[list[Probe], dict[str, Any]]:
    """The padded batches at :data:`GROWTH_SECONDS` (where one activation is at most
    ``cheap`` bytes) and at :data:`DECLARED_SECONDS` (where it fits the level), and the
    family's record: the length declared, the longest run, and why the declared one did not."""
    extractor = feature_extractor(directory)
    rate = _sampling_rate(extractor)
    declared = DECLARED_SECONDS * rate
    lengths = [
        (s * rate, GROWTH_KIND) for s in GROWTH_SECONDS if audio_bytes(config, s * rate) <= cheap
    ]
    if not lengths:  # a model with many frames a second: the longest padding that fits
        shorter = (int(rate * (CLIP_SECONDS + 2**-k)) for k in range(4))
        lengths = [(n, GROWTH_KIND) for n in shorter if audio_bytes(config, n) <= cheap][:1]
    runs = audio_bytes(config, declared) <= budget.declared_activation_bytes
    if runs:
        lengths.append((declared, "declared-size"))
    probes = []
    for samples, kind in lengths:
        kwargs = {**_extras(chosen), **padded_batch(extractor, samples, chosen.seed)}
        how = {
            "kind": kind,
            FAMILY: samples,
            "clip_samples": CLIP_SECONDS * rate,
            "seed": chosen.seed,
            "feature_extractor": type(extractor).__name__,
        }
        probes.append(
            Probe(
                f"forward:padded-audio@{samples}",
                "forward",
                kwargs,
                sweep=how,
                max_output=budget.max_output,
            )
        )
    run = max((s for s, _ in lengths), default=None)
    record: dict[str, Any] = {"declared": declared, "run": run}
    if not runs:
        record["not_run"] = (
            f"one forward is over the {budget.level} level's declared_activation_bytes "
            f"({budget.declared_activation_bytes >> 20} MiB for one activation)"
        )
    return probes, {FAMILY: record}


def _extras(chosen: ModelInputs) -> dict[str, Any]:
    """The chosen probe's arguments other than the audio and its mask (flags such as
    ``use_cache``)."""
    template = chosen.probes[0].kwargs
    return {k: v for k, v in template.items() if k not in ("input_values", "attention_mask")}
