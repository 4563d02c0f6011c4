"""A summarized probe judges the same logits whether its head computes every row or the kept ones.

The output head of a summarized probe computes the rows the summary keeps and every row's RMS
from its Gram matrix (:mod:`precision_convert.validation.probe.run.head`); a row that might come
near the limit of its dtype is computed in full. These tests hold it to the whole head: the same
kept rows, the same RMS, the same NaN/Inf, padded positions zeroed, and a head that something
else watches left whole.
"""

from __future__ import annotations

from typing import Any

import _models
import pytest
import torch

from precision_convert.conversion.analysis.hook_marks import row_wise
from precision_convert.validation.probe.inputs.model_inputs import Probe
from precision_convert.validation.probe.run.execute import call_probe
from precision_convert.validation.probe.run.head import FULL_ROW_CHUNK

#: Few elements kept, so that every probe here is summarized: 5 of 48 rows of 256 logits.
LIMIT = 1200


def _bert_mlm() -> Any:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(**_models.BERT))


def _probe(ids: torch.Tensor, mask: torch.Tensor | None = None) -> Probe:
    kwargs: dict[str, Any] = {"input_ids": ids}
    if mask is not None:
        kwargs["attention_mask"] = mask
    positions = None if mask is None else mask.bool()
    return Probe("forward:test", "forward", kwargs, max_output=LIMIT, positions=positions)


def _both(model: Any, probe: Probe) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    sampled = call_probe(model, probe, "cpu", None)
    whole = call_probe(model, probe, "cpu", None, sample_head=False)
    return sampled, whole


def _assert_same(
    sampled: dict[str, torch.Tensor], whole: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """Equal up to the head's own rounding in ``dtype`` (the sampled RMS is exact arithmetic,
    the whole head's is of rounded logits; kept rows come from a matmul of another shape)."""
    assert sampled.keys() == whole.keys()
    rtol = 4 * torch.finfo(dtype).eps
    for name, tensor in whole.items():
        assert sampled[name].shape == tensor.shape, name
        torch.testing.assert_close(
            sampled[name].float(), tensor.float(), rtol=rtol, atol=rtol, equal_nan=True
        )


@pytest.mark.parametrize(
    "family",
    [_models.llama, _models.gpt2, lambda: _bert_mlm()],
    ids=["llama-tied", "gpt2", "bert-mlm"],
)
def test_the_sampled_head_keeps_the_rows_and_rms_the_whole_head_keeps(family: Any) -> None:
    torch.manual_seed(0)
    model = family().eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (3, 16))
    for dtype in (torch.float32, torch.bfloat16):
        sampled, whole = _both(model.to(dtype), _probe(ids))
        assert whole["logits.rms"].shape == (3, 16) and whole["logits"].numel() <= LIMIT + vocab
        _assert_same(sampled, whole, dtype)


def test_capped_logits_keep_their_rows_and_the_rms_of_the_heads_rows() -> None:
    """Gemma 2 caps its logits (``cap * tanh(x / cap)``) after the head: the kept rows are the
    capped ones the model returns, the RMS is of the head's rows before the cap (the same
    model uncapped returns them)."""
    torch.manual_seed(0)
    model = _models.gemma2(final_logit_softcapping=0.05).eval()
    probe = _probe(torch.randint(0, 256, (3, 16)))
    sampled, whole = _both(model, probe)
    assert not torch.allclose(sampled["logits.rms"], whole["logits.rms"], rtol=0.1)
    torch.testing.assert_close(sampled["logits"], whole["logits"])
    model.config.final_logit_softcapping = None
    uncapped = call_probe(model, probe, "cpu", None, sample_head=False)
    torch.testing.assert_close(sampled["logits.rms"], uncapped["logits.rms"])


def test_padded_positions_are_zeroed_as_the_whole_head_zeroes_them() -> None:
    torch.manual_seed(0)
    model = _models.llama().eval()
    ids = torch.randint(0, 256, (3, 16))
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 3:] = 0
    sampled, whole = _both(model, _probe(ids, mask))
    _assert_same(sampled, whole, torch.float32)
    assert (sampled["logits.rms"][2, 3:] == 0).all() and (sampled["logits.rms"][0] > 0).all()


def test_a_head_that_overflows_fp16_shows_inf_in_the_same_rows() -> None:
    """The head's weights scaled until about half the positions' logits pass 65504 in fp16:
    the bound sends those rows (and perhaps more) to a full computation, so their RMS is inf
    as the whole head's is, and the rows under the bound keep their exact RMS."""
    torch.manual_seed(0)
    model = _models.gpt2(tie_word_embeddings=False).eval()
    ids = torch.randint(0, 128, (3, 16))
    with torch.no_grad():
        peaks = model(input_ids=ids).logits.abs().amax(-1)
        model.lm_head.weight.mul_(65504.0 / peaks.median())
    sampled, whole = _both(model.half(), _probe(ids))
    overflowed = ~torch.isfinite(whole["logits.rms"])
    assert overflowed.any() and not overflowed.all()
    assert torch.equal(~torch.isfinite(sampled["logits.rms"]), overflowed)
    _assert_same(sampled, whole, torch.float16)


def test_a_head_someone_else_hooks_runs_whole() -> None:
    torch.manual_seed(0)
    model = _models.llama().eval()
    seen: list[tuple[int, ...]] = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    try:
        sampled = call_probe(model, _probe(torch.randint(0, 256, (3, 16))), "cpu", None)
    finally:
        handle.remove()
    assert seen == [(3, 16, 256)]  # the hook saw every row's logits
    assert sampled["logits.rms"].shape == (3, 16)


def test_a_row_wise_hook_sees_every_row_in_chunks() -> None:
    """A peak recorder (marked row-wise) on the head sees every row's real logits, a chunk at a
    time: its peak is the whole head's, and the outputs are the whole head's."""
    torch.manual_seed(0)
    model = _models.llama().eval()
    probe = _probe(torch.randint(0, 256, (3, 400)))  # 1200 rows: five chunks
    peaks: list[float] = []
    shapes: list[int] = []

    def record(module: Any, args: Any, out: torch.Tensor) -> None:
        peaks.append(float(out.abs().max()))
        shapes.append(out.shape[0])

    handle = model.lm_head.register_forward_hook(row_wise(record))
    try:
        sampled, whole = _both(model, probe)
    finally:
        handle.remove()
    with torch.no_grad():
        everything = model(**probe.kwargs).logits
    assert max(peaks) == float(everything.abs().max())
    assert max(shapes) == FULL_ROW_CHUNK and sum(shapes) > 1200  # chunks, then whole
    _assert_same(sampled, whole, torch.float32)


def test_the_chunks_of_full_rows_share_one_buffer() -> None:
    """Every chunk of full rows is written over the previous one's storage: a fresh tensor per
    chunk was a fresh mapping for the kernel to zero (256 rows of a 128k head: 131 MB)."""
    torch.manual_seed(0)
    model = _models.llama().eval()
    probe = _probe(torch.randint(0, 256, (3, 400)))  # 1200 rows: five chunks
    storages: list[int] = []

    def record(module: Any, args: Any, out: torch.Tensor) -> None:
        if out.shape[0] == FULL_ROW_CHUNK:
            storages.append(out.untyped_storage().data_ptr())

    handle = model.lm_head.register_forward_hook(row_wise(record))
    try:
        call_probe(model, probe, "cpu", None)
    finally:
        handle.remove()
    assert len(storages) == 4 and len(set(storages)) == 1
