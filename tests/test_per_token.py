"""Per-token judgement: a few broken tokens fail a probe whose pooled metrics pass.

Pooled over a probe of thousands of tokens, top-1 >= 0.9 and mean KL <= 0.05 let a wrong
answer at a handful of positions through. The worst token's KL and error, and the top-1 of
the worst batch row and block of positions, are judged too; every metric is reduced a block
of rows at a time, so a long wide-vocabulary output is never copied whole in float64. An
intermediate layer's hidden state is judged per token against that layer's typical token, so
a rounding there that the outputs do not carry refuses nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.validation.certify.runner import validate
from precision_convert.validation.probe.run import metrics
from precision_convert.validation.probe.run.metrics import OutputKind, compare, kind_of
from precision_convert.validation.probe.run.parity import thresholds_for

#: The rare token fp16 rounding damages, and the vocabulary it hides in.
RARE, VOCAB = 400, 512


def rare_token_gpt2() -> Any:
    """A GPT-2 whose embedding of one rare token loses its shape in fp16, finite throughout.

    The row is its own values scaled to unit spread and raised by 1500: LayerNorm removes the
    offset, so fp32 reads the row's shape, but fp16 spaces numbers near 1500 one apart and
    rounds that shape to a coarse staircase (the residual stream there rounds the same way).
    The untied head is scaled x60 so logits are peaked as a trained model's are: that token's
    answer changes (KL near 1 nat) while every other token stays within fp16 rounding.
    """
    torch.manual_seed(0)
    model = _models.gpt2(vocab_size=VOCAB, tie_word_embeddings=False).eval()
    with torch.no_grad():
        row = model.transformer.wte.weight[RARE]
        row.copy_(1500.0 + row / row.std())
        model.lm_head.weight.mul_(60.0)
    return model


#: The cancelling Llama's residual channels, its quiet token, and the value the token's
#: embedding puts on the scratch channel: between bf16's 24.0 and 24.125, nearer the first.
SCRATCH, STEADY = 0, 1
QUIET = 5
LARGE = 24.06


def cancelling_llama() -> Any:
    """A Llama whose intermediate hidden state at one token is mostly bf16 rounding, while its
    last hidden state and logits agree with fp32.

    Token QUIET's embedding holds LARGE on a scratch channel, which layer 0's MLP cancels (one
    channel: gate and up read the scratch channel, down writes it back negated, scaled so fp32
    leaves nothing), as trained models remove the large activations they put in early. bf16
    rounds the two halves to neighbouring grid points and leaves 0.125 there: 2.6x the token's
    own norm at layer 1 (0.048), an eighth of the layer's typical token, which carries 1.0 on a
    steady channel (as trained residual streams carry a few large constant channels). Nothing
    later reads the scratch channel, and layer 1 writes values large beside the residual, so
    the last hidden state and the logits keep only a rounding's worth of it.
    """
    torch.manual_seed(0)
    model = _models.llama(tie_word_embeddings=False).eval()
    first, second = model.model.layers
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, SCRATCH] = 0.0
        embed[:, STEADY] = 1.0
        embed[QUIET] *= 0.3
        embed[QUIET, [SCRATCH, STEADY]] = torch.tensor([LARGE, 0.0])
        readers = [first.self_attn.q_proj, first.self_attn.k_proj, first.self_attn.v_proj]
        readers += [second.self_attn.q_proj, second.self_attn.k_proj, second.self_attn.v_proj]
        readers += [first.mlp.gate_proj, first.mlp.up_proj, second.mlp.gate_proj]
        for projection in [*readers, second.mlp.up_proj]:
            projection.weight[:, SCRATCH] = 0.0
        for projection in (first.self_attn.o_proj, second.self_attn.o_proj, second.mlp.down_proj):
            projection.weight[SCRATCH] = 0.0
        for factor in (first.mlp.gate_proj, first.mlp.up_proj):
            factor.weight[0] = 0.0
            factor.weight[0, SCRATCH] = 1.0
        first.mlp.down_proj.weight[:, 0] = 0.0
        first.mlp.down_proj.weight[SCRATCH] = 0.0
        second.self_attn.v_proj.weight.mul_(100.0)
        product: list[float] = []
        hook = first.mlp.down_proj.register_forward_pre_hook(
            lambda m, args: product.append(float(args[0][0, 0, 0]))
        )
        model(input_ids=torch.tensor([[QUIET]]))
        hook.remove()
        first.mlp.down_proj.weight[SCRATCH, 0] = -LARGE / product[0]
    return model


def test_an_intermediate_rounding_the_outputs_do_not_carry_is_certified(tmp_path: Path) -> None:
    """The cancelling Llama at position 0: layer 1's hidden state at QUIET is off by 2.6x its
    own norm in bf16, an eighth of the layer's typical token; the last hidden state and the
    logits agree. ``bf16-safe`` certifies it, and through ``pc.load`` its logits match fp32."""
    model = cancelling_llama()
    ids = torch.tensor([[QUIET]])
    with torch.no_grad():
        fp32 = model(input_ids=ids, output_hidden_states=True)
    assert float(fp32.hidden_states[1][0, 0].norm()) < 0.06  # what layer 0 left of LARGE
    source = tmp_path / "src"
    model.save_pretrained(source)
    result = pc.convert(source, to="bf16-safe", output=tmp_path / "bf16", coverage="quick")
    assert result.certificate.verdict == "pass", result.certificate.failures
    judged = next(
        m
        for m in result.certificate.metrics
        if (m.probe, m.output, m.metric)
        == ("forward:first-position-1of1", "hidden_states.1", "token_error")
    )
    assert judged.value is not None and 0.05 < judged.value < 0.5  # seen, an eighth of typical
    with torch.no_grad():
        loaded = pc.load(tmp_path / "bf16")(input_ids=ids, output_hidden_states=True)
    inner = loaded.hidden_states[1][0, 0].float() - fp32.hidden_states[1][0, 0]
    assert float(inner.norm()) > fp32.hidden_states[1][0, 0].norm()  # the rounding left
    last = torch.nn.functional.cosine_similarity(
        loaded.hidden_states[2].float().flatten(), fp32.hidden_states[2].flatten(), dim=0
    )
    logits = torch.nn.functional.cosine_similarity(
        loaded.logits.float().flatten(), fp32.logits.flatten(), dim=0
    )
    assert float(last) > 0.999 and float(logits) > 0.999


def _token_kl(model: Any, ids: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        log_q = model(input_ids=ids).logits.double().log_softmax(-1)
    log_p = reference.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def test_a_rare_token_off_by_more_than_the_per_token_bound_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "src"
    model = rare_token_gpt2()
    model.save_pretrained(source)
    convert(source, to="fp16", output=tmp_path / "fp16", validate=False)
    certificate = validate(tmp_path / "fp16", baseline=source, coverage="quick")
    assert certificate.verdict == "fail"
    failed = {(m.probe, m.metric) for m in certificate.metrics if not m.passed}
    assert failed == {("forward:vocab-1of1", "token_kl")}, failed
    pooled = [
        m
        for m in certificate.metrics
        if m.probe == "forward:vocab-1of1" and m.metric in ("rel_l2", "max_abs_rel", "top1", "kl")
    ]
    assert len(pooled) == 4 and all(m.passed for m in pooled)
    # Under 1% of positions are off by more than the bound: every id once, in rows of 128.
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0)).view(4, 128)
    with torch.no_grad():
        reference = model(input_ids=ids).logits.double()
    kl = _token_kl(pc.load(tmp_path / "fp16"), ids, reference)
    bound = thresholds_for("lm-logits")["token_kl"]
    assert 0 < int((kl > bound).sum()) < 0.01 * kl.numel()
    assert float(kl[ids == RARE].max()) > bound


def test_a_block_of_wrong_positions_fails_where_the_pool_passes() -> None:
    """A range of 64 positions that all changed answer is 1.6% of a 4096-token probe."""
    base = torch.zeros(2, 2048, 16)
    base[..., 3] = 5.0
    cand = base.clone()
    cand[1, 1000:1064, 7] = 5.3
    values = compare(base, cand, OutputKind.LOGITS)
    thresholds = thresholds_for("lm-logits")
    assert values["top1"] > thresholds["top1"] and values["kl"] < thresholds["kl"]
    assert values["top1_worst"] < thresholds["top1_worst"]


def test_a_single_wrong_row_of_a_batch_is_seen() -> None:
    base = torch.zeros(16, 48, 16)
    base[..., 3] = 5.0
    cand = base.clone()
    cand[5, :, 7] = 9.0  # one batch row answers otherwise everywhere: 6% of the probe
    values = compare(base, cand, OutputKind.LOGITS)
    assert values["top1"] > 0.9 and values["top1_worst"] == 0.0


def test_streamed_metrics_equal_the_whole_tensor_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 300, 50, generator=g)
    cand = base + 0.05 * torch.randn(3, 300, 50, generator=g)
    cand[2, 299, 4] = float("inf")
    whole = compare(base, cand, OutputKind.LOGITS)
    monkeypatch.setattr(metrics, "ROW_BLOCK", 7)
    streamed = compare(base, cand, OutputKind.LOGITS)
    assert streamed.keys() == whole.keys()
    for key, value in whole.items():
        assert streamed[key] == pytest.approx(value, nan_ok=True), key
    assert whole["nonfinite"] == 1 and whole["nonfinite_tokens"] == 1
    b, c = base.double(), cand.double()
    finite = torch.isfinite(c)
    assert whole["max_abs"] == float("inf")
    assert whole["rel_l2"] == float("inf")
    tidy = compare(base, base + (c - b).where(finite, 0).float(), OutputKind.TENSOR)
    assert tidy["rel_l2"] == pytest.approx(float((c - b).where(finite, 0).norm() / b.norm()))


def test_a_tokens_error_is_relative_to_its_own_norm() -> None:
    """An attention sink (a token 100x the others' norm) keeps its rounding to its own scale;
    a quiet token's error is judged against a floor of the typical norm, not a ratio of two
    roundings."""
    base = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(1))
    base[0, 0] *= 100.0
    base[0, 1] *= 1e-6
    cand = base * (1 + 1e-3)
    cand[0, 1] = base[0, 1] + 1e-4
    assert compare(base, cand, OutputKind.TENSOR)["token_error"] < 0.01
    cand[0, 10] = -base[0, 10]
    assert compare(base, cand, OutputKind.TENSOR)["token_error"] > 1.0


def test_an_intermediate_layers_tokens_are_judged_at_its_typical_scale() -> None:
    """Every hidden state but a stack's last is an intermediate layer's (a summarized one's
    row norms too). There a quiet token's error is measured against the layer's median token,
    an attention sink's against its own norm; an error the size of a typical token still
    fails, and the last hidden state keeps the per-token scale."""
    names = ["logits", "hidden_states.0", "hidden_states.1", "hidden_states.1.rms"]
    names += ["hidden_states.2", "decoder_hidden_states.0", "decoder_hidden_states.3"]
    names += ["encoder_hidden_states.4", "last_hidden_state"]
    assert metrics.intermediate_states(names) == {
        "hidden_states.0",
        "hidden_states.1",
        "hidden_states.1.rms",
        "decoder_hidden_states.0",
    }
    base = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(1))
    base[0, 0] *= 100.0
    base[0, 1] *= 1e-2
    cand = base * (1 + 1e-3)
    cand[0, 1] += 0.1  # a fifth of a typical token's norm (about 5.6), ten of its own
    quiet = compare(base, cand, OutputKind.TENSOR)["token_error"]
    inner = compare(base, cand, OutputKind.TENSOR, intermediate=True)["token_error"]
    assert quiet > 0.5 > inner
    typical = float(base[0].norm(dim=-1).median())
    assert inner == pytest.approx(float((cand - base)[0, 1].norm()) / typical)
    cand[0, 0] = base[0, 0] * 1.6  # the sink off by 0.6 of its own norm: 60 typical tokens
    assert compare(base, cand, OutputKind.TENSOR, intermediate=True)["token_error"] > 0.5
    cand[0, 0] = base[0, 0] * (1 + 1e-3)
    cand[0, 10] = -base[0, 10]  # a typical token's sign flipped
    assert compare(base, cand, OutputKind.TENSOR, intermediate=True)["token_error"] > 1.0


def test_row_norms_of_a_summarized_output_are_one_token_each() -> None:
    assert kind_of("logits.rms", images=False) is OutputKind.NORMS
    base = torch.ones(4, 1000)
    cand = base.clone()
    cand[2, 17] = 3.0  # one position's logits grew threefold
    values = compare(base, cand, OutputKind.NORMS)
    assert values["token_error"] == pytest.approx(2.0 / 1.1)
    assert values["rel_l2"] < 0.05
