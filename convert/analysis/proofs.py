"""Proofs from the weights alone: bounds on what a module can receive and hand on, for any input.

Calibration's peaks are samples and the factor bounds (:mod:`.factors`) are conditional on the
peaks the probes saw. Some modules need neither: what they read is normalised, and a
normalised vector is bounded whatever the input.

* An RMSNorm hands on ``u * g`` (plus ``b`` for a LayerNorm) with ``||u||_2 <= sqrt(d)``
  (``eps`` only shrinks it), so channel ``c`` of a projection ``W`` reading it is at most
  ``sqrt(d) * ||W_c * g||_2 + |W_c . b| + |bias_c|`` (Cauchy-Schwarz; every partial sum of the
  dot product too, so the bound holds in any order of accumulation).
* Attention hands its output projection convex combinations of value vectors, head by head:
  channel ``(h, i)`` of ``o_proj``'s input is at most value channel ``i`` of head ``h``'s
  key-value group, and ``o_proj``'s output channel ``r`` at most ``sum_j |W_rj| * v_j``.
  The scores are bounded too (``scaling * ||q_h|| * ||k_h||``, rotary keeps the norms).
* A gated MLP hands ``act(gate) * up`` to its down projection: per channel at most
  ``act_bound(gate_c) * up_c``, where ReLU, SiLU and GELU are at most their input's bound (or
  the small negative dip of SiLU and GELU, when that is larger).
* The output head reads the final norm; the embedding hands on rows of its table.

Which modules read which norm is data (:data:`LAYOUTS`, by ``config.model_type``): decoder
blocks of the Llama, Mistral, Qwen2 and Gemma families. Every other module (the norms, whose
input is the residual stream; any other architecture) is *sampled only*: its range is what the
probes measured. :func:`module_status` sorts the modules of a plan into proven, islanded and
sampled only, with the share of parameters in each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from precision_convert.conversion.analysis.factors import CONVEX, PRODUCT, Bound
from precision_convert.core.folding import fold

#: A module's statuses (:func:`module_status`), in the certificate's order.
PROVEN = "proven"
ISLANDED = "islanded"
SAMPLED = "sampled_only"
STATUSES = (PROVEN, ISLANDED, SAMPLED)
#: Kinds of sound bound beside :data:`~.factors.PRODUCT` and :data:`~.factors.CONVEX`.
NORMED = "normed"  # a projection reading a norm's output
TABLE = "table"  # an embedding: its output is rows of its weight
#: Per activation, the largest |act(x)| for x below zero: ReLU's is 0, SiLU's dip is -0.2785
#: (at x = -1.28), GELU's -0.1700 (exact and tanh forms), each rounded up.
ACTIVATION_DIPS = {
    "relu": 0.0,
    "silu": 0.2785,
    "swish": 0.2785,
    "gelu": 0.1701,
    "gelu_pytorch_tanh": 0.1701,
    "gelu_new": 0.1701,
}
#: Vocabulary rows normalised at a time when finding the tokens that drive a channel.
ROWS = 4096


@dataclass(frozen=True)
class DecoderLayout:
    """Which norm each projection of a decoder block reads (paths below the block), and how
    the norms scale: Gemma's RMSNorm multiplies by ``1 + weight``."""

    model_types: tuple[str, ...]
    attention: str = "self_attn"
    mlp: str = "mlp"
    attention_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    gain_offset: float = 0.0
    #: Below the base model: the block list and the final norm the head reads.
    layers: str = "layers"
    final_norm: str = "norm"
    embedding: str = "embed_tokens"


LAYOUTS = (
    DecoderLayout(("llama", "mistral", "qwen2")),
    DecoderLayout(("gemma",), gain_offset=1.0),
    # Gemma 2 normalises the MLP's input with its own norm, after the residual add.
    DecoderLayout(("gemma2",), mlp_norm="pre_feedforward_layernorm", gain_offset=1.0),
)


@dataclass(frozen=True)
class SoundBound:
    """What one module can receive (``input``) and hand on (``output``), from its weights
    alone: the largest |x| over channels (None: that side is not bounded)."""

    module: str
    kind: str  # NORMED, CONVEX, PRODUCT or TABLE
    input: float | None
    output: float | None
    weight: float  # the largest |w|: the weight itself must fit the format
    #: Per channel, the bound the search starts from (down's input; o_proj's input; else
    #: the output), and the factor projections whose rows drive it.
    channels: torch.Tensor
    drivers: tuple[str, ...] = ()

    @property
    def largest(self) -> float:
        """The largest |x| the module's weight, input or output may hold."""
        return max(self.weight, self.input or 0.0, self.output or 0.0)

    def proven(self, limit: float, margin: float) -> bool:
        """Whether everything the module receives and hands on is below ``limit`` by
        ``margin``."""
        return self.largest * margin < limit

    def as_target(self, observed: float, seeds: tuple[tuple[int, ...], ...]) -> Bound:
        """This bound's largest channel as a search target (:class:`~.factors.Bound`)."""
        side = "input" if self.kind in (PRODUCT, CONVEX) else "output"
        value = self.input if side == "input" else self.output
        return Bound(
            self.module,
            side,
            self.kind,
            observed,
            float(value if value is not None else math.inf),
            "nothing: the weights alone (a sound bound)",
            int(self.channels.argmax()),
            seeds=seeds,
        )


def layout_of(model: nn.Module) -> DecoderLayout | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return next((lay for lay in LAYOUTS if model_type in lay.model_types), None)


def _activation_dip(model: nn.Module) -> float | None:
    config = getattr(model, "config", None)
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    return ACTIVATION_DIPS.get(name) if isinstance(name, str) else None


@dataclass(frozen=True)
class _Norm:
    gain: torch.Tensor
    shift: torch.Tensor | None  # a LayerNorm's bias

    @property
    def bound(self) -> float:
        """The largest |x| the norm hands on."""
        shift = float(self.shift.abs().max()) if self.shift is not None else 0.0
        return math.sqrt(self.gain.numel()) * float(self.gain.abs().max()) + shift

    def reading(self, linear: nn.Linear) -> torch.Tensor:
        """Per output channel, the bound of ``linear`` reading this norm's output."""
        weight = linear.weight.detach().float()
        out = math.sqrt(self.gain.numel()) * (weight * self.gain).norm(dim=1)
        if self.shift is not None:
            out = out + (weight @ self.shift).abs()
        if linear.bias is not None:
            out = out + linear.bias.detach().float().abs()
        return out


def _norm(module: nn.Module | None, offset: float) -> _Norm | None:
    """A norm's gain and shift, when ``module`` is an RMSNorm or a LayerNorm."""
    if module is None:
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if isinstance(module, nn.LayerNorm):
        bias = module.bias.detach().float() if module.bias is not None else None
        return _Norm(weight.detach().float(), bias)
    if type(module).__name__.endswith("RMSNorm"):
        return _Norm(weight.detach().float() + offset, None)
    return None


def _child(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _linear(module: nn.Module, path: str) -> nn.Linear | None:
    found = _child(module, path)
    return found if isinstance(found, nn.Linear) else None


def _abs_max(t: torch.Tensor) -> float:
    return float(t.detach().float().abs().max()) if t.numel() else 0.0


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _base(model: nn.Module, layout: DecoderLayout) -> tuple[str, nn.Module] | None:
    """The base model (the one holding the block list, final norm and embedding)."""
    for name, module in model.named_modules():
        if isinstance(_child(module, layout.layers), nn.ModuleList) and all(
            _child(module, p) is not None for p in (layout.final_norm, layout.embedding)
        ):
            return name, module
    return None


def _normed(name: str, linear: nn.Linear, norm: _Norm) -> SoundBound:
    out = norm.reading(linear)
    return SoundBound(name, NORMED, norm.bound, float(out.max()), _abs_max(linear.weight), out)


def _attention(name: str, attention: nn.Module, norm: _Norm, config: Any) -> list[SoundBound]:
    """q, k and v read the norm; o reads convex combinations of values, when the scores are
    bounded (their bound stays out of every record: it only decides o's)."""
    projections = [_linear(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    q, k, v, o = projections
    if q is None or k is None or v is None or o is None:
        return []
    found = [
        _normed(_join(name, p), lin, norm)
        for p, lin in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), strict=True)
    ]
    head_dim = getattr(attention, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    if (
        not isinstance(head_dim, int)
        or not isinstance(heads, int)
        or o.in_features != heads * head_dim
    ):
        return found
    if v.out_features % head_dim or heads % (v.out_features // head_dim):
        return found
    values = found[2].channels
    groups = heads // (v.out_features // head_dim)
    j = torch.arange(o.in_features)
    reads = values[(j // head_dim // groups) * head_dim + j % head_dim]
    out = o.weight.detach().float().abs() @ reads
    if o.bias is not None:
        out = out + o.bias.detach().float().abs()
    scaling = float(getattr(attention, "scaling", head_dim**-0.5))
    q_heads = found[0].channels.reshape(-1, head_dim).norm(dim=1)
    k_heads = found[1].channels.reshape(-1, head_dim).norm(dim=1)
    scores = scaling * float(q_heads.max()) * float(k_heads.max())
    # A score past the format's range makes o's input NaN: o is proven only with the scores.
    o_input = max(float(reads.max()), scores)
    return [
        *found,
        SoundBound(
            _join(name, "o_proj"),
            CONVEX,
            o_input,
            float(out.max()),
            _abs_max(o.weight),
            reads,
            (_join(name, "v_proj"),),
        ),
    ]


def _mlp(name: str, mlp: nn.Module, norm: _Norm, dip: float | None) -> list[SoundBound]:
    gate, up, down = (_linear(mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
    if gate is None or up is None or down is None:
        return []
    found = [
        _normed(_join(name, "gate_proj"), gate, norm),
        _normed(_join(name, "up_proj"), up, norm),
    ]
    if dip is None or down.in_features != gate.out_features:
        return found
    product = found[0].channels.clamp(min=dip) * found[1].channels
    out = down.weight.detach().float().abs() @ product
    if down.bias is not None:
        out = out + down.bias.detach().float().abs()
    drivers = (_join(name, "gate_proj"), _join(name, "up_proj"))
    return [
        *found,
        SoundBound(
            _join(name, "down_proj"),
            PRODUCT,
            float(product.max()),
            float(out.max()),
            _abs_max(down.weight),
            product,
            drivers,
        ),
    ]


def sound_bounds(model: nn.Module) -> list[SoundBound]:
    """The weights-only bound of every module :data:`LAYOUTS` knows in ``model``, in model
    order; [] for an architecture it does not know."""
    layout = layout_of(model)
    found = _base(model, layout) if layout is not None else None
    if layout is None or found is None:
        return []
    base_name, base = found
    config = getattr(model, "config", None)
    dip = _activation_dip(model)
    out: list[SoundBound] = []
    embedding = _child(base, layout.embedding)
    if type(embedding) is nn.Embedding:  # a subclass may scale what it hands on
        table = embedding.weight.detach()
        out.append(
            SoundBound(
                _join(base_name, layout.embedding),
                TABLE,
                None,
                _abs_max(table),
                _abs_max(table),
                table.abs().amax(0).float(),
            )
        )
    layers = _child(base, layout.layers)
    assert isinstance(layers, nn.ModuleList)
    for index, block in enumerate(layers):
        prefix = _join(base_name, f"{layout.layers}.{index}")
        attention_norm = _norm(_child(block, layout.attention_norm), layout.gain_offset)
        mlp_norm = _norm(_child(block, layout.mlp_norm), layout.gain_offset)
        attention, mlp = _child(block, layout.attention), _child(block, layout.mlp)
        if attention_norm is not None and attention is not None:
            out += _attention(_join(prefix, layout.attention), attention, attention_norm, config)
        if mlp_norm is not None and mlp is not None:
            out += _mlp(_join(prefix, layout.mlp), mlp, mlp_norm, dip)
    head_of = getattr(model, "get_output_embeddings", None)
    head = head_of() if callable(head_of) else None
    final = _norm(_child(base, layout.final_norm), layout.gain_offset)
    if isinstance(head, nn.Linear) and final is not None and head.in_features == final.gain.numel():
        name = next(n for n, m in model.named_modules() if m is head)
        out.append(_normed(name, head, final))
    return out


def driving_tokens(model: nn.Module, bounds: Sequence[SoundBound], most: int) -> list[int]:
    """Up to ``most`` token ids that drive the channels with the largest sound bounds most
    directly: for each gated MLP (largest product bound first), then each attention block
    (largest value bound first), the id whose embedding, through the block's norm, drives its
    gate, up or value row highest. Where a gradient is zero (ReLU at zero, a product of two
    zero factors) these are where a search for the worst context can start."""
    layout = layout_of(model)
    found = _base(model, layout) if layout is not None else None
    embeddings_of = getattr(model, "get_input_embeddings", None)
    embeddings = embeddings_of() if callable(embeddings_of) else None
    if layout is None or found is None or not isinstance(embeddings, nn.Embedding):
        return []
    modules = dict(model.named_modules())
    by_name = {b.module: b for b in bounds}
    rows: list[tuple[nn.Module, torch.Tensor, bool]] = []  # (norm, row, through act)
    products = sorted((b for b in bounds if b.kind == PRODUCT), key=lambda b: -(b.input or 0))
    convex = sorted((b for b in bounds if b.kind == CONVEX), key=lambda b: -(b.input or 0))
    for bound in [*products, *convex]:
        block = bound.module.rsplit(".", 2)[0]
        norm = modules.get(
            _join(block, layout.mlp_norm if bound.kind == PRODUCT else layout.attention_norm)
        )
        for k, driver in enumerate(bound.drivers):
            weight = modules[driver].weight.detach().float()
            # o's largest input channel is v's largest output channel: start from that.
            of = by_name[driver] if bound.kind == CONVEX and driver in by_name else bound
            channel = int(of.channels.argmax())
            if norm is not None:
                rows.append((norm, weight[channel], bound.kind == PRODUCT and k == 0))
    table = embeddings.weight.detach()
    tokens: list[int] = []
    with torch.no_grad():
        for norm, row, gated in rows:
            drive = torch.cat(
                [
                    norm(table[i : i + ROWS].float()[None])[0].float() @ row
                    for i in range(0, table.shape[0], ROWS)
                ]
            )
            token = int(drive.argmax()) if gated else int(drive.abs().argmax())
            if token not in tokens:
                tokens.append(token)
            if len(tokens) >= most:
                break
    return tokens


def parameter_owners(model: nn.Module) -> dict[str, tuple[tuple[str, int], ...]]:
    """Every module that owns a parameter, with its parameters (by the name each is first
    reached under, so a tied one is one key) and their sizes: what :func:`module_status`
    counts, kept after the model is freed."""
    first: dict[int, str] = {}
    out: dict[str, tuple[tuple[str, int], ...]] = {}
    for name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if params:
            keys = tuple(
                (first.setdefault(id(p), _join(name, leaf)), p.numel()) for leaf, p in params
            )
            out[name] = keys
    return out


def module_status(
    owners: Mapping[str, Sequence[tuple[str, int]]],
    bounds: Iterable[SoundBound],
    fp32_modules: Iterable[str],
    limit: float,
    margin: float,
) -> dict[str, Any]:
    """Every module of ``owners`` (:func:`parameter_owners`), as proven (its sound bound is
    below ``limit`` by ``margin``), islanded (kept in fp32: one of ``fp32_modules`` or inside
    one) or sampled only; per status the modules (folded by layer role) and the share of
    parameters. A tied parameter counts once, under the weakest status of its owners
    (islanded, then sampled only, then proven)."""
    islands = tuple(fp32_modules)
    by_name = {b.module: b for b in bounds}
    rank = {ISLANDED: 0, SAMPLED: 1, PROVEN: 2}
    status: dict[str, str] = {}
    owned: dict[str, tuple[int, str]] = {}  # parameter -> (elements, status)
    for name, params in owners.items():
        if any(name == i or name.startswith(f"{i}.") for i in islands):
            found = ISLANDED
        elif name in by_name and by_name[name].proven(limit, margin):
            found = PROVEN
        else:
            found = SAMPLED
        status[name] = found
        for key, elements in params:
            had = owned.get(key)
            if had is None or rank[found] < rank[had[1]]:
                owned[key] = (elements, found)
    total = sum(n for n, _ in owned.values()) or 1
    out: dict[str, Any] = {"limit": limit, "margin": margin}
    for kind in STATUSES:
        names = [n for n, s in status.items() if s == kind]
        elements = sum(n for n, s in owned.values() if s == kind)
        out[kind] = {
            "modules": [role.label for role in fold(names)],
            "count": len(names),
            "parameters": elements,
            "share": round(elements / total, 6),
        }
    unproven = [by_name[n] for n, s in status.items() if s == SAMPLED and n in by_name]
    if unproven:
        top = max(unproven, key=lambda b: b.largest)
        out["largest_unproven"] = {"module": top.module, "bound": top.largest}
    return out
