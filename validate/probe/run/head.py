"""The output head of a summarized probe, computed only where its numbers are kept.

A summarized probe (:func:`~.execute.summarize`) keeps a strided sample of its logits' rows
and every row's RMS. Computing the whole vocabulary's logits at every position to keep that
much is most of a sweep's cost on a big vocabulary: a 128k-id head is 4M multiply-adds a
token where a 2-layer, 32-wide body is 10k, and each probe allocated (and the kernel zeroed)
hundreds of MB of logits only to reduce them to one number a row.

Inside :func:`sampled_head`, the model's output embedding (a ``Linear``) computes, for the
rows it is given:

- the kept rows' logits in full, through its own forward (the rows :func:`summarize` keeps
  of whole logits, so both ways keep the same rows);
- every row's RMS exactly, from the head's Gram matrix: ``‖W h + b‖² = hᵀ(WᵀW)h + 2hᵀWᵀb +
  ‖b‖²``, in float32, H² multiply-adds a row instead of H x vocabulary;
- a bound per row, ``|logit| ≤ ‖h‖ · maxⱼ‖Wⱼ‖ + max|b|`` (Cauchy-Schwarz). A row whose bound
  reaches :data:`FULL_ROW_SHARE` of the limit its dtype can hold (or fp16's, which the
  calibration's near-limit watch measures against) is computed in full, through the module's
  own call, so NaN/Inf in that row shows in its RMS exactly as it happened and any hook sees
  the row's real logits. Every other row provably stays under that share of the limit.

What a row's exact RMS does not include is the head's own rounding in the compute dtype (a
relative 2^-8 or 2^-11 on an RMS judged at 10%); the kept rows carry it.

Where a hook marked row-wise watches the head (calibration's recorder, the carriage, the size
fits' peaks), every row is computed in full, :data:`FULL_ROW_CHUNK` at a time, through the
module's call. Any other hook (a block-wise run, one this module does not know) leaves the
head whole, as does a probe whose logits fit its limit.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from precision_convert.conversion.analysis.hook_marks import ROW_WISE
from precision_convert.conversion.runtime.boundaries import REGISTRY_ATTR
from precision_convert.core.dtypes import WATCHED_RANGE
from precision_convert.validation.probe.inputs.model_inputs import linear_head

#: Rows whose bound reaches this share of their dtype's finite limit are computed in full: a
#: quarter leaves the calibration's near-limit margin (half of fp16's limit) well inside.
FULL_ROW_SHARE = 0.25
#: Rows computed in full at a time: bounds the memory a head of many risky rows takes.
FULL_ROW_CHUNK = 256


@dataclass
class HeadRows:
    """What :func:`sampled_head` saw in one probe: the head's input rows (as (batch, length)
    when it was given a sequence), the rows whose logits it returned, and every row's RMS."""

    head: nn.Module | None = field(default=None, repr=False)
    lead_shape: tuple[int, ...] = ()
    kept: torch.Tensor | None = None
    rms: torch.Tensor | None = None
    returned: torch.Tensor | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Gram:
    """The head's second moments, in float32: what every row's RMS and bound need."""

    gram: torch.Tensor  # (H, H): WᵀW
    cross: torch.Tensor  # (H,): Wᵀb
    bias_square: float  # ‖b‖²
    bias_peak: float  # max |b|
    row_norm_peak: float  # maxⱼ ‖Wⱼ‖


#: Per head module: (weight's data pointer, dtype, version) -> its Gram matrix. A head is
#: reused across a sweep's probes (and under every load path a fresh module, freed after).
_GRAMS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], _Gram]] = (
    weakref.WeakKeyDictionary()
)


#: Heads whose model reshapes their rows before returning them: run whole from then on.
_WHOLE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@contextmanager
def sampled_head(model: Any, limit: int | None) -> Iterator[HeadRows | None]:
    """Inside, the model's head computes kept rows only (see the module docstring) when its
    logits would exceed ``limit`` elements; yields what it saw (None: the head runs as is)."""
    head = linear_head(model) if limit is not None else None
    watch = _watch(head) if head is not None and head not in _WHOLE else WHOLE
    if head is None or limit is None or watch == WHOLE:
        yield None
        return
    seen = HeadRows(head)
    original = head.forward
    # "inside": our own calls of the head (full rows); "hooks": the hooks of the call that got
    # the kept rows are running (a recorder recomputing the head in fp16 gets those rows).
    state = {"phase": ""}
    scratch: list[torch.Tensor] = []  # the full rows' logits, one buffer for every chunk

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        if state["phase"] == "inside":
            return _full_rows(head, original, hidden, scratch)
        if rows.shape[0] * head.weight.shape[0] <= limit:
            return original(hidden)
        if state["phase"] == "hooks" and seen.kept is not None:
            return original(rows[seen.kept])
        state["phase"] = "inside"
        try:
            return _sampled(head, original, hidden, limit, seen, every_row=watch == ROWS)
        finally:
            state["phase"] = "hooks"

    def hooks_done(*_: Any) -> None:
        if state["phase"] == "hooks":  # our own chunks' calls end inside
            state["phase"] = ""

    head.forward = forward  # type: ignore[method-assign, assignment]
    done = head.register_forward_hook(hooks_done, always_call=True)  # runs after the others
    try:
        yield seen
    finally:
        done.remove()
        del head.forward  # the class's forward again


def _sampled(
    head: nn.Linear,
    original: Any,
    hidden: torch.Tensor,
    limit: int,
    seen: HeadRows,
    *,
    every_row: bool,
) -> torch.Tensor:
    """The kept rows' logits; every row's RMS into ``seen``. ``every_row``: compute every row
    in full (a row-wise hook watches the head and must see them all)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    vocabulary = head.weight.shape[0]
    stride = max(1, -(-rows.shape[0] * vocabulary // limit))
    kept = torch.arange(0, rows.shape[0], stride, device=rows.device)
    if every_row:
        rms = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        full = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    else:
        moments = _gram(head)
        wide = rows.float()
        square = ((wide @ moments.gram) * wide).sum(-1) + 2 * (wide @ moments.cross)
        rms = ((square + moments.bias_square).clamp_min(0) / vocabulary).sqrt()
        bound = torch.linalg.vector_norm(wide, dim=-1) * moments.row_norm_peak + moments.bias_peak
        # NaN rows fail the comparison; ±inf rows are computed so their RMS is what happened.
        full = ~(bound < _full_row_limit(hidden.dtype, head.weight.dtype))
    chosen = full.nonzero().flatten()
    for start in range(0, chosen.numel(), FULL_ROW_CHUNK):
        some = chosen[start : start + FULL_ROW_CHUNK]
        logits = head(rows[some])  # through __call__: hooks see these rows' real logits
        rms[some] = torch.linalg.vector_norm(logits, dim=-1, dtype=torch.float32) / math.sqrt(
            vocabulary
        )
    seen.lead_shape = tuple(hidden.shape[:-1])
    seen.kept, seen.rms = kept, rms.reshape(hidden.shape[:-1])
    seen.returned = original(rows[kept])
    return seen.returned


def _full_rows(
    head: nn.Linear, original: Any, rows: torch.Tensor, scratch: list[torch.Tensor]
) -> torch.Tensor:
    """A chunk of full rows' logits (what ``original`` computes: ``addmm``, as ``F.linear``
    does for rows), written over the previous chunk's in ``scratch``. The hooks that see them
    reduce them at once (row-wise) and :func:`_sampled` takes their RMS; a fresh tensor per
    chunk was a fresh mapping for the kernel to zero (256 rows of a 128k vocabulary: 131 MB),
    kernel time on the order of the product itself."""
    weight, bias = head.weight, head.bias
    if (
        rows.dim() != 2
        or rows.dtype != weight.dtype
        or rows.device != weight.device
        or torch.is_grad_enabled()  # out= takes no part in autograd
    ):
        return original(rows)
    if not scratch or scratch[0].shape[0] < rows.shape[0] or scratch[0].dtype != weight.dtype:
        shape = (max(rows.shape[0], FULL_ROW_CHUNK), weight.shape[0])
        scratch[:] = [torch.empty(shape, dtype=weight.dtype, device=weight.device)]
    out = scratch[0][: rows.shape[0]]
    if bias is None:
        return torch.mm(rows, weight.t(), out=out)
    return torch.addmm(bias, rows, weight.t(), out=out)


def _full_row_limit(*dtypes: torch.dtype) -> float:
    """The bound past which a row is computed in full: a share of the smallest limit among
    the row's dtypes and the range every certificate watches (fp16's)."""
    return FULL_ROW_SHARE * min([WATCHED_RANGE.finite_max, *(torch.finfo(d).max for d in dtypes)])


def _gram(head: nn.Linear) -> _Gram:
    """The head's :class:`_Gram`, computed once per weight (in chunks of the vocabulary: the
    weight is never copied whole to float32)."""
    weight = head.weight
    key = (weight.data_ptr(), weight.dtype, weight._version)
    cached = _GRAMS.get(head)
    if cached is not None and cached[0] == key:
        return cached[1]
    size = weight.shape[1]
    gram = torch.zeros(size, size, dtype=torch.float32, device=weight.device)
    cross = torch.zeros(size, dtype=torch.float32, device=weight.device)
    bias = head.bias.float() if head.bias is not None else None
    peak = 0.0
    for start in range(0, weight.shape[0], 8192):
        block = weight[start : start + 8192].float()
        gram += block.T @ block
        peak = max(peak, float(torch.linalg.vector_norm(block, dim=-1).max()))
        if bias is not None:
            cross += block.T @ bias[start : start + 8192]
    moments = _Gram(
        gram=gram,
        cross=cross,
        bias_square=float(bias @ bias) if bias is not None else 0.0,
        bias_peak=float(bias.abs().max()) if bias is not None else 0.0,
        row_norm_peak=peak,
    )
    _GRAMS[head] = (key, moments)
    return moments


#: How the head may run (:func:`_watch`): sampled, every row in chunks, or whole as is.
SAMPLED, ROWS, WHOLE = "sampled", "rows", "whole"


def _watch(head: nn.Module) -> str:
    """How the hooks on ``head`` let it run: :data:`SAMPLED` when only the loader's boundary
    hooks are there; :data:`ROWS` when the others reduce what they see row by row (marked
    :func:`~precision_convert.conversion.analysis.hook_marks.row_wise`: peaks and sums), so
    every row must be computed but may be in chunks; :data:`WHOLE` for any other hook (or a
    global one): it sees the head's output as the model computes it."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return WHOLE
    registry: dict[str, tuple[Any, ...]] = head.__dict__.get(REGISTRY_ATTR, {})
    own = {handle.id for handles in registry.values() for handle in handles}
    hooks = [
        hook
        for table in (head._forward_hooks, head._forward_pre_hooks)
        for key, hook in table.items()
        if key not in own
    ]
    if not hooks:
        return SAMPLED
    return ROWS if all(getattr(hook, ROW_WISE, False) for hook in hooks) else WHOLE


def head_outputs(
    outputs: dict[str, torch.Tensor], seen: HeadRows, positions: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The head's output taken out of ``outputs`` as :func:`~.execute.summarize` would keep
    it: ``name`` (the kept rows, (rows, vocabulary)) and ``name.rms`` (every row's RMS), padded
    positions zeroed. The RMS is of the head's own rows: before any elementwise transform the
    model applies to them (Gemma 2's soft cap), which would only squash the differences judged.
    Empty when the head computed nothing of its own or no output has the shape of the rows it
    returned (a model that reshaped them: the caller runs it whole)."""
    if seen.returned is None or seen.kept is None or seen.rms is None:
        return {}
    returned = seen.returned
    name = next((key for key, t in outputs.items() if t.shape == returned.shape), None)
    if name is None:
        if seen.head is not None:
            _WHOLE.add(seen.head)
        return {}
    shape = returned.shape
    rows = outputs.pop(name).reshape(-1, shape[-1])
    rms = seen.rms
    if positions is not None and tuple(positions.shape) == seen.lead_shape:
        real = positions.to(rms.device)
        rows = rows.masked_fill(~real.reshape(-1)[seen.kept].unsqueeze(-1), 0)
        rms = rms.masked_fill(~real, 0)
    return {name: rows, f"{name}.rms": rms}
