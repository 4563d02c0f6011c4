"""Parity metrics between a baseline output and a candidate output, and how each is judged.

Every metric is a row of :data:`METRICS`: whether its threshold is an upper or a lower bound,
and whether it is fatal whatever the thresholds say. Which metrics apply to an output depends
on its kind: every tensor gets the generic ones, vocabulary/class ``logits`` add top-1
agreement and KL, decoded images and frames add PSNR and the constant-frame check.

Example:
    >>> values = compare(baseline, candidate, kind=kind_of("logits", images=False))
    >>> [judge(name, v, thresholds) for name, v in values.items()]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch


class Bound(StrEnum):
    """Which side of its threshold a metric must stay on."""

    MAX = "max"  # value <= threshold
    MIN = "min"  # value >= threshold


@dataclass(frozen=True)
class MetricSpec:
    bound: Bound
    description: str
    #: Fatal metrics are judged against a fixed threshold that recipes cannot loosen.
    fatal_threshold: float | None = None


METRICS: dict[str, MetricSpec] = {
    "nonfinite": MetricSpec(Bound.MAX, "NaN/Inf values in the candidate output", 0.0),
    "nonfinite_tokens": MetricSpec(
        Bound.MAX, "tokens (rows of the last dimension) holding NaN/Inf (reported, not judged)"
    ),
    "rel_l2": MetricSpec(Bound.MAX, "||candidate - baseline|| / ||baseline||"),
    "cosine": MetricSpec(Bound.MIN, "cosine similarity of the flattened outputs"),
    "max_abs": MetricSpec(Bound.MAX, "largest absolute difference (reported, not judged)"),
    "max_abs_rel": MetricSpec(Bound.MAX, "largest absolute difference / baseline's largest |x|"),
    "token_error": MetricSpec(
        Bound.MAX,
        "worst token's ||candidate - baseline|| / ||baseline|| (softened near 0; an "
        "intermediate layer's hidden state: at least the layer's median token norm)",
    ),
    "top1": MetricSpec(
        Bound.MIN, "fraction of positions whose argmax agrees (fp32 near-ties count)"
    ),
    "top1_worst": MetricSpec(
        Bound.MIN, "top-1 agreement of the worst batch row or block of positions"
    ),
    "kl": MetricSpec(Bound.MAX, "mean KL(baseline || candidate) of the softmax, in nats"),
    "token_kl": MetricSpec(Bound.MAX, "worst token's KL(baseline || candidate), in nats"),
    "psnr": MetricSpec(Bound.MIN, "PSNR in dB over the baseline's value range"),
    "constant_frames": MetricSpec(Bound.MAX, "image planes that are constant (black)", 0.0),
    "coverage": MetricSpec(
        Bound.MIN,
        "fraction of parameters the inputs exercised, times the share of probes the fp32 "
        "baseline could answer",
    ),
}

#: Values at or below this (relative to the baseline's range) count as no variation at all.
_CONSTANT_EPS = 1e-6


class OutputKind(StrEnum):
    TENSOR = "tensor"
    LOGITS = "logits"
    IMAGE = "image"
    #: A summarized output's per-row RMS (``<name>.rms``): every element is one token.
    NORMS = "norms"


#: Suffix of the per-row RMS a summarized output keeps (see ``execute.summarize``).
NORMS_SUFFIX = ".rms"


def kind_of(output: str, *, images: bool) -> OutputKind:
    """The kind of a flattened output: ``logits`` by name, images when the probe decodes,
    the per-token RMS of a summarized output by its suffix."""
    if images:
        return OutputKind.IMAGE
    if output.endswith(NORMS_SUFFIX):
        return OutputKind.NORMS
    return OutputKind.LOGITS if output.rsplit(".", 1)[-1] == "logits" else OutputKind.TENSOR


#: Rows (tokens) compared at a time, and at most this many elements: a 128k-vocabulary
#: probe's comparison holds a few float64 temporaries of 32 rows (32 MB each), however long
#: the probe is.
ROW_BLOCK = 256
BLOCK_ELEMENTS = 1 << 22
#: A token's error is relative to its own norm plus this share of the median token's norm: a
#: token whose baseline is near zero (a padded row, an attention sink's quiet neighbour) is
#: not judged on a ratio of two roundings, and an attention sink's huge norm is its own scale.
TOKEN_FLOOR = 0.1
#: A model's hidden states as its outputs name them (``hidden_states.3``,
#: ``decoder_hidden_states.3``, a summarized one's ``hidden_states.3.rms``): the stack and the
#: layer. The last of a stack is what the head reads; the others are intermediate layers.
_HIDDEN_STATE = re.compile(r"(?P<stack>(?:.*\.)?\w*hidden_states)\.(?P<layer>\d+)(?:\.rms)?")
#: Top-1 agreement is judged per batch row and per block of this many consecutive positions
#: (across the batch), where a group holds at least MIN_GROUP tokens: one flipped near-tie in
#: a row of 3 is noise; a block of positions that all changed answer is a broken range.
POSITION_GROUP = 64
MIN_GROUP = 32
#: Rows narrower than this are no tokens (a similarity matrix's row over a few images, a
#: two-class head): their own norm swings with values near zero, so a relative error per row
#: says nothing; the pooled metrics and ``max_abs_rel`` judge them.
MIN_TOKEN_WIDTH = 8


def intermediate_states(outputs: Iterable[str]) -> frozenset[str]:
    """The names among one probe's ``outputs`` that hold an intermediate layer's hidden states:
    every ``hidden_states.K`` of a stack but its last K, which is what the head reads."""
    found = [(m, name) for name in outputs if (m := _HIDDEN_STATE.fullmatch(name))]
    last: dict[str, int] = {}
    for m, _ in found:
        last[m["stack"]] = max(last.get(m["stack"], 0), int(m["layer"]))
    return frozenset(name for m, name in found if int(m["layer"]) < last[m["stack"]])


def compare(
    baseline: torch.Tensor,
    candidate: torch.Tensor,
    kind: OutputKind,
    *,
    intermediate: bool = False,
) -> dict[str, float]:
    """Every metric of ``kind`` for one output pair, in float64 on the CPU.

    Pooled metrics (over the whole output) and per-token ones (a token is one row of the last
    dimension, one element of a ``NORMS`` output; images have none) are reduced
    :data:`ROW_BLOCK` rows (:data:`BLOCK_ELEMENTS` elements) at a time, so no full-size
    float64 copy, difference or softmax of the output is ever held. ``intermediate``: the
    output is an intermediate layer's hidden state (:func:`intermediate_states`), whose
    tokens' errors are judged against at least the layer's median token norm.
    """
    if baseline.shape != candidate.shape:
        raise ValueError(
            f"shape mismatch: baseline {tuple(baseline.shape)} vs "
            f"candidate {tuple(candidate.shape)}"
        )
    b_all = baseline.detach().to("cpu")
    c_all = candidate.detach().to("cpu")
    width = 1 if kind is OutputKind.NORMS or b_all.dim() == 0 else b_all.shape[-1]
    b_rows = b_all.reshape(-1, width) if b_all.numel() else b_all.reshape(0, 1)
    c_rows = c_all.reshape(-1, width) if c_all.numel() else c_all.reshape(0, 1)
    logits = kind is OutputKind.LOGITS and width > 1
    acc = _Sums(b_rows.shape[0], logits)
    step = max(1, min(ROW_BLOCK, BLOCK_ELEMENTS // width))
    for start in range(0, b_rows.shape[0], step):
        acc.add(start, b_rows[start : start + step].double(), c_rows[start : start + step].double())
    values = acc.pooled()
    # An image's rows are no tokens (PSNR judges pixels), nor are rows of a few values.
    if kind is OutputKind.NORMS or (kind is not OutputKind.IMAGE and width >= MIN_TOKEN_WIDTH):
        values.update(acc.per_token(intermediate))
    if logits:
        values.update(acc.logit_metrics(_groups(b_all.shape, b_rows.shape[0])))
    if kind is OutputKind.IMAGE:
        values.update(_image_metrics(b_all.double(), c_all.double()))
    return values


class _Sums:
    """Running sums of one output's comparison, fed :data:`ROW_BLOCK` rows at a time."""

    def __init__(self, rows: int, logits: bool) -> None:
        self.nonfinite = 0.0
        self.diff_sq = self.b_sq = self.c_sq = self.dot = 0.0
        self.max_abs = self.peak = 0.0
        self.token_diff = torch.zeros(rows, dtype=torch.float64)
        self.token_norm = torch.zeros(rows, dtype=torch.float64)
        self.token_bad = torch.zeros(rows, dtype=torch.bool)
        self.logits = logits
        if logits:
            self.agree = torch.zeros(rows, dtype=torch.bool)
            self.kl = torch.zeros(rows, dtype=torch.float64)

    def add(self, start: int, b: torch.Tensor, c: torch.Tensor) -> None:
        stop = start + b.shape[0]
        bad = ~torch.isfinite(c)
        self.nonfinite += float(bad.sum())
        self.token_bad[start:stop] = bad.any(-1)
        diff = c - b
        token_diff = torch.linalg.vector_norm(diff, dim=-1)
        token_norm = torch.linalg.vector_norm(b, dim=-1)
        self.token_diff[start:stop] = token_diff
        self.token_norm[start:stop] = token_norm
        self.diff_sq += float(token_diff.square().sum())
        self.b_sq += float(token_norm.square().sum())
        self.c_sq += float(torch.linalg.vector_norm(c).square())
        self.dot += float(torch.dot(b.reshape(-1), c.reshape(-1)))
        if diff.numel():
            self.max_abs = _worse(self.max_abs, float(diff.abs().max()))
            self.peak = max(self.peak, float(b.abs().max()))
        if self.logits:
            chosen = b.gather(-1, c.argmax(-1, keepdim=True))[:, 0]  # fp32's logit of c's pick
            self.agree[start:stop] = chosen >= b.max(-1).values - TIE_LOGIT_MARGIN
            log_p = torch.log_softmax(b, -1)
            log_q = torch.log_softmax(c, -1)
            self.kl[start:stop] = (log_p.exp() * (log_p - log_q)).sum(-1)

    def pooled(self) -> dict[str, float]:
        diff_norm, b_norm = math.sqrt(self.diff_sq), math.sqrt(self.b_sq)
        c_norm = math.sqrt(self.c_sq)
        if b_norm == 0 and c_norm == 0:
            cosine = 1.0
        elif b_norm == 0 or c_norm == 0:
            cosine = 0.0
        else:
            cosine = self.dot / (b_norm * c_norm)
        return {
            "nonfinite": self.nonfinite,
            "rel_l2": diff_norm / b_norm if b_norm > 0 else diff_norm,
            "cosine": cosine,
            "max_abs": self.max_abs,
            "max_abs_rel": self.max_abs / self.peak if self.peak > 0 else self.max_abs,
        }

    def per_token(self, intermediate: bool) -> dict[str, float]:
        """The worst token: NaN/Inf count, and the largest error relative to its own norm, or
        to the median token's where that is larger and the output is an ``intermediate``
        layer's: no caller reads that layer, its error reaches the outputs only through the
        layers after it, and a token near zero there (a large value the layer cancels) is not
        judged on its rounding over almost nothing. The last hidden state and the logits keep
        the per-token scale."""
        if not self.token_norm.numel():
            return {"nonfinite_tokens": 0.0, "token_error": 0.0}
        typical = float(self.token_norm.median())  # an attention sink does not move it
        scale = self.token_norm + TOKEN_FLOOR * typical
        if intermediate:
            scale = scale.clamp(min=typical)
        ratio = torch.where(scale > 0, self.token_diff / scale, self.token_diff)
        worst = float("nan") if bool(ratio.isnan().any()) else float(ratio.max())
        return {"nonfinite_tokens": float(self.token_bad.sum()), "token_error": worst}

    def logit_metrics(self, groups: list[torch.Tensor]) -> dict[str, float]:
        """Top-1 agreement and KL pooled, KL of the worst token, top-1 of the worst group."""
        if not self.agree.numel():
            return {"top1": 1.0, "top1_worst": 1.0, "kl": 0.0, "token_kl": 0.0}
        agree = self.agree.double()
        worst_group = min((float(agree[g].mean()) for g in groups), default=float(agree.mean()))
        kl_nan = bool(self.kl.isnan().any())
        return {
            "top1": float(agree.mean()),
            "top1_worst": worst_group,
            "kl": float(self.kl.mean()),
            "token_kl": float("nan") if kl_nan else float(self.kl.max()),
        }


def _worse(a: float, b: float) -> float:
    """The larger of two maxima, NaN when either is (NaN must never hide behind a number)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _groups(shape: torch.Size, tokens: int) -> list[torch.Tensor]:
    """Token indices of each batch row and each block of :data:`POSITION_GROUP` positions
    (across the batch) holding at least :data:`MIN_GROUP` tokens. Outputs of three or more
    dimensions are (batch, positions..., vocabulary); smaller ones one row of positions."""
    batch = int(shape[0]) if len(shape) >= 3 and tokens else 1
    positions = tokens // batch if batch else 0
    index = torch.arange(tokens).view(batch, positions)
    groups = [index[r] for r in range(batch)] if batch > 1 else []
    for start in range(0, positions, POSITION_GROUP):
        groups.append(index[:, start : start + POSITION_GROUP].reshape(-1))
    return [g for g in groups if g.numel() >= MIN_GROUP]


#: A token whose fp32 logit is within this of the top one (probabilities within ~5%) is a
#: tie: the candidate choosing it agrees. A half-precision model's rounding alone flips such
#: ties (a barely trained model's flat logits are full of them), which no reader of the output
#: would call a different answer; a real change of answer still counts, and KL measures the
#: distributions anyway.
TIE_LOGIT_MARGIN = 0.05


def _image_metrics(b: torch.Tensor, c: torch.Tensor) -> dict[str, float]:
    """PSNR over the baseline's value range, and the number of constant planes.

    A plane is one H x W slice (a channel of a frame). NaN-free black frames — fp16 overflow
    clamped away by a pipeline's post-processing — show up here, not in ``nonfinite``.
    """
    value_range = float(b.max() - b.min()) or 1.0
    mse = float(((c - b) ** 2).mean())
    psnr = math.inf if mse == 0 else 10 * math.log10(value_range**2 / mse)
    planes = c.reshape(-1, c.shape[-2] * c.shape[-1]) if c.dim() >= 2 else c.reshape(1, -1)
    spread = planes.amax(-1) - planes.amin(-1)
    constant = float(((spread <= _CONSTANT_EPS * value_range) | ~torch.isfinite(spread)).sum())
    return {"psnr": psnr, "constant_frames": constant}


def judge(metric: str, value: float, thresholds: Mapping[str, float]) -> tuple[float | None, bool]:
    """The threshold that applies to ``metric`` and whether ``value`` meets it.

    A metric without a threshold (``max_abs``) is only reported: it passes (NaN is judged by
    ``nonfinite``, which always has one). Against a threshold, NaN never passes.
    """
    spec = METRICS[metric]
    threshold = spec.fatal_threshold if spec.fatal_threshold is not None else thresholds.get(metric)
    if threshold is None:
        return None, True
    if math.isnan(value):
        return threshold, False
    ok = value <= threshold if spec.bound is Bound.MAX else value >= threshold
    return threshold, ok


@dataclass(frozen=True)
class Measurement:
    """One judged metric of one output, as listed in the certificate."""

    component: str  # "" for a single model; the pipeline component name otherwise
    probe: str  # "forward", "encode", "decode", "pipeline", or "block:<module name>"
    output: str
    metric: str
    value: float | None  # None when the value is NaN or infinite (JSON has no such numbers)
    threshold: float | None
    bound: str
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def where(self) -> str:
        return "/".join(p for p in (self.component, self.probe, self.output) if p)


#: Significant digits a measured value keeps: float32's own resolution (the outputs compared
#: are float32 or narrower), so the certificate's thousands of values are not written with a
#: float64's 17 digits. Values are judged as recorded, so a reader re-judging agrees.
SIGNIFICANT_DIGITS = 7


def recorded_value(value: float) -> float:
    """``value`` to :data:`SIGNIFICANT_DIGITS` (NaN and infinities unchanged)."""
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if math.isfinite(value) else value


def measure(
    component: str,
    probe: str,
    output: str,
    values: Mapping[str, float],
    thresholds: Mapping[str, float],
) -> list[Measurement]:
    """Judge every value of one output against the task's thresholds."""
    rows = []
    for metric, measured in values.items():
        value = recorded_value(measured)
        threshold, ok = judge(metric, value, thresholds)
        rows.append(
            Measurement(
                component,
                probe,
                output,
                metric,
                value if math.isfinite(value) else None,
                threshold,
                METRICS[metric].bound.value,
                ok,
            )
        )
    return rows
