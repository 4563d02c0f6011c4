"""The ``precision_convert`` record of a converted model: reading it, and checking that the
weights still hold it.

The record (docs/format.md) lives in ``config.json`` and in every safetensors shard's
metadata; it names the fp32 islands and why each exists. The loader reads and checks it before
building a model, and a re-save checks it against what was written before writing it back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.io.tensors import LazyTensor
from precision_convert.conversion.plan import DIFFUSERS_RECORD_KEY, RECORD_KEY, PlanRecord
from precision_convert.core.dtypes import FP32
from precision_convert.core.errors import InputError

__all__ = ["check_record", "read_record", "record_mismatch", "tensors_under"]


def read_record(source: ModelSource) -> PlanRecord | None:
    """The ``precision_convert`` record: from the config, else from the first shard's metadata
    (a ``--variant`` output keeps the source's config, so only its shards carry it)."""
    block = source.config.get(RECORD_KEY, source.config.get(DIFFUSERS_RECORD_KEY))
    where: Path = source.root / source.config_name
    if block is None:
        from precision_convert.conversion.io.header import read_header

        first = source.files[0].path
        if first.suffix != ".safetensors":
            return None
        raw = read_header(first).metadata.get(RECORD_KEY)
        if raw is None:
            return None
        where = first
        try:
            block = json.loads(raw)
        except ValueError:
            raise InputError(f"{RECORD_KEY} metadata is not valid JSON", where) from None
    try:
        return PlanRecord.from_dict(block)
    except ValueError:
        raise InputError(
            f"{RECORD_KEY} record is not an object with an fp32_modules list", where
        ) from None


def tensors_under(name: str, tensors: Iterable[LazyTensor]) -> list[LazyTensor]:
    """Tensors a record name covers: the tensor itself, or everything below the module."""
    return [t for t in tensors if t.name == name or t.name.startswith(name + ".")]


def record_mismatch(record: PlanRecord, tensors: list[LazyTensor]) -> str | None:
    """How ``tensors`` contradict ``record`` (an island with no tensor, or one not stored in
    fp32), or None when they hold it."""
    for island in record.fp32_modules:
        covered = tensors_under(island, tensors)
        if not covered:
            return f"the {RECORD_KEY} record keeps {island!r} in fp32 but no tensor belongs to it"
        wrong = next((t for t in covered if t.dtype.is_float and t.dtype != FP32), None)
        if wrong is not None:
            return (
                f"the {RECORD_KEY} record keeps {island!r} in fp32 but {wrong.name!r} is stored "
                f"as {wrong.dtype.short}"
            )
    return None


def check_record(record: PlanRecord, tensors: list[LazyTensor], source: ModelSource) -> None:
    """Refuse weights that contradict their record: the plan is only worth what the files hold."""
    mismatch = record_mismatch(record, tensors)
    if mismatch is not None:
        raise InputError(
            f"{mismatch}; the weights do not match their record, convert again", source.root
        )
