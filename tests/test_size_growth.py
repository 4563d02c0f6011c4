"""Peaks fitted against size predict an fp16 overflow at a declared size no probe reached.

At ``quick`` coverage the planted SDXL-shaped VAE (``_models.sdxl_vae(planted=True)``: its
decoder's mid-block value projection grows linearly with the latent side, past fp16's limit
only at 1024 px) is run at 64, 128 and 256 px only; the power law fitted to its peaks still
predicts the overflow at 1024: fp16 is refused, fp16-safe keeps the module fp32 from the
prediction, and its load decodes 1024 px finite and within the recipe's thresholds. Models
whose peaks do not grow toward the limit get no island from a fit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN
from precision_convert.conversion.analysis.growth import MAX_RESIDUAL, fit_growth
from precision_convert.validation.certify.card import render_card
from precision_convert.validation.certify.certificate import CERTIFICATE_NAME, Certificate
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs, Probe
from precision_convert.validation.probe.run.execute import run_probes
from precision_convert.validation.probe.run.growth import PREDICTED
from precision_convert.validation.probe.run.parity import compare_outputs, thresholds_for

VALUE = "decoder.mid_block.attentions.0.to_v"
#: Latents a side of a 1024 px image (the VAE downsamples 8x).
DECLARED_LATENT = 128


def test_a_power_law_is_fitted_and_only_a_clean_rising_one_extrapolates() -> None:
    """Exact growth is recovered (exponent, zero residual) and extrapolated; flat, falling,
    scattered or narrow-range peaks are never extrapolated past the largest one measured."""
    rising = fit_growth({64: 700.0, 128: 1400.0, 256: 2800.0})
    assert rising is not None and rising.trusted
    assert rising.exponent == pytest.approx(1.0) and rising.residual == pytest.approx(0.0)
    assert rising.predict(1024) == pytest.approx(11200.0)
    noisy = fit_growth({16: 100.0, 64: 400.0, 128: 90.0, 256: 500.0})
    assert noisy is not None and noisy.residual > MAX_RESIDUAL and not noisy.trusted
    falling = fit_growth({16: 400.0, 64: 200.0, 256: 100.0})
    narrow = fit_growth({100: 100.0, 150: 150.0, 200: 200.0})  # sizes within 2x: no span
    for fit in (noisy, falling, narrow):
        assert fit is not None and not fit.trusted
        assert fit.predict(1 << 20) == max(fit.peaks)
    assert fit_growth({64: 1.0, 128: 2.0}) is None  # two sizes always fit a line


def _growth(certificate: Certificate) -> dict[str, Any]:
    (component,) = certificate.to_dict()["components"]
    return component["inputs"]["sizes"]["growth"]


def _decode_at_declared_size(model: Any) -> tuple[Any, ModelInputs]:
    """``model`` decoding one seeded 128x128 latent (a 1024 px image), and the probe."""
    z = torch.randn(
        1, 4, DECLARED_LATENT, DECLARED_LATENT, generator=torch.Generator().manual_seed(0)
    )
    probes = ModelInputs("vae", (Probe("decode@1024", "decode", {"z": z}, images=True),), seed=0)
    dtype = next(model.parameters()).dtype
    return run_probes(model, probes, "cpu", dtype), probes


@pytest.fixture(scope="module")
def planted_quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The planted VAE converted at ``quick`` (no declared side runs) to fp16 and fp16-safe."""
    root = tmp_path_factory.mktemp("growth-vae")
    source = root / "source"
    _models.sdxl_vae(planted=True).save_pretrained(source)
    results = {
        target: convert(source, to=target, output=root / target, coverage="quick")
        for target in ("fp16", "fp16-safe")
    }
    return {"source": source, "root": root, **results}


def test_fp16_is_refused_on_the_prediction(planted_quick: dict[str, Any]) -> None:
    """No probe reached 1024 px, yet fp16 fails there: the failure names the value projection,
    its predicted peak and that 1024 px was predicted, not run."""
    certificate = Certificate.read(planted_quick["root"] / "fp16")
    assert certificate.verdict == "fail"
    (line,) = [f for f in certificate.failures if f.startswith(VALUE)]
    assert f"at image side (px) 1024 ({PREDICTED}" in line and "fp16 here" in line
    assert _growth(certificate)["image_side"]["largest_run"] == 256


def test_fp16_safe_keeps_the_predicted_module_and_decodes_1024_px(
    planted_quick: dict[str, Any],
) -> None:
    """fp16-safe passes with the value projection a range island from the prediction; the
    certificate (re-read from disk) and the card say 257–1024 px were predicted, not run; and
    ``pc.load`` decodes a 1024 px image finite and within the VAE's thresholds vs fp32."""
    result = planted_quick["fp16-safe"]
    assert result.certificate.verdict == "pass", result.certificate.failures
    (island,) = [i for i in result.components[0].plan.islands if i.name == VALUE]
    assert island.reason == "range" and "predicted peak" in island.rule
    assert f"at image side (px) 1024 ({PREDICTED}" in island.rule
    out = planted_quick["root"] / "fp16-safe"
    record = json.loads((out / CERTIFICATE_NAME).read_text())
    (sizes,) = [c["inputs"]["sizes"] for c in record["components"]]
    assert sizes["image_side"]["run"] == 64 and "quick" in sizes["image_side"]["not_run"]
    growth = sizes["growth"]["image_side"]
    assert growth["sizes_run"] == [64, 128, 256]
    assert growth["status"] == PREDICTED and growth["predicted"] == [257, 1024]
    # Claimed from the declared side to 4x the largest judged (1024 here), none past it.
    assert growth["claimed"] == [1024, 1024] and growth["not_covered"] == [1025, None]
    top = {t["module"]: t for t in growth["top"]}
    assert top[VALUE]["extrapolated"] and top[VALUE]["exponent"] == pytest.approx(1.0, abs=0.05)
    assert top[VALUE]["margin"] < 1  # past fp16's limit at 1024 px
    assert VALUE in [n["module"] for n in growth["near_limit"]]
    card = (out / "README.md").read_text()
    assert f"257–1024 {PREDICTED}" in card and f"`{VALUE}`" in card

    reference, probes = _decode_at_declared_size(_models.sdxl_vae(planted=True))
    loaded, _ = _decode_at_declared_size(pc.load(out))
    (decoded,) = loaded["decode@1024"].values()
    assert decoded.isfinite().all()
    rows = compare_outputs("", probes, reference, loaded, thresholds_for("vae", {}))
    assert rows and all(r.passed for r in rows), [r.to_dict() for r in rows if not r.passed]


def test_validate_and_push_keep_the_sizes(planted_quick: dict[str, Any]) -> None:
    """``validate`` at quick writes the same fits again, and the card as pushed shows them."""
    out = planted_quick["root"] / "fp16-safe"
    before = _growth(Certificate.read(out))
    again = pc.validate(out, baseline=planted_quick["source"], coverage="quick")
    assert again.verdict == "pass", again.failures
    after = _growth(Certificate.read(out))
    assert after["image_side"]["predicted"] == before["image_side"]["predicted"]
    assert after["image_side"]["top"] == before["image_side"]["top"]
    pushed = render_card(Certificate.read(out), out, "ns/planted-vae")
    assert f"257–1024 {PREDICTED}" in pushed


def test_plain_vae_gets_no_island_from_the_fit(tmp_path: Path) -> None:
    """Without the planted weights nothing is predicted near the limit: no range island, and
    the margins at 1024 px are reported, every one above the activation margin."""
    _models.sdxl_vae().save_pretrained(tmp_path / "source")
    result = convert(tmp_path / "source", to="fp16-safe", output=tmp_path / "out", coverage="quick")
    assert result.certificate.verdict == "pass", result.certificate.failures
    assert not [i for i in result.components[0].plan.islands if i.reason == "range"]
    growth = _growth(result.certificate)["image_side"]
    assert growth["status"] == PREDICTED and "near_limit" not in growth
    assert growth["top"] and all(t["margin"] > ACTIVATION_MARGIN for t in growth["top"])


def test_sequence_length_fit_adds_no_island_to_a_zoo_llama(
    zoo_converted: Callable[[str, str], Any],
) -> None:
    """A language model's peaks against length are fitted and reported up to its position
    limit, and add no island: none is predicted near fp16's limit."""
    result = zoo_converted("llama-3.2-1b", "fp16-safe")
    growth = _growth(result.certificate)["sequence_length"]
    assert len(growth["sizes_run"]) >= 3 and "near_limit" not in growth
    assert all(math.isfinite(t["margin"]) for t in growth["top"])
    rules = [i.rule for i in result.components[0].plan.islands]
    assert not [r for r in rules if "predicted peak" in r], rules
