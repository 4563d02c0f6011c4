"""The fp32 baseline's peaks against size: what the certificate records of each size family,
and the modules whose predicted peak at a size not run comes near fp16's limit.

The probes run at several sizes of each family (the built ones, :mod:`~..inputs.sizes`'
intermediate and declared ones, a token model's lengths); :func:`run_sized` keeps each
module's peak per probe while they run, and :func:`size_growth` fits each module's peaks
against the family's size (:func:`~precision_convert.conversion.analysis.growth.fit_growth`)
and predicts them over the range the certificate claims (:class:`Claim`: from the declared
size up to 4x the largest size judged, or the declared limit). A prediction within the
activation margin of fp16's limit inside that range is a :class:`Predicted`, which names the
size from which the fit puts it past the limit: calibration keeps the module fp32, validation
refuses an output that computes it in fp16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN, LEAF, _Reduced
from precision_convert.conversion.analysis.growth import Growth, fit_growth, probe_peaks
from precision_convert.core.dtypes import FiniteRange
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.sizes import FAMILIES, declared_bounds, probe_sizes
from precision_convert.validation.probe.run.execute import Outputs, run_probes

#: Modules per family whose fit the certificate shows: those predicted highest.
TOP_MODULES = 3
#: What a size not run but predicted is called, in the certificate and on the card.
PREDICTED = "predicted, not run"
#: How the rules name each family's size.
WORDS = {
    "image_side": "image side (px)",
    "latent_side": "latent side",
    "latent_frames": "latent frames",
    "sequence_length": "sequence length",
    "audio_length": "padded audio length (samples)",
    # A pipeline's call: the pixels and frames it defaults to.
    "height": "height (px)",
    "width": "width (px)",
    "frames": "frames",
}


@dataclass(frozen=True)
class SizedRun:
    """What one fp32 run kept for the fits: per probe, each ``(module, side)``'s peak and the
    probe's size per family; each module's kind."""

    peaks: dict[str, dict[tuple[str, str], float]]
    sizes: dict[str, dict[str, int]]
    kinds: dict[str, str]


def run_sized(
    model: Any,
    inputs: ModelInputs,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    seen: _Reduced | None = None,
    paused: Callable[[], bool] | None = None,
    id_sweeps: bool = True,
) -> tuple[Outputs, SizedRun]:
    """:func:`~.execute.run_probes`, keeping each module's peak on every probe that has a
    size, the id sweeps (:data:`ID_SWEEPS`) only if ``id_sweeps`` (``seen``, ``paused``: see
    :func:`~.growth.probe_peaks`)."""
    sizes = probe_sizes(getattr(model, "config", None), inputs)
    fitted = frozenset(
        p.name for p in inputs.probes if p.name in sizes and (id_sweeps or not _id_sweep(p))
    )
    with probe_peaks(model, fitted, seen, paused) as peaks:
        outputs = run_probes(model, inputs, device, dtype, stop=peaks.mark, around=peaks.watching)
    return outputs, SizedRun(peaks.by_probe, sizes, peaks.kinds)


#: Sweeps that feed every id at one length (a 512-token row, position 0, after BOS): each
#: size's peak there is a maximum over the vocabulary, where the ladder's rows of seeded ids
#: sample a length. Where the fits' predictions decide (fp16 compute), those maxima stay in the
#: fits: they raise the point at their length, which errs toward keeping a module fp32.
#: Elsewhere the fits are a record only, and these sweeps run unwatched by them, so their
#: output head computes the rows a probe keeps rather than every row of the vocabulary.
ID_SWEEPS = frozenset({"vocabulary", "first-position"})


def _id_sweep(probe: Any) -> bool:
    return (probe.sweep or {}).get("kind") in ID_SWEEPS


@dataclass(frozen=True)
class Predicted:
    """A module whose peak, predicted at a size not run, comes within the margin of
    ``limit``."""

    module: str
    side: str  # "output", or "input": what a weighted module receives
    kind: str
    family: str
    size: int  # the top of the family's claimed range
    peak: float
    growth: Growth
    limit: FiniteRange

    @property
    def where(self) -> str:
        """The size it is predicted at: ``at image side (px) 1024, predicted, not run``."""
        return f"at {WORDS[self.family]} {self.size}, {PREDICTED}"

    @property
    def safe_up_to(self) -> int:
        """The largest size at which the fit keeps the peak outside the margin (0: none)."""
        return math.ceil(self.growth.reaches(self.limit.finite_max / ACTIVATION_MARGIN)) - 1

    @property
    def overflow_at(self) -> int | None:
        """The size from which the fit puts the peak past the limit itself, within the claimed
        range (None: not before its top)."""
        at = self.growth.reaches(self.limit.finite_max)
        return math.ceil(at) if at <= self.size else None

    @property
    def rule(self) -> str:
        """Why it is kept fp32 (or why the limit's dtype is refused): the prediction, where it
        crosses the limit, and its fit."""
        words = WORDS[self.family]
        sizes = ", ".join(str(s) for s in self.growth.sizes)
        crossing = (
            f"past the limit from {words} {self.overflow_at}"
            if self.overflow_at is not None
            else f"within the margin from {words} {self.safe_up_to + 1}"
        )
        return (
            f"predicted peak {self.peak:.4g} ({self.side}) at {words} {self.size} "
            f"({PREDICTED}; {crossing}; "
            f"power law over {sizes}: exponent {self.growth.exponent:.2f}, residual "
            f"{self.growth.residual:.3f}; {self.limit.name} limit {self.limit.finite_max:g}, "
            f"margin {ACTIVATION_MARGIN:g}x)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "side": self.side,
            "kind": self.kind,
            "predicted_peak": round(self.peak, 4),
            "safe_up_to": self.safe_up_to,
            "overflow_at": self.overflow_at,
            "rule": self.rule,
        }


@dataclass(frozen=True)
class Claim:
    """The sizes of one family a certificate speaks for: from the size the model declares
    (else the smallest run) to ``high``; judged up to ``judged``, predicted by the growth fits
    above it; past ``high``, not covered. With fits, ``high`` is :data:`CLAIM_FACTOR` times
    the largest size judged, at most the model's declared ``limit`` and at least its declared
    size; without (too few sizes run), nothing is predicted: ``high`` is ``judged``."""

    low: int
    judged: int
    high: int
    limit: int | None

    @classmethod
    def of(
        cls, sizes_run: list[int], declared: int | None, limit: int | None, *, fitted: bool
    ) -> Claim:
        judged = sizes_run[-1]
        high = judged
        if fitted:
            reach = CLAIM_FACTOR * judged if limit is None else min(CLAIM_FACTOR * judged, limit)
            high = max(reach, declared or 0, judged)
        low = declared if declared is not None and declared <= high else sizes_run[0]
        return cls(low, judged, high, limit)

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"largest_run": self.judged, "claimed": [self.low, self.high]}
        if self.high > self.judged:
            entry.update(
                largest_predicted=self.high,
                predicted=[self.judged + 1, self.high],
                status=PREDICTED,
            )
        if self.limit is None or self.high < self.limit:
            entry["not_covered"] = [self.high + 1, self.limit]
        return entry


#: How far past the largest size judged a family's claimed range reaches.
CLAIM_FACTOR = 4


def size_growth(
    inputs: ModelInputs, run: SizedRun, limit: FiniteRange
) -> tuple[ModelInputs, list[Predicted]]:
    """``inputs`` with ``sizes.growth`` recording, per family, the sizes run, the range
    claimed (:class:`Claim`), predicted above them and not covered past it, the fits of its
    top modules and the plain cast's predicted limits; and the modules predicted near
    ``limit`` inside the claimed range."""
    bounds = declared_bounds(inputs)
    base = next((run.sizes[p.name] for p in inputs.probes if p.name in run.sizes), {})
    record: dict[str, Any] = {}
    near: list[Predicted] = []
    for family in FAMILIES:
        points = _points(family, base, run)
        if not points:
            continue
        sizes = sorted({s for by_size in points.values() for s in by_size})
        fits = {m: g for m, p in points.items() if (g := fit_growth(p)) is not None}
        claim = Claim.of(sizes, *bounds.get(family, (None, None)), fitted=bool(fits))
        ranked = sorted(fits.items(), key=lambda item: -item[1].predict(claim.high))
        found: list[Predicted] = []
        if claim.high > claim.judged:
            for (module, side), growth in ranked:
                peak = growth.predict(claim.high)
                if peak <= limit.finite_max / ACTIVATION_MARGIN:
                    break
                if growth.trusted:
                    kind = run.kinds.get(module, LEAF)
                    found.append(
                        Predicted(module, side, kind, family, claim.high, peak, growth, limit)
                    )
        entry: dict[str, Any] = {"sizes_run": sizes, **claim.to_json()}
        entry["fits"] = {
            "modules": len(fits),
            "extrapolated": sum(g.trusted for g in fits.values()),
        }
        entry["top"] = [_fit_record(key, g, claim.high, limit) for key, g in ranked[:TOP_MODULES]]
        entry["plain_cast"] = plain_cast(claim, found)
        if found:
            entry["near_limit"] = [p.to_json() for p in found]
        record[family] = entry
        near += found
    if not record:
        return inputs, []
    return replace(inputs, sizes={**(inputs.sizes or {}), "growth": record}), near


def plain_cast(claim: Claim, found: list[Predicted]) -> dict[str, Any]:
    """What the fits predict for a plain cast to the limit's dtype, every module in it: the
    largest size of the claimed range that keeps every peak outside the margin, and the
    size (and module) from which one is predicted past the limit (None: none in the
    range)."""
    first = min(
        (p for p in found if p.overflow_at is not None),
        key=lambda p: p.overflow_at or 0,
        default=None,
    )
    return {
        "largest_predicted_safe": min([claim.high, *(p.safe_up_to for p in found)]),
        "overflow_at": first.overflow_at if first is not None else None,
        "module": first.module if first is not None else None,
    }


def _points(
    family: str, base: dict[str, int], run: SizedRun
) -> dict[tuple[str, str], dict[int, float]]:
    """Per ``(module, side)``, its largest peak at each size of ``family`` over the probes
    whose other sizes are the chosen probe's (a 13-frame probe at a larger side says nothing
    of frames alone)."""
    points: dict[tuple[str, str], dict[int, float]] = {}
    for probe, sizes in run.sizes.items():
        others = {k: v for k, v in sizes.items() if k != family}
        if family not in sizes or probe not in run.peaks:
            continue
        if any(base.get(k) != v for k, v in others.items()):
            continue
        size = sizes[family]
        for key, peak in run.peaks[probe].items():
            by_size = points.setdefault(key, {})
            by_size[size] = max(by_size.get(size, 0.0), peak)
    return points


def _fit_record(
    key: tuple[str, str], growth: Growth, at: int, limit: FiniteRange
) -> dict[str, Any]:
    """A module's fit as the certificate shows it: the exponent and residual, whether it was
    trusted to extrapolate, its largest peak run, its peak predicted at ``at`` and the margin
    from there to ``limit`` (below the activation margin, the module is kept fp32)."""
    predicted = growth.predict(at)
    return {
        "module": key[0],
        "side": key[1],
        "exponent": round(growth.exponent, 4),
        "residual": round(growth.residual, 4),
        "extrapolated": growth.trusted,
        "peak_run": round(growth.largest_peak, 4),
        "predicted_peak": round(predicted, 4),
        "margin": round(limit.finite_max / predicted, 3) if predicted else None,
    }
