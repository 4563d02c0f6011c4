"""A certificate holds at the sizes the model declares: a VAE with sample_size 1024 is judged
decoding 1024 px images, and a 49-frame video transformer on 13 latent frames, not only on
the small sizes that run in milliseconds.

The overflows are real: ``_models.sdxl_vae(planted=True)`` sets weights of a real diffusers
``AutoencoderKL`` so its decoder's mid-block value projection grows with the latent side and
passes fp16's limit only at 128x128 latents (1024 px); ``cogvideox_i2v_transformer(planted=
True)`` sets a learned frame-position table and a feed-forward unit so the first block passes
it only on the declared frames. A plain fp16 cast shows each.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.core.dtypes import FP16_MAX
from precision_convert.validation.probe.inputs.budgets import budget_for
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.sizes import declared_size_probes
from precision_convert.validation.probe.inputs.sweep import sweep

#: Latents a side of a 1024 px image (the SDXL VAE downsamples 8x), and of a 256 px one.
DECLARED_LATENT = 128
SMALL_LATENT = 32
VALUE = "decoder.mid_block.attentions.0.to_v"


def _decode(vae: Any, side: int) -> torch.Tensor:
    dtype = next(vae.parameters()).dtype
    z = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        return vae.decode(z).sample.float()


@pytest.fixture(scope="module")
def planted_vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("planted-vae")
    _models.sdxl_vae(planted=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain_vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plain-vae")
    _models.sdxl_vae().save_pretrained(path)
    return path


def test_planted_vae_overflows_fp16_only_at_its_declared_size() -> None:
    """The reproduction: the fp32 decode is finite at every side, the value projection's peak
    grows with the side, and a plain fp16 cast is all NaN at 1024 px but finite at 256 px."""
    vae = _models.sdxl_vae(planted=True)
    peaks: dict[int, float] = {}
    module = vae.get_submodule(VALUE)
    for side in (SMALL_LATENT, DECLARED_LATENT):
        handle = module.register_forward_hook(
            lambda _m, _i, out, side=side: peaks.__setitem__(side, float(out.abs().max()))
        )
        assert _decode(vae, side).isfinite().all()
        handle.remove()
    assert peaks[SMALL_LATENT] < FP16_MAX / 2 < FP16_MAX < peaks[DECLARED_LATENT]
    half = vae.half()
    assert _decode(half, SMALL_LATENT).isfinite().all()
    assert _decode(half, DECLARED_LATENT).isnan().all()


def test_sweep_probes_the_declared_sizes() -> None:
    """The default sweep encodes and decodes the VAE at its sample_size; even the quick one
    runs a video denoiser at its declared latent frames; the record names what ran, and what
    quick did not."""
    vae = _models.sdxl_vae()
    chosen = next(input_candidates(vae, seed=0))
    quick = sweep(vae, chosen, "quick").sizes["image_side"]
    assert quick["run"] == 64 and "quick level runs no declared sides" in quick["not_run"]
    swept = sweep(vae, chosen)
    declared = [p for p in swept.probes if p.sweep.get("kind") == "declared-size"]
    assert [p.name for p in declared] == ["encode@1024x1024", "decode@1024x1024"]
    (image,) = declared[0].kwargs.values()
    assert tuple(image.shape) == (1, 3, 1024, 1024)
    assert swept.describe()["sizes"] == {"image_side": {"declared": 1024, "run": 1024}}

    video = _models.make("cogvideox-transformer")  # sample_frames 9, 4x: 3 latent frames
    chosen = next(input_candidates(video, seed=0))
    swept = sweep(video, chosen, "quick")
    (probe,) = [p for p in swept.probes if p.sweep.get("kind") == "declared-size"]
    assert probe.sweep["latent_frames"] == 3
    batch, *channels_and_frames = probe.kwargs["hidden_states"].shape[:3]
    assert batch == 1 and sorted(channels_and_frames) == [3, 4]  # either 5-D layout
    assert swept.sizes["latent_frames"] == {"declared": 3, "run": 3}


def test_a_side_over_the_budget_is_recorded_not_run() -> None:
    """A declared side whose activations pass the level's budget is not run, and says so."""
    vae = _models.sdxl_vae()
    chosen = next(input_candidates(vae, seed=0))
    tight = replace(budget_for("standard"), declared_activation_bytes=1 << 20)
    probes, sizes = declared_size_probes(vae, chosen, tight)
    # Only the cheap intermediate sides the growth fit needs run (128 and 256 px).
    assert {p.sweep["kind"] for p in probes} == {"size-growth"}
    assert [p.name for p in probes if p.method == "encode"] == ["encode@128x128", "encode@256x256"]
    assert sizes["image_side"]["run"] == 64
    assert "declared_activation_bytes" in sizes["image_side"]["not_run"]


def _sizes(certificate: Any) -> dict[str, Any]:
    (component,) = certificate.to_dict()["components"]
    return component["inputs"]["sizes"]


@pytest.mark.slow  # three conversions, each running 1024 px passes in fp16 on a CPU (minutes)
def test_declared_image_side_decides_the_certificate(planted_vae: Path, tmp_path: Path) -> None:
    """fp16 is refused at 1024 px (the small probes alone passed it); fp16-safe makes the value
    projection a range island and its load decodes 1024 px finite; bf16-safe passes; each
    certificate names the image side run."""
    results = {
        target: convert(planted_vae, to=target, output=tmp_path / target)
        for target in ("fp16", "fp16-safe", "bf16-safe")
    }
    fp16 = results["fp16"].certificate
    assert fp16.verdict == "fail"
    assert any("1024x1024" in line for line in fp16.failures), fp16.failures
    for target in ("fp16-safe", "bf16-safe"):
        certificate = results[target].certificate
        assert certificate.verdict == "pass", (target, certificate.failures)
        assert _sizes(certificate)["image_side"]["run"] == 1024
        card = (tmp_path / target / "README.md").read_text()
        assert "image side (px) run: 1024 of 1024 declared" in card
    islands = results["fp16-safe"].components[0].plan.islands
    assert any(i.name == VALUE and i.reason == "range" for i in islands), islands
    loaded = pc.load(tmp_path / "fp16-safe")
    reference = _decode(_models.sdxl_vae(planted=True), DECLARED_LATENT)
    decoded = _decode(loaded, DECLARED_LATENT)
    assert decoded.isfinite().all()
    assert (
        torch.nn.functional.cosine_similarity(
            decoded.flatten().double(), reference.flatten().double(), dim=0
        )
        > 0.999
    )


@pytest.mark.slow  # two conversions at 1024 px
def test_plain_vae_is_certified_at_its_declared_size(plain_vae: Path, tmp_path: Path) -> None:
    """No false fail: without the planted weights fp16 and fp16-safe pass at 1024 px with no
    range island added."""
    for target in ("fp16", "fp16-safe"):
        result = convert(plain_vae, to=target, output=tmp_path / target)
        assert result.certificate.verdict == "pass", (target, result.certificate.failures)
        assert _sizes(result.certificate)["image_side"] == {"declared": 1024, "run": 1024}
    islands = result.components[0].plan.islands
    assert not [i for i in islands if i.reason == "range"], islands


FRAME_UNIT = "transformer_blocks.0.ff.net.0.proj"


def _denoise(model: Any, frames: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, frames, 4, 8, 8, generator=g).to(dtype)
    text = (0.5 * torch.randn(1, 8, 32, generator=g)).to(dtype)
    with torch.no_grad():
        out = model(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([500]))
    return out.sample.float()


def test_planted_video_transformer_overflows_fp16_only_at_its_declared_frames() -> None:
    """The reproduction: fp32 is finite at 2 and 13 latent frames, the feed-forward's peak is
    below the margin at 2 and past fp16's limit at 13, and a plain fp16 cast is all NaN at 13
    latent frames (49 frames) but finite at 2."""
    model = _models.cogvideox_i2v_transformer(planted=True)
    peaks: dict[int, float] = {}
    unit = model.get_submodule(FRAME_UNIT)
    for frames in (2, 13):
        handle = unit.register_forward_hook(
            lambda _m, _i, out, frames=frames: peaks.__setitem__(frames, float(out.abs().max()))
        )
        assert _denoise(model, frames).isfinite().all()
        handle.remove()
    assert peaks[2] < FP16_MAX / 2 < FP16_MAX < peaks[13]
    half = model.half()
    assert _denoise(half, 2).isfinite().all()
    assert _denoise(half, 13).isnan().all()


@pytest.mark.parametrize("planted", [True, False], ids=["planted", "plain"])
def test_declared_frames_decide_the_certificate(planted: bool, tmp_path: Path) -> None:
    """At quick coverage (frames always run): planted, fp16 is refused and fp16-safe makes the
    feed-forward a range island and its load is finite at 13 frames; plain, both pass with
    no range island (no false fail); bf16-safe passes either way; certificates name 13 frames."""
    source = tmp_path / "source"
    _models.cogvideox_i2v_transformer(planted=planted).save_pretrained(source)
    results = {
        target: convert(source, to=target, output=tmp_path / target, coverage="quick")
        for target in ("fp16", "fp16-safe", "bf16-safe")
    }
    assert (results["fp16"].certificate.verdict == "fail") is planted
    for target in ("fp16-safe", "bf16-safe"):
        certificate = results[target].certificate
        assert certificate.verdict == "pass", (target, certificate.failures)
        assert _sizes(certificate)["latent_frames"] == {"declared": 13, "run": 13}
    islands = results["fp16-safe"].components[0].plan.islands
    ranged = [i.name for i in islands if i.reason == "range"]
    if planted:  # the unit, and the down-projection that receives its output
        assert FRAME_UNIT in ranged, ranged
        assert all(n.startswith("transformer_blocks.0.ff.") for n in ranged), ranged
    else:
        assert ranged == [], ranged
        # The frames' fit is reported with its margins (2, 4 and 8 frames, and the 13 run).
        growth = _sizes(results["fp16-safe"].certificate)["growth"]["latent_frames"]
        assert growth["sizes_run"] == [2, 4, 8, 13] and "near_limit" not in growth
        assert growth["top"] and all(t["margin"] > 2 for t in growth["top"]), growth["top"]
    loaded = pc.load(tmp_path / "fp16-safe")
    reference = _denoise(_models.cogvideox_i2v_transformer(planted=planted), 13)
    output = _denoise(loaded, 13)
    assert output.isfinite().all()
    assert (
        torch.nn.functional.cosine_similarity(
            output.flatten().double(), reference.flatten().double(), dim=0
        )
        > 0.999
    )
