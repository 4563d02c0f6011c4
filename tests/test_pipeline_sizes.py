"""A whole pipeline is certified at the sizes its call defaults to: an SD-style pipeline that
declares SDXL's latents at 1024 px, a CogVideoX-style one at its default 49 frames, and the
explicit-dtype load diffusers' documentation teaches judged there, its failure shown at the
top of the card.

The overflows are real weights (``_models.sdxl_vae(planted=True)``, whose decoder's value
projection passes fp16's limit only at 128x128 latents; ``cogvideox_i2v_transformer(planted=
True)``, whose first feed-forward passes it only on the 13 latent frames of 49): the small
end-to-end run is finite in fp16, the run at the call's defaults is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import ConversionResult, convert
from precision_convert.conversion.runtime.builders import _diffusers_dtype_keyword
from precision_convert.validation.probe.inputs.budgets import budget_for
from precision_convert.validation.probe.inputs.pipelines import pipeline_inputs
from precision_convert.validation.probe.run.metrics import compare, kind_of
from precision_convert.validation.probe.run.parity import thresholds_for

TARGETS = ("fp16", "fp16-safe", "bf16-safe")
#: The planted modules: the VAE's mid-block value projection, the transformer's frame unit.
VALUE = "decoder.mid_block.attentions.0.to_v"
FRAME_UNIT = "transformer_blocks.0.ff.net.0.proj"
#: How the certificate names the call the docs teach, and the probe at the call's defaults.
KEYWORD = _diffusers_dtype_keyword()  # torch_dtype, or dtype in newer diffusers
EXPLICIT = f'DiffusionPipeline.from_pretrained("<repo>", {KEYWORD}=torch.float16)'
SD_DEFAULT, VIDEO_DEFAULT = "pipeline@1024x1024", "pipeline@64x64x49f"


def _sd(path: Path, planted: bool) -> Path:
    vae = _models.sdxl_vae(planted=planted)
    return _models.sd_pipeline(path, unet=_models.sdxl_sized_unet(), vae=vae)


def _video(path: Path, planted: bool) -> Path:
    transformer = _models.cogvideox_i2v_transformer(planted=planted)
    _models.cogvideox_pipeline(path, transformer=transformer)
    return path


#: Per pipeline: its builder, the coverage it is certified at (the SD one's 1024 px side
#: runs from ``standard``; declared frames run at every level), the probe at its defaults.
PIPELINES: dict[str, tuple[Callable[[Path, bool], Path], str, str]] = {
    "sd": (_sd, "standard", SD_DEFAULT),
    "video": (_video, "quick", VIDEO_DEFAULT),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ConversionResult]:
    """Each (pipeline, planted, target) converted once for the module, on demand."""
    done: dict[tuple[str, bool, str], ConversionResult] = {}
    sources: dict[tuple[str, bool], Path] = {}

    def get(name: str, planted: bool, target: str) -> ConversionResult:
        build, coverage, _ = PIPELINES[name]
        if (name, planted) not in sources:
            root = tmp_path_factory.mktemp(f"{name}-{'planted' if planted else 'plain'}")
            sources[name, planted] = build(root / "source", planted)
        key = (name, planted, target)
        if key not in done:
            out = sources[name, planted].parent / target
            done[key] = convert(sources[name, planted], to=target, output=out, coverage=coverage)
        return done[key]

    return get


def test_the_call_defaults_run_where_the_budget_allows(tmp_path: Path) -> None:
    """The SD-style pipeline runs at 1024 px from ``standard`` on, quick and a tight budget
    record why not; the video pipeline runs its 49 default frames even at quick."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(_sd(tmp_path / "sd", planted=False))
    inputs = pipeline_inputs(pipe, budget_for("standard"))
    assert [p.name for p in inputs.probes] == ["pipeline", SD_DEFAULT]
    assert inputs.probes[1].kwargs["height"] == inputs.probes[1].kwargs["width"] == 1024
    assert inputs.probes[1].sweep["kind"] == "declared-size"
    assert inputs.sizes == {s: {"declared": 1024, "run": 1024} for s in ("height", "width")}

    quick = pipeline_inputs(pipe, budget_for("quick"))
    assert [p.name for p in quick.probes] == ["pipeline"]
    assert quick.sizes["height"]["run"] == 64
    assert "quick level runs no declared sides" in quick.sizes["height"]["not_run"]
    tight = replace(budget_for("standard"), declared_activation_bytes=1 << 20)
    assert "declared_activation_bytes" in pipeline_inputs(pipe, tight).sizes["width"]["not_run"]

    video = DiffusionPipeline.from_pretrained(_video(tmp_path / "video", planted=False))
    quick = pipeline_inputs(video, budget_for("quick"))
    assert [p.name for p in quick.probes] == ["pipeline", VIDEO_DEFAULT]
    assert quick.probes[0].kwargs["num_frames"] == 5 and quick.probes[1].kwargs["num_frames"] == 49
    assert quick.sizes["frames"] == {"declared": 49, "run": 49}


def _ranged(result: ConversionResult) -> dict[str, list[str]]:
    """Each component's range islands that calibration measured (a recipe's own, such as
    T5's ``wo``, are there by design whatever the weights)."""
    return {
        c.name: [i.name for i in c.plan.islands if i.reason == "range" and i.measured]
        for c in result.components
    }


def _pipeline_sizes(result: ConversionResult) -> dict[str, Any]:
    record = next(c for c in result.certificate.components if c.name == "pipeline")
    return record.inputs["sizes"]


def _generate(pipe: Any, default: str) -> torch.Tensor:
    """The certificate's call at the pipeline's defaults, as a user makes it."""
    (probe,) = [
        p for p in pipeline_inputs(pipe, budget_for("standard")).probes if p.name == default
    ]
    kwargs = {**probe.kwargs, "generator": torch.Generator().manual_seed(0)}
    with torch.no_grad():
        out = pipe(**kwargs)
    return (out.images if hasattr(out, "images") else out.frames).float()


@pytest.mark.slow  # SD at 1024 px: minutes on a 2-core CPU; the video one: about a minute
@pytest.mark.parametrize("name", ["sd", "video"])
def test_planted_overflow_is_judged_at_the_call_defaults(
    converted: Callable[..., ConversionResult], name: str
) -> None:
    """fp16 is refused at the defaults (its small run alone is finite); fp16-safe makes the
    planted module a range island, passes through ``pc.load`` and the plain default load at
    the defaults, and the explicit-dtype load fails there, said first in the card; bf16-safe
    passes."""
    from diffusers import DiffusionPipeline

    _, _, default = PIPELINES[name]
    fp16 = converted(name, True, "fp16").certificate
    assert fp16.verdict == "fail"
    failed = {m.probe for m in fp16.metrics if not m.passed and m.component == "pipeline"}
    assert failed == {default}, fp16.failures  # the small run passed

    safe = converted(name, True, "fp16-safe")
    certificate = safe.certificate
    assert certificate.verdict == "pass", certificate.failures
    planted = {"sd": ("vae", VALUE), "video": ("transformer", FRAME_UNIT)}[name]
    assert planted[1] in _ranged(safe)[planted[0]]
    judged = [m for m in certificate.metrics if m.where.startswith(f"pipeline/{default}/")]
    assert judged and all(m.passed for m in judged)
    for way in ("pc.load", "plain"):
        assert certificate.load_path(way, "pipeline").verdict == "pass"
    explicit = certificate.load_path("compute", "pipeline")
    assert explicit.call == EXPLICIT and explicit.verdict == "fail"
    assert any(f.startswith(f"pipeline/{default}/") and "NaN" in f for f in explicit.failures)
    sizes = _pipeline_sizes(safe)
    assert {k: v["run"] for k, v in sizes.items()} == (
        {"height": 1024, "width": 1024}
        if name == "sd"
        else {"frames": 49, "height": 64, "width": 64}
    )

    body = (safe.output / "README.md").read_text().split("---", 2)[2]
    top = body[: body.index("## Ways of loading")]
    at = "1024x1024 px" if name == "sd" else "64x64 px, 49 frames"
    assert f"`{EXPLICIT}` gives NaN/Inf at {at}" in top
    (keep,) = [line for line in top.splitlines() if "These keep the islands" in line]
    assert '`precision_convert.load("<repo>")`' in keep
    assert '`DiffusionPipeline.from_pretrained("<repo>")`' in keep
    run = "height (px) run: 1024 of 1024 declared" if name == "sd" else "frames run: 49 of 49"
    assert run in top

    # As users load it, at the defaults: finite and within the pipeline's PSNR bound of fp32.
    reference = _generate(DiffusionPipeline.from_pretrained(safe.output.parent / "source"), default)
    bound = thresholds_for("pipeline")["psnr"]
    for load in (pc.load, DiffusionPipeline.from_pretrained):
        images = _generate(load(safe.output), default)
        assert images.isfinite().all()
        assert compare(reference, images, kind_of("images", images=True))["psnr"] >= bound

    bf16 = converted(name, True, "bf16-safe").certificate
    assert bf16.verdict == "pass", bf16.failures


@pytest.mark.slow  # three conversions each; SD at 1024 px takes minutes on a CPU
@pytest.mark.parametrize("name", ["sd", "video"])
def test_unplanted_pipelines_are_certified_at_the_call_defaults(
    converted: Callable[..., ConversionResult], name: str
) -> None:
    """No false fail: without the planted weights every target passes at the call's
    defaults, with no range island added and the explicit-dtype load passing too."""
    _, _, default = PIPELINES[name]
    for target in TARGETS:
        result = converted(name, False, target)
        certificate = result.certificate
        assert certificate.verdict == "pass", (target, certificate.failures)
        assert any(m.probe == default for m in certificate.metrics)
        assert not any(_ranged(result).values()), _ranged(result)
        assert certificate.load_path("compute", "pipeline").verdict == "pass"
