"""How activation peaks grow with input size, and where they would stand at sizes not run.

Overflow can grow with size: a GroupNorm normalises a localized feature by the whole image's
spread, so its peak grows with the side; a long context sums more terms. Probes at the small
sizes a CPU affords then miss an fp16 overflow at the size users run. So calibration keeps,
besides its whole-sweep statistics, each module's peak per probe (:func:`probe_peaks`), and
fits each module's peaks against one size as a power law, ``peak = a * size ** b``, by least
squares in log-log space (:func:`fit_growth`). A fit is trusted to extrapolate
(:attr:`Growth.trusted`) only when the peaks grow (``b > 0``), follow the law closely (their
log residual at most :data:`MAX_RESIDUAL`) and the sizes span :data:`MIN_SPAN` or more: flat or
scattered peaks (a language model's, which vary with the tokens more than with the length)
say nothing about a size not run.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from precision_convert.conversion.analysis.activations import (
    CONTAINER,
    LEAF,
    UNRECORDED,
    _floats,
    _kind,
    _Reduced,
)
from precision_convert.conversion.analysis.hook_marks import row_wise

#: Fewest distinct sizes a fit takes: two points always fit a line.
MIN_SIZES = 3
#: Largest RMS deviation (natural log) of the peaks from their fitted power law that still
#: extrapolates: 0.15 is about 15% scatter. Peaks that follow the size (a planted GroupNorm
#: spike: under 0.01) sit far below it; peaks that vary with the content do not.
MAX_RESIDUAL = 0.15
#: Smallest ratio of the largest size fitted to the smallest: a fit over sizes closer than
#: this measures noise more than growth.
MIN_SPAN = 4.0


@dataclass(frozen=True)
class Growth:
    """One module's peaks against one size, and the power law fitted to them."""

    sizes: tuple[int, ...]
    peaks: tuple[float, ...]
    exponent: float  # b of peak = a * size ** b
    log_scale: float  # log a
    residual: float  # RMS deviation of log(peak) from the fit

    @property
    def trusted(self) -> bool:
        """Whether the fit may extrapolate: growing peaks, close to the law, over a wide
        enough range of sizes."""
        return (
            self.exponent > 0
            and self.residual <= MAX_RESIDUAL
            and self.sizes[-1] >= MIN_SPAN * self.sizes[0]
        )

    @property
    def largest_peak(self) -> float:
        """The largest peak measured at any size."""
        return max(self.peaks)

    def predict(self, size: int) -> float:
        """The peak at ``size``: the fit's where it is trusted, else the largest measured (a
        fit that does not hold is never extrapolated, up or down)."""
        if not self.trusted:
            return self.largest_peak
        return max(self.largest_peak, math.exp(self.log_scale) * size**self.exponent)

    def reaches(self, peak: float) -> float:
        """The size at which the peaks reach ``peak``: where the fitted law does, if trusted
        (at least 1); else the smallest size measured at or past it; else ``inf``."""
        if self.trusted:
            log_size = (math.log(peak) - self.log_scale) / self.exponent
            return max(1.0, math.exp(min(log_size, math.log(sys.float_info.max))))
        reached = [s for s, p in zip(self.sizes, self.peaks, strict=True) if p >= peak]
        return float(min(reached)) if reached else math.inf


def fit_growth(points: Mapping[int, float]) -> Growth | None:
    """The least-squares power law through ``points`` (size -> peak) in log-log space; None
    with fewer than :data:`MIN_SIZES` sizes holding a positive, finite peak."""
    kept = sorted((s, p) for s, p in points.items() if s > 0 and 0 < p < math.inf)
    if len(kept) < MIN_SIZES:
        return None
    xs = [math.log(s) for s, _ in kept]
    ys = [math.log(p) for _, p in kept]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    intercept = mean_y - slope * mean_x
    residual = math.sqrt(
        sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True)) / len(xs)
    )
    return Growth(tuple(s for s, _ in kept), tuple(p for _, p in kept), slope, intercept, residual)


@dataclass
class ProbePeaks:
    """Each module's peaks per probe, by ``(module, side)``: what
    :func:`~.activations.near_limit` judges (a container's main output, any other module's
    outputs, a weighted leaf's inputs too), kept for the probes named in ``keep`` as each ends
    (:meth:`mark`)."""

    seen: _Reduced
    keep: frozenset[str]
    model: nn.Module
    paused: Callable[[], bool] = lambda: False
    kinds: dict[str, str] = field(default_factory=dict)
    by_probe: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    _current: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def _note(self, key: tuple[str, str], peak: torch.Tensor) -> None:
        found = self._current.get(key)
        self._current[key] = peak if found is None else torch.maximum(found, peak)

    def _input(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not (self.paused() or UNRECORDED.get()):
                for tensor in _floats((args, kwargs)):
                    self._note((name, "input"), self.seen.peak(tensor))

        return row_wise(hook)

    def _output(self, name: str, kind: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.paused() or UNRECORDED.get():
                return
            for index, tensor in enumerate(_floats(output)):
                if index and kind == CONTAINER:
                    break  # a container hands on its main output; a mask may come beside it
                self._note((name, "output"), self.seen.peak(tensor))

        return row_wise(hook)

    @contextmanager
    def watching(self, probe: str) -> Iterator[None]:
        """Every module hooked while ``probe`` runs, if its peaks are kept (hooks removed)."""
        if probe not in self.keep:
            yield
            return
        handles = []
        try:
            for name, module in self.model.named_modules():
                kind = self.kinds[name]
                if kind == LEAF:
                    handles.append(
                        module.register_forward_pre_hook(self._input(name), with_kwargs=True)
                    )
                handles.append(
                    module.register_forward_hook(self._output(name, kind), with_kwargs=True)
                )
            yield
        finally:
            for handle in handles:
                handle.remove()

    def mark(self, probe: str, _outputs: object = None) -> bool:
        """End of ``probe``: keep its peaks (when asked to) and start the next probe's. Returns
        False, so that it serves as :func:`~.execute.run_probes`' ``stop``."""
        if probe in self.keep and self._current:
            names = list(self._current)
            values = torch.stack([self._current[n].float() for n in names]).tolist()
            self.by_probe[probe] = dict(zip(names, values, strict=True))
        self._current.clear()
        self.seen.clear()  # what the probe computed is freed now
        return False


@contextmanager
def probe_peaks(
    model: nn.Module,
    keep: frozenset[str],
    seen: _Reduced | None = None,
    paused: Callable[[], bool] | None = None,
) -> Iterator[ProbePeaks]:
    """Peaks per probe of ``model``'s modules for the probes named in ``keep``: the probe
    runner wraps each probe in :meth:`ProbePeaks.watching`, which hooks every module while a
    kept probe runs (the others run unhooked: a hook on the output head makes it compute every
    row's logits). ``seen``: the reductions of a :func:`~.activations.recording` running
    alongside (its hooks must be registered first), so that no tensor is reduced twice;
    ``paused``: when that recording recomputes a module in low precision."""
    peaks = ProbePeaks(seen if seen is not None else _Reduced(), keep, model)
    if paused is not None:
        peaks.paused = paused
    for name, module in model.named_modules():
        peaks.kinds.setdefault(name, _kind(module))
    yield peaks
