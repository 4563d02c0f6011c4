"""The real-config zoo: each family is what its published checkpoint is, and it certifies.

The structural tests check what makes a zoo entry a small model *of that family* (the values
kept from its published config, its tokenizer's kind, size and special tokens, its shard
layout); the conversion tests run every family through ``bf16-safe`` at ``quick`` coverage
(``fp16-safe`` too with ``pytest -m slow``, and both at ``standard``) and require a passing
certificate.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _models import ZOO_TARGETS, with_custom_head, zoo

from precision_convert.api.conversion import convert, plan_model

FAMILIES = sorted(zoo.FAMILIES)
SAFE_TARGETS = ("bf16-safe", "fp16-safe")


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


#: Tokenizers shorter than their embedding, as published: the rows past them exist in the
#: model and no text produces them (Qwen2.5 pads to 151936, Phi-3 to 32064, T5 to 32128).
TOKENIZER_LENGTH = {"qwen2.5-0.5b": 151665, "phi-3-mini-4k": 32011, "t5": 32100}


def _text_parts(directory: Path) -> list[tuple[Path, Path]]:
    """(config folder, tokenizer folder) pairs: the model itself, or a pipeline's encoders."""
    if not (directory / "model_index.json").exists():
        return [(directory, directory)]
    return [
        (encoder, directory / encoder.name.replace("text_encoder", "tokenizer"))
        for encoder in sorted(directory.glob("text_encoder*"))
    ]


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_is_the_familys(tiny_model: Callable[[str], Path], name: str) -> None:
    from transformers import AutoTokenizer

    for config_dir, tokenizer_dir in _text_parts(tiny_model(name)):
        config = _text_config(_config(config_dir))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        expected = TOKENIZER_LENGTH.get(
            "t5" if config["model_type"] == "t5" else name, config["vocab_size"]
        )
        assert len(tokenizer) == expected, config_dir
        assert (tokenizer.pad_token is None) == (name in zoo.PADLESS)
        # Real text splits into learned sub-words, not single bytes.
        assert len(tokenizer.tokenize("the river bank")) <= 6


def test_llama_keeps_its_published_layout(tiny_model: Callable[[str], Path]) -> None:
    directory = tiny_model("llama-3.2-1b")
    config = _config(directory)
    published = zoo.causal_lm.LLAMA_3_2_1B
    for key in ("vocab_size", "rope_scaling", "rope_theta", "max_position_embeddings"):
        assert config[key] == published[key]
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4  # GQA as 32/8
    assert config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_mistral_is_sharded_with_an_index(tiny_model: Callable[[str], Path]) -> None:
    directory = tiny_model("mistral-7b-v0.3")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert (directory / "tokenizer.model").is_file()  # the sentencepiece model ships too


@pytest.mark.parametrize("target", ZOO_TARGETS)
@pytest.mark.parametrize("name", FAMILIES)
def test_family_certifies(
    tiny_model: Callable[[str], Path],
    zoo_converted: Callable[[str, str], Any],
    name: str,
    target: str,
) -> None:
    result = zoo_converted(name, target)
    _check_certified(tiny_model(name), result)


def test_sd15_candidates_load_each_component_as_its_class(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """A candidate of the fp16 search loads as the source does: the SD 1.5 safety checker as
    the pipeline's ``StableDiffusionSafetyChecker``, not the ``CLIPModel`` its config alone
    reads as (whose outputs never match the fp32 checker's)."""
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker

    from precision_convert.conversion.io.source import open_source
    from precision_convert.conversion.runtime.loader import load
    from precision_convert.validation.calibration.search import _write_candidate

    checker = open_source(tiny_model("stable-diffusion-1.5")).components["safety_checker"]
    plan, _ = plan_model(checker, "fp16-safe")
    candidate = load(_write_candidate(checker, plan, tmp_path))
    assert type(candidate) is StableDiffusionSafetyChecker


def test_sd15_fp16_search_gives_no_advice_validation_contradicts(
    zoo_converted: Callable[[str, str], Any],
) -> None:
    """Validation finds every SD 1.5 component matching fp32 at fp16-safe, so the search must
    not have told the user to fall back to bf16-safe for any of them."""
    result = zoo_converted("stable-diffusion-1.5", "fp16-safe")
    assert result.certificate.verdict == "pass", result.certificate.failures
    for component in result.components:
        assert component.calibration is None or component.calibration.passed is not False
        assert not [w for w in component.plan.warnings if "use bf16-safe" in w], component.name


def _check_certified(source: Path, result: Any) -> None:
    """A passing certificate, and every sharded source folder still sharded, same shards."""
    certificate = result.certificate
    assert certificate is not None
    assert certificate.verdict == "pass", certificate.failures
    for index in source.rglob("*.safetensors.index.json"):
        folder = result.output / index.parent.relative_to(source)
        written = json.loads((folder / index.name).read_text())["weight_map"]
        assert written == json.loads(index.read_text())["weight_map"]


#: Slow: every family at standard coverage, both safe targets, on CPU.
@pytest.mark.slow
@pytest.mark.parametrize("target", SAFE_TARGETS)
@pytest.mark.parametrize("name", FAMILIES)
def test_family_certifies_at_standard_coverage(
    tiny_model: Callable[[str], Path], tmp_path: Path, name: str, target: str
) -> None:
    source = tiny_model(name)
    _check_certified(source, convert(source, to=target, output=tmp_path / "out"))


def test_zoo_scales_only_depth_and_width() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        zoo._build.scaled(zoo.causal_lm.GPT2, n_embd=32, vocab_size=100)


def test_builders_leave_the_callers_rng_alone() -> None:
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    zoo._build.transformers_model(
        zoo._build.scaled(zoo.causal_lm.GPT2, n_embd=8, n_head=2, n_layer=1)
    )
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------- what the zoo revealed


def test_phi3_auto_map_beside_a_native_class_needs_no_remote_code(
    tiny_model: Callable[[str], Path],
) -> None:
    """Phi-3 ships an ``auto_map`` its native transformers class replaces: the fp32 baseline
    builds that class, as ``from_pretrained`` does, instead of refusing to validate."""
    from precision_convert.conversion.runtime.baseline import load_fp32

    directory = tiny_model("phi-3-mini-4k")
    assert "auto_map" in _config(directory)
    assert type(load_fp32(directory)).__name__ == "Phi3ForCausalLM"


def test_safety_checker_is_built_as_the_pipeline_names_it(
    tiny_model: Callable[[str], Path],
) -> None:
    """SD 1.5's safety checker: its config reads as CLIP's, its class is diffusers'; the
    baseline builds the class model_index.json names, and probes feed its own inputs."""
    from precision_convert.conversion.runtime.baseline import load_fp32
    from precision_convert.validation.probe.inputs.layouts import input_candidates

    checker = load_fp32(tiny_model("stable-diffusion-1.5")).safety_checker
    assert type(checker).__name__ == "StableDiffusionSafetyChecker"
    probe = next(input_candidates(checker)).probes[0]
    assert set(probe.kwargs) == {"clip_input", "images"}


def test_small_model_with_a_wide_vocabulary_gets_probes_it_can_hold(
    tiny_model: Callable[[str], Path],
) -> None:
    """A 16 MB model with Llama-3's 128k vocabulary fed the level's 1024 tokens would hold
    0.5 GB of logits per probe where its head is computed whole (a head of a class of its own):
    its probes shrink to what one probe may take. A plain linear head computes the kept rows
    only, and the level's probes fit."""
    from transformers import AutoModelForCausalLM

    from precision_convert.validation.probe.inputs.budgets import (
        PROBE_ACTIVATIONS,
        budget_for,
        bytes_per_token,
        fit_model,
    )

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama-3.2-1b"))
    quick = budget_for("quick")
    assert fit_model(quick, model) == quick
    assert quick.tokens_per_probe * bytes_per_token(model, logits=False) <= PROBE_ACTIVATIONS
    fitted = fit_model(quick, with_custom_head(model))
    assert fitted.tokens_per_probe < quick.tokens_per_probe
    assert fitted.tokens_per_probe * bytes_per_token(model) <= PROBE_ACTIVATIONS


def test_quick_coverage_calls_a_pipeline_at_a_small_size(
    zoo_converted: Callable[[str, str], Any],
) -> None:
    """quick's end-to-end call decodes 64-pixel frames: CogVideoX's 5-frame decode in low
    precision took 285 s of a 7 MB model's conversion on a CPU at the standard 256."""
    certificate = zoo_converted("cogvideox-5b", "bf16-safe").certificate
    record = next(c for c in certificate.components if c.name == "pipeline")
    call = record.inputs["probes"]["pipeline"]["args"]
    assert (call["height"], call["width"], call["num_frames"]) == (64, 64, 5)


def test_whole_vocabulary_sweep_stays_within_what_memory_affords(
    tiny_model: Callable[[str], Path],
) -> None:
    """standard covers every id of Llama-3's 128k vocabulary in probes no bigger than the
    model's memory affords: chunks of 4008 ids (4 GB of logits a probe for a 16 MB model;
    Gemma's took 17 GB) became more, memory-sized probes."""
    import torch
    from transformers import AutoModelForCausalLM

    from precision_convert.validation.probe.inputs.budgets import budget_for, fit_model
    from precision_convert.validation.probe.inputs.layouts import input_candidates
    from precision_convert.validation.probe.inputs.sweep import sweep
    from precision_convert.validation.probe.run.execute import run_probes, select_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama-3.2-1b")).eval()
    chosen, _ = select_inputs(model, input_candidates(model), run_probes)
    probes = sweep(model, chosen, "standard", None).probes
    vocabulary = [p for p in probes if (p.sweep or {}).get("kind") == "vocabulary"]
    fitted = fit_model(budget_for("standard"), model)
    assert all(p.kwargs["input_ids"].numel() <= fitted.tokens_per_probe for p in vocabulary)
    ids = torch.cat([p.kwargs["input_ids"].flatten() for p in vocabulary])
    assert len(ids.unique()) == model.config.vocab_size


def test_long_rows_of_a_big_vocabulary_keep_the_logits_memory_affords(
    tiny_model: Callable[[str], Path],
) -> None:
    """A 2048-token row over Llama-3's 128k vocabulary holds 1 GB of fp32 logits. A plain
    linear head computes the sampled rows only (every position's RMS from its Gram matrix), so
    the row runs whole at no such cost. A head of another class is the memory it was: rows
    longer than a probe affords keep the last positions' logits and every position's hidden
    states, and the record says so; shorter rows keep every position's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from precision_convert.validation.probe.inputs.budgets import budget_for, fit_model
    from precision_convert.validation.probe.inputs.layouts import input_candidates
    from precision_convert.validation.probe.inputs.sweep import sweep
    from precision_convert.validation.probe.run.execute import call_probe, run_probes, select_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama-3.2-1b")).eval()
    vocab, layers = model.config.vocab_size, model.config.num_hidden_layers

    def length_probes() -> dict[int, Any]:
        chosen, _ = select_inputs(model, input_candidates(model), run_probes)
        return {
            p.sweep["length"]: p
            for p in sweep(model, chosen, "standard", None).probes
            if (p.sweep or {}).get("kind") == "length"
        }

    whole = length_probes()[2048]
    assert "logits_to_keep" not in whole.kwargs and "logits" not in whole.sweep
    outputs = call_probe(model, whole, "cpu", torch.float32)
    assert outputs["logits"].shape[-1] == vocab and outputs["logits"].numel() <= (1 << 20) + vocab
    assert outputs["logits.rms"].shape == whole.kwargs["input_ids"].shape == (2, 2048)

    with_custom_head(model)
    lengths = length_probes()
    affordable = fit_model(budget_for("standard"), model).tokens_per_probe
    assert max(lengths) == 2048 > affordable
    for length, probe in lengths.items():
        trimmed = length > affordable
        assert probe.kwargs.get("logits_to_keep") == (affordable if trimmed else None)
        assert ("logits" in probe.sweep) is trimmed
    outputs = call_probe(model, lengths[2048], "cpu", torch.float32)
    sampled = outputs["logits"]  # summarized: rows sampled, every row's RMS kept
    assert sampled.shape[-1] == vocab and outputs["logits.rms"].shape == (1, affordable)
    for layer in range(layers + 1):  # every position, whole (small next to the logits)
        assert outputs[f"hidden_states.{layer}"].shape[:2] == (1, 2048)
    assert lengths[2048].sweep["logits"] == (
        f"the last {affordable} positions'; hidden states of every layer"
    )


def test_make_zoo_model_checks_its_packages_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A family whose tokenizer needs sentencepiece, without it: one line naming the packages
    and the pip command, exit 2, nothing written."""
    import importlib.util

    import make_zoo_model

    real = importlib.util.find_spec

    def find_spec(name: str, *rest: object) -> object:
        return None if name == "sentencepiece" else real(name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert zoo.missing_packages("flan-t5-base") == ["sentencepiece"]
    assert zoo.missing_packages("gpt2") == []
    assert make_zoo_model.main(["flan-t5-base", str(tmp_path / "flan")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["make_zoo_model.py: flan-t5-base needs sentencepiece: pip install sentencepiece"]
    assert list(tmp_path.iterdir()) == []


def test_make_zoo_model_leaves_no_half_written_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import make_zoo_model

    def half_then_fail(name: str, path: Path) -> Path:
        path.mkdir()
        (path / "config.json").write_text("{}")
        raise RuntimeError("tokenizer trainer crashed")

    monkeypatch.setattr(zoo, "build", half_then_fail)
    assert make_zoo_model.main(["gpt2", str(tmp_path / "gpt2")]) == 2
    assert capsys.readouterr().err.strip() == (
        "make_zoo_model.py: building gpt2 failed: tokenizer trainer crashed"
    )
    assert list(tmp_path.iterdir()) == []
