"""Per-token judgement: a few broken tokens fail a probe whose pooled metrics pass.

Pooled over a probe of thousands of tokens, top-1 >= 0.9 and mean KL <= 0.05 let a wrong
answer at a handful of positions through. The worst token's KL and error, and the top-1 of
the worst batch row and block of positions, are judged too; every metric is reduced a block
of rows at a time, so a long wide-vocabulary output is never copied whole in float64.
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


def test_row_norms_of_a_summarized_output_are_one_token_each() -> None:
    assert kind_of("logits.rms", images=False) is OutputKind.NORMS
    base = torch.ones(4, 1000)
    cand = base.clone()
    cand[2, 17] = 3.0  # one position's logits grew threefold
    values = compare(base, cand, OutputKind.NORMS)
    assert values["token_error"] == pytest.approx(2.0 / 1.1)
    assert values["rel_l2"] < 0.05
