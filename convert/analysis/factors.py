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
  ``sum_j |W_ij| * |v_j|max + |b_i|``. Where the value projection sits and whether it is
  fused with the query and key projections is data (:data:`VALUE_NAMES`).

The bounds are conditional on the factor peaks the sweep observed (a token whose up factor is
larger than any probe showed is not covered), and the certificate says so. Each factor's peak
is kept per channel with the few ids that led up to it (:data:`WINDOW`), so a search for the
worst context can start from the tokens where the factors peaked. Hooks are removed when the
block ends, even on error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
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


@dataclass(frozen=True)
class AttentionNames:
    """Where an attention block keeps its value and output projections (paths below the
    block). A ``fused`` value projection hands on query, key and value in turn along its last
    dimension: the values are its last columns, as many as the output projection reads.
    ``blocks``, when given, are the only block classes the names are known to mean that in
    (elsewhere they may not: Longformer's ``self.value`` has a twin for global tokens,
    GPT-BigCode's fused ``c_attn`` interleaves its heads)."""

    value: str
    out: str
    fused: bool = False
    blocks: tuple[str, ...] = ()


#: The attention blocks bounded: Llama-likes and T5 (siblings ``v_proj``/``o_proj``, ``v``/``o``),
#: CLIP (``out_proj``), BERT and its kin (``self.value`` feeding ``output.dense``) and GPT-2 (a
#: fused ``c_attn``, transformers' ``Conv1D`` layers).
VALUE_NAMES = (
    AttentionNames("v_proj", "o_proj"),
    AttentionNames("v_proj", "out_proj"),
    AttentionNames("v", "o"),
    AttentionNames(
        "self.value",
        "output.dense",
        blocks=(
            "BertAttention",
            "RobertaAttention",
            "XLMRobertaAttention",
            "ElectraAttention",
            "CamembertAttention",
        ),
    ),
    AttentionNames("c_attn", "c_proj", fused=True, blocks=("GPT2Attention",)),
)
#: A child of the attention block that normalises the values after their projection (Gemma 3n
#: and Gemma 4 scale each head's values to unit RMS): where present, its output, not the
#: projection's, is what attention combines.
VALUE_NORM = "v_norm"
#: Children that normalise what a bounded projection receives: attention's output (BitNet's
#: and Dory's ``attn_sub_norm``, Kosmos-2's ``inner_attn_ln``, DiffLlama's ``groupnorm`` after
#: its difference of two softmaxes) or a gated MLP's product (their ``ffn_sub_norm``). There
#: the projection receives neither a convex combination of values nor the product itself, so
#: the block is not bounded.
SUB_NORMS = ("attn_sub_norm", "inner_attn_ln", "groupnorm", "ffn_sub_norm")
#: Sides of a bound (:attr:`Bound.kind`).
PRODUCT = "product"
CONVEX = "convex"
#: How far past its bound a probe's own peak may sit from rounding alone (the bound and the
#: peak are computed in fp32 by different reductions).
ROUNDING = 1e-4


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

    @property
    def holds(self) -> bool:
        """Whether the probes stayed within the bound (beyond rounding), as a bound must."""
        return self.observed <= self.bound * (1 + ROUNDING)

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
    recorded: str  # the module whose output attention combines: the projection or its norm
    columns: slice  # the recorded output's columns that are values
    values: _ChannelPeaks = field(default_factory=_ChannelPeaks)
    observed_in: float = 0.0
    observed_out: float = 0.0


def _child(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:  # no such attribute, or not a module
        return None


def projection_weight(module: nn.Module | None) -> torch.Tensor | None:
    """A projection's weight as (out, in): ``nn.Linear``'s, or transformers' ``Conv1D``'s
    (GPT-2's, stored (in, out)); None for any other module."""
    if isinstance(module, nn.Linear):
        return module.weight
    from transformers.pytorch_utils import Conv1D

    return module.weight.T if isinstance(module, Conv1D) else None


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _sites(model: nn.Module) -> tuple[list[_Gated], list[_Values]]:
    """The gated MLPs and attention blocks of ``model``, found by their children's names."""
    gated: list[_Gated] = []
    values: list[_Values] = []
    for name, module in model.named_modules():
        if any(_child(module, norm) is not None for norm in SUB_NORMS):
            continue
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
        for names in VALUE_NAMES:
            if names.blocks and type(module).__name__ not in names.blocks:
                continue
            v_weight = projection_weight(_child(module, names.value))
            o_weight = projection_weight(_child(module, names.out))
            if v_weight is None or o_weight is None:
                continue
            # A fused projection's values are as many columns as the output projection reads
            # (an unfused one may hand on fewer: grouped-query heads share them).
            width = o_weight.shape[1]
            if names.fused and v_weight.shape[0] % width:
                continue
            head_dim = getattr(module, "head_dim", None)
            normed = not names.fused and _child(module, VALUE_NORM) is not None
            values.append(
                _Values(
                    name,
                    _join(name, names.value),
                    _join(name, names.out),
                    head_dim if isinstance(head_dim, int) else None,
                    _join(name, VALUE_NORM if normed else names.value),
                    slice(-width, None) if names.fused else slice(None),
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
            yield modules[values.recorded].register_forward_hook(
                self._factor(values.values, values.columns)
            )
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

    def _factor(self, peaks: _ChannelPeaks, columns: slice = slice(None)) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if not UNRECORDED.get():
                peaks.add(output, self._ids_for(output), columns=columns)

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
            out += _convex(values, modules[values.out])
        return out


def holding(bounds: Sequence[Bound]) -> tuple[list[Bound], list[Bound]]:
    """``bounds`` split into those the probes stayed within and those a probe passed. A probe
    past its own bound shows the block is not the layout the bound assumes (names another
    architecture shares, a step between the factors and the module the bound does not know),
    so such a bound says nothing: it is reported, and neither makes islands nor is searched."""
    return [b for b in bounds if b.holds], [b for b in bounds if not b.holds]


def _convex(values: _Values, projection: nn.Module) -> list[Bound]:
    """The output projection's input and output bounds of one attention block."""
    peaks = values.values.peak
    found = projection_weight(projection)
    assert found is not None  # as :func:`_sites` found it
    weight = found.detach().float()
    if peaks is None or weight.shape[1] % peaks.numel():
        return []
    groups = weight.shape[1] // peaks.numel()
    head_dim = values.head_dim or (peaks.numel() if groups == 1 else 0)
    if not head_dim:
        return []
    # o_proj input channel j = (head, d) reads value channel (head // groups, d).
    j = torch.arange(weight.shape[1])
    reads = peaks[(j // head_dim // groups) * head_dim + j % head_dim]
    bias = getattr(projection, "bias", None)
    sums = weight.abs() @ reads + (bias.detach().float().abs() if bias is not None else 0)
    row = int(sums.argmax())
    column = int((weight[row].abs() * reads).argmax())
    value_channel = int((column // head_dim // groups) * head_dim + column % head_dim)
    note = (
        f"each head's output is a convex combination of its value vectors: the per-channel "
        f"peaks of {_last(values.recorded)} calibration saw"
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
