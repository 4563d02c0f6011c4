"""Dtype boundaries of a mixed-precision model, and the hooks that make them safe to cross.

A model loaded from a ``-safe`` checkpoint computes in one dtype (bf16/fp16) except for fp32
islands. The failures users hit with such models (T5's fp32 ``wo`` before a fused RMSNorm,
CogVLM's fp16 weight with an fp32 bias, OpenCLIP's LayerNorm given bf16, fp32 side inputs reaching
fp16 layers) are each a tensor crossing such a boundary in the wrong dtype, so the rule is: a
floating tensor entering a module is cast to that module's dtype. What an island hands on depends
on why it exists (docs/format.md):

* a **precision** island (a norm) hands its output back in the compute dtype, so nothing
  downstream ever sees fp32;
* a **flowing** island (``range``, ``search``, ``user``) lets its fp32 output flow on: casting it
  back would recreate the fp16 overflow it exists to avoid. A residual add then promotes the
  stream to fp32, so every module that might receive it casts what it receives to its own
  dtype, and the island's parent promotes mixed fp32/fp16 matmuls instead of failing on them.

Hooks go only where dtypes change. With precision islands only (every ``bf16-safe`` plan) that
is the islands themselves plus the model's entry points (the root and its direct children,
which methods such as ``encode_image`` or ``decode`` call directly). A flowing island changes
the dtype of everything that runs after it, and execution order cannot be read from the module
tree (diffusers registers ``up_blocks`` before ``mid_block``), so then every module that owns
compute-dtype weights gets a guard; an fp32 tensor held directly by a container (OpenCLIP's
``class_embedding``) is used by the container's own code and flows the same way.

Hooks read dtypes from the model's tensors at call time, so they stay right after a later
``model.to(torch.float32)`` (diffusers pipelines upcast a VAE that way). They live in a small
registry on each module: named, idempotent, removable; :func:`boundary_hooks` guarantees
removal.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from precision_convert.core.dtypes import FLOATS, FP16
from precision_convert.core.errors import InputError

#: Attribute holding a module's registry: hook name -> the torch handles that implement it.
REGISTRY_ATTR = "_precision_convert_hooks"
#: Hook names, one per kind of boundary.
CAST_INPUTS = "precision_convert.cast_inputs"
CAST_OUTPUTS = "precision_convert.cast_outputs"
PROMOTE_MIXED = "precision_convert.promote_mixed"
CAST_CHECK = "precision_convert.cast_check"
#: Dtypes a boundary converts between; fp8 and integer tensors are always left alone.
_CASTABLE = frozenset(d.torch for d in FLOATS)
#: Functions that refuse mixed floating dtypes instead of promoting them. ``cat`` and the
#: elementwise ops already promote, so an fp32 tensor meeting an fp16 one only fails here.
_NO_PROMOTION: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.baddbmm,
        torch.Tensor.baddbmm,
        torch.addmm,
        torch.Tensor.addmm,
        torch.einsum,
        F.linear,
        F.bilinear,
        F.scaled_dot_product_attention,
        F.conv1d,
        F.conv2d,
        F.conv3d,
    }
)
#: Island kinds whose fp32 output must not be cast back (docs/format.md).
PRECISION = "precision"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Boundaries:
    """Where a model's dtype changes, by module name; what :func:`install` hooks.

    Attributes:
        compute: the dtype every module outside the islands runs in.
        precision_islands: fp32 subtrees whose output is handed back in ``compute``.
        flowing_islands: fp32 subtrees whose fp32 output flows on (range/search/user).
        tensor_units: fp32 tensors held directly by a container of compute-dtype modules.
        entries: modules whose floating inputs are cast to ``compute`` (the model's doors).
        guards: compute-dtype modules that cast what they receive to their own dtype.
        promote: modules during whose forward mixed-dtype matmuls promote instead of failing.
    """

    compute: torch.dtype
    precision_islands: tuple[str, ...] = ()
    flowing_islands: tuple[str, ...] = ()
    tensor_units: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()
    guards: tuple[str, ...] = ()
    promote: tuple[str, ...] = ()

    @property
    def flows(self) -> bool:
        """True when fp32 can reach compute-dtype modules (so guards are installed)."""
        return bool(self.flowing_islands or self.tensor_units)


# --- analysis ----------------------------------------------------------------------------


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers held directly by ``module``, castable floats only.

    Non-persistent buffers (a rotary ``inv_freq``) are the library's own working state, not
    weights: they never decide a module's dtype.
    """
    for name, tensor in module._parameters.items():
        if tensor is not None and tensor.dtype in _CASTABLE:
            yield name, tensor
    skip = module._non_persistent_buffers_set
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in skip and buffer.dtype in _CASTABLE:
            yield name, buffer


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def find_boundaries(
    model: nn.Module,
    *,
    compute: torch.dtype | None = None,
    reasons: Mapping[str, str] | None = None,
) -> Boundaries:
    """Read a loaded model's dtype boundaries from its tensors' real dtypes.

    Args:
        model: a model whose parameters already hold their stored dtypes.
        compute: the compute dtype; default the dtype holding the most elements.
        reasons: module or tensor name -> island kind (``precision``, ``range``, ``search``,
            ``user``), as in the ``islands`` record. An island no name covers is treated as
            ``user``: letting fp32 flow is the safe choice when the reason is unknown.

    Raises:
        InputError: a leaf module holds tensors of different dtypes (CogVLM's fp16 weight
            with an fp32 bias), which no boundary cast can fix.
    """
    tree = _DtypeTree(model)
    everything = tree.subtree[id(model)]
    if compute is None or len(everything) == 1:
        # A model stored wholly in one dtype computes in it, whatever the record says.
        compute = _dominant(model) if len(everything) != 1 else next(iter(everything))
    if compute is None:
        return Boundaries(torch.get_default_dtype())
    islands = _islands(tree, compute, dict(reasons or {}))
    hooked = set(islands.precision) | set(islands.flowing)
    flows = bool(islands.flowing or islands.units)
    return Boundaries(
        compute=compute,
        precision_islands=tuple(islands.precision),
        flowing_islands=tuple(islands.flowing),
        tensor_units=tuple(islands.units),
        entries=tuple(_entries(tree, hooked, flows)),
        guards=tuple(_guards(tree, compute, hooked) if flows else []),
        promote=tuple(sorted(islands.promote)),
    )


class _DtypeTree:
    """The floating dtypes each module of ``model`` holds: ``direct``ly, and in its
    ``subtree`` (itself and every descendant), by module id."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.direct: dict[int, frozenset[torch.dtype]] = {}
        self.subtree: dict[int, frozenset[torch.dtype]] = {}
        self._visit(model)

    def _visit(self, module: nn.Module) -> frozenset[torch.dtype]:
        if id(module) not in self.subtree:
            own = frozenset(t.dtype for _, t in _own_tensors(module))
            self.direct[id(module)] = own
            self.subtree[id(module)] = own.union(*(self._visit(c) for c in module.children()))
        return self.subtree[id(module)]


@dataclass
class _Islands:
    """What differs from the compute dtype: whole-module islands by kind, single tensors
    (``units``), and the modules that must promote mixed-dtype matmuls."""

    precision: list[str] = field(default_factory=list)
    flowing: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    promote: set[str] = field(default_factory=set)


def _islands(tree: _DtypeTree, compute: torch.dtype, reasons: Mapping[str, str]) -> _Islands:
    """The islands of ``tree``: the outermost modules wholly in one non-compute dtype, and
    the non-compute tensors of modules that otherwise compute in ``compute``."""
    found = _Islands()
    model = tree.model
    for module in model.modules():
        name = tree.names[id(module)]
        kinds = tree.subtree[id(module)]
        parent_name = name.rpartition(".")[0]
        parent_kinds = tree.subtree[id(model.get_submodule(parent_name))] if name else frozenset()
        if len(kinds) == 1 and compute not in kinds and kinds != parent_kinds:
            # Covered by several names, a unit flows unless every one is a precision island.
            covered = {r for n, r in reasons.items() if _related(n, name)} or {"user"}
            if covered == {PRECISION}:
                found.precision.append(name)
            else:
                found.flowing.append(name)
                found.promote.add(parent_name)
            continue
        if len(kinds) == 1 and compute not in kinds:
            continue  # inside an island
        mixed = [(n, t) for n, t in _own_tensors(module) if t.dtype != compute]
        if not mixed:
            continue
        if not any(True for _ in module.children()):
            found_dtypes = ", ".join(f"{n} {t.dtype}" for n, t in _own_tensors(module))
            raise InputError(
                f"module {name or type(module).__name__!r} holds tensors of different dtypes "
                f"({found_dtypes}); convert the checkpoint with `precision-convert model` first"
            )
        for attr, _ in mixed:
            unit = _join(name, attr)
            found.units.append(unit)
            if reasons.get(unit, "user") != PRECISION:
                found.promote.add(name)
    return found


def _guards(tree: _DtypeTree, compute: torch.dtype, hooked: set[str]) -> list[str]:
    """Where fp32 can flow: every module owning compute-dtype tensors but the islands (and
    embeddings, which take integer ids)."""
    return [
        name
        for module in tree.model.modules()
        if (name := tree.names[id(module)])
        and name not in hooked
        and tree.direct[id(module)] == {compute}
        and not isinstance(module, nn.Embedding | nn.EmbeddingBag)
    ]


def _entries(tree: _DtypeTree, hooked: set[str], flows: bool) -> list[str]:
    """The model's entry points: the root (when it holds floating tensors) and, unless fp32
    flows (then guards cover them), its direct children that methods such as
    ``encode_image`` call."""
    model = tree.model
    entries = [""] if tree.subtree[id(model)] else []
    if not flows:
        entries += [
            name
            for name, child in model.named_children()
            if name not in hooked
            and tree.subtree[id(child)]
            and not isinstance(child, nn.Embedding | nn.ModuleList | nn.ModuleDict)
        ]
    return entries


def _related(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` name the same unit or one contains the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _dominant(model: nn.Module) -> torch.dtype | None:
    """The floating dtype holding the most elements: the compute dtype of an unrecorded plan."""
    counts: dict[torch.dtype, int] = {}
    for module in model.modules():
        for _, tensor in _own_tensors(module):
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else None


# --- casting -----------------------------------------------------------------------------


def _cast(value: Any, dtype: torch.dtype, only: torch.dtype | None = None) -> Any:
    """``value`` with every castable floating tensor (of dtype ``only``, if given) in ``dtype``.

    Tuples, lists and plain dicts are walked; other containers (a transformers ``Cache``) are
    passed through untouched. Integer and bool tensors (token ids, masks) are never cast.
    """
    if isinstance(value, torch.Tensor):
        current = value.dtype
        if current is dtype or current not in _CASTABLE or (only is not None and current != only):
            return value
        return value.to(dtype)
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(_cast(v, dtype, only) for v in value)
    if kind is dict:
        return {k: _cast(v, dtype, only) for k, v in value.items()}
    return value


def _float_dtypes(value: Any) -> Iterator[torch.dtype]:
    """Dtypes of the castable tensors in ``value``, walked like :func:`_cast` walks it."""
    if isinstance(value, torch.Tensor):
        if value.dtype in _CASTABLE:
            yield value.dtype
    elif type(value) in (tuple, list):
        for v in value:
            yield from _float_dtypes(v)
    elif type(value) is dict:
        for v in value.values():
            yield from _float_dtypes(v)


class _DtypeOf:
    """The current dtype of one tensor slot (``module._parameters[name]``), read at call time.

    Reading the slot rather than remembering a dtype keeps hooks right after ``model.to(...)``
    or ``load_state_dict(assign=True)`` replaces what the slot holds.
    """

    __slots__ = ("key", "slots")

    def __init__(self, module: nn.Module, dtype: torch.dtype | None = None) -> None:
        """The first floating tensor under ``module`` (of ``dtype``, when given)."""
        for owner in module.modules():
            for name, tensor in _own_tensors(owner):
                if dtype is None or tensor.dtype == dtype:
                    self.slots = owner._parameters if name in owner._parameters else owner._buffers
                    self.key = name
                    return
        raise ValueError(f"{type(module).__name__} holds no floating tensor of dtype {dtype}")

    def __call__(self) -> torch.dtype:
        tensor = self.slots[self.key]
        # Only a slot that held a floating tensor is read, and loads replace, never empty, one.
        assert tensor is not None, f"{self.key} was emptied after its dtype hooks were placed"
        return tensor.dtype


class _CastInputs:
    """Forward pre-hook: floating inputs (args and kwargs) to the dtype ``target`` reports."""

    __slots__ = ("target",)

    def __init__(self, target: _DtypeOf) -> None:
        self.target = target

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.target()
        return _cast(args, dtype), _cast(kwargs, dtype)


class _CastOutputs:
    """Forward hook of a precision island: its outputs in the island's dtype, to compute."""

    __slots__ = ("compute", "island")

    def __init__(self, island: _DtypeOf, compute: _DtypeOf) -> None:
        self.island, self.compute = island, compute

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return _cast(output, self.compute(), only=self.island())


class _PromoteMixedFloats(TorchFunctionMode):
    """Promote functions that refuse mixed fp32/fp16 inputs (matmul, sdpa) to the wider dtype.

    Promoting keeps an fp32 range value in fp32, as a residual add would; casting it down would
    bring back the overflow.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _NO_PROMOTION:
            found = set(_float_dtypes(args)) | set(_float_dtypes(kwargs))
            if len(found) > 1:
                wide = functools.reduce(torch.promote_types, found)
                args, kwargs = _cast(args, wide), _cast(kwargs, wide)
        return func(*args, **kwargs)


class _PromoteDuring:
    """Pre/post hook pair that keeps :class:`_PromoteMixedFloats` active during a forward."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active: list[_PromoteMixedFloats] = []

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        mode = _PromoteMixedFloats()
        mode.__enter__()
        self.active.append(mode)

    def exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # Registered with always_call: runs even when forward raised, so the mode never leaks.
        if self.active:
            self.active.pop().__exit__(None, None, None)


class _WarnWhenCastWhole:
    """Forward pre-hook on the root of a model with flowing islands: once they hold float16,
    the model was cast as a whole (``.half()``, ``.to(torch.float16)``) and the values they
    kept in fp32 overflow again. Said once, at the first forward after the cast.

    The cast itself is not hooked: torch offers no per-module hook on ``Module._apply``, and
    a model is cast by many doors (``half``, ``to``, ``type``, ``_apply``, a pipeline's
    ``.to`` calling each component's, accelerate's dispatch). Wrapping named methods on the
    instance would miss some, sit in every ``.to(device)`` call, and travel oddly with
    ``copy.deepcopy`` and pickling; swapping the instance's class changes ``type(model)``.
    Reading the islands' dtype at the next forward sees every door, and costs one dtype read
    per island per forward until it has spoken.
    """

    __slots__ = ("islands", "warned")

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        self.islands = {name: _DtypeOf(model.get_submodule(name)) for name in names}
        self.warned = False

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.warned:
            return
        cast = [name for name, dtype in self.islands.items() if dtype() == FP16.torch]
        if cast:
            self.warned = True
            logger.warning(
                "%d fp32 island(s) kept for fp16's range (%s%s) now hold float16: the model "
                "was cast as a whole (.half(), .to(torch.float16)), and their outputs can "
                "overflow 65504 again (inf/NaN). Use the model as precision_convert.load "
                "returns it; move it with .to(device) only.",
                len(cast),
                cast[0],
                ", …" if len(cast) > 1 else "",
            )


# --- registry ----------------------------------------------------------------------------


def attach(
    module: nn.Module,
    name: str,
    *,
    pre: Callable[..., Any] | None = None,
    pre_with_kwargs: bool = True,
    post: Callable[..., Any] | None = None,
    always_call: bool = False,
) -> None:
    """Register hook ``name`` on ``module``, replacing one of the same name (idempotent)."""
    detach(module, name)
    handles: list[RemovableHandle] = []
    if pre is not None:
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=pre_with_kwargs))
    if post is not None:
        handles.append(module.register_forward_hook(post, always_call=always_call))
    module.__dict__.setdefault(REGISTRY_ATTR, {})[name] = tuple(handles)


def detach(module: nn.Module, name: str) -> bool:
    """Remove hook ``name`` from ``module``; False when it had none."""
    registry: dict[str, tuple[RemovableHandle, ...]] = module.__dict__.get(REGISTRY_ATTR, {})
    handles = registry.pop(name, None)
    for handle in handles or ():
        handle.remove()
    return handles is not None


def hook_names(module: nn.Module) -> tuple[str, ...]:
    """Names of the precision-convert hooks on ``module`` itself."""
    return tuple(sorted(module.__dict__.get(REGISTRY_ATTR, {})))


def hooked_modules(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every module of ``model`` that carries precision-convert hooks, with their names."""
    return {n: hook_names(m) for n, m in model.named_modules() if hook_names(m)}


def remove(model: nn.Module) -> int:
    """Remove every precision-convert hook from ``model``; returns how many were removed."""
    removed = 0
    for module in model.modules():
        for name in hook_names(module):
            removed += detach(module, name)
    return removed


def install(model: nn.Module, boundaries: Boundaries | None = None) -> Boundaries:
    """Hook ``model`` at its dtype boundaries (found from its tensors when not given).

    Any earlier precision-convert hooks are removed first, so installing twice is harmless.
    """
    found = boundaries if boundaries is not None else find_boundaries(model)
    remove(model)
    if not found.entries and not found.guards and not found.precision_islands:
        return found
    compute = _DtypeOf(model, found.compute)
    for name in found.entries:
        attach(model.get_submodule(name), CAST_INPUTS, pre=_CastInputs(compute))
    for name in found.guards:
        module = model.get_submodule(name)
        attach(module, CAST_INPUTS, pre=_CastInputs(_DtypeOf(module)))
    for name in found.flowing_islands:
        module = model.get_submodule(name)
        attach(module, CAST_INPUTS, pre=_CastInputs(_DtypeOf(module)))
    for name in found.precision_islands:
        module = model.get_submodule(name)
        island = _DtypeOf(module)
        attach(module, CAST_INPUTS, pre=_CastInputs(island))
        attach(module, CAST_OUTPUTS, post=_CastOutputs(island, compute))
    if found.flowing_islands:
        warn = _WarnWhenCastWhole(model, found.flowing_islands)
        attach(model, CAST_CHECK, pre=warn, pre_with_kwargs=False)
    for name in found.promote:
        during = _PromoteDuring()
        attach(
            model.get_submodule(name),
            PROMOTE_MIXED,
            pre=during.enter,
            pre_with_kwargs=False,
            post=during.exit,
            always_call=True,
        )
    return found


@contextmanager
def boundary_hooks(model: nn.Module, boundaries: Boundaries | None = None) -> Iterator[Boundaries]:
    """Install boundary hooks for the duration of a ``with`` block; always removed after.

    Example:
        >>> with boundary_hooks(model) as found:
        ...     out = model(x)
    """
    found = install(model, boundaries)
    try:
        yield found
    finally:
        remove(model)
