"""Proof where cheap: weights-only bounds per module, the search they start, the status table.

The fast tests check the sound-bound arithmetic against real forwards (a bound below a peak a
forward reached would be no proof), and that the context search started from the largest
sound bound reaches the three-token trigger (tests/_planted_triple.py) that observed factor
peaks and gradients cannot. The slow one converts the planted model and its control at
``standard`` coverage, as a user would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models
import _planted_triple as planted
import pytest
import torch
from _planted import converted_at_standard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN
from precision_convert.conversion.analysis.factors import (
    FactorRecorder,
    holding,
    recording_factors,
)
from precision_convert.conversion.analysis.proofs import (
    ISLANDED,
    PROVEN,
    SAMPLED,
    module_status,
    parameter_owners,
    sound_bounds,
)
from precision_convert.core.dtypes import FP16_MAX, WATCHED_RANGE
from precision_convert.validation.certify.card_text import code
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.run.contexts import search_contexts, sound_targets

DOWN_1 = "model.layers.1.mlp.down_proj"
TRIPLE = (8, 9, 10)


def _family(name: str, act: str) -> Any:
    if name == "llama":
        return _models.llama(hidden_act=act)
    if name == "qwen2":
        return _models.qwen2(hidden_act=act)
    return _models.gemma2(hidden_activation=act)


def _peaks(model: Any, ids: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Per module owning a parameter, the largest |input| (float inputs) and |output|."""
    seen: dict[str, tuple[float, float]] = {}

    def hook(name: str) -> Callable[..., None]:
        def take(module: Any, args: tuple[Any, ...], out: torch.Tensor) -> None:
            first = args[0]
            inp = float(first.abs().max()) if first.is_floating_point() else 0.0
            had = seen.get(name, (0.0, 0.0))
            seen[name] = (max(had[0], inp), max(had[1], float(out.abs().max())))

        return take

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in model.named_modules()
        if list(m.parameters(recurse=False))
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2", "gemma2"]),
    act=st.sampled_from(["relu", "silu", "gelu_pytorch_tanh"]),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.1, 30.0),
)
def test_every_sound_bound_holds_on_real_forwards(
    family: str, act: str, seed: int, scale: float
) -> None:
    """Random weights with scaled norm gains and projections (so every term of the bound
    matters), random ids: no module's input or output passes its weights-only bound."""
    torch.manual_seed(seed)
    model = _family(family, act).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(scale if "norm" in name else 1.0).add_(torch.randn_like(p) * 0.1 * scale)
    bounds = sound_bounds(model)
    kinds = {b.kind for b in bounds}
    assert {"normed", "convex", "product"} <= kinds
    ids = torch.randint(0, model.config.vocab_size, (3, 24))
    peaks = _peaks(model, ids)
    for bound in bounds:
        seen_in, seen_out = peaks[bound.module]
        assert bound.output is not None and seen_out <= bound.output * (1 + 1e-4), bound.module
        if bound.input is not None:
            assert seen_in <= bound.input * (1 + 1e-4), bound.module


def test_unknown_layouts_are_sampled_only() -> None:
    """A GPT-2 (no layout in the table) gets no sound bound: every module is sampled only;
    a tied parameter counts once, under the weakest status of its owners."""
    gpt2 = _models.gpt2()
    assert sound_bounds(gpt2) == []
    table = module_status(parameter_owners(gpt2), [], (), FP16_MAX, ACTIVATION_MARGIN)
    assert table[PROVEN]["share"] == 0 and table[SAMPLED]["share"] == 1.0
    llama = _models.llama().eval()  # tied: lm_head and embed_tokens share one weight
    owners = parameter_owners(llama)
    bounds = sound_bounds(llama)
    table = module_status(owners, bounds, ("lm_head",), FP16_MAX, ACTIVATION_MARGIN)
    total = sum(p.numel() for p in llama.parameters())
    assert sum(table[s]["parameters"] for s in (PROVEN, ISLANDED, SAMPLED)) == total
    assert "model.embed_tokens" in table[PROVEN]["modules"]
    tied = llama.lm_head.weight.numel()
    assert table[ISLANDED]["parameters"] == tied  # counted once, as the island it is
    assert table[SAMPLED]["count"] == 5
    assert table[SAMPLED]["modules"] == [
        "model.layers.{0,1}.input_layernorm",
        "model.layers.{0,1}.post_attention_layernorm",
        "model.norm",
    ]


def test_every_certificate_states_what_is_proven(zoo_converted: Callable[[str, str], Any]) -> None:
    """A Llama's certificate sorts every module into proven, islanded and sampled only (the
    shares add up to all of it); fp16-safe keeps its norms in fp32, so nothing is left
    sampled only and the card says so; a GPT-2 (no layout in the table) is all sampled only,
    and the card names each role."""
    result = zoo_converted("llama", "fp16-safe")
    cert = json.loads((result.output / "precision_certificate.json").read_text())
    table = cert["components"][0]["calibration"]["modules"]
    assert table["limit"] == FP16_MAX and table["margin"] == ACTIVATION_MARGIN
    assert sum(table[s]["share"] for s in (PROVEN, ISLANDED, SAMPLED)) == pytest.approx(1.0)
    assert "model.layers.{0,1}.mlp.down_proj" in table[PROVEN]["modules"]
    assert table[SAMPLED]["count"] == 0 and table[PROVEN]["share"] > 0.9
    card = (result.output / "README.md").read_text()
    assert "## Range proofs" in card and "No module is sampled only." in card
    result = zoo_converted("gpt2", "fp16-safe")
    cert = json.loads((result.output / "precision_certificate.json").read_text())
    table = cert["components"][0]["calibration"]["modules"]
    assert table[PROVEN]["count"] == 0 and table[SAMPLED]["share"] > 0.9
    card = (result.output / "README.md").read_text()
    assert all(code(label) in card for label in table[SAMPLED]["modules"])


def _recorded(model: Any) -> FactorRecorder:
    """Factor peaks over every one-, two- and three-token variant but the trigger."""
    recorder = FactorRecorder(model)
    with recording_factors(model, recorder), torch.no_grad():
        for order in planted.variants():
            model(input_ids=planted.prompt(TRIPLE, order))
    return recorder


def test_the_triple_overflows_only_in_order() -> None:
    """The planted model is what the issue describes: finite in fp32, past fp16's limit at
    A's position on C, B, A (a plain fp16 cast gives NaN logits there), and below 0.2 of the
    limit at the watched modules on every other order and subset."""
    model = planted.model(triple=TRIPLE)
    assert planted.peaks(model, planted.prompt(TRIPLE))[DOWN_1] > FP16_MAX
    for order in planted.variants():
        assert max(planted.peaks(model, planted.prompt(TRIPLE, order)).values()) < 0.2 * FP16_MAX
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=planted.prompt(TRIPLE)).logits).all()
        logits = planted.model(triple=TRIPLE).half()(input_ids=planted.prompt(TRIPLE)).logits
    assert not torch.isfinite(logits[0, planted.A_AT]).any()
    assert torch.isfinite(logits[0, : planted.A_AT]).all()


def test_the_search_from_the_sound_bound_reaches_the_triple() -> None:
    """Observed factor peaks bound layer 1's product far below the limit (its gate never left
    ReLU's zero), so they start no search; the sound bound there is far past it, and the
    search started from that channel reaches a context past 65504 holding C, B, A in order,
    with no time to climb (the seeds alone)."""
    model = planted.model(triple=TRIPLE)
    observed = holding(_recorded(model).bounds(model))[0]
    row = next(b for b in observed if b.module == DOWN_1)
    assert row.bound < FP16_MAX / ACTIVATION_MARGIN
    proofs = sound_bounds(model)
    targets = sound_targets(model, proofs, observed, WATCHED_RANGE)
    assert [(t.module, t.channel) for t in targets] == [(DOWN_1, 0)]
    chosen = next(iter(input_candidates(model, seed=0)))
    probes, record = search_contexts(
        model, chosen, observed, seconds=0.0, steps=5, device=torch.device("cpu"), seed=0,
        sound=targets,
    )  # fmt: skip
    assert record["near_limit"] == 0 and record["sound_targets"] == 1
    (searched,) = record["searched"]
    assert searched["from"] == "sound bound" and searched["peak"] > FP16_MAX
    context = searched["context"]
    c, b, a = TRIPLE
    assert context.index(c) < context.index(b) < len(context) - context[::-1].index(a)
    (probe,) = probes
    assert planted.peaks(model, probe.kwargs["input_ids"])[DOWN_1] > FP16_MAX
    # The control's sound bounds are all proven: nothing to search.
    control = planted.model(planted=False)
    assert sound_targets(control, sound_bounds(control), [], WATCHED_RANGE) == []


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool, str], Any]:
    """``converted(planted, target)`` → (source, triple, output, certificate) at ``standard``
    coverage, once per module."""
    return converted_at_standard(tmp_path_factory.mktemp("triple"), planted.save)


def _kept(out: Path) -> set[str]:
    with safe_open(out / "model.safetensors", "pt") as weights:
        return set(json.loads(weights.metadata()["precision_convert"])["fp32_modules"])


@pytest.mark.slow
def test_the_triple_is_refused_in_fp16_and_certified_safe(
    converted: Callable[..., Any],
) -> None:
    """fp16 is refused on the context the sound-bound search found; fp16-safe is certified
    with layer 1's product formed and received in fp32, finite and close to fp32 at A's
    position through ``pc.load``; the certificate and card say per module what is proven,
    islanded and sampled only."""
    import precision_convert as pc

    _, _, _, cert = converted(True, "fp16")
    assert cert["verdict"] == "fail"
    assert any(f.startswith("forward:context-1/") for f in cert["failures"])
    source, triple, out, cert = converted(True, "fp16-safe")
    assert cert["verdict"] == "pass", cert["failures"]
    calibration = cert["components"][0]["calibration"]
    (searched,) = [s for s in calibration["context_search"]["searched"] if s["module"] == DOWN_1]
    assert searched["from"] == "sound bound" and searched["peak"] > FP16_MAX
    assert DOWN_1 in _kept(out)
    trigger = planted.prompt(triple)
    from transformers import AutoModelForCausalLM

    reference = _logits(AutoModelForCausalLM.from_pretrained(source), trigger)[0, planted.A_AT]
    got = _logits(pc.load(out), trigger)[0, planted.A_AT]
    assert torch.isfinite(got).all()
    assert float(torch.nn.functional.cosine_similarity(got, reference, dim=0)) >= 0.99
    table = calibration["modules"]
    assert DOWN_1 in table[ISLANDED]["modules"]
    assert table[PROVEN]["share"] > 0.5
    card = (out / "README.md").read_text()
    assert "## Range proofs" in card
    for label in table[SAMPLED]["modules"]:
        assert code(label) in card
    assert converted(True, "bf16-safe")[3]["verdict"] == "pass"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fp16", "fp16-safe", "bf16-safe"])
def test_the_unplanted_control_is_certified(converted: Callable[..., Any], target: str) -> None:
    """The same shape without the planting passes every target, with no island past the
    norms and no sound bound left to search."""
    _, _, out, cert = converted(False, target)
    assert cert["verdict"] == "pass", cert["failures"]
    search = cert["components"][0]["calibration"]["context_search"]
    assert search["near_limit"] == 0 and search["sound_targets"] == 0
    assert all("norm" in module for module in _kept(out))
