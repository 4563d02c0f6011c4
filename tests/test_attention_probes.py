"""Left-padded batches under every attention implementation a user can pick.

``generate`` pads a batch of prompts on the left, so the first positions of a short row attend
to nothing. Eager attention adds ``finfo(dtype).min`` to masked scores: in fp16, -65504 plus
any score below about -16 is ``-inf``, a row of ``-inf`` is NaN after softmax, and the NaN
reaches every real token of the row through the next layer's values. The models here carry a
constant offset on every score through real q/k biases (softmax ignores it, nothing comes near
65504): Gemma2 runs eager by default, Qwen2 runs sdpa by default and breaks only when a user
picks ``attn_implementation="eager"``. The certificate must judge both implementations, and
the island search must find what keeps them finite.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import _models
import pytest
import torch
from transformers import GPT2Config, GPT2DoubleHeadsModel

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.validation.certify.certificate import Certificate
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.sweep import sweep
from precision_convert.validation.probe.run.attention import (
    attention,
    attention_choices,
    eager_score_bytes,
    outputs_by_attention,
    same_function,
)
from precision_convert.validation.probe.run.execute import run_probes, select_inputs

#: The score offset: past fp16's -inf point (16) after Gemma2's softcapping (50 * tanh(x/50)
#: makes it -22.6), and below 32, where bf16's rounding of the scores (a step of 0.25 there)
#: would swamp a tiny random model's own score differences.
OFFSET = 24.0
FAMILIES: dict[str, Callable[..., Any]] = {"gemma2": _models.gemma2, "qwen2": _models.qwen2}
#: The implementation under which each family's left-padded fp16 row turns to NaN.
EAGER = {"gemma2": None, "qwen2": "eager"}  # None: the model's default (Gemma2's is eager)


def _model(family: str, offset: bool) -> Any:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    return _models.offset_scores(model, OFFSET) if offset else model


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """A 3x16 batch padded on the left as ``generate`` pads it: rows of 16, 11 and 6 tokens."""
    ids = torch.randint(3, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :10] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _forward(model: Any, implementation: str | None) -> torch.Tensor:
    """Logits at the real positions of the left-padded batch, positions as generate makes
    them (counting real tokens only)."""
    ids, mask = _left_padded()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with attention(model, implementation), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return logits[mask.bool()].float()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    root = tmp_path_factory.mktemp("attention-sources")
    made: dict[tuple[str, bool], Path] = {}

    def get(family: str, offset: bool) -> Path:
        if (family, offset) not in made:
            path = root / f"{family}-{'offset' if offset else 'clean'}"
            _model(family, offset).save_pretrained(path)
            made[family, offset] = path
        return made[family, offset]

    return get


@pytest.fixture(scope="module")
def converted(
    source: Callable[[str, bool], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, bool, str], Path]:
    """``converted(family, offset, target)`` → that conversion's directory (made once)."""
    root = tmp_path_factory.mktemp("attention-converted")
    done: dict[tuple[str, bool, str], Path] = {}

    def get(family: str, offset: bool, target: str) -> Path:
        key = (family, offset, target)
        if key not in done:
            out = root / f"{family}-{offset}-{target}"
            convert(source(family, offset), to=target, output=out, coverage="quick")
            done[key] = out
        return done[key]

    return get


# --- the premise, in plain torch -----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_fp16_eager_gives_nan_where_fp32_and_bf16_do_not(family: str) -> None:
    model = _model(family, offset=True)
    fp32 = _forward(model, EAGER[family])
    assert torch.isfinite(fp32).all() and fp32.abs().max() < 100  # nothing near 65504
    bf16 = _forward(_model(family, offset=True).to(torch.bfloat16), EAGER[family])
    assert torch.isfinite(bf16).all()
    fp16 = _forward(_model(family, offset=True).half(), EAGER[family])
    assert torch.isnan(fp16).any()
    clean = _forward(_model(family, offset=False).half(), EAGER[family])
    assert torch.isfinite(clean).all()
    if family == "qwen2":  # its default (sdpa) keeps the same fp16 model finite
        assert torch.isfinite(_forward(_model(family, offset=True).half(), None)).all()


def test_attention_choices_name_the_default_and_the_others() -> None:
    gemma = attention_choices(_model("gemma2", offset=False))
    assert gemma.default == "eager" and gemma.others == ()
    assert "does not support" in gemma.not_judged["sdpa"]
    qwen = attention_choices(_model("qwen2", offset=False))
    assert (qwen.default, qwen.others) == ("sdpa", ("eager",))
    assert attention_choices(_models.make("unet")).default is None  # diffusers: no choice here


def _sweep_names(model: Any) -> set[str]:
    chosen, _ = select_inputs(model, input_candidates(model), run_probes)
    return {p.name for p in sweep(model, chosen, "quick").probes}


@pytest.mark.parametrize(
    ("build", "left"),
    [
        (lambda: _models.gpt2(), True),
        # generate pads its prompts too, yet the class name is no "...LMHeadModel"
        (lambda: GPT2DoubleHeadsModel(GPT2Config(**_models.GPT2)), True),
        (lambda: _models.bert(), False),  # encoders: right padding only
        (lambda: _models.make("bart"), False),  # its encoder takes the prompts, right-padded
    ],
)
def test_left_padded_probes_go_to_every_model_that_generate_pads(
    build: Callable[[], Any], left: bool
) -> None:
    torch.manual_seed(0)
    names = _sweep_names(build().eval())
    assert "forward:padded" in names
    assert ("forward:padded-left" in names) is left


# --- the certificate -------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_is_refused_on_the_left_padded_batch(
    family: str, converted: Callable[[str, bool, str], Path]
) -> None:
    cert = Certificate.read(converted(family, True, "fp16"))
    assert cert.verdict == "fail"
    assert any("padded-left" in line and "NaN" in line for line in cert.failures)
    judged = cert.components[0].attention
    assert judged is not None and "eager" in judged["judged"]
    if family == "qwen2":  # the default load passes: only the eager ways fail
        eager = [p for p in cert.load_paths if p.attention == "eager"]
        assert {p.way for p in eager} == {"pc.load", "plain"}
        assert all(p.verdict == "fail" and p.decides for p in eager)
        assert cert.load_path("pc.load").verdict == "pass"


@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_safe_is_certified_finite_and_close_in_forward_and_generate(
    family: str, converted: Callable[[str, bool, str], Path]
) -> None:
    directory = converted(family, True, "fp16-safe")
    cert = Certificate.read(directory)
    assert cert.verdict == "pass", cert.failures
    assert all(p.verdict == "pass" for p in cert.load_paths if p.decides)
    assert "eager" in cert.components[0].attention["judged"]  # type: ignore[index]
    islands = json.loads((directory / "config.json").read_text())["precision_convert"]["islands"]
    assert "search" in islands.values()  # found by the search, under eager attention too
    loaded = pc.load(directory)
    reference = _model(family, offset=True)
    implementation = EAGER[family]
    got, want = _forward(loaded, implementation), _forward(reference, implementation)
    assert torch.isfinite(got).all()
    assert _cosine(got, want) > 0.999
    ids, mask = _left_padded()
    settings = {
        "attention_mask": mask,
        "max_new_tokens": 6,
        "do_sample": False,
        "output_scores": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }
    with attention(loaded, implementation), torch.no_grad():
        mine = loaded.generate(ids, **settings)
    with attention(reference, implementation), torch.no_grad():
        theirs = reference.generate(ids, **settings)
    scores = torch.stack(mine.scores).float()
    assert torch.isfinite(scores).all()
    assert _cosine(scores, torch.stack(theirs.scores)) > 0.999
    assert (mine.sequences == theirs.sequences).float().mean() > 0.9


@pytest.mark.slow
def test_fp32_query_and_key_projections_keep_eager_masked_scores_finite(
    source: Callable[[str, bool], Path], tmp_path: Path
) -> None:
    """The other island set: scores computed in fp32 take fp16's -65504 mask without reaching
    -inf. (The search itself stops at the embedding, the first module that suffices: its fp32
    output gives the mask float32's minimum.)"""
    out = tmp_path / "qk"
    keep = ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj"]
    convert(
        source("qwen2", True),
        to="fp16-safe",
        output=out,
        coverage="quick",
        keep_fp32=keep,
        calibrate=False,
    )
    cert = Certificate.read(out)
    assert cert.verdict == "pass", cert.failures
    assert all(p.verdict == "pass" for p in cert.load_paths if p.attention == "eager")
    assert (
        "model.embed_tokens"
        not in json.loads((out / "config.json").read_text())["precision_convert"]["islands"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_safe_is_certified(family: str, converted: Callable[[str, bool, str], Path]) -> None:
    cert = Certificate.read(converted(family, True, "bf16-safe"))
    assert cert.verdict == "pass", cert.failures


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fp16", "fp16-safe", "bf16-safe"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_clean_model_of_each_family_is_certified_in_every_target(
    family: str, target: str, converted: Callable[[str, bool, str], Path]
) -> None:
    cert = Certificate.read(converted(family, False, target))
    assert cert.verdict == "pass", cert.failures
    assert "eager" in cert.components[0].attention["judged"]  # type: ignore[index]


def test_the_card_says_which_attention_was_judged(
    converted: Callable[[str, bool, str], Path],
) -> None:
    directory = converted("qwen2", True, "fp16")
    card = (directory / "README.md").read_text()
    assert "Attention judged under `sdpa` (the default) and `eager`" in card
    assert "| precision-convert, eager attention |" in card
    stored = json.loads((directory / "precision_certificate.json").read_text())
    assert {p.get("attention") for p in stored["load_paths"]} == {None, "eager"}


# --- memory: the longest eager contexts ----------------------------------------------------


def _quick_probes(model: Any) -> Any:
    chosen, _ = select_inputs(model, input_candidates(model), run_probes)
    return sweep(model, chosen, "quick")


def test_eager_fp32_scores_over_the_allowance_take_the_default_as_baseline() -> None:
    """A probe whose fp32 eager scores would exceed a probe's memory allowance is not run in
    fp32 under eager when fp32 eager matched the default on every other probe: the default's
    outputs are its eager baseline, and the record names it and says why."""
    model = _model("qwen2", offset=True)
    inputs = _quick_probes(model)
    allowance = max(eager_score_bytes(model, p) for p in inputs.probes) - 1
    large = [p for p in inputs.probes if eager_score_bytes(model, p) > allowance]
    assert 0 < len(large) < len(inputs.probes)  # the longest only
    default = run_probes(model, inputs, "cpu", torch.float32)
    ran: list[str] = []

    def run(fp32: Any, probes: Any) -> Any:
        ran.extend(p.name for p in probes.probes)
        return run_probes(fp32, probes, "cpu", torch.float32)

    choices, outputs = outputs_by_attention(
        model, attention_choices(model), inputs, default, run, allowance=allowance
    )
    names = sorted(p.name for p in large)
    assert not set(names) & set(ran) and len(ran) == len(inputs.probes) - len(large)
    assert all(outputs["eager"][n] is default[n] for n in names)
    record = choices.to_json()["baseline_from_default"]["eager"]
    assert record["probes"] == names and "allowance" in record["why"]
    # fp32 eager really is the same function as sdpa there (what the stand-in relies on)
    with attention(model, "eager"):
        eager = run_probes(model, replace(inputs, probes=tuple(large)), "cpu", torch.float32)
    assert same_function(default, eager)


def test_an_eager_fp32_run_that_differs_from_the_default_runs_every_probe() -> None:
    """When fp32 eager is not the default's function on the probes that fit, the large ones
    run under eager too (memory over the allowance rather than a baseline that is not eager's)."""
    model = _model("qwen2", offset=True)
    inputs = _quick_probes(model)
    allowance = max(eager_score_bytes(model, p) for p in inputs.probes) - 1
    default = run_probes(model, inputs, "cpu", torch.float32)
    shifted = {name: {k: v * 1.01 for k, v in out.items()} for name, out in default.items()}
    choices, outputs = outputs_by_attention(
        model,
        attention_choices(model),
        inputs,
        shifted,
        lambda fp32, probes: run_probes(fp32, probes, "cpu", torch.float32),
        allowance=allowance,
    )
    assert not choices.baseline_from_default
    assert set(outputs["eager"]) == {p.name for p in inputs.probes}
    assert all(outputs["eager"][n] is not shifted[n] for n in outputs["eager"])
