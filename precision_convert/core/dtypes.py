"""The one table of dtypes: safetensors codes, torch dtypes, target names and config strings.

Everything that turns a name into a dtype goes through here so that "bf16", "BF16",
"bfloat16" and ``torch.bfloat16`` can never drift apart; so does every reading of a target
name (:class:`Target`), whose facts are one row each of the target table (:data:`FORMATS`):
its storage and compute dtypes, the finite range it watches, whether its weights carry scales,
how it chooses fp32 islands, its usual Hub variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One dtype as each of the formats we touch spells it."""

    code: str  # safetensors header code, e.g. "BF16"
    torch_name: str  # attribute of the torch module, e.g. "bfloat16"
    itemsize: int  # bytes per element
    kind: str  # "float", "int" or "bool": only "float" is ever cast
    short: str  # name used in targets and reports, e.g. "bf16"

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def torch(self) -> torch.dtype:
        import torch

        found: torch.dtype = getattr(torch, self.torch_name)
        return found


_TABLE: tuple[DType, ...] = (
    DType("F64", "float64", 8, "float", "fp64"),
    DType("F32", "float32", 4, "float", "fp32"),
    DType("F16", "float16", 2, "float", "fp16"),
    DType("BF16", "bfloat16", 2, "float", "bf16"),
    # fp8 stays as stored: it is already a deliberate low-precision choice.
    DType("F8_E4M3", "float8_e4m3fn", 1, "fp8", "fp8_e4m3"),
    DType("F8_E5M2", "float8_e5m2", 1, "fp8", "fp8_e5m2"),
    DType("I64", "int64", 8, "int", "i64"),
    DType("I32", "int32", 4, "int", "i32"),
    DType("I16", "int16", 2, "int", "i16"),
    DType("I8", "int8", 1, "int", "i8"),
    DType("U8", "uint8", 1, "int", "u8"),
    DType("U16", "uint16", 2, "int", "u16"),
    DType("U32", "uint32", 4, "int", "u32"),
    DType("U64", "uint64", 8, "int", "u64"),
    DType("BOOL", "bool", 1, "bool", "bool"),
)

BY_CODE: dict[str, DType] = {d.code: d for d in _TABLE}
BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in _TABLE}
BY_SHORT: dict[str, DType] = {d.short: d for d in _TABLE}

#: The floating dtypes a conversion may cast (fp8 stays as stored).
FLOATS: tuple[DType, ...] = tuple(d for d in _TABLE if d.is_float)

FP32 = BY_CODE["F32"]
FP16 = BY_CODE["F16"]
BF16 = BY_CODE["BF16"]

#: Largest finite fp16 value; anything beyond becomes inf when cast.
FP16_MAX = 65504.0


@dataclass(frozen=True)
class FiniteRange:
    """A dtype's finite range as the certificate watches it: activations and weights must
    stay within ``finite_max`` (by the activation margin) or be kept in fp32."""

    dtype: DType
    finite_max: float

    @property
    def name(self) -> str:
        """How messages name it: ``fp16``."""
        return self.dtype.short


class IslandChoice(StrEnum):
    """How a target chooses the modules it keeps in fp32."""

    #: None: every floating tensor is cast (the plain targets).
    NONE = "none"
    #: Norms and the recipe's fp32 rules (calibration, when asked, adds layers whose rounding
    #: loses precision).
    NORMS_AND_RECIPE = "norms-and-recipe"
    #: Norms, the recipe's rules and the modules whose measured range comes near the target's
    #: finite maximum (calibration and the island search run by default).
    RECIPE_PLUS_MEASURED_RANGE = "recipe-plus-measured-range"


@dataclass(frozen=True)
class TargetFormat:
    """One row of the target table: everything the planner, calibration, the bounds, the
    certificate, the schemas and the commands read about a target."""

    name: str  # as ``--to``, manifests, certificates and configs spell it
    storage: DType  # the dtype weights outside fp32 islands are stored in
    compute: DType  # the dtype modules outside fp32 islands run in
    #: The range the certificate watches for this target; None where the compute dtype has
    #: fp32's exponent (bf16), so range never binds.
    range: FiniteRange | None
    scaled_weights: bool  # whether stored weights carry scales beside them
    islands: IslandChoice
    variant: str  # the Hub variant name its weight files usually go under (``--variant``)

    @property
    def safe(self) -> bool:
        """Whether modules that need fp32 keep it."""
        return self.islands is not IslandChoice.NONE


FP16_RANGE = FiniteRange(FP16, FP16_MAX)

#: The target table: name -> row. Each target is registered here once; :class:`Target` names
#: the rows (an import-time check keeps the two equal).
FORMATS: dict[str, TargetFormat] = {}


def register(row: TargetFormat) -> TargetFormat:
    """Add ``row`` to :data:`FORMATS` (a name is registered once)."""
    if row.name in FORMATS:
        raise ValueError(f"target {row.name!r} is registered twice")
    FORMATS[row.name] = row
    return row


# Safe targets first: the table's order is the order of choices in messages and schemas.
register(TargetFormat("bf16-safe", BF16, BF16, None, False, IslandChoice.NORMS_AND_RECIPE, "bf16"))
register(
    TargetFormat(
        "fp16-safe", FP16, FP16, FP16_RANGE, False, IslandChoice.RECIPE_PLUS_MEASURED_RANGE, "fp16"
    )
)
register(TargetFormat("bf16", BF16, BF16, None, False, IslandChoice.NONE, "bf16"))
register(TargetFormat("fp16", FP16, FP16, FP16_RANGE, False, IslandChoice.NONE, "fp16"))

#: The range every certificate watches whatever its target: the narrowest any target watches.
#: Records that describe a model's activations for any target (the size-growth margins, the
#: output head's full-row bound, inspect's headroom and chart) measure against it.
WATCHED_RANGE: FiniteRange = min(
    (row.range for row in FORMATS.values() if row.range is not None),
    key=lambda r: r.finite_max,
)


class Target(StrEnum):
    """A conversion target, read once: a member is its name as a string (so it prints,
    compares and serializes as one) and reads everything else from its :data:`FORMATS` row.
    ``<dtype>-safe`` keeps fp32 islands (recipe and analysis), ``<dtype>`` casts every floating
    tensor (offered to show why the safe ones exist)."""

    BF16_SAFE = "bf16-safe"
    FP16_SAFE = "fp16-safe"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def row(self) -> TargetFormat:
        return FORMATS[self.value]

    @property
    def compute(self) -> DType:
        """The dtype every module outside an fp32 island runs in."""
        return self.row.compute

    @property
    def storage(self) -> DType:
        """The dtype every weight outside an fp32 island is stored in."""
        return self.row.storage

    @property
    def safe(self) -> bool:
        """Whether modules that need fp32 keep it."""
        return self.row.safe

    @property
    def range(self) -> FiniteRange | None:
        """The finite range weights and activations must stay within; None if it never binds."""
        return self.row.range

    @property
    def range_limited(self) -> bool:
        """Whether its compute dtype's finite range binds (fp16's 65504); bf16 has fp32's
        exponent."""
        return self.row.range is not None

    @property
    def plain(self) -> Target:
        """The plain cast of the same format (``bf16`` for ``bf16-safe``)."""
        return self._sibling(safe=False)

    @property
    def with_islands(self) -> Target:
        """The safe target of the same format (``bf16-safe`` for ``bf16``)."""
        return self._sibling(safe=True)

    def _sibling(self, *, safe: bool) -> Target:
        mine = self.row
        return next(
            Target(row.name)
            for row in FORMATS.values()
            if row.safe == safe
            and (row.storage, row.compute, row.scaled_weights)
            == (mine.storage, mine.compute, mine.scaled_weights)
        )

    @classmethod
    def lookup(cls, name: object) -> Target | None:
        """The target named ``name`` (as a certificate or record spells it); None if none is."""
        try:
            return cls(name) if isinstance(name, str) else None
        except ValueError:
            return None


if [t.value for t in Target] != list(FORMATS):
    raise ImportError("Target's members and the FORMATS table name different targets")

#: Target names, safe ones first (the order of choices in messages).
TARGETS: tuple[str, ...] = tuple(FORMATS)
SAFE_TARGETS: tuple[str, ...] = tuple(name for name, row in FORMATS.items() if row.safe)
#: Targets whose islands include measured ranges: calibration is on by default for them.
MEASURED_TARGETS: tuple[str, ...] = tuple(
    name for name, row in FORMATS.items() if row.islands is IslandChoice.RECIPE_PLUS_MEASURED_RANGE
)


def range_binds(dtype: DType) -> bool:
    """Whether a target watches ``dtype``'s finite range (fp16's 65504): bf16 has fp32's
    exponent, so nothing fp32 holds overflows it."""
    return any(row.range is not None and row.range.dtype == dtype for row in FORMATS.values())


def from_torch(dtype: torch.dtype) -> DType:
    """Look up a torch dtype (``torch.float16``) in the table."""
    name = str(dtype).removeprefix("torch.")
    try:
        return BY_TORCH_NAME[name]
    except KeyError:
        raise ValueError(f"unsupported torch dtype {dtype}") from None


def from_config_string(value: str) -> DType | None:
    """Parse a config's dtype string ("bfloat16", "float32", "fp16"); None if unknown."""
    value = value.removeprefix("torch.")
    return BY_TORCH_NAME.get(value) or BY_SHORT.get(value)
