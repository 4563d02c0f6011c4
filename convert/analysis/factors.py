"""Bounds, not only samples: what a module could receive when the largest factors seen meet.

Calibration's peaks are samples: an overflow that needs a *context* (token A after token B)
hides from every probe that does not hold that context. Two kinds of module combine what
different tokens carry, and for both the fp32 sweep can bound what no probe reached:

* a gated MLP forms ``act(gate(x)) * up(x)`` channel by channel and hands it to ``down``: in
  any one context, channel ``c`` of the product is at most ``|act(gate)_c|max * |up_c|max``,
  the peaks of each factor wherever the sweep saw them. The bound on ``down``'s input is the
  largest such product over channels (per channel, not the product of global peaks: two
  factors peaking in different channels never meet).
* attention hands its output projection a convex combination of value vectors, head by head,
  so channel ``(h, d)`` of what ``o_proj`` receives is at most the peak of value channel ``d``
  of head ``h``'s key-value group, and ``o_proj``'s output channel ``i`` at most
  ``sum_j |W_ij| * |v_j|max + |b_i|``.

The bounds are conditional on the factor peaks the sweep observed (a token whose up factor is
larger than any probe showed is not covered), and the certificate says so. Each factor's peak
is kept per channel with the few ids that led up to it (:data:`WINDOW`), so a search for the
worst context can start from the tokens where the factors peaked. Hooks are removed when the
block ends, even on error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from precision_convert.conversion.analysis.activations import CHUNK, UNRECORDED, _peak

#: Ids kept per channel and factor: the token where the factor peaked and those before it.
WINDOW = 4
#: (gate, up, down, activation) child names of a gated MLP: Llama, Mistral, Qwen, Gemma
#: (``act_fn``), T5's gated feed-forward (``act``), and Phi-3's, whose one ``gate_up_proj``
#: hands on both factors (gate first, up second, along its last dimension).
GATED_NAMES = (
    ("gate_proj", "up_proj", "down_proj", "act_fn"),
    ("wi_0", "wi_1", "wo", "act"),
    ("gate_up_proj", "gate_up_proj", "down_proj", "activation_fn"),
)
#: (value, output) child names of an attention block.
VALUE_NAMES = (("v_proj", "o_proj"), ("v_proj", "out_proj"), ("v", "o"))
#: Sides of a bound (:attr:`Bound.kind`).
PRODUCT = "product"
CONVEX = "convex"


@dataclass(frozen=True)
class Bound:
    """A bound on one module's input or output, and the fp32 peak actually seen there."""

    module: str
    side: str  # "input" or "output"
    kind: str  # PRODUCT (a gated MLP's down input) or CONVEX (attention's output projection)
    observed: float
    bound: float
    conditional_on: str  # what the bound assumes, in words
    channel: int  # the channel reaching the bound
    #: Modules whose outputs form the bounded tensor: kept fp32 together with ``module``, they
    #: make the product (or sum) be formed in fp32.
    factors: tuple[str, ...] = ()
    #: Id windows where the channel's factors peaked: where a search for the context starts.
    seeds: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "side": self.side,
            "kind": self.kind,
            "observed_peak": self.observed,
            "bound": self.bound,
            "channel": self.channel,
            "conditional_on": self.conditional_on,
        }


class _ChannelPeaks:
    """Running per-channel max of |x| over everything but the last dim, finite values only,
    with the id window that led to each channel's peak (when the ids are known)."""

    def __init__(self) -> None:
        self.peak: torch.Tensor | None = None
        self.windows: torch.Tensor | None = None  # (channels, WINDOW), -1 where unknown

    def add(
        self,
        tensor: torch.Tensor,
        ids: torch.Tensor | None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        columns: slice = slice(None),
    ) -> None:
        """Take the peaks of ``transform(tensor[..., columns])``, a few rows at a time (a
        long probe's MLP activations are hundreds of MB; the copies stay :data:`CHUNK`
        elements)."""
        rows = tensor.detach().reshape(-1, tensor.shape[-1])
        step = max(1, CHUNK // rows.shape[1])
        tops, wheres = [], []
        for start in range(0, rows.shape[0], step):
            part = rows[start : start + step, columns]
            part = (transform(part) if transform is not None else part).float()
            top, where = _abs_max(part)
            if not bool(top.isfinite().all()):  # rare: a non-finite value counts as none
                top, where = _abs_max(torch.where(part.isfinite(), part, 0))
            tops.append(top)
            wheres.append(where + start)
        best = torch.stack(tops).argmax(0, keepdim=True)
        top = torch.stack(tops).gather(0, best)[0]
        where = torch.stack(wheres).gather(0, best)[0]
        if self.peak is None or self.peak.shape != top.shape:
            self.peak = torch.zeros_like(top)
            self.windows = torch.full((top.numel(), WINDOW), -1, dtype=torch.int32)
        better = top > self.peak
        self.peak = torch.maximum(self.peak, top)
        if ids is not None and ids.numel() == rows.shape[0] and bool(better.any()):
            assert self.windows is not None
            self.windows[better] = _windows(ids)[where[better]]


def _abs_max(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column, the largest |x| and its row, from the max and the min (no |x| copy)."""
    high, high_at = part.max(0)
    low, low_at = part.min(0)
    below = -low > high
    return torch.where(below, -low, high), torch.where(below, low_at, high_at)


def _windows(ids: torch.Tensor) -> torch.Tensor:
    """(rows * length, WINDOW): each position's id and the ones before it in its row."""
    rows = ids.reshape(-1, ids.shape[-1]).to(torch.int32)
    padded = torch.cat([torch.full((rows.shape[0], WINDOW - 1), -1, dtype=torch.int32), rows], 1)
    return padded.unfold(1, WINDOW, 1).reshape(-1, WINDOW)


@dataclass
class _Gated:
    mlp: str
    gate: str
    up: str
    down: str
    act: Callable[[torch.Tensor], torch.Tensor]
    gates: _ChannelPeaks = field(default_factory=_ChannelPeaks)
    ups: _ChannelPeaks = field(default_factory=_ChannelPeaks)
    observed: float = 0.0


@dataclass
class _Values:
    attention: str
    value: str
    out: str
    head_dim: int | None
    values: _ChannelPeaks = field(default_factory=_ChannelPeaks)
    observed_in: float = 0.0
    observed_out: float = 0.0


def _child(module: nn.Module, name: str) -> nn.Module | None:
    found = getattr(module, name, None)
    return found if isinstance(found, nn.Module) else None


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _sites(model: nn.Module) -> tuple[list[_Gated], list[_Values]]:
    """The gated MLPs and attention blocks of ``model``, found by their children's names."""
    gated: list[_Gated] = []
    values: list[_Values] = []
    for name, module in model.named_modules():
        for gate, up, down, act in GATED_NAMES:
            gate_m, up_m, down_m = (_child(module, n) for n in (gate, up, down))
            act_m = _child(module, act)
            if not (
                isinstance(gate_m, nn.Linear)
                and isinstance(up_m, nn.Linear)
                and isinstance(down_m, nn.Linear)
                and act_m is not None
            ):
                continue
            # A fused projection hands on (gate, up): twice what down receives.
            if gate == up and gate_m.out_features != 2 * down_m.in_features:
                continue
            gated.append(_Gated(name, _join(name, gate), _join(name, up), _join(name, down), act_m))
            break
        for value, out in VALUE_NAMES:
            v, o = _child(module, value), _child(module, out)
            if isinstance(v, nn.Linear) and isinstance(o, nn.Linear):
                head_dim = getattr(module, "head_dim", None)
                values.append(
                    _Values(
                        name,
                        _join(name, value),
                        _join(name, out),
                        head_dim if isinstance(head_dim, int) else None,
                    )
                )
                break
    return gated, values


class FactorRecorder:
    """Per-channel factor peaks of every gated MLP and attention block, across the runs made
    under :func:`recording_factors`; :meth:`bounds` turns them into :class:`Bound` rows."""

    def __init__(self, model: nn.Module) -> None:
        self.gated, self.values = _sites(model)
        self.ids: torch.Tensor | None = None  # the token ids of the forward running now

    def hooks(self, model: nn.Module) -> Iterator[Any]:
        """Register the hooks; yields each handle."""
        modules = dict(model.named_modules())

        def take_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if UNRECORDED.get():
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
                self.ids = ids.detach().cpu()
            else:
                self.ids = None

        yield model.register_forward_pre_hook(take_ids, with_kwargs=True)
        for site in self.gated:
            yield modules[site.gate].register_forward_hook(self._gate(site))
            if site.up != site.gate:
                yield modules[site.up].register_forward_hook(self._factor(site.ups))
            yield modules[site.down].register_forward_pre_hook(self._down(site))
        for values in self.values:
            yield modules[values.value].register_forward_hook(self._factor(values.values))
            yield modules[values.out].register_forward_hook(self._out(values))

    def _ids_for(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The running forward's ids when ``tensor`` has one row per id."""
        ids = self.ids
        return ids if ids is not None and ids.numel() * tensor.shape[-1] == tensor.numel() else None

    def _gate(self, site: _Gated) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if UNRECORDED.get():
                return
            ids = self._ids_for(output)
            if site.up == site.gate:  # fused: the gate's half, then the up factor's
                half = output.shape[-1] // 2
                site.ups.add(output, ids, columns=slice(half, None))
                site.gates.add(output, ids, site.act, slice(None, half))
            else:
                site.gates.add(output, ids, site.act)

        return hook

    def _factor(self, peaks: _ChannelPeaks) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if not UNRECORDED.get():
                peaks.add(output, self._ids_for(output))

        return hook

    def _down(self, site: _Gated) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], torch.Tensor) and not UNRECORDED.get():
                site.observed = max(site.observed, _observed(args[0]))

        return hook

    def _out(self, values: _Values) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if UNRECORDED.get():
                return
            if args and isinstance(args[0], torch.Tensor):
                values.observed_in = max(values.observed_in, _observed(args[0]))
            values.observed_out = max(values.observed_out, _observed(output))

        return hook

    def bounds(self, model: nn.Module) -> list[Bound]:
        """Every site's bound in ``model`` (the one recorded), in model order (a site no probe
        ran is left out)."""
        modules = dict(model.named_modules())
        out: list[Bound] = []
        for site in self.gated:
            if site.gates.peak is None or site.ups.peak is None:
                continue
            if site.gates.peak.shape != site.ups.peak.shape:
                continue
            product = site.gates.peak * site.ups.peak
            channel = int(product.argmax())
            out.append(
                Bound(
                    site.down,
                    "input",
                    PRODUCT,
                    site.observed,
                    float(product[channel]),
                    f"each channel's peak of act({_last(site.gate)}) times its peak of "
                    f"{_last(site.up)}, as calibration saw them, meeting in one context",
                    channel,
                    (site.up,),
                    _seeds(site.ups, site.gates, channel),
                )
            )
        for values in self.values:
            projection = modules[values.out]
            assert isinstance(projection, nn.Linear)  # as :func:`_sites` found it
            out += _convex(values, projection)
        return out


def _convex(values: _Values, projection: nn.Linear) -> list[Bound]:
    """The output projection's input and output bounds of one attention block."""
    peaks = values.values.peak
    weight = projection.weight.detach().float()
    if peaks is None or weight.shape[1] % peaks.numel():
        return []
    groups = weight.shape[1] // peaks.numel()
    head_dim = values.head_dim or (peaks.numel() if groups == 1 else 0)
    if not head_dim:
        return []
    # o_proj input channel j = (head, d) reads value channel (head // groups, d).
    j = torch.arange(weight.shape[1])
    reads = peaks[(j // head_dim // groups) * head_dim + j % head_dim]
    bias = projection.bias
    sums = weight.abs() @ reads + (bias.detach().float().abs() if bias is not None else 0)
    row = int(sums.argmax())
    column = int((weight[row].abs() * reads).argmax())
    value_channel = int((column // head_dim // groups) * head_dim + column % head_dim)
    note = (
        f"each head's output is a convex combination of its value vectors: the per-channel "
        f"peaks of {_last(values.value)} calibration saw"
    )
    seeds = _seeds(values.values, None, value_channel)
    return [
        Bound(
            values.out,
            "input",
            CONVEX,
            values.observed_in,
            float(peaks.max()),
            note,
            int(peaks.argmax()),
            (values.value,),
            seeds,
        ),
        Bound(
            values.out,
            "output",
            CONVEX,
            values.observed_out,
            float(sums[row]),
            f"{note}, through |{_last(values.out)}.weight|",
            row,
            (values.value,),
            seeds,
        ),
    ]


def _seeds(
    first: _ChannelPeaks, second: _ChannelPeaks | None, channel: int
) -> tuple[tuple[int, ...], ...]:
    """Id windows to start a context search from: where ``first``'s channel peaked followed
    by where ``second``'s did (the order a causal model needs to combine them), the reverse,
    and each alone."""
    found = []
    for peaks in (first, second):
        if peaks is not None and peaks.windows is not None:
            window = tuple(int(i) for i in peaks.windows[channel] if i >= 0)
            if window:
                found.append(window)
    seeds = list(found)
    if len(found) == 2:
        seeds = [found[0] + found[1], found[1] + found[0], *found]
    return tuple(dict.fromkeys(seeds))


def _observed(tensor: torch.Tensor) -> float:
    """The largest |x| of an activation, reduced chunk by chunk as calibration's own are (a
    non-finite value counts as none: such a probe is not judged)."""
    peak = float(_peak(tensor)) if tensor.numel() else 0.0
    return peak if math.isfinite(peak) else 0.0


def _last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


@contextmanager
def recording_factors(model: nn.Module, recorder: FactorRecorder) -> Iterator[FactorRecorder]:
    """Record ``recorder``'s factor peaks for ``model`` during the block; hooks always
    removed. One recorder may record several blocks (a sweep run in parts)."""
    handles = []
    try:
        for handle in recorder.hooks(model):
            handles.append(handle)
        yield recorder
    finally:
        for handle in handles:
            handle.remove()
