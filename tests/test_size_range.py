"""A certificate claims a range of sizes past the default, and says where the fit predicts the
limit: each size family is claimed from the declared size up to 4x the largest size judged
(or the model's declared limit), predicted by the growth fit above the sizes run and not
covered past it.

The SD 1.5 case scaled down (``_models.sd15_vae``: real weights, the planted value projection
of ``sdxl_vae``): the pipeline declares 128 px, where the VAE's ``to_v`` peaks at 45k, below
65504, and is judged there; its peak grows with the side and passes 65504 near 190 px, so a
plain fp16 cast decodes 256 px (SD 1.5's 1024 px) all NaN. The fit knows: fp16 is refused
naming the module and the crossing, fp16-safe keeps it fp32 and decodes 256 px right.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import ConversionResult, convert
from precision_convert.conversion.analysis.growth import fit_growth
from precision_convert.core.dtypes import FP16_MAX, WATCHED_RANGE
from precision_convert.validation.probe.run.growth import (
    CLAIM_FACTOR,
    PREDICTED,
    Claim,
    Predicted,
    plain_cast,
)

VALUE = "decoder.mid_block.attentions.0.to_v"
#: Latents a side at the declared 128 px and at twice it (SD 1.5's 1024 px); the VAE is 8x.
DECLARED_LATENT = _models.SD15_SIDE // 8
TWICE_LATENT = 2 * DECLARED_LATENT
TARGETS = ("fp16", "fp16-safe", "bf16-safe")


def _decode(vae: Any, latent: int) -> tuple[torch.Tensor, float]:
    """``vae`` decoding one seeded latent ``latent`` a side, and its value projection's peak."""
    dtype = next(vae.parameters()).dtype
    z = torch.randn(1, 4, latent, latent, generator=torch.Generator().manual_seed(0)).to(dtype)
    peak: list[float] = []
    module = vae.get_submodule(VALUE)
    handle = module.register_forward_hook(lambda _m, _i, out: peak.append(float(out.abs().max())))
    try:
        with torch.no_grad():
            return vae.decode(z).sample.float(), peak[0]
    finally:
        handle.remove()


def test_a_family_claims_4x_its_largest_size_judged_within_its_declared_limit() -> None:
    """The claim runs from the declared size to 4x the largest judged, capped by a declared
    limit (a position limit), never below the declared size; without a fit nothing past the
    sizes run is claimed. Past the claim is not covered."""
    judged = Claim.of([32, 64, 128], 128, None, fitted=True)
    assert judged == Claim(128, 128, 512, None)
    assert judged.to_json() == {
        "largest_run": 128,
        "claimed": [128, 512],
        "largest_predicted": 512,
        "predicted": [129, 512],
        "status": PREDICTED,
        "not_covered": [513, None],
    }
    assert Claim.of([1, 16, 64], None, 128, fitted=True) == Claim(1, 64, 128, 128)
    assert "not_covered" not in Claim.of([1, 16, 64], None, 128, fitted=True).to_json()
    assert Claim.of([64, 128, 256], 2048, None, fitted=True).high == 2048  # declared, not run
    unfitted = Claim.of([16], 16, None, fitted=False)
    assert unfitted == Claim(16, 16, 16, None) and "predicted" not in unfitted.to_json()


def test_the_fit_names_where_a_peak_crosses_the_limit() -> None:
    """A peak growing linearly (the planted value projection's peaks measured at 32, 64 and
    128 px) is predicted past 65504 near 187 px and within the 2x margin from 94 px: the rule
    names the crossing, and the plain cast's record the first one."""
    growth = fit_growth({32: 11112.5, 64: 22356.6, 128: 44778.4})
    assert growth is not None and growth.trusted
    predicted = Predicted(VALUE, "output", "leaf", "image_side", 512, growth.predict(512), growth,
                          WATCHED_RANGE)  # fmt: skip
    assert predicted.overflow_at == 187 and predicted.safe_up_to == 93
    assert "past the limit from image side (px) 187;" in predicted.rule
    claim = Claim.of([32, 64, 128], 128, None, fitted=True)
    assert plain_cast(claim, [predicted]) == {
        "largest_predicted_safe": 93,
        "overflow_at": 187,
        "module": VALUE,
    }
    assert plain_cast(claim, []) == {
        "largest_predicted_safe": 512,
        "overflow_at": None,
        "module": None,
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool, str], ConversionResult]:
    """The SD 1.5-shaped pipeline (planted or not) converted to each target once, on demand,
    at the default coverage (the declared 128 px runs)."""
    done: dict[tuple[bool, str], ConversionResult] = {}
    sources: dict[bool, Path] = {}

    def get(planted: bool, target: str) -> ConversionResult:
        if planted not in sources:
            root = tmp_path_factory.mktemp("sd15-planted" if planted else "sd15-plain")
            vae = _models.sd15_vae(planted=planted)
            sources[planted] = _models.sd_pipeline(root / "source", vae=vae)
        if (planted, target) not in done:
            out = sources[planted].parent / target
            done[planted, target] = convert(sources[planted], to=target, output=out)
        return done[planted, target]

    return get


def _vae(result: ConversionResult) -> tuple[Any, dict[str, Any]]:
    """The VAE component's plan and its image side's growth record."""
    (component,) = [c for c in result.components if c.name == "vae"]
    (record,) = [c for c in result.certificate.components if c.name == "vae"]
    return component.plan, record.inputs["sizes"]["growth"]["image_side"]


def test_planted_vae_passes_65504_between_the_declared_side_and_twice_it() -> None:
    """The reproduction: fp32 decodes both sides finite with the value projection at ~45k at
    128 px and past 65504 at 256 px; a plain fp16 cast is finite at 128 px, all NaN at 256."""
    vae = _models.sd15_vae(planted=True)
    declared, at_declared = _decode(vae, DECLARED_LATENT)
    twice, at_twice = _decode(vae, TWICE_LATENT)
    assert declared.isfinite().all() and twice.isfinite().all()
    assert FP16_MAX / 2 < at_declared < FP16_MAX < at_twice
    half = vae.half()
    assert _decode(half, DECLARED_LATENT)[0].isfinite().all()
    assert _decode(half, TWICE_LATENT)[0].isnan().all()


@pytest.mark.slow  # six standard-coverage pipeline conversions, about 50 s of CPU each
def test_fp16_is_refused_naming_the_module_and_where_it_crosses(
    converted: Callable[[bool, str], ConversionResult],
) -> None:
    """The declared 128 px ran and passed, yet fp16 is refused: the VAE's value projection is
    predicted past 65504 inside the claimed range, at the size the fp32 arithmetic crosses."""
    result = converted(True, "fp16")
    certificate = result.certificate
    assert certificate.verdict == "fail"
    (line,) = [f for f in certificate.failures if f.startswith(f"vae: {VALUE} ")]
    found = re.search(r"past the limit from image side \(px\) (\d+)", line)
    assert found is not None, line
    crossing = int(found.group(1))
    # The fp32 model itself: below 65504 a little before the predicted crossing, past it after.
    vae = _models.sd15_vae(planted=True)
    below, above = int(0.9 * crossing) // 8, -(-crossing // 8) + 1
    assert _decode(vae, below)[1] < FP16_MAX < _decode(vae, above)[1]
    _, growth = _vae(result)
    assert growth["sizes_run"][-1] == _models.SD15_SIDE  # the declared side was judged
    high = CLAIM_FACTOR * _models.SD15_SIDE
    assert growth["claimed"] == [_models.SD15_SIDE, high]
    assert growth["predicted"] == [_models.SD15_SIDE + 1, high] and growth["status"] == PREDICTED
    assert growth["not_covered"] == [high + 1, None]
    # A plain cast overflows first where the earliest predicted crossing is: at the latest
    # where the value projection's is.
    crossings = [(n["module"], n["overflow_at"]) for n in growth["near_limit"] if n["overflow_at"]]
    assert (VALUE, crossing) in crossings
    first = min(at for _, at in crossings)
    assert growth["plain_cast"]["overflow_at"] == first <= crossing
    assert (growth["plain_cast"]["module"], first) in crossings
    # Computed in fp16 here: predicted safe only below the margin's crossing.
    assert growth["largest_predicted_safe"] < _models.SD15_SIDE


@pytest.mark.slow  # six standard-coverage pipeline conversions, about 50 s of CPU each
def test_fp16_safe_islands_the_module_and_decodes_twice_the_declared_side(
    converted: Callable[[bool, str], ConversionResult],
) -> None:
    """fp16-safe passes with the value projection a range island from the prediction; the
    card states the side judged, the range claimed and predicted safe, and where a plain cast
    overflows; 256 px decodes finite and close to fp32 through ``pc.load`` and the plain
    default load."""
    from diffusers import DiffusionPipeline

    result = converted(True, "fp16-safe")
    assert result.certificate.verdict == "pass", result.certificate.failures
    plan, growth = _vae(result)
    (island,) = [i for i in plan.islands if i.name == VALUE]
    assert island.reason == "range" and "past the limit from image side (px)" in island.rule
    high = CLAIM_FACTOR * _models.SD15_SIDE
    assert growth["largest_predicted_safe"] == high
    plain = growth["plain_cast"]
    crossing = plain["overflow_at"]
    assert _models.SD15_SIDE < crossing < 2 * _models.SD15_SIDE
    card = (result.output / "README.md").read_text()
    (line,) = [x for x in card.splitlines() if x.startswith("- `vae`:") and "run:" in x]
    assert f"image side (px) run: {_models.SD15_SIDE} of {_models.SD15_SIDE} declared" in line
    assert f"claimed {_models.SD15_SIDE}–{high} ({_models.SD15_SIDE + 1}–{high} {PREDICTED}" in line
    assert f"predicted safe up to {high}" in line
    assert (
        f"a plain fp16 cast is predicted past fp16's limit from {crossing} (`{plain['module']}`)"
        in line
    )

    reference, _ = _decode(_models.sd15_vae(planted=True), TWICE_LATENT)
    for load in (pc.load, DiffusionPipeline.from_pretrained):
        decoded, _ = _decode(load(result.output).vae, TWICE_LATENT)
        assert decoded.isfinite().all(), load
        cosine = torch.nn.functional.cosine_similarity(
            decoded.flatten().double(), reference.flatten().double(), dim=0
        )
        assert cosine > 0.999, (load, float(cosine))

    bf16 = converted(True, "bf16-safe").certificate
    assert bf16.verdict == "pass", bf16.failures


@pytest.mark.slow  # six standard-coverage pipeline conversions, about 50 s of CPU each
def test_unplanted_pipeline_is_certified_in_every_target_with_no_island(
    converted: Callable[[bool, str], ConversionResult],
) -> None:
    """No false fail: without the planted weights every target passes, no range island is
    measured, and the whole claimed range is predicted safe with no overflow in a plain cast."""
    for target in TARGETS:
        result = converted(False, target)
        assert result.certificate.verdict == "pass", (target, result.certificate.failures)
        ranged = [
            i.name
            for c in result.components
            for i in c.plan.islands
            if i.reason == "range" and i.measured
        ]
        assert ranged == [], (target, ranged)
        _, growth = _vae(result)
        high = CLAIM_FACTOR * _models.SD15_SIDE
        assert growth["largest_predicted_safe"] == high and "near_limit" not in growth
        assert growth["plain_cast"] == {
            "largest_predicted_safe": high,
            "overflow_at": None,
            "module": None,
        }
