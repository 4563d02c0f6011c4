"""The certificate runs a model on the inputs its real call feeds: an SDXL UNet on the time ids
its pipeline computes at each size run (1024s at the default 1024 px call), a speech model on
a batch its feature extractor pads. Each forward argument's range is recorded, and an argument
never fed or never varied is listed as not covered.

The overflows are real (``tests/_models.py``): ``sdxl_conditioned_unet(planted=True)`` sets
one unit of a real diffusers UNet's added-conditioning embedding to read the size ids through
their sinusoidal features at 1024, so it passes fp16's limit only at the default call;
``wav2vec2_base(planted=True)`` scales the gains of a real wav2vec2's GroupNorm over time, so a
1 s clip zero-padded to 30 s beside a long one passes it while dense audio stays under half.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.validation.certify.card_sizes import arguments_run
from precision_convert.validation.probe.inputs.arguments import NEVER_FED, argument_ranges
from precision_convert.validation.probe.inputs.layouts import input_candidates, sdxl_time_ids
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs, Probe
from precision_convert.validation.probe.inputs.sizes import probe_sizes
from precision_convert.validation.probe.inputs.sweep import sweep

#: SDXL's default call: 1024 px, 128 latents a side.
DEFAULT_LATENT = 128
PLANTED_UNIT = "add_embedding.linear_1"
#: A padded batch's length: a 1 s clip beside a 30 s one at 16 kHz.
CLIP, PADDED = 16_000, 480_000


def _swept(model: Any, level: str = "standard", directory: Path | None = None) -> ModelInputs:
    return sweep(model, next(input_candidates(model)), level, directory=directory)


def _probe(inputs: ModelInputs, name: str) -> Probe:
    return next(p for p in inputs.probes if p.name == name)


def _in(dtype: torch.dtype, value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, dict):
        return {k: _in(dtype, v) for k, v in value.items()}
    return value


def _run(model: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        out = model(**_in(dtype, kwargs))
    tensor = out.sample if hasattr(out, "sample") else out.last_hidden_state
    return tensor.float()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
    )


# --------------------------------------------------------------------------- SDXL


def test_sdxl_probes_feed_the_time_ids_of_the_size_they_run() -> None:
    """Every UNet probe gets the time ids the pipeline computes at its size (original = target
    = the call's pixels, crop 0): 1024s at the declared 128 latents; the conditioning probe
    adds a crop off the origin."""
    inputs = _swept(_models.sdxl_conditioned_unet())
    sides = set()
    for probe in inputs.probes:
        side = int(probe.kwargs["sample"].shape[-1])
        crop = (64, 64) if probe.sweep.get("kind") == "conditioning" else (0, 0)
        expected = sdxl_time_ids(
            8 * side, 8 * side, crop=crop, batch=probe.kwargs["sample"].shape[0]
        )
        assert torch.equal(probe.kwargs["added_cond_kwargs"]["time_ids"], expected), probe.name
        sides.add(side)
    assert DEFAULT_LATENT in sides and len(sides) >= 3, sides
    declared = _probe(inputs, f"forward@{DEFAULT_LATENT}x{DEFAULT_LATENT}")
    assert declared.kwargs["added_cond_kwargs"]["time_ids"].eq(1024).sum() == 4


def test_planted_sdxl_unet_overflows_fp16_only_at_the_default_call() -> None:
    """The reproduction, on the probes the sweep makes: fp32 is finite on each; a plain fp16
    cast is NaN on the 1024 px probe and finite on the built (256 px) one."""
    planted = _models.sdxl_conditioned_unet(planted=True)
    inputs = _swept(planted)
    built, declared = inputs.probes[0], _probe(inputs, f"forward@{DEFAULT_LATENT}x{DEFAULT_LATENT}")
    assert _run(planted, dict(declared.kwargs)).isfinite().all()
    half = _models.sdxl_conditioned_unet(planted=True).half()
    assert _run(half, dict(built.kwargs)).isfinite().all()
    assert not _run(half, dict(declared.kwargs)).isfinite().all()


def test_each_argument_s_range_is_recorded_and_what_was_not_covered() -> None:
    """The record: time ids per column (sizes 128 to 1024 px, crops 0 to 64), the timesteps'
    range, and the UNet's arguments never fed named; the card says both."""
    inputs = _swept(_models.sdxl_conditioned_unet())
    record = argument_ranges(inputs.probes, inputs.forward_arguments)
    size, crop = [128.0, 1024.0], [0.0, 64.0]
    assert record["fed"]["added_cond_kwargs.time_ids"]["columns"] == [
        size,
        size,
        crop,
        crop,
        size,
        size,
    ]
    assert record["fed"]["timestep"]["range"] == [0.0, 999.0]
    assert record["not_covered"]["class_labels"] == NEVER_FED
    assert "sample" not in record["not_covered"]
    fed, missing = arguments_run(record)
    assert (
        "`added_cond_kwargs.time_ids` [128–1024, 128–1024, 0–64, 0–64, 128–1024, 128–1024]" in fed
    )
    assert "`class_labels` (never fed)" in missing


def _sdxl_call(latent: int) -> dict[str, Any]:
    """The UNet's inputs at a pipeline's default call of ``8 * latent`` px (batch 1)."""
    g = torch.Generator().manual_seed(0)
    return {
        "sample": torch.randn(1, 4, latent, latent, generator=g),
        "timestep": torch.tensor([999]),
        "encoder_hidden_states": 0.5 * torch.randn(1, 8, 24, generator=g),
        "added_cond_kwargs": {
            "text_embeds": 0.5 * torch.randn(1, _models.SDXL_TEXT_DIM, generator=g),
            "time_ids": sdxl_time_ids(8 * latent, 8 * latent),
        },
    }


@pytest.mark.slow  # three conversions each judging 1024 px UNet passes in fp16 on a CPU
@pytest.mark.parametrize("planted", [True, False], ids=["planted", "plain"])
def test_sdxl_default_call_decides_the_certificate(planted: bool, tmp_path: Path) -> None:
    """Planted: fp16 is refused at the 1024 px call, fp16-safe makes the unit a range island
    and both loads are right there, bf16-safe passes. Plain: all three pass, no range island."""
    from diffusers import UNet2DConditionModel

    source = tmp_path / "source"
    _models.sdxl_conditioned_unet(planted=planted).save_pretrained(source)
    _, ranged = _three_targets(source, tmp_path, planted)
    assert ranged == ([PLANTED_UNIT] if planted else []), ranged
    call = _sdxl_call(DEFAULT_LATENT)
    reference = _run(_models.sdxl_conditioned_unet(planted=planted), call)
    for loaded in (
        pc.load(tmp_path / "fp16-safe"),
        UNet2DConditionModel.from_pretrained(tmp_path / "fp16-safe"),
    ):
        output = _run(loaded, call)
        assert output.isfinite().all()
        assert _cosine(output, reference) > 0.999


def _three_targets(source: Path, tmp_path: Path, planted: bool) -> tuple[dict[str, Any], list[str]]:
    """``source`` converted to fp16, fp16-safe and bf16-safe: fp16 refused exactly when
    planted, both safe targets certified; with fp16-safe's range islands."""
    results = {
        target: convert(source, to=target, output=tmp_path / target)
        for target in ("fp16", "fp16-safe", "bf16-safe")
    }
    assert (results["fp16"].certificate.verdict == "fail") is planted
    for target in ("fp16-safe", "bf16-safe"):
        certificate = results[target].certificate
        assert certificate.verdict == "pass", (target, certificate.failures)
    islands = results["fp16-safe"].components[0].plan.islands
    return results, [i.name for i in islands if i.reason == "range"]


# --------------------------------------------------------------------------- speech


def test_padded_batch_goes_through_the_feature_extractor() -> None:
    """The speech probes include batches padded as Wav2Vec2FeatureExtractor pads them (a 1 s
    clip zero-padded beside a long one, each row normalised over its padded length, no mask),
    up to 30 s; audio length is a size family recorded against the 30 s declared."""
    inputs = _swept(_models.wav2vec2_base())
    padded = [p for p in inputs.probes if "clip_samples" in p.sweep]
    assert [int(p.kwargs["input_values"].shape[-1]) for p in padded] == [32_000, 128_000, PADDED]
    longest = padded[-1].kwargs
    assert "attention_mask" not in longest
    short = longest["input_values"][0]
    tail = short[CLIP:]
    assert torch.allclose(tail, tail[:1].expand_as(tail))  # the padding: one value throughout
    assert short.abs().max() > 4 * longest["input_values"][1].std()  # the clip scaled up
    assert inputs.sizes == {"audio_length": {"declared": PADDED, "run": PADDED}}
    assert probe_sizes(None, inputs)[padded[-1].name] == {"audio_length": PADDED}


def test_the_model_s_own_feature_extractor_pads(tmp_path: Path) -> None:
    """A source with a preprocessor_config.json is batched by its own extractor: here one that
    returns an attention mask at 8 kHz."""
    from transformers import Wav2Vec2FeatureExtractor

    Wav2Vec2FeatureExtractor(sampling_rate=8000, return_attention_mask=True).save_pretrained(
        tmp_path
    )
    inputs = _swept(_models.wav2vec2_base(), directory=tmp_path)
    padded = [p for p in inputs.probes if "clip_samples" in p.sweep]
    assert padded and all("attention_mask" in p.kwargs for p in padded)
    assert inputs.sizes == {"audio_length": {"declared": 240_000, "run": 240_000}}
    mask = padded[-1].kwargs["attention_mask"]
    assert mask[0].sum() == 8000 and mask[1].all()


def test_planted_wav2vec2_overflows_fp16_only_on_the_padded_batch() -> None:
    """The reproduction, on the probes the sweep makes: fp32 is finite on the 30 s padded
    batch; a plain fp16 cast is NaN there and finite on the dense built probe."""
    planted = _models.wav2vec2_base(planted=True)
    inputs = _swept(planted)
    padded = _probe(inputs, f"forward:padded-audio@{PADDED}")
    assert _run(planted, dict(padded.kwargs)).isfinite().all()
    half = _models.wav2vec2_base(planted=True).half()
    assert _run(half, dict(inputs.probes[0].kwargs)).isfinite().all()
    assert not _run(half, dict(padded.kwargs)).isfinite().all()


def _padded_call() -> dict[str, torch.Tensor]:
    """A user's batch: a 1 s clip and a 30 s one through the extractor wav2vec2-base ships."""
    from transformers import Wav2Vec2FeatureExtractor

    g = torch.Generator().manual_seed(1)
    clips = [
        torch.sin(torch.arange(n) / 7.0) + 0.1 * torch.randn(n, generator=g) for n in (CLIP, PADDED)
    ]
    made = Wav2Vec2FeatureExtractor()(
        [c.numpy() for c in clips], sampling_rate=16_000, padding="longest", return_tensors="pt"
    )
    return {"input_values": made["input_values"]}


@pytest.mark.slow  # three conversions, each judging 30 s batches in fp16 on a CPU
@pytest.mark.parametrize("planted", [True, False], ids=["planted", "plain"])
def test_padded_audio_decides_the_certificate(planted: bool, tmp_path: Path) -> None:
    """Planted: fp16 is refused on the padded batch, fp16-safe makes the GroupNorm a range
    island and both loads are right on a user's padded batch, bf16-safe passes. Plain: all
    three pass, no range island; the certificate fits the audio length family."""
    from transformers import Wav2Vec2Model

    source = tmp_path / "source"
    _models.wav2vec2_base(planted=planted).save_pretrained(source)
    results, ranged = _three_targets(source, tmp_path, planted)
    for target in ("fp16-safe", "bf16-safe"):
        sizes = results[target].certificate.components[0].inputs["sizes"]
        assert sizes["audio_length"] == {"declared": PADDED, "run": PADDED}
    if planted:
        assert _models.PADDED_AUDIO_UNIT in ranged, ranged
        assert all(n.startswith("feature_extractor.conv_layers.") for n in ranged), ranged
    else:
        assert ranged == [], ranged
    card = (tmp_path / "fp16-safe" / "README.md").read_text()
    assert f"padded audio length (samples) run: {PADDED} of {PADDED} declared" in card
    call = _padded_call()
    reference = _run(_models.wav2vec2_base(planted=planted), call)
    for loaded in (
        pc.load(tmp_path / "fp16-safe"),
        Wav2Vec2Model.from_pretrained(tmp_path / "fp16-safe"),
    ):
        output = _run(loaded, call)
        assert output.isfinite().all()
        for row in range(2):  # the padded clip and the long one, each right
            assert _cosine(output[row], reference[row]) > 0.999
