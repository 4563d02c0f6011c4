"""The one table of dtypes: safetensors codes, torch dtypes, target names and config strings.

Everything that turns a name into a dtype goes through here so that "bf16", "BF16",
"bfloat16" and ``torch.bfloat16`` can never drift apart; so does every reading of a target
name (:class:`Target`): its compute dtype, whether it keeps fp32 islands, whether fp16's range
binds it.
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


class Target(StrEnum):
    """A conversion target, read once: ``<dtype>-safe`` keeps fp32 islands (recipe and
    analysis), ``<dtype>`` casts every floating tensor (offered to show why the safe ones
    exist). A member is its name as a string, so it prints, compares and serializes as one."""

    BF16_SAFE = "bf16-safe"
    FP16_SAFE = "fp16-safe"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def compute(self) -> DType:
        """The dtype every module outside an fp32 island is stored and runs in."""
        return BY_SHORT[self.removesuffix("-safe")]

    @property
    def safe(self) -> bool:
        """Whether modules that need fp32 keep it."""
        return self.endswith("-safe")

    @property
    def range_limited(self) -> bool:
        """Whether it computes in fp16, whose largest finite value (65504) weights and
        activations must stay under; bf16 has fp32's exponent."""
        return self.compute == FP16

    @property
    def plain(self) -> Target:
        """The plain cast to the same dtype (``bf16`` for ``bf16-safe``)."""
        return Target(self.compute.short)

    @property
    def with_islands(self) -> Target:
        """The safe target of the same dtype (``bf16-safe`` for ``bf16``)."""
        return Target(f"{self.compute.short}-safe")

    @classmethod
    def lookup(cls, name: object) -> Target | None:
        """The target named ``name`` (as a certificate or record spells it); None if none is."""
        try:
            return cls(name) if isinstance(name, str) else None
        except ValueError:
            return None


#: Target names, safe ones first (the order of choices in messages).
TARGETS: tuple[str, ...] = tuple(t.value for t in Target)
SAFE_TARGETS: tuple[str, ...] = tuple(t.value for t in Target if t.safe)


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
