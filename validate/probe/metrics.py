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
from collections.abc import Mapping
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
    "rel_l2": MetricSpec(Bound.MAX, "||candidate - baseline|| / ||baseline||"),
    "cosine": MetricSpec(Bound.MIN, "cosine similarity of the flattened outputs"),
    "max_abs": MetricSpec(Bound.MAX, "largest absolute difference (reported, not judged)"),
    "max_abs_rel": MetricSpec(Bound.MAX, "largest absolute difference / baseline's largest |x|"),
    "top1": MetricSpec(
        Bound.MIN, "fraction of positions whose argmax agrees (fp32 near-ties count)"
    ),
    "kl": MetricSpec(Bound.MAX, "mean KL(baseline || candidate) of the softmax, in nats"),
    "psnr": MetricSpec(Bound.MIN, "PSNR in dB over the baseline's value range"),
    "constant_frames": MetricSpec(Bound.MAX, "image planes that are constant (black)", 0.0),
    "coverage": MetricSpec(Bound.MIN, "fraction of parameters the inputs exercised"),
}

#: Values at or below this (relative to the baseline's range) count as no variation at all.
_CONSTANT_EPS = 1e-6


class OutputKind(StrEnum):
    TENSOR = "tensor"
    LOGITS = "logits"
    IMAGE = "image"


_KIND_METRICS: dict[OutputKind, tuple[str, ...]] = {
    OutputKind.TENSOR: ("nonfinite", "rel_l2", "cosine", "max_abs", "max_abs_rel"),
    OutputKind.LOGITS: ("nonfinite", "rel_l2", "cosine", "max_abs", "max_abs_rel", "top1", "kl"),
    OutputKind.IMAGE: (
        "nonfinite",
        "rel_l2",
        "cosine",
        "max_abs",
        "max_abs_rel",
        "psnr",
        "constant_frames",
    ),
}


def kind_of(output: str, *, images: bool) -> OutputKind:
    """The kind of a flattened output: ``logits`` by name, images when the probe decodes."""
    if images:
        return OutputKind.IMAGE
    return OutputKind.LOGITS if output.rsplit(".", 1)[-1] == "logits" else OutputKind.TENSOR


def metrics_for(kind: OutputKind) -> tuple[str, ...]:
    return _KIND_METRICS[kind]


def compare(baseline: torch.Tensor, candidate: torch.Tensor, kind: OutputKind) -> dict[str, float]:
    """Every metric of ``kind`` for one output pair (computed in float64 on the CPU)."""
    if baseline.shape != candidate.shape:
        raise ValueError(
            f"shape mismatch: baseline {tuple(baseline.shape)} vs "
            f"candidate {tuple(candidate.shape)}"
        )
    b = baseline.detach().to("cpu", torch.float64)
    c = candidate.detach().to("cpu", torch.float64)
    values = {"nonfinite": float((~torch.isfinite(c)).sum())}
    diff = c - b
    b_norm = float(b.norm())
    values["rel_l2"] = float(diff.norm()) / b_norm if b_norm > 0 else float(diff.norm())
    values["cosine"] = _cosine(b.flatten(), c.flatten())
    values["max_abs"] = float(diff.abs().max()) if diff.numel() else 0.0
    peak = float(b.abs().max()) if b.numel() else 0.0
    values["max_abs_rel"] = values["max_abs"] / peak if peak > 0 else values["max_abs"]
    if kind is OutputKind.LOGITS and b.shape[-1] > 1:
        values.update(_logit_metrics(b, c))
    if kind is OutputKind.IMAGE:
        values.update(_image_metrics(b, c))
    return values


def _cosine(b: torch.Tensor, c: torch.Tensor) -> float:
    nb, nc = float(b.norm()), float(c.norm())
    if nb == 0 and nc == 0:
        return 1.0
    if nb == 0 or nc == 0:
        return 0.0
    return float(torch.dot(b, c)) / (nb * nc)


#: A token whose fp32 logit is within this of the top one (probabilities within ~5%) is a
#: tie: the candidate choosing it agrees. A half-precision model's rounding alone flips such
#: ties (a barely trained model's flat logits are full of them), which no reader of the output
#: would call a different answer; a real change of answer still counts, and KL measures the
#: distributions anyway.
TIE_LOGIT_MARGIN = 0.05


def _logit_metrics(b: torch.Tensor, c: torch.Tensor) -> dict[str, float]:
    b2 = b.reshape(-1, b.shape[-1])
    c2 = c.reshape(-1, c.shape[-1])
    chosen = b2.gather(-1, c2.argmax(-1, keepdim=True))[:, 0]  # fp32's logit of c's answer
    top1 = float((chosen >= b2.max(-1).values - TIE_LOGIT_MARGIN).double().mean())
    log_p = torch.log_softmax(b2, -1)
    log_q = torch.log_softmax(c2, -1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    return {"top1": top1, "kl": kl}


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


def measure(
    component: str,
    probe: str,
    output: str,
    values: Mapping[str, float],
    thresholds: Mapping[str, float],
) -> list[Measurement]:
    """Judge every value of one output against the task's thresholds."""
    rows = []
    for metric, value in values.items():
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
