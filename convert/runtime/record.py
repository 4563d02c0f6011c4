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
from typing import TYPE_CHECKING

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.io.tensors import LazyTensor
from precision_convert.conversion.plan import DIFFUSERS_RECORD_KEY, RECORD_KEY, PlanRecord
from precision_convert.conversion.runtime.builders import key_map, merged_key_map
from precision_convert.core.dtypes import FP32
from precision_convert.core.errors import InputError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "check_record",
    "loaded_mismatch",
    "read_record",
    "record_mismatch",
    "recorded_fp32",
    "shared_storage",
    "tensors_under",
]


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
    fp32; names the record ties that share no stored tensor, or that it gives two dtypes), or
    None when they hold it. A tied name stores nothing of its own: the tensor stored under
    another name of its group is what an island holding it covers."""
    stored = {t.name: t for t in tensors}
    groups = shared_storage(record)
    for island in record.fp32_modules:
        covered = tensors_under(island, tensors)
        covered += [
            stored[name]
            for group in groups
            if any(_under(island, member) for member in group)
            for name in sorted(group)
            if name in stored
        ]
        if not covered:
            return f"the {RECORD_KEY} record keeps {island!r} in fp32 but no tensor belongs to it"
        wrong = next((t for t in covered if t.dtype.is_float and t.dtype != FP32), None)
        if wrong is not None:
            return (
                f"the {RECORD_KEY} record keeps {island!r} in fp32 but {wrong.name!r} is stored "
                f"as {wrong.dtype.short}"
            )
    for group in groups:
        if not any(name in stored for name in group):
            return f"the {RECORD_KEY} record ties {_names(group)} but none of them is stored"
        kept = {name for name in group if recorded_fp32(record, name)}
        if kept and kept != group:
            return (
                f"the {RECORD_KEY} record keeps {_names(kept)} in fp32 but not "
                f"{_names(group - kept)}, which share their storage"
            )
    return None


def shared_storage(record: PlanRecord) -> list[frozenset[str]]:
    """The groups of names the record says are one tensor (``tied``: other name -> stored)."""
    groups: dict[str, set[str]] = {}
    for alias, holder in record.tied.items():
        groups.setdefault(holder, {holder}).add(alias)
    return [frozenset(group) for _, group in sorted(groups.items())]


def recorded_fp32(record: PlanRecord, name: str) -> bool:
    """Whether the record keeps tensor ``name`` in fp32 (an ``fp32_modules`` entry covers it)."""
    return any(_under(island, name) for island in record.fp32_modules)


def _under(island: str, name: str) -> bool:
    return name == island or name.startswith(island + ".")


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


def check_record(record: PlanRecord, tensors: list[LazyTensor], source: ModelSource) -> None:
    """Refuse weights that contradict their record: the plan is only worth what the files hold."""
    mismatch = record_mismatch(record, tensors)
    if mismatch is not None:
        raise InputError(
            f"{mismatch}; the weights do not match their record, convert again", source.root
        )


def loaded_mismatch(model: nn.Module, source: ModelSource) -> str | None:
    """The first floating parameter of ``model`` (``pc.load`` of ``source``, every name of a
    tied one) whose dtype is not the one ``source``'s record says, or None when the record says
    what loads (or there is no record). Dtypes only: no tensor is read.

    Validation runs it on the model ``pc.load`` built for the comparison, and a mismatch is
    one of the certificate's failures rather than an internal error: the record is what every
    other reader trusts (the card, ``inspect``, a re-save, the Hub gate), so a certificate of
    files whose record lies must not pass, and must say why; yet ``validate`` of a directory
    written by an older version must still report on it rather than crash. A conversion that
    writes such a record thus fails (exit 1) with the line naming the parameter, and ``push``
    refuses it."""
    record = read_record(source)
    compute = record.compute if record is not None else None
    if record is None or compute is None:
        return None
    key_of, merged_into = key_map(model, source), merged_key_map(model, source)
    # Model key -> the record's name for it: each stored tensor, then each other tied name.
    recorded: dict[str, str] = {}
    for name in [*(t.name for t in source.tensors() if t.dtype.is_float), *sorted(record.tied)]:
        key = merged_into(name) or key_of(name)
        if key is not None:
            recorded.setdefault(key, name)
    for key, parameter in model.named_parameters(remove_duplicate=False):
        if not parameter.is_floating_point():
            continue
        name = recorded.get(key, key)
        said = FP32 if recorded_fp32(record, name) else compute
        if parameter.dtype != said.torch:
            loaded = str(parameter.dtype).removeprefix("torch.")
            return (
                f"the {RECORD_KEY} record says {name!r} is {said.torch_name} but pc.load gives "
                f"{key!r} in {loaded}: the record does not say what loads"
            )
    return None
