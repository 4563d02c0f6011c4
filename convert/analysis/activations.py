"""Activation analysis: what overflows fp16, and the smallest set of fp32 islands that fixes it.

Calibration runs the fp32 model once on the validation inputs with a hook on every module that
keeps a few running numbers (largest |input|, |output| and |x| of its main output, the share of
outputs fp16 would flush to zero): memory stays bounded, and the hooks go when the pass ends.

Every module is judged, not only those that own weights (:func:`near_limit`): a container's
main output is the stream it hands on (a decoder layer's residual sum), which no weighted
module ever outputs, and a module that owns weights is judged on what it receives too, since
the loader casts that to the module's own dtype.

The search (:func:`search_islands`) then bisects over modules in execution order for the next
module that must stay fp32 while a candidate fails against the fp32 outputs, as
onnxconverter-common's ``auto_convert_mixed_precision`` and Polygraphy's do for graphs.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from precision_convert.conversion.analysis.hook_marks import row_wise
from precision_convert.conversion.runtime.memory import large_allocations_mapped
from precision_convert.core.dtypes import WATCHED_RANGE, FiniteRange
from precision_convert.core.nested import map_tensors, tensors_in
from precision_convert.core.progress import report, stage

#: A module whose fp32 activations come within this factor of fp16's limit is kept fp32: other
#: inputs than the calibration ones may well push it over.
ACTIVATION_MARGIN = 2.0
#: bf16 keeps 8 significant bits, so one rounding costs at most 2**-9 relative error and a
#: healthy layer lands within a few times that. A module whose output, recomputed from bf16
#: weights and inputs, is off by more than 2**-4 has lost most of its mantissa.
BF16_LOSS_LIMIT = 2.0**-4
#: |x| at or beyond this is a masking sentinel (``finfo.min``, ``-inf`` filled into attention
#: masks and biases), not an activation: left out of input and main-output peaks.
MASK_SENTINEL = 1e30
#: Kinds of module, as judged by :func:`near_limit`.
LEAF = "leaf"  # owns weights and has no child modules: a Linear, a norm, an embedding
CONTAINER = "container"  # has child modules: a decoder layer, an attention block, the model
FUNCTION = "function"  # neither: an activation, a sinusoidal embedding, a rotary table
#: Above this share of fp32 parameters, fp16-safe costs most of its memory savings: recommend
#: bf16-safe instead.
FP32_SHARE_LIMIT = 0.25
#: Set while a probe runs whose activations another probe of the run holds (a free generation:
#: its teacher-forced twin feeds the same ids in one forward; hooked at every step it cost 3.3x
#: its plain run). Recording hooks (statistics, per-probe and factor peaks) let it pass.
UNRECORDED: ContextVar[bool] = ContextVar("precision_convert_unrecorded", default=False)


@contextmanager
def unrecorded() -> Iterator[None]:
    """Run the block past every recording hook (:data:`UNRECORDED`)."""
    token = UNRECORDED.set(True)
    try:
        yield
    finally:
        UNRECORDED.reset(token)


@dataclass(frozen=True)
class ActivationStats:
    """What one module saw during calibration."""

    module: str
    order: int  # position of the module's first call: execution order
    max_in: float
    max_out: float
    rms_out: float
    flushed_out: float  # share of non-zero output values that fp16 rounds to zero
    low_precision_error: float  # relative L2 error of the module recomputed in low precision
    kind: str = LEAF  # LEAF, CONTAINER or FUNCTION
    #: Largest |x| of the module's main output (its first floating tensor, masking sentinels
    #: left out): for a container the stream it hands on, whatever else it returns beside it.
    main_out: float = 0.0
    #: Other modules holding the same parameters (tied weights: a head sharing the embedding's
    #: matrix): whichever of them is the checkpoint's unit decides the dtype of all.
    shares_weights_with: tuple[str, ...] = ()

    @property
    def output_peak(self) -> float:
        """The output peak that is judged: a container's main output, any other module's all."""
        return self.main_out if self.kind == CONTAINER else self.max_out

    def headroom(self, limit: FiniteRange = WATCHED_RANGE) -> float:
        """``limit``'s finite maximum over the largest activation: below 1 it overflows."""
        peak = max(self.max_in, self.max_out)
        return limit.finite_max / peak if peak else float("inf")


class _Recorder:
    def __init__(self, simulate: torch.dtype | None) -> None:
        self.simulate = simulate
        self.error: dict[str, float] = {}
        self.paused = False  # set while a module is recomputed in low precision
        self.order: dict[str, int] = {}
        self.kind: dict[str, str] = {}
        self.shared: dict[str, tuple[str, ...]] = {}
        self.main_out: dict[str, torch.Tensor] = {}
        self.max_in: dict[str, torch.Tensor] = {}
        self.max_out: dict[str, torch.Tensor] = {}
        self.sum_sq: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.nonzero: dict[str, int] = {}
        self.flushed: dict[str, int] = {}
        self.seen = _Reduced()

    def pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.paused or UNRECORDED.get():
                return
            if name not in self.order:
                self.order[name] = len(self.order)
                self.kind[name] = _kind(module)
            peaks = [self.seen.peak(t) for t in _floats((args, kwargs))]
            if peaks:
                peak = torch.stack(peaks).amax()
                self.max_in[name] = _running_max(self.max_in.get(name), peak)

        return row_wise(hook)

    def post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.paused or UNRECORDED.get():
                return
            for index, tensor in enumerate(_floats(output)):
                seen = self.seen.summary(tensor)
                if index == 0:  # the main output
                    self.main_out[name] = _running_max(self.main_out.get(name), seen.peak)
                self.max_out[name] = _running_max(self.max_out.get(name), seen.top)
                self.sum_sq[name] = self.sum_sq.get(name, 0.0) + seen.sum_sq
                self.count[name] = self.count.get(name, 0) + tensor.numel()
                self.nonzero[name] = self.nonzero.get(name, 0) + seen.nonzero
                self.flushed[name] = self.flushed.get(name, 0) + seen.flushed
            if self.simulate is not None and _is_weighted_leaf(module):
                self.paused = True
                try:
                    error = _low_precision_error(module, args, kwargs, output, self.simulate)
                finally:
                    self.paused = False
                if error is not None:
                    self.error[name] = max(self.error.get(name, 0.0), error)
            if not name:  # the whole model returned: what it computed is freed now
                self.seen.clear()

        return row_wise(hook)

    def stats(self) -> dict[str, ActivationStats]:
        out: dict[str, ActivationStats] = {}
        for name, order in sorted(self.order.items(), key=lambda item: item[1]):
            count = self.count.get(name, 0)
            nonzero = self.nonzero.get(name, 0)
            out[name] = ActivationStats(
                module=name,
                order=order,
                max_in=float(self.max_in[name]) if name in self.max_in else 0.0,
                max_out=float(self.max_out[name]) if name in self.max_out else 0.0,
                rms_out=(self.sum_sq.get(name, 0.0) / count) ** 0.5 if count else 0.0,
                flushed_out=self.flushed.get(name, 0) / nonzero if nonzero else 0.0,
                low_precision_error=self.error.get(name, 0.0),
                kind=self.kind.get(name, LEAF),
                main_out=float(self.main_out[name]) if name in self.main_out else 0.0,
                shares_weights_with=self.shared.get(name, ()),
            )
        return out


def _floats(value: Any) -> Iterator[torch.Tensor]:
    return (t for t in tensors_in(value) if t.is_floating_point() and t.numel())


#: Elements a hook reduces at a time: its temporaries stay this small (one 4096-token probe's
#: logits over a 32k vocabulary are 131M elements; whole-tensor copies of them were 0.5 GB each).
CHUNK = 1 << 22


def _chunks(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensor.detach().reshape(-1).split(CHUNK)


def _top(values: torch.Tensor) -> torch.Tensor:
    """Largest |x| of ``values`` (NaN when there is one), in one pass and without a copy."""
    low, high = torch.aminmax(values)
    return torch.maximum(-low, high)


def _masked_peak(values: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Largest |x| of ``values`` below the masking sentinel, given their largest ``top``: the
    same unless a sentinel (or NaN) is among them."""
    if bool(top < MASK_SENTINEL):
        return top
    magnitudes = values.abs()
    return torch.where(magnitudes < MASK_SENTINEL, magnitudes, 0).amax()


def _peak(tensor: torch.Tensor) -> torch.Tensor:
    """Largest |x| of ``tensor`` that is an activation (masking sentinels left out)."""
    peaks = [_masked_peak(chunk, _top(chunk)) for chunk in _chunks(tensor)]
    return torch.stack(peaks).amax().float()


@dataclass(frozen=True)
class _Summary:
    """What the recorder keeps of one output tensor, reduced chunk by chunk in fp32."""

    peak: torch.Tensor  # largest |x| that is an activation (masking sentinels left out)
    top: torch.Tensor  # largest |x| (NaN when there is one)
    sum_sq: float
    nonzero: int
    flushed: int  # non-zero values fp16 rounds to zero

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Summary:
        peaks, tops, sum_sq, nonzero, flushed = [], [], 0.0, 0, 0
        for chunk in _chunks(tensor):
            values = chunk.float()
            top = _top(values)
            tops.append(top)
            peaks.append(_masked_peak(values, top))
            sum_sq += float(torch.dot(values, values))
            count = int(torch.count_nonzero(values))
            nonzero += count
            # Rounded to fp16 itself rather than compared with its flush threshold: one
            # half-width copy instead of an |x| copy and a mask.
            flushed += count - int(torch.count_nonzero(values.to(torch.float16)))
        return cls(torch.stack(peaks).amax(), torch.stack(tops).amax(), sum_sq, nonzero, flushed)


class _Reduced:
    """Reductions of the tensors one forward has already reduced, by identity.

    Most of what a module receives is what another module returned (and one attention mask
    reaches every layer); the model's output is its head's. Reducing each tensor once roughly
    halves what the hooks cost. A tensor changed in place since (its version moved on) or
    freed (its weak reference died, its id perhaps reused) is reduced again.
    """

    def __init__(self) -> None:
        self._summaries: dict[int, tuple[weakref.ref[torch.Tensor], int, _Summary]] = {}
        self._peaks: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    @staticmethod
    def _lookup(table: dict[int, tuple[Any, int, Any]], tensor: torch.Tensor) -> Any:
        found = table.get(id(tensor))
        if found is not None and found[0]() is tensor and found[1] == tensor._version:
            return found[2]
        return None

    def summary(self, tensor: torch.Tensor) -> _Summary:
        found = self._lookup(self._summaries, tensor)
        if found is None:
            found = _Summary.of(tensor)
            self._summaries[id(tensor)] = (weakref.ref(tensor), tensor._version, found)
        return found

    def peak(self, tensor: torch.Tensor) -> torch.Tensor:
        summary = self._lookup(self._summaries, tensor)
        if summary is not None:
            return summary.peak
        found = self._lookup(self._peaks, tensor)
        if found is None:
            found = _peak(tensor)
            self._peaks[id(tensor)] = (weakref.ref(tensor), tensor._version, found)
        return found

    def clear(self) -> None:
        self._summaries.clear()
        self._peaks.clear()


def _shared_weights(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Module -> the other modules holding one of its own parameters (tied weights)."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(name)
    out: dict[str, set[str]] = {}
    for names in holders.values():
        for name in names:
            others = set(names) - {name}
            if others:
                out.setdefault(name, set()).update(others)
    return {name: tuple(sorted(others)) for name, others in out.items()}


def _submodules(module: nn.Module) -> Iterator[nn.Module]:
    """``module``'s children, less a parametrized weight's container (weight norm): that holds
    the module's own weight, so a weight-normed conv is a leaf like any other."""
    return (
        child
        for name, child in module.named_children()
        if not (name == "parametrizations" and parametrize.is_parametrized(module))
    )


def _kind(module: nn.Module) -> str:
    if next(_submodules(module), None) is not None:
        return CONTAINER
    return LEAF if next(module.parameters(), None) is not None else FUNCTION


def _is_weighted_leaf(module: nn.Module) -> bool:
    return next(_submodules(module), None) is None and next(module.parameters(), None) is not None


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _low_precision_error(
    module: nn.Module, args: Any, kwargs: Any, output: Any, dtype: torch.dtype
) -> float | None:
    """Relative L2 error of ``module`` recomputed with weights and inputs rounded to ``dtype``."""
    reference = next(_floats(output), None)
    if reference is None:
        return None
    state = {k: _cast_floats(v, dtype) for k, v in module.state_dict(keep_vars=True).items()}
    low = torch.func.functional_call(
        module, state, _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
    )
    approx = next(_floats(low), None)
    if approx is None or approx.shape != reference.shape:
        return None
    scale = reference.float().norm()
    return float((approx.float() - reference.float()).norm() / scale) if scale else 0.0


def _running_max(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if current is None else torch.maximum(current, new)


@contextmanager
def recording(model: nn.Module, simulate: torch.dtype | None = None) -> Iterator[_Recorder]:
    """Hook every module of ``model`` for the duration of the block; hooks always removed.

    With ``simulate``, each leaf module that owns weights is also recomputed in that dtype to
    measure how much precision it loses on its own."""
    recorder = _Recorder(simulate)
    recorder.shared = _shared_weights(model)
    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(recorder.pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(recorder.post(name), with_kwargs=True))
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


class Carriage:
    """How a loaded low-precision candidate carried each module's tensors (dtypes only).

    ``pre[m]``/``post[m]``: event number of module ``m``'s first call and of its first return
    (one counter across all hooks: execution order, finer than module order). ``low[(m,
    side)]``: the first event at which ``m`` received (``"input"``, before the loader's casts)
    or handed on (``"output"``, its main output after the loader's casts) a floating tensor
    narrower than fp32 holding a value beyond ``threshold`` (or inf). Only large calls count:
    a module called several times (a shared activation) may carry small tensors in fp16.
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.events = 0
        self.pre: dict[str, int] = {}
        self.post: dict[str, int] = {}
        self.low: dict[tuple[str, str], int] = {}

    def _before(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.events += 1
            self.pre.setdefault(name, self.events)
            if any(self._large_and_narrow(t) for t in _floats((args, kwargs))):
                self.low.setdefault((name, "input"), self.events)

        return row_wise(hook)

    def _after(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self.events += 1
            self.post.setdefault(name, self.events)
            main = next(_floats(output), None)
            if main is not None and self._large_and_narrow(main):
                self.low.setdefault((name, "output"), self.events)

        return row_wise(hook)

    def _large_and_narrow(self, tensor: torch.Tensor) -> bool:
        info = torch.finfo(tensor.dtype)
        if info.bits >= 32:
            return False
        values = tensor.detach().abs()
        # NaN is not a value; finfo.max exactly is a mask filled with finfo.min, not a result
        # (fp16 arithmetic overflows to inf, and inf counts).
        values = torch.where(values.isnan() | (values == info.max), 0, values)
        return bool(values.amax() > self.threshold)


#: A candidate tensor narrower than fp32 counts as large beyond this share of the near-limit
#: threshold: its fp16 values only approximate the fp32 ones that came near the limit.
CARRIAGE_SLACK = 0.5


@contextmanager
def carriage(model: nn.Module, limit: FiniteRange) -> Iterator[Carriage]:
    """Record, for the duration of the block, in which dtype ``model`` carries each module's
    large inputs (as they arrive, before any boundary hook casts them) and main output (as it
    is handed on, after the boundary hooks), large meaning near ``limit``; hooks always
    removed."""
    seen = Carriage(limit.finite_max / ACTIVATION_MARGIN * CARRIAGE_SLACK)
    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(
                module.register_forward_pre_hook(seen._before(name), with_kwargs=True, prepend=True)
            )
            handles.append(module.register_forward_hook(seen._after(name), with_kwargs=True))
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def calibrate(
    model: nn.Module, run: Callable[[], Any], simulate: torch.dtype | None = None
) -> tuple[dict[str, ActivationStats], Any]:
    """Call ``run()`` (which runs ``model`` in fp32) once under recording hooks.

    Returns the per-module statistics in execution order and whatever ``run`` returned (the
    baseline outputs, so the caller does not need a second pass). In the command's processes
    large allocations are mapped afresh meanwhile (:func:`large_allocations_mapped`).
    """
    with large_allocations_mapped(), recording(model, simulate) as recorder, torch.no_grad():
        result = run()
    return recorder.stats(), result


def overflowing(
    stats: Mapping[str, ActivationStats], units: Sequence[str], limit: FiniteRange
) -> dict[str, str]:
    """Units (modules owning weights) whose output comes within the margin of ``limit``."""
    near = limit.finite_max / ACTIVATION_MARGIN
    found: dict[str, str] = {}
    for unit in units:
        seen = stats.get(unit)
        if seen is not None and seen.max_out > near:
            found[unit] = (
                f"activations reach {seen.max_out:.4g} ({limit.name} limit {limit.finite_max:g}, "
                f"margin {ACTIVATION_MARGIN:g}x)"
            )
    return found


@dataclass(frozen=True)
class NearLimit:
    """A tensor whose fp32 peak came within the margin of fp16's limit during calibration.

    ``side`` is ``"output"`` (any module: for a container its main output, the stream it hands
    on) or ``"input"`` (a module that owns weights: the loader casts what it receives to the
    module's own dtype, so an fp16 module would overflow on it).
    """

    module: str
    side: str
    peak: float
    kind: str
    order: int
    #: Where the peak is a prediction at a size not run (``at image side (px) 1024, predicted,
    #: not run``) rather than measured: empty when measured.
    where: str = ""

    @property
    def label(self) -> str:
        """``model.layers.0 (container) output``: the module, its kind and the side."""
        return f"{self.module or '<model>'} ({self.kind}) {self.side}" + (
            f" {self.where}" if self.where else ""
        )


def near_limit(
    stats: Mapping[str, ActivationStats], limit: FiniteRange, margin: float = ACTIVATION_MARGIN
) -> list[NearLimit]:
    """Every module output, containers included, and every weighted module's input whose fp32
    peak comes within ``margin`` of ``limit`` (or over it), in execution order.

    Containers are judged on their main output only: beside the stream they may return an
    attention bias that already holds a mask.
    """
    near = limit.finite_max / margin
    found: list[NearLimit] = []
    for seen in sorted(stats.values(), key=lambda s: s.order):
        if seen.output_peak > near:
            found.append(NearLimit(seen.module, "output", seen.output_peak, seen.kind, seen.order))
        if seen.kind == LEAF and seen.max_in > near:
            found.append(NearLimit(seen.module, "input", seen.max_in, seen.kind, seen.order))
    return found


def losing_precision(stats: Mapping[str, ActivationStats], units: Sequence[str]) -> dict[str, str]:
    """Units whose output, recomputed in low precision, lost most of its mantissa."""
    return {
        unit: (
            f"recomputed in low precision its output is off by "
            f"{stats[unit].low_precision_error:.2%} (limit {BF16_LOSS_LIMIT:.2%})"
        )
        for unit in units
        if unit in stats and stats[unit].low_precision_error > BF16_LOSS_LIMIT
    }


#: How the island search labels its progress.
SEARCH_STAGE = "island search"


@dataclass(frozen=True)
class SearchResult:
    """Islands the search added, in execution order, and what it cost."""

    added: tuple[str, ...]
    evaluations: int
    passed: bool


def search_islands(
    candidates: Sequence[str], passes: Callable[[frozenset[str]], bool]
) -> SearchResult:
    """Find a small set of ``candidates`` whose fp32 islands make ``passes`` true.

    ``candidates`` are modules in execution order; ``passes(extra)`` builds the plan with
    ``extra`` kept fp32 and compares it with the fp32 baseline. Each round bisects for the
    shortest prefix of the remaining candidates that passes: the last module of that prefix is
    one the model cannot do without (every shorter prefix fails), so it is kept and the next
    round searches the modules before it. With *k* modules needed out of *n* this costs about
    ``k * log2(n)`` evaluations instead of the ``n`` of trying each module.

    Progress is reported as "candidate k of at most m", ``m`` shrinking as rounds end.
    """
    evaluations = 0
    bound = 2 + _worst_case(len(candidates))

    def check(extra: frozenset[str]) -> bool:
        nonlocal evaluations
        report(SEARCH_STAGE, evaluations, bound, at_most=True)
        evaluations += 1
        with stage(f"{SEARCH_STAGE} candidate {evaluations}"):
            return passes(extra)

    def round_starts(left: int) -> None:
        nonlocal bound
        bound = evaluations + _worst_case(left)

    try:
        kept, passed = _bisect(list(candidates), check, round_starts)
    finally:
        report(SEARCH_STAGE, evaluations, evaluations)  # over, whatever the bound said
    order = {name: i for i, name in enumerate(candidates)}
    return SearchResult(tuple(sorted(kept, key=order.__getitem__)), evaluations, passed)


def _worst_case(left: int) -> int:
    """The most evaluations rounds over ``left`` candidates can take: each bisects its rest
    (ceil(log2 r) checks) and checks what it kept (one), and removes at least one candidate."""
    return sum(math.ceil(math.log2(r)) + 1 for r in range(1, left + 1))


def _bisect(
    remaining: list[str],
    check: Callable[[frozenset[str]], bool],
    round_starts: Callable[[int], None],
) -> tuple[frozenset[str], bool]:
    """:func:`search_islands`' rounds: the modules kept and whether the model can pass.
    ``round_starts(n)`` hears how many candidates each round begins with."""
    kept: frozenset[str] = frozenset()
    if check(kept):
        return kept, True
    if not remaining or not check(frozenset(remaining)):
        return kept, False
    while True:
        round_starts(len(remaining))
        low, high = 0, len(remaining)  # prefix of length `high` passes, of length `low` fails
        while high - low > 1:
            middle = (low + high) // 2
            if check(kept | frozenset(remaining[:middle])):
                high = middle
            else:
                low = middle
        kept |= {remaining[high - 1]}
        remaining = remaining[: high - 1]
        if not remaining or check(kept):
            return kept, True
