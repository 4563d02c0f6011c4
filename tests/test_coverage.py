"""Coverage by design: probes sweep what changes activations, and users can add their own.

Three tiny real models whose fp16 forward overflows only off the beaten path — one rare token,
positions past 32, timesteps near the first denoising step — were certified by a validation
that fed 2x12 random ids or t=500. Each overflow below is built by scaling real weights (never
by faking outputs): fp32 computes a sane function, fp16 really exceeds 65504. Each must now be
refused by plain ``fp16`` at the default coverage, with the layout probe (all that used to run)
still passing: the sweep is what catches it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models
import pytest
import torch
from _models import make, t5_tokenizer, unet

from precision_convert.api.conversion import convert
from precision_convert.core.errors import CannotValidateError, InputError
from precision_convert.validation.certify.certificate import Certificate
from precision_convert.validation.certify.runner import validate
from precision_convert.validation.probe.inputs.budgets import BUDGETS, LEVELS, budget_for
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.media_probes import timestep_values
from precision_convert.validation.probe.inputs.sweep import replay, sweep
from precision_convert.validation.probe.inputs.userdata import read_calibration_data
from precision_convert.validation.probe.run.execute import (
    build_inputs,
    run_probes,
    run_sweep,
    select_inputs,
    summarize,
)

#: The rare token of the overflowing Llama, and its vocabulary.
RARE, VOCAB = 2000, 2048


# --------------------------------------------------------------------------- models


def rare_token_llama() -> Any:
    """A Llama whose MLP overflows fp16 on one rare token id only.

    The rare id's embedding row is a spike in dimension ``d``; after RMSNorm any token
    dominated by ``d`` reads 8 there (sqrt(64)). One MLP neuron gates and projects on ``d``
    alone with weight 40: the rare token makes silu(320) * 320 = 102400 > 65504, while
    ordinary tokens (|x_d| <~ 4) stay below 26000. Its down-projection is scaled 1e-3, so fp32
    adds a modest ~100 to the residual.
    """
    torch.manual_seed(0)
    # An untied head: a tied one would make the spike hit every position.
    model = _models.llama(vocab_size=VOCAB, tie_word_embeddings=False).eval()
    d, j = 5, 7
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        model.model.embed_tokens.weight[RARE, d] = 10.0
        mlp.gate_proj.weight[j].zero_()
        mlp.gate_proj.weight[j, d] = 40.0
        mlp.up_proj.weight[j].zero_()
        mlp.up_proj.weight[j, d] = 40.0
        mlp.down_proj.weight[:, j].mul_(1e-3)
    return model


def long_position_gpt2() -> Any:
    """A GPT-2 (learned positions, 128 of them) that overflows fp16 only past position 32.

    Position embeddings from 32 on spike in dimension ``d`` (LayerNorm makes that ~8); one MLP
    neuron reads ``d`` with weight 10000 (80000 > 65504 there, < 40000 for ordinary tokens),
    and its output projection is scaled 1e-4.
    """
    torch.manual_seed(0)
    model = _models.gpt2().eval()
    d, j = 5, 7
    mlp = model.transformer.h[0].mlp
    with torch.no_grad():
        model.transformer.wpe.weight[32:, d] = 10.0
        mlp.c_fc.weight[:, j].zero_()  # Conv1D weights are (in, out)
        mlp.c_fc.weight[d, j] = 10000.0
        mlp.c_fc.bias[j] = 0.0
        mlp.c_proj.weight[j, :].mul_(1e-4)
    return model


def late_timestep_unet() -> Any:
    """The zoo UNet whose time embedding overflows fp16 for t >~ 870 only (not at t=500).

    The sinusoidal embedding is bounded, but its slowest sine channels grow with t. One
    ``time_embedding.linear_1`` row reads the two slowest with weight 60000 (+3000 bias):
    41000 at t=500, 64000 at t=850, 66800 at t=900 and 72000 at t=999, where every sampler
    starts. ``linear_2`` reads that row scaled 1e-4, so fp32 stays sane.
    """
    torch.manual_seed(0)
    model = unet().eval()
    linear_1, linear_2 = model.time_embedding.linear_1, model.time_embedding.linear_2
    half = linear_1.in_features // 2  # [cos | sin] halves (flip_sin_to_cos)
    j = 3
    with torch.no_grad():
        linear_1.weight[j].zero_()
        linear_1.weight[j, 2 * half - 2] = 60000.0
        linear_1.weight[j, 2 * half - 1] = 60000.0
        linear_1.bias[j] = 3000.0
        linear_2.weight[:, j].mul_(1e-4)
    return model


def _saved(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def _convert_and_validate(source: Path, out: Path, target: str, **kwargs: Any) -> Certificate:
    convert(source, to=target, output=out, validate=False)
    return validate(out, baseline=source, **kwargs)


def _layout_rows(certificate: Certificate) -> list[Any]:
    """The measurements of the layout probe: everything validation used to run."""
    return [m for m in certificate.metrics if m.probe in ("forward", "encode", "decode")]


def _assert_refused_by_the_sweep(certificate: Certificate, kind: str) -> None:
    assert certificate.verdict == "fail"
    assert any("NaN/Inf" in line for line in certificate.failures), certificate.failures
    failing = {m.probe for m in certificate.metrics if not m.passed}
    # Only the sweep's probes fail: forwards, and a generating model's free generation.
    assert failing and all(p.startswith(("forward:", "generate:")) for p in failing), failing
    probes = certificate.components[0].inputs["probes"]
    assert any(probes[p]["sweep"]["kind"] == kind for p in failing if p in probes)
    # What the old 2x12 / t=500 validation ran still passes: only the sweep sees the overflow.
    layout = _layout_rows(certificate)
    assert layout and all(m.passed for m in layout)


# --------------------------------------------------------------------------- the three classes


def test_rare_token_overflow_is_refused(tmp_path: Path) -> None:
    source = _saved(rare_token_llama(), tmp_path / "src")
    model = rare_token_llama()
    chosen, _ = select_inputs(model, input_candidates(model), run_probes)
    assert not (chosen.probes[0].kwargs["input_ids"] == RARE).any()  # the old probe misses it
    certificate = _convert_and_validate(source, tmp_path / "fp16", "fp16")
    _assert_refused_by_the_sweep(certificate, "vocabulary")
    assert certificate.components[0].inputs["coverage"] == "standard"


def test_long_position_overflow_is_refused(tmp_path: Path) -> None:
    source = _saved(long_position_gpt2(), tmp_path / "src")
    certificate = _convert_and_validate(source, tmp_path / "fp16", "fp16")
    _assert_refused_by_the_sweep(certificate, "length")
    probes = certificate.components[0].inputs["probes"]
    lengths = sorted(
        p["sweep"]["length"] for p in probes.values() if p.get("sweep", {}).get("kind") == "length"
    )
    assert lengths == [32, 64, 128]  # doubling up to the position limit
    assert not any(
        m.passed
        for m in certificate.metrics
        if m.probe == "forward:length-128" and m.metric == "nonfinite"
    )


def test_late_timestep_overflow_is_refused(tmp_path: Path) -> None:
    source = _saved(late_timestep_unet(), tmp_path / "src")
    certificate = _convert_and_validate(source, tmp_path / "fp16", "fp16")
    _assert_refused_by_the_sweep(certificate, "timestep")
    probes = certificate.components[0].inputs["probes"]
    first = probes["forward:t=999"]
    assert first["sweep"]["timestep"] == 999
    assert first["args"]["timestep"]["values"] == [999, 999]
    assert first["args"]["timestep"]["dtype"] == "int64"  # as DDPM-style schedulers hand it on
    failing = {m.probe for m in certificate.metrics if not m.passed}
    assert "forward:t=999" in failing and "forward:t=250" not in failing


def test_safe_targets_of_the_rare_token_model(tmp_path: Path) -> None:
    """bf16 has fp32's range: bf16-safe is certified on the whole sweep."""
    source = _saved(rare_token_llama(), tmp_path / "src")
    certificate = _convert_and_validate(source, tmp_path / "bf16-safe", "bf16-safe")
    assert certificate.verdict == "pass", certificate.failures


def _rare_token_run(model: Any, dtype: torch.dtype) -> torch.Tensor:
    return model(input_ids=torch.tensor([[5, 9, RARE, 17, 3]])).logits


def _long_run(model: Any, dtype: torch.dtype) -> torch.Tensor:
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(3))
    return model(input_ids=ids).logits


def _first_step_run(model: Any, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    sample, states = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 8, 24, generator=g)
    return model(sample.to(dtype), torch.tensor([999, 999]), states.to(dtype)).sample


@pytest.mark.parametrize(
    ("build", "trigger"),
    [
        (rare_token_llama, _rare_token_run),
        (long_position_gpt2, _long_run),
        (late_timestep_unet, _first_step_run),
    ],
    ids=["rare-token", "long-positions", "late-timesteps"],
)
def test_fp16_safe_calibrates_on_the_sweep_and_stays_finite(
    tmp_path: Path, build: Callable[[], Any], trigger: Callable[[Any, torch.dtype], Any]
) -> None:
    """Calibration sees the same sweep, so fp16-safe finds the range islands the overflow
    needs: certified, and finite and close to fp32 on the inputs that break plain fp16."""
    import precision_convert as pc

    model = build()
    source = _saved(model, tmp_path / "src")
    result = convert(source, to="fp16-safe", output=tmp_path / "safe")
    assert result.certificate.verdict == "pass", result.certificate.failures
    assert any(i.reason == "range" for i in result.components[0].plan.islands)
    with torch.no_grad():
        reference = trigger(model, torch.float32).float()
        got = trigger(pc.load(tmp_path / "safe"), torch.float16).float()
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got.flatten(), reference.flatten(), 0) >= 0.99


# --------------------------------------------------------------------------- what is swept


def test_standard_sweeps_every_token_id_special_tokens_and_lengths() -> None:
    model = make("llama")
    inputs = build_inputs(model, coverage="standard")
    vocab = model.config.vocab_size
    seen = torch.cat(
        [
            p.kwargs["input_ids"].flatten()
            for p in inputs.probes
            if p.sweep.get("kind") == "vocabulary"
        ]
    )
    assert set(seen.tolist()) == set(range(vocab))
    kinds = [p.sweep.get("kind") for p in inputs.probes]
    assert inputs.probes[0].name == "forward" and not inputs.probes[0].sweep  # layout first
    assert {"vocabulary", "special", "padding", "length"} <= set(kinds)
    special = next(p for p in inputs.probes if p.sweep.get("kind") == "special")
    assert {model.config.bos_token_id, model.config.eos_token_id} <= set(
        special.kwargs["input_ids"].flatten().tolist()
    )
    padded = next(p for p in inputs.probes if p.sweep.get("kind") == "padding")
    mask = padded.kwargs["attention_mask"]
    assert mask.shape[0] > 1 and (mask == 0).any() and (mask.sum(1) > 0).all()
    longest = max(p.kwargs["input_ids"].shape[1] for p in inputs.probes)
    assert longest == model.config.max_position_embeddings


def test_quick_samples_and_thorough_sweeps_more() -> None:
    model = make("llama")
    quick = build_inputs(model, coverage="quick")
    thorough = build_inputs(model, coverage="thorough")
    assert quick.coverage == "quick" and thorough.coverage == "thorough"
    assert len(quick.probes) < len(thorough.probes)
    assert not BUDGETS["quick"].whole_vocabulary and BUDGETS["thorough"].max_length is None
    with pytest.raises(InputError, match="coverage level"):
        budget_for("exhaustive")
    assert LEVELS == ("quick", "standard", "thorough")


def test_timesteps_span_the_schedule_on_the_model_scale() -> None:
    unet_model, flux = make("unet"), make("flux-transformer")
    assert timestep_values(unet_model, BUDGETS["standard"], None)[0] == 999
    assert timestep_values(unet_model, BUDGETS["standard"], 1000) == [999, 749, 250, 0]
    assert len(timestep_values(unet_model, BUDGETS["thorough"], None)) == 10  # every decile
    # Flux multiplies t by 1000 itself: sigmas in [0, 1], exact in bf16 even after the x1000.
    sigmas = timestep_values(flux, BUDGETS["standard"], None)
    assert sigmas[0] == 1.0 and all(0.0 <= s <= 1.0 for s in sigmas)
    inputs = build_inputs(flux, coverage="standard")
    swept = [p for p in inputs.probes if p.sweep.get("kind") == "timestep"]
    assert swept and all(float(p.kwargs["timestep"].max()) <= 1.0 for p in swept)


def test_other_families_sweep_what_makes_sense(tiny_model: Callable[[str], Path]) -> None:
    vae = build_inputs(make("autoencoder-kl"), coverage="standard")
    assert [p.name for p in vae.probes] == ["encode", "decode", "encode@64x64", "decode@64x64"]
    whisper = build_inputs(make("whisper"), coverage="standard")
    vocab_probe = next(p for p in whisper.probes if p.sweep.get("kind") == "vocabulary")
    assert vocab_probe.sweep["argument"] == "decoder_input_ids"
    bart = build_inputs(make("bart"), coverage="standard")
    probe = next(p for p in bart.probes if p.sweep.get("kind") == "length")
    assert probe.kwargs["decoder_input_ids"].shape == probe.kwargs["input_ids"].shape
    clip = build_inputs(make("clip"), coverage="standard")
    probe = next(p for p in clip.probes if p.sweep.get("kind") == "vocabulary")
    assert probe.kwargs["pixel_values"].shape[0] == 2  # images stay: CLIP compares any batches
    # Every swept probe of every family runs on the fp32 model (none is dropped).
    for name in (
        "t5-encoder",
        "bert",
        "whisper",
        "bart",
        "clip",
        "vit",
        "wav2vec2",
        "dit-transformer",
        "cogvideox-vae",
        "sd3-transformer",
    ):
        model = make(name)
        chosen, outputs = select_inputs(model, input_candidates(model), run_probes)
        full = sweep(model, chosen, "standard")
        kept, _ = run_sweep(model, chosen, full, run_probes, outputs)
        assert len(kept.probes) == len(full.probes) > 1, (name, kept.notes)


def test_big_outputs_are_summarized_not_kept_whole() -> None:
    logits = torch.randn(4, 64, 1000)
    logits[2, 17, 3] = float("inf")
    small = summarize({"logits": logits}, 1 << 16)
    assert small["logits.rms"].shape == (4, 64) and not torch.isfinite(small["logits.rms"]).all()
    assert small["logits"].numel() <= 1 << 16 and small["logits"].shape[-1] == 1000
    assert summarize({"logits": logits}, logits.numel())["logits"] is logits


# --------------------------------------------------------------------------- replay


def test_certificate_probes_replay_to_the_same_tensors(tmp_path: Path) -> None:
    source = _saved(make("unet"), tmp_path / "src")
    certificate = _convert_and_validate(source, tmp_path / "out", "bf16", coverage="quick")
    record = json.loads(json.dumps(certificate.components[0].inputs))  # as read from disk
    assert record["coverage"] == "quick" and "forward:t=999" in record["probes"]
    model = make("unet")
    replayed = replay(model, record)
    rebuilt = build_inputs(model, coverage="quick")
    assert [p.name for p in replayed.probes] == list(record["probes"])
    for probe in replayed.probes:
        original = next(p for p in rebuilt.probes if p.name == probe.name)
        for key, value in probe.kwargs.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, original.kwargs[key])
    # Token probes record ids (inline when short) or their digest, with shape and seed.
    llama = build_inputs(make("llama"), coverage="standard").describe()
    vocab = next(
        p for p in llama["probes"].values() if p.get("sweep", {}).get("kind") == "vocabulary"
    )
    assert len(vocab["args"]["input_ids"]["sha256"]) == 64 and vocab["args"]["input_ids"]["shape"]
    assert vocab["sweep"]["permutation_seed"] == 0
    tampered = json.loads(json.dumps(record))
    tampered["probes"]["forward:t=999"]["args"]["timestep"]["sha256"] = "0" * 64
    with pytest.raises(CannotValidateError, match="differs"):
        replay(model, tampered)


# --------------------------------------------------------------------------- user data


def test_text_calibration_data_goes_through_the_tokenizer(tmp_path: Path) -> None:
    data = tmp_path / "prompts.txt"
    data.write_text("a red fox jumps\n\nprecision matters\nthe dog sleeps near the river\n")
    model, tokenizer = make("t5-encoder"), t5_tokenizer()
    chosen, _ = select_inputs(model, input_candidates(model, tokenizer=tokenizer), run_probes)
    inputs = sweep(model, chosen, "quick", tokenizer, data=read_calibration_data(data))
    user = [p for p in inputs.probes if p.sweep.get("kind") == "user-text"]
    assert len(user) == 1 and user[0].sweep["lines"] == [1, 4]
    ids = user[0].kwargs["input_ids"]
    expected = tokenizer("precision matters")["input_ids"]
    assert ids[1, : len(expected)].tolist() == expected
    assert user[0].kwargs["attention_mask"][1].sum() == len(expected)
    assert any(p.sweep.get("kind") == "text" for p in inputs.probes)  # the model's own text too
    # Without a tokenizer, text cannot be fed: one clear error naming the file.
    with pytest.raises(InputError, match=r"prompts\.txt.*no tokenizer"):
        sweep(model, chosen, "quick", None, data=read_calibration_data(data))
    unet_model = make("unet")
    chosen, _ = select_inputs(unet_model, input_candidates(unet_model), run_probes)
    with pytest.raises(InputError, match="takes no token ids"):
        sweep(unet_model, chosen, "quick", None, data=read_calibration_data(data))


def test_jsonl_calibration_data_is_validated_and_certified(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    data = tmp_path / "inputs.jsonl"
    rows = [
        {"input_ids": [[3, 17, 42, 99, 5]]},
        {"input_ids": [[7] * 40], "attention_mask": [[1] * 40]},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = tiny_model("llama")
    certificate = _convert_and_validate(
        source, tmp_path / "out", "bf16", coverage="quick", calibration_data=data
    )
    assert certificate.verdict == "pass", certificate.failures
    probes = certificate.components[0].inputs["probes"]
    assert probes["forward:user-1"]["args"]["input_ids"]["values"] == [[3, 17, 42, 99, 5]]
    assert probes["forward:user-2"]["sweep"] == {"kind": "user-jsonl", "file": data.name, "line": 2}
    assert any(m.probe == "forward:user-2" for m in certificate.metrics)
    # --inputs replaces the built probes; calibration data still adds its own.
    from safetensors.torch import save_file

    tensors = tmp_path / "inputs.safetensors"
    save_file({"input_ids": torch.tensor([[1, 2, 3, 4]])}, tensors)
    certificate = validate(
        tmp_path / "out", baseline=source, inputs=tensors, calibration_data=data, coverage="quick"
    )
    assert list(certificate.components[0].inputs["probes"]) == [
        "forward",
        "forward:user-1",
        "forward:user-2",
    ]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "empty"),
        ("\n  \n", "empty"),
        ('{"input_ids": [[1, 2]]}\n{"input_ids": [[1, 2]\n', "bad JSON on line 2"),
        ('{"input_ids": [[1, 2]]}\n[1, 2]\n', "line 2 is not a JSON object"),
        ('{"input_ids": [[1, 2], [3]]}\n', "line 1: 'input_ids' must be .*rectangular"),
        ('{"input_ids": "hello"}\n', "line 1: 'input_ids'"),
    ],
)
def test_malformed_calibration_data_names_file_and_line(
    tmp_path: Path, content: str, match: str
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=match) as caught:
        read_calibration_data(path)
    assert str(path) in str(caught.value)


def test_calibration_data_errors_against_the_model(tmp_path: Path) -> None:
    model = make("llama")
    chosen, _ = select_inputs(model, input_candidates(model), run_probes)
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"input_ids": [[1, 2]], "pixel_values": [[0.5]]}\n')
    with pytest.raises(InputError, match="line 1 names pixel_values") as caught:
        sweep(model, chosen, "quick", data=read_calibration_data(unknown))
    assert "unknown.jsonl" in str(caught.value)
    with pytest.raises(InputError, match="no such file"):
        read_calibration_data(tmp_path / "missing.txt")
    rejected = tmp_path / "rejected.jsonl"
    rejected.write_text('{"input_ids": [[1, 2, 100000]]}\n')  # an id past the vocabulary
    full = sweep(model, chosen, "quick", data=read_calibration_data(rejected))
    with pytest.raises(InputError, match=r"rejected\.jsonl.*line 1"):
        run_sweep(model, chosen, full, run_probes)


def test_cli_checks_coverage_and_calibration_data_before_any_work(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    source = str(tiny_model("t5-encoder"))
    out = tmp_path / "out"
    bad_level = CliRunner().invoke(app, ["model", source, "--to", "bf16", "-o", str(out),
                                         "--coverage", "bogus"])  # fmt: skip
    assert bad_level.exit_code == 2 and "unknown coverage level 'bogus'" in bad_level.stderr
    data = str(tmp_path / "none.txt")
    missing = CliRunner().invoke(app, ["model", source, "--to", "bf16", "-o", str(out),
                                       "--calibration-data", data])  # fmt: skip
    assert missing.exit_code == 2 and "none.txt" in missing.stderr
    assert not out.exists()  # refused before anything was written


def test_probe_size_follows_the_model_so_validation_stays_near_its_size() -> None:
    """A 350 MB model with an 8k vocabulary whose head probes cannot sample (a class of its
    own): 4096-token probes would hold ~0.5 GB of activations (logits alone 134 MB), so probes
    shrink to the fixed per-probe allowance (a share of the model for larger ones: memory
    follows the model, not the probes); with a plain linear head a token costs no row of
    logits, and the level's probes fit; a tiny model keeps the level's probes (their memory
    matters nowhere), and every vocabulary id is still swept."""
    from accelerate import init_empty_weights

    from precision_convert.validation.probe.inputs.budgets import (
        ACTIVATION_SHARE,
        PROBE_ACTIVATIONS,
        budget_for,
        bytes_per_token,
        fit_model,
    )

    with init_empty_weights():
        big = _models.llama(
            vocab_size=8192,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=12,
            tie_word_embeddings=False,
        )
    weights = sum(4 * p.numel() for p in big.parameters())
    standard = budget_for("standard")
    allowance = max(ACTIVATION_SHARE * weights, PROBE_ACTIVATIONS)
    assert fit_model(standard, big) == standard
    assert standard.tokens_per_probe * bytes_per_token(big, logits=False) <= allowance
    with init_empty_weights():
        _models.with_custom_head(big)
    fitted = fit_model(standard, big)
    assert 16 <= fitted.tokens_per_probe < standard.tokens_per_probe
    assert fitted.tokens_per_probe * bytes_per_token(big) <= allowance
    assert fitted.whole_vocabulary and fitted.vocabulary_probes == standard.vocabulary_probes
    tiny = make("llama")
    assert fit_model(standard, tiny) == standard
