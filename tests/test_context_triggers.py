"""A certificate holds on the contexts an overflow may need that the vocabulary and length
sweeps leave out: an id at position 0 (every id, in one-token rows) and a long greedy
generation (the candidate teacher-forced on fp32's continuation, its own generation checked
for NaN/Inf); and it says which kinds of trigger it searched and which it did not.

The overflows are real: ``_planted.qwen2_first_position()`` is a Qwen2 (no BOS) whose id X
lights a feed-forward unit past fp16's limit only when X opens the sequence;
``_planted.flan_t5_long_generation()`` is a Flan-T5 whose greedy output loops on one token
and whose decoder overflows from the 60th new token on. A plain fp16 cast shows each. The
controls are the same seeded models without the planting.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models
import _planted
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.core.dtypes import FP16_MAX
from precision_convert.validation.probe.run.execute import build_inputs

TARGETS = ("fp16", "fp16-safe", "bf16-safe")
#: The prompt that opens with the planted id, and the same ids with it second.
FIRST = torch.tensor([[_planted.FIRST_ID, 5, 9, 13, 21, 34, 55, 89]])
SECOND = torch.tensor([[5, _planted.FIRST_ID, 9, 13, 21, 34, 55, 89]])
#: The long-generation model's prompt and how many tokens it generates.
PROMPT = torch.tensor([[3, 17, 29, 41, 53, 65, 77, 89, 101, 113]])
NEW_TOKENS = 96


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
    )


def _down_input_peak(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Per position, the largest |input| of layer 0's down projection (the MLP product)."""
    peaks: list[torch.Tensor] = []
    down = model.model.layers[0].mlp.down_proj
    handle = down.register_forward_hook(lambda _m, i, _o: peaks.append(i[0].abs().amax(-1)))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return peaks[0][0]


def test_first_position_model_overflows_fp16_only_when_the_id_opens_the_sequence() -> None:
    """The reproduction: fp32 is finite, the MLP product peaks past fp16's limit at position 0
    only when X is there (below 1 anywhere else), and a plain fp16 cast is NaN on the prompt
    that opens with X but finite with X second."""
    model = _planted.qwen2_first_position()
    first, second = _down_input_peak(model, FIRST), _down_input_peak(model, SECOND)
    assert float(first[0]) > FP16_MAX
    assert float(first[1:].max()) < 1 and float(second.max()) < 1
    with torch.no_grad():
        assert model(input_ids=FIRST).logits.isfinite().all()
        half = _planted.qwen2_first_position().half()
        assert not half(input_ids=FIRST).logits.isfinite().any()
        assert half(input_ids=SECOND).logits.isfinite().all()


def test_only_the_first_position_probes_open_a_row_with_the_id() -> None:
    """Without the first-position probes the sweep never puts X first (nor first after left
    padding): they are what reaches it, alone in a one-token row."""
    inputs = build_inputs(_planted.qwen2_first_position(), coverage="quick")
    reached = []
    for probe in inputs.probes:
        ids = probe.kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            continue
        mask = probe.kwargs.get("attention_mask")
        firsts = ids[:, 0] if mask is None else ids.gather(1, mask.argmax(1, keepdim=True))[:, 0]
        if bool((firsts == _planted.FIRST_ID).any()):
            reached.append(probe.sweep.get("kind"))
    assert reached == ["first-position"], reached


def test_repeated_id_rows_keep_every_hidden_state_and_only_the_last_logits() -> None:
    """A head that takes ``logits_to_keep`` spends no row of logits per repeated token: the
    rows are judged on every layer's hidden states, at every position, and the last logits."""
    inputs = build_inputs(_models.llama(), coverage="quick")
    repeats = [p for p in inputs.probes if p.sweep.get("kind") == "repeats"]
    assert repeats
    for probe in repeats:
        assert probe.kwargs["logits_to_keep"] == 1
        assert probe.kwargs["output_hidden_states"] is True
        assert probe.sweep["logits"] == "the last position's; hidden states of every layer"


@pytest.fixture(scope="module")
def first_position(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool, str], Any]:
    """``first_position(planted, target)`` → the ConversionResult at ``quick`` coverage (a
    256-id vocabulary is whole there), converted once per module."""
    root = tmp_path_factory.mktemp("first-position")
    done: dict[tuple[bool, str], Any] = {}

    def get(planted: bool, target: str) -> Any:
        if (planted, target) not in done:
            source = root / f"source-{planted}"
            if not source.exists():
                _planted.qwen2_first_position(planted=planted).save_pretrained(source)
            out = root / f"{planted}-{target}"
            done[planted, target] = convert(source, to=target, output=out, coverage="quick")
        return done[planted, target]

    return get


@pytest.mark.slow  # three conversions: 83 s on a 2-core CPU
def test_first_position_decides_the_certificate(
    first_position: Callable[[bool, str], Any],
) -> None:
    """Planted: fp16 is refused on a first-position probe; fp16-safe and bf16-safe pass, and
    the fp16-safe output, through ``pc.load`` and the plain default ``from_pretrained``, is
    finite and within cosine 0.99 of fp32 on the prompt that opens with X."""
    from transformers import Qwen2ForCausalLM

    results = {target: first_position(True, target) for target in TARGETS}
    fp16 = results["fp16"].certificate
    assert fp16.verdict == "fail"
    assert any("first-position" in line for line in fp16.failures), fp16.failures
    for target in ("fp16-safe", "bf16-safe"):
        certificate = results[target].certificate
        assert certificate.verdict == "pass", (target, certificate.failures)
    out = results["fp16-safe"].output
    with torch.no_grad():
        reference = _planted.qwen2_first_position()(input_ids=FIRST).logits
        for loaded in (pc.load(out), Qwen2ForCausalLM.from_pretrained(out).eval()):
            logits = loaded(input_ids=FIRST).logits.float()
            assert logits.isfinite().all()
            assert _cosine(logits, reference) > 0.99


@pytest.mark.slow  # three conversions: 60 s
def test_first_position_control_is_certified(
    first_position: Callable[[bool, str], Any],
) -> None:
    """No false fail: the same model without the planting passes in all three targets."""
    for target in TARGETS:
        certificate = first_position(False, target).certificate
        assert certificate.verdict == "pass", (target, certificate.failures)


def test_certificate_and_card_state_the_triggers_searched(
    first_position: Callable[[bool, str], Any],
) -> None:
    """``inputs.triggers``: ids, positions (every id at position 0; the family has no BOS)
    and generation searched with their reach, bound from the factor peaks; pairs not (no
    context search at quick); the card says so."""
    result = first_position(False, "fp16-safe")
    written = json.loads((result.output / "precision_certificate.json").read_text())
    (component,) = written["components"]
    triggers = component["inputs"]["triggers"]
    assert list(triggers) == ["ids", "positions", "pairs", "generation", "bound"]
    assert triggers["ids"] == {"searched": True, "reached": 256, "of": 256}
    first = triggers["positions"]["first_position"]
    assert first == {"ids": 256, "after_bos": "the family has no BOS token", "of": 256}
    assert triggers["generation"]["searched"] is True
    # quick: 2 prompts x 64 tokens, cut to the 64-position limit with the prompt
    assert triggers["generation"]["new_tokens"] == 64 - 16
    assert triggers["pairs"] == {
        "searched": False,
        "why": "not searched: no context search at quick",
    }
    assert triggers["bound"]["searched"] is True and triggers["bound"]["modules"] > 0
    assert triggers["bound"]["highest"]["bound"] >= triggers["bound"]["highest"]["observed_peak"]
    card = (result.output / "README.md").read_text()
    assert "256 ids at position 0, the family has no BOS" in card
    assert "modules bounded, highest `model.layers." in card
    assert "not searched: pairs." in card


def _generate(model: Any, **settings: Any) -> Any:
    with torch.no_grad():
        return model.generate(
            input_ids=PROMPT,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            **settings,
        )


def _forced(model: Any, sequences: torch.Tensor) -> torch.Tensor:
    """The decoder's logits teacher-forced on ``sequences`` (start token first)."""
    with torch.no_grad():
        return model(input_ids=PROMPT, decoder_input_ids=sequences).logits.float()


def test_long_generation_model_overflows_fp16_from_the_60th_new_token() -> None:
    """The reproduction: fp32's greedy output repeats the loop token and stays finite; the
    feed-forward product stays small while the start token is within 58 positions and passes
    fp16's limit from decoder position 59; a plain fp16 cast teacher-forced on fp32's output
    is finite on the first 59 positions alone and NaN with the rest, and its own generation
    turns non-finite."""
    model = _planted.flan_t5_long_generation()
    sequences = _generate(model)
    assert bool((sequences[0, 1:] == _planted.LOOP_ID).all())
    peaks: list[torch.Tensor] = []
    ff = model.decoder.block[0].layer[2].DenseReluDense
    handle = ff.wo.register_forward_hook(lambda _m, i, _o: peaks.append(i[0].abs().amax(-1)))
    assert _forced(model, sequences).isfinite().all()
    handle.remove()
    peak = peaks[0][0]
    start = _planted.LOOP_START
    assert float(peak[:start].max()) < 10 and float(peak[start:].min()) > FP16_MAX
    half = _planted.flan_t5_long_generation().half()
    assert _forced(half, sequences[:, :start]).isfinite().all()
    assert not _forced(half, sequences).isfinite().all()
    free = _generate(half, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(free.logits, 1)
    assert logits[:, : start - 1].isfinite().all()
    assert not logits[:, start:].isfinite().any()


@pytest.mark.slow  # three conversions generating 2 x 64 tokens per load path: 146 s (control)
@pytest.mark.parametrize("planted", [True, False], ids=["planted", "control"])
def test_long_generation_decides_the_certificate(planted: bool, tmp_path: Path) -> None:
    """At ``quick`` (2 prompts x 64 greedy tokens). Planted: fp16 is refused on the
    generation probes (teacher-forced and free); fp16-safe and bf16-safe pass, and the
    fp16-safe output, through ``pc.load`` and the plain default ``from_pretrained``, is finite
    and within cosine 0.99 of fp32 teacher-forced on fp32's continuation, and its own
    ``generate()`` is finite. Control: all three pass."""
    from transformers import T5ForConditionalGeneration

    source = tmp_path / "source"
    _planted.flan_t5_long_generation(planted=planted).save_pretrained(source)
    results = {
        target: convert(source, to=target, output=tmp_path / target, coverage="quick")
        for target in TARGETS
    }
    fp16 = results["fp16"].certificate
    if not planted:
        assert fp16.verdict == "pass", fp16.failures
    else:
        assert fp16.verdict == "fail"
        assert any("generation-" in line for line in fp16.failures), fp16.failures
    for target in ("fp16-safe", "bf16-safe"):
        certificate = results[target].certificate
        assert certificate.verdict == "pass", (target, certificate.failures)
        (component,) = certificate.to_dict()["components"]
        assert component["inputs"]["triggers"]["generation"]["new_tokens"] == 64
    reference_model = _planted.flan_t5_long_generation(planted=planted)
    sequences = _generate(reference_model)
    reference = _forced(reference_model, sequences)
    out = tmp_path / "fp16-safe"
    for loaded in (pc.load(out), T5ForConditionalGeneration.from_pretrained(out).eval()):
        logits = _forced(loaded, sequences)
        assert logits.isfinite().all()
        assert _cosine(logits, reference) > 0.99
        free = _generate(loaded, output_logits=True, return_dict_in_generate=True)
        assert torch.stack(free.logits, 1).isfinite().all()


def test_a_family_with_bos_gets_every_id_after_it_too() -> None:
    """Llama starts prompts with BOS: every id runs alone at position 0 and right after BOS
    (each row continuing one BOS's cache, judged on hidden states, with no row of logits), and
    the triggers record counts both."""
    from precision_convert.validation.probe.inputs.contexts import triggers
    from precision_convert.validation.probe.inputs.positions import reach
    from precision_convert.validation.probe.run.execute import call_probe

    model = _models.llama()
    inputs = build_inputs(model, coverage="quick")
    bos = model.config.bos_token_id
    after = [p for p in inputs.probes if p.name.startswith("forward:first-position-bos")]
    assert after and all(p.prefix and p.prefix["input_ids"].tolist() == [[bos]] for p in after)
    assert all(p.kwargs["logits_to_keep"].numel() == 0 for p in after)
    out = call_probe(model, after[0])
    assert out["logits"].shape[1] == 0
    assert sum(k.startswith("hidden_states.") for k in out) == model.config.num_hidden_layers + 1
    first = triggers(inputs, reach(inputs))["positions"]["first_position"]
    assert first == {"ids": 256, "after_bos": 256, "of": 256}


def test_free_generation_is_judged_for_nan_and_inf_only() -> None:
    """A free generation that picked other tokens (other logits) passes; one holding an inf
    fails on ``nonfinite``, and no other metric is judged on it."""
    from precision_convert.validation.probe.inputs.model_inputs import ModelInputs, Probe
    from precision_convert.validation.probe.run.parity import compare_outputs, thresholds_for

    probe = Probe("generate:free", "generate", {}, finite_only=True)
    inputs = ModelInputs(task="lm-logits", probes=(probe,), seed=0)
    g = torch.Generator().manual_seed(0)
    baseline = {"generate:free": {"generated_logits": torch.randn(2, 8, 16, generator=g)}}
    other = torch.randn(2, 8, 16, generator=g)
    thresholds = thresholds_for("text")
    rows = compare_outputs(
        "", inputs, baseline, {"generate:free": {"generated_logits": other}}, thresholds
    )
    assert [(r.metric, r.passed) for r in rows] == [("nonfinite", True)]
    other[1, 5, 3] = float("inf")
    rows = compare_outputs(
        "", inputs, baseline, {"generate:free": {"generated_logits": other}}, thresholds
    )
    assert [(r.metric, r.value, r.passed) for r in rows] == [("nonfinite", 1.0, False)]


def test_the_free_generation_runs_on_the_kv_cache_as_a_user_call_does() -> None:
    """``generate`` runs as users call it, on its cache, though the forwards the prompts are
    built from say ``use_cache=False``: without the cache every step reruns the whole sequence
    (8x the time of a 256-token generation at 55M, and a heap grown by gigabytes)."""
    inputs = build_inputs(_models.llama(), coverage="quick")
    kinds = {p.method: p for p in inputs.probes if p.sweep.get("kind") == "generation"}
    assert kinds["generate"].kwargs["use_cache"] is True
    assert kinds["forward"].kwargs["use_cache"] is False  # the teacher-forced twin: no cache
