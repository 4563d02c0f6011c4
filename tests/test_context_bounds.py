"""An overflow only a context triggers is bounded, searched for, and judged: the token pair.

The fast tests run the bound and the search on the planted model in memory (tests/
_planted_pair.py: ``down_proj``'s input passes 65504 only when B precedes A); the slow one
converts it to every target at ``standard`` coverage, as a user would, with an unplanted
control of the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import _planted_pair as pair
import pytest
import torch
from _planted import converted_at_standard
from safetensors import safe_open

from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN
from precision_convert.conversion.analysis.factors import FactorRecorder, recording_factors
from precision_convert.core.dtypes import FP16_MAX
from precision_convert.validation.probe.inputs.context_probes import CONTEXT_KIND, context_probe
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.sweep import replay
from precision_convert.validation.probe.inputs.token_probes import token_spec
from precision_convert.validation.probe.run.contexts import search_contexts

DOWN = "model.layers.0.mlp.down_proj"
NEAR = FP16_MAX / ACTIVATION_MARGIN


@pytest.fixture(scope="module")
def ids() -> tuple[int, int]:
    """The pair (A, B): outside every row the quick and standard sweeps feed the model."""
    rows = pair.sweep_rows(pair.model(planted=False), "quick")
    rows += pair.sweep_rows(pair.model(planted=False), "standard")
    return pair.pair_outside(rows)


def _recorded(model: Any, prompts: list[torch.Tensor]) -> FactorRecorder:
    recorder = FactorRecorder(model)
    with recording_factors(model, recorder), torch.no_grad():
        for prompt in prompts:
            model(input_ids=prompt)
    return recorder


def test_the_pair_overflows_only_in_order(ids: tuple[int, int]) -> None:
    """The planted model is what the issue describes: finite in fp32, non-finite in a plain
    fp16 cast on "… B … A …", and far from the limit on every other order."""
    a, b = ids
    model = pair.model(pair=ids)
    assert pair.down_input_peak(model, pair.prompt(a, b)) > FP16_MAX
    for order in ("AB", "A", "B"):
        assert pair.down_input_peak(model, pair.prompt(a, b, order=order)) < 1e3
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=pair.prompt(a, b)).logits).all()
        half = pair.model(pair=ids).half()
        assert not torch.isfinite(half(input_ids=pair.prompt(a, b)).logits).all()
        assert torch.isfinite(half(input_ids=pair.prompt(a, b, order="AB")).logits).all()


def test_the_bound_reaches_the_limit_the_samples_never_did(ids: tuple[int, int]) -> None:
    """A alone and B alone each peak one factor of channel 0: the per-channel bound on
    ``down_proj``'s input is past the limit while every sample stayed below 1e3; the
    unplanted control's bounds stay far from it."""
    a, b = ids
    prompts = [pair.prompt(a, b, order="A"), pair.prompt(a, b, order="B")]
    bounds = {
        (r.module, r.side): r
        for r in _recorded(pair.model(pair=ids), prompts).bounds(pair.model(pair=ids))
    }
    row = bounds[DOWN, "input"]
    assert row.observed < 1e3
    assert row.bound >= NEAR
    assert row.channel == 0
    assert row.factors == ("model.layers.0.mlp.up_proj",)
    assert "act(gate_proj)" in row.conditional_on and "one context" in row.conditional_on
    # The seeds hold where each factor peaked: B's window, then A's.
    assert any(b in seed and a in seed and seed.index(b) < seed.index(a) for seed in row.seeds)
    # Attention's output projection is fed convex combinations of values: its input bound is
    # the value peak, which B's value (8 after the norm) sets in layer 0.
    convex = bounds["model.layers.0.self_attn.o_proj", "input"]
    assert convex.kind == "convex" and convex.observed <= convex.bound + 1e-3
    control = pair.model(planted=False)
    assert all(r.bound < NEAR for r in _recorded(control, prompts).bounds(control))


def test_the_search_finds_the_context_and_it_replays(ids: tuple[int, int]) -> None:
    """Seeded where the factors peaked, the search reaches past fp16's limit even with no
    time to climb (the seeds are always tried); the context probe it returns drives the
    fp32 model past the limit, and a certificate's record of it replays to the same ids."""
    a, b = ids
    model = pair.model(pair=ids)
    recorder = _recorded(model, [pair.prompt(a, b, order="A"), pair.prompt(a, b, order="B")])
    chosen = next(iter(input_candidates(model, seed=0)))
    probes, record = search_contexts(
        model, chosen, recorder.bounds(model), seconds=0.0, steps=5, device=torch.device("cpu"),
        seed=0,
    )  # fmt: skip
    assert record["near_limit"] == 1 and record["highest_peak"] > FP16_MAX
    (searched,) = record["searched"]
    assert searched["module"] == DOWN and searched["steps"] == 0 and searched["peak"] > FP16_MAX
    (probe,) = probes
    assert probe.sweep["kind"] == CONTEXT_KIND and probe.sweep["ids"] == searched["context"]
    assert pair.down_input_peak(model, probe.kwargs["input_ids"]) == pytest.approx(
        searched["peak"], rel=1e-4
    )
    replayed = replay(model, replace(chosen, probes=(*chosen.probes, probe)).describe())
    assert torch.equal(replayed.probes[-1].kwargs["input_ids"], probe.kwargs["input_ids"])
    # With steps, the climb only goes up.
    probes, record = search_contexts(
        model, chosen, recorder.bounds(model), seconds=5.0, steps=3, device=torch.device("cpu"),
        seed=0,
    )  # fmt: skip
    assert record["searched"][0]["peak"] >= record["searched"][0]["start_peak"]
    spec = token_spec(model, chosen.probes[0], None, chosen.task)
    assert spec is not None
    again = context_probe(spec, chosen.probes[0].kwargs, probe.sweep["ids"], 0, DOWN)
    assert torch.equal(again.kwargs["input_ids"], probe.kwargs["input_ids"])


def _phi3() -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return Phi3ForCausalLM(config)


@pytest.mark.parametrize("family", ["llama", "t5-encoder", "phi3"])
def test_every_gated_form_is_bounded_per_channel(family: str) -> None:
    """Separate gate and up projections (Llama), T5's gated feed-forward and Phi-3's fused
    ``gate_up_proj`` each get a product bound, per channel: at least what the probes reached,
    and exactly the largest product of the factors' per-channel peaks."""
    import _models

    torch.manual_seed(0)
    model = (_phi3() if family == "phi3" else _models.ZOO[family][0]()).eval()
    seeded = [torch.Generator().manual_seed(k) for k in range(3)]
    prompts = [torch.randint(0, 128, (2, 12), generator=g) for g in seeded]
    products = [r for r in _recorded(model, prompts).bounds(model) if r.kind == "product"]
    assert products and all(r.bound >= r.observed * (1 - 1e-5) for r in products)
    down = dict(model.named_modules())[products[0].module]
    mlp = dict(model.named_modules())[products[0].module.rsplit(".", 1)[0]]
    gates, ups = [], []

    def take(module: Any, args: tuple[Any, ...]) -> None:
        # What down receives is act(gate) * up: recompute both factors from the MLP's input.
        x = mlp_inputs[-1]
        if family == "phi3":
            gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
            gates.append(mlp.activation_fn(gate).abs().amax((0, 1)))
        else:
            gate_proj, up_proj, act = (
                (mlp.wi_0, mlp.wi_1, mlp.act) if family == "t5-encoder"
                else (mlp.gate_proj, mlp.up_proj, mlp.act_fn)
            )  # fmt: skip
            up = up_proj(x)
            gates.append(act(gate_proj(x)).abs().amax((0, 1)))
        ups.append(up.abs().amax((0, 1)))

    mlp_inputs: list[torch.Tensor] = []
    handles = [
        mlp.register_forward_pre_hook(lambda m, args: mlp_inputs.append(args[0])),
        down.register_forward_pre_hook(take),
    ]
    with torch.no_grad():
        for prompt in prompts:
            model(input_ids=prompt)
    for handle in handles:
        handle.remove()
    expected = (torch.stack(gates).amax(0) * torch.stack(ups).amax(0)).max()
    assert products[0].bound == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_attention_kept_apart_or_fused_is_bounded(family: str) -> None:
    """BERT keeps its value projection in ``attention.self`` and its output projection in
    ``attention.output``; GPT-2 fuses query, key and value in one ``c_attn`` (values last) and
    stores its ``Conv1D`` weights (in, out). Every block still gets both convex bounds, equal
    to what the value vectors, recomputed here, and the projection's own weights give."""
    import _models

    torch.manual_seed(0)
    model = (_models.gpt2() if family == "gpt2" else _models.bert()).eval()
    seeded = [torch.Generator().manual_seed(k) for k in range(3)]
    prompts = [torch.randint(0, 128, (2, 12), generator=g) for g in seeded]
    bounds = {(r.module, r.side): r for r in _recorded(model, prompts).bounds(model)}
    width = model.config.hidden_size
    if family == "gpt2":
        blocks = [(f"transformer.h.{k}.attn", "c_attn", "c_proj") for k in range(2)]
    else:
        blocks = [(f"encoder.layer.{k}.attention", "self.value", "output.dense") for k in range(2)]
    modules = dict(model.named_modules())
    peaks: dict[str, list[torch.Tensor]] = {block: [] for block, _, _ in blocks}
    handles = [
        modules[f"{block}.{value}"].register_forward_hook(
            lambda m, args, out, block=block: peaks[block].append(
                out[..., -width:].abs().amax((0, 1))  # GPT-2: (query, key, value)
            )
        )
        for block, value, _ in blocks
    ]
    with torch.no_grad():
        for prompt in prompts:
            model(input_ids=prompt)
    for handle in handles:
        handle.remove()
    for block, value, out in blocks:
        value_peak = torch.stack(peaks[block]).amax(0)
        projection = modules[f"{block}.{out}"]
        # BERT's Linear weight is (out, in), GPT-2's Conv1D weight (in, out).
        weight = projection.weight.detach().abs()
        weight = weight if family == "gpt2" else weight.T
        expected = (weight * value_peak[:, None]).sum(0) + projection.bias.detach().abs()
        into, out_of = bounds[f"{block}.{out}", "input"], bounds[f"{block}.{out}", "output"]
        assert into.kind == out_of.kind == "convex"
        assert into.factors == (f"{block}.{value}",)
        assert into.bound == pytest.approx(float(value_peak.max()), rel=1e-5)
        assert out_of.bound == pytest.approx(float(expected.max()), rel=1e-5)
        assert 0 < into.observed <= into.bound * (1 + 1e-5)
        assert 0 < out_of.observed <= out_of.bound * (1 + 1e-5)


def _gemma4_small_values() -> tuple[Any, FactorRecorder, float]:
    """A Gemma 4 text model whose ``v_proj`` outputs are small (its weights scaled by 1e-2),
    recorded on three prompts, and the largest value ``v_proj`` handed on."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
        vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config).eval()
    projections = [layer.self_attn.v_proj for layer in model.model.layers]
    projected: list[float] = []
    with torch.no_grad():
        for projection in projections:
            projection.weight.mul_(1e-2)
    handles = [
        p.register_forward_hook(lambda m, args, out: projected.append(float(out.abs().max())))
        for p in projections
    ]
    seeded = [torch.Generator().manual_seed(k) for k in range(3)]
    recorder = _recorded(model, [torch.randint(3, 128, (2, 12), generator=g) for g in seeded])
    for handle in handles:
        handle.remove()
    return model, recorder, max(projected)


def test_values_normalised_after_their_projection_are_bounded_as_attention_sees_them() -> None:
    """Gemma 4 scales each head's values to unit RMS after ``v_proj`` (``v_norm``), so a
    projection with small outputs still hands attention values near 1. The bound is taken from
    the normalised values and holds what ``o_proj`` receives; from ``v_proj``'s outputs it
    would sit far below it."""
    model, recorder, projected = _gemma4_small_values()
    convex = [r for r in recorder.bounds(model) if r.kind == "convex"]
    assert all(0 < r.observed <= r.bound * (1 + 1e-5) for r in convex)
    into = [r for r in convex if r.side == "input"]
    assert [r.module for r in into] == [f"model.layers.{k}.self_attn.o_proj" for k in range(2)]
    for row in into:
        assert "v_norm" in row.conditional_on
        assert row.observed > 10 * projected  # past every value v_proj handed on


def test_a_bound_a_probe_passed_is_refuted_and_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blind to ``v_norm`` (as for names that mean another layout), the value bound is read
    from ``v_proj`` and the probes themselves pass it: such a bound is set apart, so it makes
    no islands and is not searched, and the session reports it under ``refuted``."""
    from precision_convert.conversion.analysis import factors

    monkeypatch.setattr(factors, "VALUE_NORM", "no_such_norm")
    model, recorder, projected = _gemma4_small_values()
    kept, refuted = factors.holding(recorder.bounds(model))
    into = [r for r in refuted if r.side == "input"]
    assert [r.module for r in into] == [f"model.layers.{k}.self_attn.o_proj" for k in range(2)]
    assert all(r.bound <= projected < r.observed / 10 for r in into)
    assert {r.module for r in refuted} == {r.module for r in into}
    assert kept and all(r.holds for r in kept)


def _lookalike(family: str) -> Any:
    import transformers

    small = {"vocab_size": 128, "num_attention_heads": 4}
    if family == "gpt-bigcode":
        config = transformers.GPTBigCodeConfig(
            **small, n_embd=32, n_layer=1, multi_query=False, bos_token_id=0, eos_token_id=1
        )
        return transformers.GPTBigCodeForCausalLM(config)
    if family == "longformer":
        config = transformers.LongformerConfig(
            **small, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
            attention_window=4, pad_token_id=1,
        )  # fmt: skip
        return transformers.LongformerModel(config)
    llama_like = {**small, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    if family == "bitnet":
        return transformers.BitNetForCausalLM(transformers.BitNetConfig(**llama_like))
    return transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**llama_like))


#: Blocks named as a bounded layout is, computing something else: (family, block, factor,
#: projection, which sites of :class:`FactorRecorder` they would have been).
LOOKALIKES = [
    ("gpt-bigcode", "transformer.h.0.attn", "c_attn", "c_proj", "values"),
    ("longformer", "encoder.layer.0.attention", "self.value", "output.dense", "values"),
    ("bitnet", "model.layers.0.self_attn", "v_proj", "o_proj", "values"),
    ("bitnet", "model.layers.0.mlp", "up_proj", "down_proj", "gated"),
    ("diffllama", "model.layers.0.self_attn", "v_proj", "o_proj", "values"),
]


@pytest.mark.parametrize(("family", "block", "factor", "projection", "sites"), LOOKALIKES)
def test_lookalike_names_of_another_layout_are_not_bounded(
    family: str, block: str, factor: str, projection: str, sites: str
) -> None:
    """GPT-BigCode names its fused projection ``c_attn`` and its output ``c_proj`` as GPT-2
    does, but interleaves query, key and value head by head; Longformer keeps BERT's
    ``self.value`` and ``output.dense``, but its global tokens read ``value_global``; BitNet
    normalises attention's output before ``o_proj`` and its MLP's product before
    ``down_proj``; DiffLlama hands ``o_proj`` a normalised difference of two attentions. None
    of those projections receives what the bound assumes, so none is bounded."""
    model = _lookalike(family).eval()
    modules = dict(model.named_modules())
    assert {f"{block}.{factor}", f"{block}.{projection}"} <= modules.keys()  # the names
    assert getattr(FactorRecorder(model), sites) == []


def test_quick_records_bounds_and_no_search(zoo_converted: Callable[[str, str], Any]) -> None:
    """At ``quick`` the certificate carries the bound table and says the search did not run."""
    result = zoo_converted("llama", "fp16-safe")
    cert = json.loads((result.output / "precision_certificate.json").read_text())
    calibration = cert["components"][0]["calibration"]
    modules = {row["module"] for row in calibration["bounds"]}
    assert "model.layers.0.mlp.down_proj" in modules
    assert "model.layers.0.self_attn.o_proj" in modules
    assert all(row["bound"] >= row["observed_peak"] * (1 - 1e-5) for row in calibration["bounds"])
    assert calibration["context_search"] == {"not_searched": "no context search at quick"}
    assert calibration["refuted"] == []


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool, str], Any]:
    """``converted(planted, target)`` → (the source, its pair, the certificate as JSON) at
    ``standard`` coverage, once per module."""
    return converted_at_standard(tmp_path_factory.mktemp("pair"), pair.save)


@pytest.mark.slow
def test_the_pair_is_refused_in_fp16_and_certified_safe(converted: Callable[..., Any]) -> None:
    """fp16 is refused on the context the search found; fp16-safe is certified with the
    product formed and received in fp32, and is finite and close to fp32 on the triggering
    prompt through ``pc.load`` and the plain default load; bf16-safe is certified."""
    from transformers import AutoModelForCausalLM

    import precision_convert as pc

    source, (a, b), out, cert = converted(True, "fp16")
    assert cert["verdict"] == "fail"
    assert any(f.startswith("forward:context-1/logits: ") for f in cert["failures"])
    source, _, out, cert = converted(True, "fp16-safe")
    assert cert["verdict"] == "pass"
    calibration = cert["components"][0]["calibration"]
    row = next(r for r in calibration["bounds"] if r["module"] == DOWN and r["side"] == "input")
    assert row["bound"] >= NEAR and row["bound"] >= row["observed_peak"]
    search = calibration["context_search"]
    assert search["highest_peak"] > FP16_MAX and search["probes"] == ["forward:context-1"]
    assert search["seconds"] <= search["budget_seconds"] + 1.0  # one step's overrun at most
    assert "forward:context-1" in cert["components"][0]["inputs"]["probes"]
    with safe_open(out / "model.safetensors", "pt") as weights:
        kept = json.loads(weights.metadata()["precision_convert"])["fp32_modules"]
    assert {DOWN, "model.layers.0.mlp.up_proj"} <= set(kept)
    assert "model.layers.1.mlp.down_proj" not in kept  # the bound is per module, not every MLP
    trigger = pair.prompt(a, b)
    reference = _logits(AutoModelForCausalLM.from_pretrained(source), trigger)
    for model in (pc.load(out), AutoModelForCausalLM.from_pretrained(out)):
        got = _logits(model, trigger)
        assert torch.isfinite(got).all()
        assert _cosine(got, reference) >= 0.99
    assert converted(True, "bf16-safe")[3]["verdict"] == "pass"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fp16", "fp16-safe", "bf16-safe"])
def test_the_unplanted_control_is_certified(converted: Callable[..., Any], target: str) -> None:
    """The same shape without the planting passes every target, with nothing to search."""
    cert = converted(False, target)[3]
    assert cert["verdict"] == "pass", cert["failures"]
    search = cert["components"][0]["calibration"]["context_search"]
    assert search["near_limit"] == 0 and search["searched"] == []
