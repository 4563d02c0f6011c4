"""Dtype plans: which dtype every tensor is stored in, and why each fp32 island exists.

A plan is built from headers, the recipe, the normalization modules of the skeleton and (for
fp16 targets) weight ranges; it is frozen, printable and hashed into ``plan_sha256`` so a
certificate can prove which plan produced the files.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The record's key, where the io layer (which recognises this tool's outputs) keeps it.
from precision_convert.conversion.io.staging import RECORD_KEY as RECORD_KEY
from precision_convert.conversion.io.tensors import LazyTensor
from precision_convert.core.dtypes import (
    FP32,
    TARGETS,
    DType,
    FiniteRange,
    Target,
    from_config_string,
)
from precision_convert.core.errors import InputError, did_you_mean
from precision_convert.core.names import (
    matches_self_or_ancestor,
    module_of,
    units,
    validate_pattern,
)
from precision_convert.recipes import ISLAND_REASONS, Recipe

if TYPE_CHECKING:
    import torch

#: Its key in a diffusers model's config: diffusers warns about every config key its class does
#: not take (the whole record, on every load, for every user) but passes over keys that start
#: with "_". Readers accept both names.
DIFFUSERS_RECORD_KEY = "_precision_convert"

#: A tensor of which at least this share of non-zero values would round to zero in fp16 has
#: lost its information wholesale; it is treated like an overflowing one.
FLUSH_FRACTION = 0.5
#: When several rules keep a unit in fp32, the kind that lets fp32 flow on wins: treating a
#: range island like a precision island recreates the overflow, never the other way round.
_REASON_RANK = {"range": 0, "search": 1, "user": 2, "precision": 3}
assert set(_REASON_RANK) == set(ISLAND_REASONS)


#: How the rule of an island that calibration measured on the model (not the recipe) begins.
MEASURED = "calibration: "


@dataclass(frozen=True)
class Island:
    """A unit kept in fp32: its name, the kind of reason (see docs/format.md) and the rule."""

    name: str
    reason: str
    rule: str

    @property
    def measured(self) -> bool:
        """Whether calibration found it on this model's activations (its rule says how)."""
        return self.rule.startswith(MEASURED)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    unit: str
    source: DType
    stored: DType
    shape: tuple[int, ...]


@dataclass(frozen=True)
class RangeStats:
    """What a weight tensor would suffer in fp16."""

    max_abs: float
    flushed_fraction: float  # share of its non-zero values that fp16 rounds to zero
    non_finite: int

    def overflows(self, limit: FiniteRange) -> bool:
        return self.max_abs > limit.finite_max

    @property
    def flushes(self) -> bool:
        return self.flushed_fraction >= FLUSH_FRACTION


@dataclass(frozen=True)
class ModelPlan:
    target: Target
    recipe: str
    tensors: tuple[TensorPlan, ...]
    islands: tuple[Island, ...]
    config_flags: Mapping[str, Any]
    warnings: tuple[str, ...]
    #: Tied parameters: every other name of a stored tensor (``lm_head.weight``) -> its stored
    #: name (``model.embed_tokens.weight``); the loaded model holds both, in one dtype.
    tied: Mapping[str, str] = field(default_factory=dict)

    @property
    def compute(self) -> DType:
        return self.target.compute

    @property
    def fp32_modules(self) -> list[str]:
        return sorted(island.name for island in self.islands)

    @property
    def fp32_share(self) -> float:
        """Share of floating-point parameters stored in fp32."""
        floats = [t for t in self.tensors if t.source.is_float]
        total = sum(math.prod(t.shape) for t in floats)
        kept = sum(math.prod(t.shape) for t in floats if t.stored == FP32)
        return kept / total if total else 0.0

    @property
    def island_parameters(self) -> dict[str, int]:
        """Floating-point parameters each island keeps in fp32 (its memory cost: 4 bytes each)."""
        out = {island.name: 0 for island in self.islands}
        for t in self.tensors:
            if t.stored == FP32 and t.source.is_float and t.unit in out:
                out[t.unit] += math.prod(t.shape)
        return out

    @property
    def sha256(self) -> str:
        payload = {
            "target": self.target.value,
            "tensors": [
                [t.name, t.source.code, t.stored.code, list(t.shape)] for t in self.tensors
            ],
            "islands": [[i.name, i.reason] for i in sorted(self.islands, key=lambda i: i.name)],
        }
        data = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(data).hexdigest()

    def record(self, version: str) -> PlanRecord:
        """The record of this plan that shard metadata and config carry (docs/format.md)."""
        return PlanRecord(
            version=version,
            target=self.target.value,
            compute_dtype=self.compute.torch_name,
            fp32_modules=tuple(self.fp32_modules),
            islands={i.name: i.reason for i in sorted(self.islands, key=lambda i: i.name)},
            recipe=self.recipe,
            plan_sha256=self.sha256,
            tied=dict(sorted(self.tied.items())),
        )


@dataclass(frozen=True)
class PlanRecord:
    """The ``precision_convert`` record of a converted model (docs/format.md): written into
    its config and every shard's metadata by the converter and a re-save, read back by the
    loader and validation. Fields another version wrote are kept in ``extra`` and written back
    as they were; a field that was absent stays absent."""

    version: str | None = None
    target: str | None = None
    compute_dtype: str | None = None  # a torch dtype name, e.g. "float16"
    fp32_modules: tuple[str, ...] = ()
    islands: Mapping[str, str] = field(default_factory=dict)  # fp32 name -> reason
    recipe: str | None = None
    plan_sha256: str | None = None
    tied: Mapping[str, str] = field(default_factory=dict)  # other name -> stored tensor name
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def compute(self) -> DType | None:
        """The compute dtype, when the record names a floating dtype the table knows."""
        found = from_config_string(self.compute_dtype) if self.compute_dtype else None
        return found if found is not None and found.is_float else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, fields in the documented order."""
        written = {
            "version": self.version,
            "target": self.target,
            "compute_dtype": self.compute_dtype,
            "fp32_modules": list(self.fp32_modules),
            "islands": dict(self.islands),
            "recipe": self.recipe,
            "plan_sha256": self.plan_sha256,
            # Absent, not empty, where nothing is tied: such a record reads as before.
            "tied": dict(self.tied) or None,
        }
        return {**{k: v for k, v in written.items() if v is not None}, **self.extra}

    @classmethod
    def from_dict(cls, data: Any) -> PlanRecord:
        """Read a record; ``ValueError`` when it is not an object with an ``fp32_modules``
        list and ``islands`` and ``tied`` objects (a record without ``tied``, as versions
        before it wrote, ties nothing)."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        modules, islands = data.get("fp32_modules", []), data.get("islands", {})
        tied = data.get("tied", {})
        if not isinstance(modules, list) or not isinstance(islands, dict):
            raise ValueError("fp32_modules must be a list and islands an object")
        if not isinstance(tied, dict):
            raise ValueError("tied must be an object")
        return cls(
            **{k: _text(data.get(k)) for k in _RECORD_TEXT_FIELDS},
            fp32_modules=tuple(str(m) for m in modules),
            islands={str(k): str(v) for k, v in islands.items()},
            tied={str(k): str(v) for k, v in tied.items()},
            extra={k: v for k, v in data.items() if k not in _RECORD_FIELDS},
        )


#: The record's fields that hold one string, and all of its fields.
_RECORD_TEXT_FIELDS = ("version", "target", "compute_dtype", "recipe", "plan_sha256")
_RECORD_FIELDS = frozenset({*_RECORD_TEXT_FIELDS, "fp32_modules", "islands", "tied"})


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def check_target(target: str) -> Target:
    """The :class:`~precision_convert.core.dtypes.Target` named ``target``; bad input is refused."""
    found = Target.lookup(target)
    if found is None:
        raise InputError(
            f"unknown target {target!r}{did_you_mean(str(target), TARGETS)}; choose one of "
            f"{', '.join(TARGETS)}"
        )
    return found


def build_plan(
    tensors: Sequence[LazyTensor],
    *,
    target: str,
    recipe: Recipe,
    normalization: Iterable[str] = (),
    keep_fp32: Sequence[str] = (),
    ranges: Mapping[str, RangeStats] | None = None,
    extra_islands: Iterable[Island] = (),
    tied: Mapping[str, str] | None = None,
    runtime: Mapping[str, str] | None = None,
) -> ModelPlan:
    """Decide the stored dtype of every tensor for ``target``.

    ``tied``: parameters that share a stored tensor (``lm_head.weight`` ->
    ``model.embed_tokens.weight``, see
    :func:`~precision_convert.conversion.analysis.norms.tied_tensors`). A recipe rule, a
    ``--keep-fp32`` pattern or any other island naming either module keeps both in fp32: the
    weight is stored once, and a module holding it beside tensors of another dtype could not
    run. The plan lists the module that stores nothing of its own (``lm_head``) as an island
    too, with its holder's reason, so its record says what loads.

    ``runtime``: stored unit -> the module the model runs it as, where the library renames or
    fuses it on load (see
    :func:`~precision_convert.conversion.analysis.runtime_names.runtime_modules`). A pattern
    naming the runtime module keeps its stored units, and the stored units fused into one
    runtime module (Mixtral's experts) are kept in fp32 together or not at all: one fused
    parameter holds one dtype. The plan and its record name stored units only.
    """
    decoded = check_target(target)
    safe = decoded.safe
    unit_of = units(t.name for t in tensors)
    all_units = sorted(set(unit_of.values()))
    islands: dict[str, Island] = {}

    unit_set = set(all_units)
    run_names = dict(runtime or {})
    # Tied parameters whose stored tensor is planned: the unit each name belongs to.
    ties = {alias: holder for alias, holder in (tied or {}).items() if holder in unit_of}
    tied_units = {alias: _unit_of_alias(alias, holder, unit_of) for alias, holder in ties.items()}

    def named(pattern: str) -> dict[str, str]:
        """Unit -> how ``pattern`` names it: itself, or a module sharing its weights."""
        hits = {u: "" for u in all_units if matches_self_or_ancestor(pattern, u)}
        for unit, run_as in sorted(run_names.items()):
            if unit in unit_set and matches_self_or_ancestor(pattern, run_as):
                hits.setdefault(unit, f" (run as {run_as})")
        for alias, holder in sorted(ties.items()):
            alias_unit, holder_unit = tied_units[alias], unit_of[holder]
            if matches_self_or_ancestor(pattern, alias_unit):
                hits.setdefault(alias_unit, "")
                hits.setdefault(holder_unit, f" ({alias_unit} shares its weights)")
            if holder_unit in hits:
                hits.setdefault(alias_unit, f" (it shares {holder_unit}'s weights)")
        return hits

    def keep(unit: str, reason: str, rule: str) -> None:
        current = islands.get(unit)
        if current is None or _REASON_RANK[reason] < _REASON_RANK[current.reason]:
            islands[unit] = Island(unit, reason, rule)

    if safe and recipe.keep_normalization:
        norm_set = set(normalization)
        for unit in all_units:
            if unit in norm_set:
                keep(unit, "precision", "normalization layer")
    if safe:
        for rule in recipe.rules_for(target):
            for pattern in rule.modules:
                for unit, via in named(pattern).items():
                    keep(unit, rule.reason, f"recipe {recipe.name}: {pattern}{via}")
    for pattern in keep_fp32:
        try:
            validate_pattern(pattern)
        except ValueError as exc:
            raise InputError(f"--keep-fp32: {exc}") from None
        hits = named(pattern)
        if not hits:
            raise InputError(f"--keep-fp32 {pattern!r} matches no module of the model")
        for unit, via in hits.items():
            keep(unit, "user", f"--keep-fp32 {pattern}{via}")
    for island in extra_islands:
        keep(island.name, island.reason, island.rule)

    warnings: list[str] = []
    # Range matters only to targets whose row watches one; bf16 has fp32's exponent.
    limit = decoded.range
    if limit is not None and safe:
        for name, stats in (ranges or {}).items():
            problem = _range_problem(stats, limit)
            if problem is not None:
                keep(unit_of[name], "range", f"weights {problem}")
    elif limit is not None:
        warnings += range_warnings(ranges or {}, decoded)
    for island in _fused_with(islands, run_names):
        keep(island.name, island.reason, island.rule)
    for island in _tied_with(islands, ties, tied_units, unit_of):
        keep(island.name, island.reason, island.rule)

    storage = decoded.storage
    planned = tuple(
        TensorPlan(
            t.name,
            unit_of[t.name],
            t.dtype,
            (FP32 if unit_of[t.name] in islands else storage) if t.dtype.is_float else t.dtype,
            t.shape,
        )
        for t in tensors
    )
    # An island whose unit holds no floating tensor keeps nothing: leave it out of the record,
    # unless it holds a tied tensor another island stores (the head tied to the embedding).
    float_units = {t.unit for t in planned if t.source.is_float}
    held = {tied_units[a] for a, h in ties.items() if unit_of[h] in islands}
    kept = tuple(islands[u] for u in sorted(islands) if u in float_units or u in held)
    return ModelPlan(
        decoded,
        recipe.name,
        planned,
        kept,
        dict(recipe.config_flags(target)),
        tuple(warnings),
        ties,
    )


def _unit_of_alias(alias: str, holder: str, unit_of: Mapping[str, str]) -> str:
    """The unit a tied parameter's other name belongs to: its own when stored, else its
    module's (a tensor held directly by a container is its own unit, as its holder is)."""
    if alias in unit_of:
        return unit_of[alias]
    return alias if unit_of[holder] == holder else module_of(alias)


def _tied_with(
    islands: Mapping[str, Island],
    ties: Mapping[str, str],
    tied_units: Mapping[str, str],
    unit_of: Mapping[str, str],
) -> list[Island]:
    """Islands for the units holding a tied parameter whose other holder is an island: one
    parameter holds one dtype, so each name of it follows the island (the embedding kept for
    its range keeps the head tied to it, and the head's own bias)."""
    out: list[Island] = []
    for alias, holder in sorted(ties.items()):
        alias_unit, holder_unit = tied_units[alias], unit_of[holder]
        for kept, follows in ((holder_unit, alias_unit), (alias_unit, holder_unit)):
            island = islands.get(kept)
            if island is not None and follows not in islands:
                out.append(Island(follows, island.reason, f"{island.rule} (tied to {kept})"))
                break
    return out


def _fused_with(islands: Mapping[str, Island], runtime: Mapping[str, str]) -> list[Island]:
    """Islands for the stored units fused at run time into one module with an island: the
    fused parameter holds one dtype, so they follow the island whose fp32 output flows
    furthest (its reason ranks first), and keep its rule (a measured one stays measured)."""
    fused: dict[str, list[str]] = {}
    for unit, run_as in sorted(runtime.items()):
        fused.setdefault(run_as, []).append(unit)
    out: list[Island] = []
    for run_as, members in fused.items():
        held = [islands[m] for m in members if m in islands]
        if len(members) < 2 or not held:
            continue
        first = min(held, key=lambda i: (_REASON_RANK[i.reason], i.name))
        rule = f"{first.rule} (fused with {first.name} into {run_as} at run time)"
        out += [Island(m, first.reason, rule) for m in members if m != first.name]
    return out


def _range_problem(stats: RangeStats, limit: FiniteRange) -> str | None:
    if stats.non_finite:
        return None  # NaN/Inf are the source's own defect; inspect reports them
    if stats.overflows(limit):
        return (
            f"exceed the {limit.name} range (max |x| = {stats.max_abs:.4g} > {limit.finite_max:g})"
        )
    if stats.flushes:
        return f"would flush to zero in fp16 ({stats.flushed_fraction:.0%} of non-zero values)"
    return None


def range_warnings(ranges: Mapping[str, RangeStats], target: Target) -> list[str]:
    """A plain target's warnings: the tensors of ``ranges`` its row's range overflows or fp16
    flushes, stored in its dtype all the same (a plain cast's stored dtypes never depend on
    them); none for a target that watches no range."""
    limit = target.range
    if limit is None:
        return []
    return [
        f"{name}: {problem}; stored in {target.storage.short} anyway (target {target.value})"
        for name, stats in ranges.items()
        if (problem := _range_problem(stats, limit)) is not None
    ]


def scan_ranges(tensors: Iterable[LazyTensor]) -> dict[str, RangeStats]:
    """Read every floating tensor once and measure what fp16 would do to it."""
    scan = RangeScan()
    for tensor in tensors:
        if tensor.dtype.is_float:
            for chunk in tensor.chunks():
                scan.add(tensor.name, chunk)
    return scan.stats()


class RangeScan:
    """What fp16 would do to floating tensors, measured chunk by chunk as they pass: on a
    read of its own (:func:`scan_ranges`) or on one made for something else (a plain fp16
    conversion's writer, whose plan the ranges only warn about)."""

    def __init__(self) -> None:
        # name -> [max |x|, non-zero values, values fp16 flushes to zero, NaN and ±inf]
        self._counts: dict[str, list[float]] = {}

    def add(self, name: str, chunk: torch.Tensor) -> None:
        """Count ``chunk``, the next piece of floating tensor ``name``."""
        import torch

        counts = self._counts.setdefault(name, [0.0, 0, 0, 0])
        finite = torch.isfinite(chunk)
        counts[3] += int((~finite).sum())
        values = chunk[finite].float().abs()
        if values.numel():
            counts[0] = max(counts[0], float(values.max()))
        nz = values != 0
        counts[1] += int(nz.sum())
        counts[2] += int((nz & (values.to(torch.float16) == 0)).sum())

    def stats(self) -> dict[str, RangeStats]:
        """Each tensor counted so far (one that had no chunk, being empty, is not)."""
        return {
            name: RangeStats(max_abs, flushed / nonzero if nonzero else 0.0, int(non_finite))
            for name, (max_abs, nonzero, flushed, non_finite) in self._counts.items()
        }
