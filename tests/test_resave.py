"""A converted model survives its user's round trip: ``pc.load``, ``save_pretrained``, load.

The case that broke: an fp16-safe Llama whose layer-1 MLP is a range island — its
real weights scaled until the fp32 ``down_proj`` output really exceeds fp16's 65504. The
library's own save kept the island fp32 in the file but wrote ``config.json``'s ``dtype`` as
float16 and dropped the record from the shards, so a plain ``from_pretrained`` flattened the
island and gave NaN. Re-saved now, all three loads stay finite and within the certificate's
bounds against fp32, and the files keep the plan's dtypes.
"""

from __future__ import annotations

import copy
import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _loader_helpers import stored_dtypes
from _models import generate, make, sd_pipeline
from safetensors import safe_open

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.validation.certify.certificate import Certificate
from precision_convert.validation.certify.load_ways import RESAVED
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.run.execute import run_probes
from precision_convert.validation.probe.run.parity import compare_outputs, thresholds_for

#: Scales of layer 1's gate, up and down projections: fp32 computes a sane function, but the
#: down projection's output peaks past fp16's 65504 while every weight stays far below it.
GATE, UP, DOWN = 100.0, 100.0, 1000.0
ISLAND = "model.layers.1.mlp.down_proj"


def llama_with_range_island(path: Path) -> Path:
    """The zoo Llama with layer 1's MLP scaled: an activation-range island, not a weight one."""
    model = make("llama")
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(GATE)
        mlp.up_proj.weight.mul_(UP)
        mlp.down_proj.weight.mul_(DOWN)
    peak: list[float] = []
    hook = mlp.down_proj.register_forward_hook(lambda m, i, o: peak.append(o.abs().max().item()))
    with torch.no_grad():
        model(input_ids=torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(0)))
    hook.remove()
    assert peak[0] > 65504 > max(p.abs().max().item() for p in mlp.parameters())
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Certificate]:
    """The range-island Llama and its certified fp16-safe conversion (read-only)."""
    root = tmp_path_factory.mktemp("resave")
    source = llama_with_range_island(root / "src")
    result = convert(source, to="fp16-safe", output=root / "out", coverage="quick")
    assert result.certificate is not None and result.certificate.verdict == "pass"
    return source, root / "out", result.certificate


def certified_inputs(fp32: Any, certificate: Certificate) -> ModelInputs:
    """The probes the certificate ran, rebuilt from its record (digests checked). ``fp32`` is
    the source model: the greedy-generation probes are the fp32 model's own continuations."""
    from precision_convert.validation.probe.inputs.sweep import replay

    return replay(fp32, certificate.components[0].inputs)


def test_resave_of_a_range_island_llama_stays_finite_and_within_bounds(
    converted: tuple[Path, Path, Certificate], tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    source, out, certificate = converted
    assert (
        json.loads((out / "config.json").read_text())["precision_convert"]["islands"][ISLAND]
        == "range"
    )
    new = tmp_path / "new"
    pc.load(out).save_pretrained(new)

    # The files keep the plan: the island fp32, the rest as converted (not all upcast).
    assert stored_dtypes(new) == stored_dtypes(out)
    assert stored_dtypes(new)[f"{ISLAND}.weight"] == torch.float32
    assert stored_dtypes(new)["model.layers.1.mlp.up_proj.weight"] == torch.float16
    config = json.loads((new / "config.json").read_text())
    assert config["dtype"] == json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (
        config["precision_convert"]
        == json.loads((out / "config.json").read_text())["precision_convert"]
    )
    with safe_open(new / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["precision_convert"]) == config["precision_convert"]

    # Every load of the re-saved files: finite and within the certificate's bounds.
    fp32 = LlamaForCausalLM.from_pretrained(source).eval()
    inputs = certified_inputs(fp32, certificate)
    thresholds = thresholds_for(certificate.components[0].task)
    with torch.no_grad():
        expected = run_probes(fp32, inputs)
        loads = {
            "plain": lambda: LlamaForCausalLM.from_pretrained(new),
            "auto": lambda: LlamaForCausalLM.from_pretrained(new, dtype="auto"),
            "pc.load": lambda: pc.load(new),
        }
        for way, build in loads.items():
            model = build().eval()
            got = run_probes(model, inputs)
            rows = compare_outputs("", inputs, expected, got, thresholds)
            failed = [(m.probe, m.metric, m.value) for m in rows if not m.passed]
            assert rows and not failed, (way, failed)
        assert pc.load(new).get_submodule(ISLAND).weight.dtype == torch.float32

    # What the library's own save wrote before: config dtype float16, the island flattened.
    old = tmp_path / "old"
    loaded = pc.load(out)
    type(loaded).save_pretrained(loaded, old)
    assert json.loads((old / "config.json").read_text())["dtype"] == "float16"
    with safe_open(old / "model.safetensors", "pt") as f:
        assert "precision_convert" not in f.metadata()
    ids = inputs.probes[0].kwargs["input_ids"]
    with torch.no_grad():
        broken = LlamaForCausalLM.from_pretrained(old).eval()(input_ids=ids).logits
    assert not torch.isfinite(broken).all()


def test_the_certificate_records_the_resave_without_it_deciding(
    converted: tuple[Path, Path, Certificate],
) -> None:
    _, _, certificate = converted
    found = {p.label: p for p in certificate.load_paths}  # eager ways apart
    for way in RESAVED.values():
        assert found[way].verdict == "pass" and not found[way].decides, way
        assert "checked on 1 of" in (found[way].detail or "")  # few probes: small cost
    assert found["resave:plain"].call.startswith('precision_convert.load("<repo>").save_pretrained')
    assert found["resave:pc.load"].dtypes == found["pc.load"].dtypes  # the plan, not upcast
    assert set(found["resave:plain"].dtypes) == {"float32"}


def test_a_model_cast_after_loading_is_saved_without_a_record_it_breaks(
    converted: tuple[Path, Path, Certificate], tmp_path: Path
) -> None:
    """``.half()`` flattens the island: the saved files cannot hold the plan, so they carry no
    record (pc.load would refuse it), and a warning says so."""
    _, out, _ = converted
    with pytest.warns(
        UserWarning, match="saved without its precision_convert record: .* stored as fp16"
    ):
        pc.load(out).half().save_pretrained(tmp_path / "half")
    assert "precision_convert" not in json.loads((tmp_path / "half" / "config.json").read_text())
    assert set(stored_dtypes(tmp_path / "half").values()) == {torch.float16}
    pc.load(tmp_path / "half")  # loads as an unconverted checkpoint, no refusal


def test_the_saver_follows_copies_and_pickles_and_is_collected_with_its_model(
    converted: tuple[Path, Path, Certificate], tmp_path: Path
) -> None:
    import gc
    import inspect
    import weakref

    _, out, _ = converted
    model = pc.load(out)
    # diffusers reads the signature to decide which keywords a component's save takes.
    assert {"variant", "max_shard_size"} <= set(inspect.signature(model.save_pretrained).parameters)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.weight.add_(1.0)  # the copy is what gets saved
    twin.save_pretrained(tmp_path / "twin")
    with safe_open(tmp_path / "twin" / "model.safetensors", "pt") as f:
        saved = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        assert "precision_convert" in f.metadata()
    assert torch.equal(saved, twin.model.layers[0].mlp.up_proj.weight)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    restored.save_pretrained(tmp_path / "restored")
    assert json.loads((tmp_path / "restored" / "config.json").read_text())["dtype"] == "float32"
    gone = weakref.ref(model)
    del model, twin, restored
    gc.collect()
    assert gone() is None  # nothing but the model's own attribute held it


def test_a_pipeline_resaved_whole_keeps_every_component_plan(tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    source = sd_pipeline(tmp_path / "src")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False)
    new = tmp_path / "new"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no component lost its record
        pc.load(out).save_pretrained(new)
    # diffusers models carry the record under the name diffusers passes over silently
    for component, key in (
        ("text_encoder", "precision_convert"),
        ("unet", "_precision_convert"),
        ("vae", "_precision_convert"),
    ):
        assert stored_dtypes(new / component) == stored_dtypes(out / component), component
        record = json.loads((out / component / "config.json").read_text())[key]
        saved = json.loads((new / component / "config.json").read_text())
        assert saved[key] == record, component
        (weights,) = (new / component).glob("*.safetensors")
        with safe_open(weights, "pt") as f:
            assert json.loads(f.metadata()["precision_convert"]) == record
    assert json.loads((new / "text_encoder" / "config.json").read_text())["dtype"] == "float32"
    with torch.no_grad():
        expected = generate(DiffusionPipeline.from_pretrained(source))
        for pipe in (DiffusionPipeline.from_pretrained(new), pc.load(new)):
            images = generate(pipe)
            assert torch.isfinite(images).all()
            assert _psnr(images.float(), expected) >= 30


def test_a_variant_output_resaved_keeps_the_sources_plain_dtype(tmp_path: Path) -> None:
    """A ``--variant`` output keeps the source's config and carries the record in its shards:
    the re-save writes the record into config.json and keeps the config's dtype."""
    source = llama_with_range_island(tmp_path / "src")
    out = tmp_path / "out"
    convert(source, to="fp16-safe", output=out, validate=False, variant="fp16")
    assert "precision_convert" not in json.loads((out / "config.json").read_text())
    new = tmp_path / "new"
    pc.load(out).save_pretrained(new)
    config = json.loads((new / "config.json").read_text())
    assert config["dtype"] == json.loads((source / "config.json").read_text())["dtype"]
    assert config["precision_convert"]["islands"][ISLAND] == "range"
    assert pc.load(new).get_submodule(ISLAND).weight.dtype == torch.float32


def _psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    import math

    mse = (image.double() - reference.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)
