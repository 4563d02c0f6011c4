"""``load()``: a converted checkpoint, built by its own library, with its dtype plan intact.

Each library flattens a mixed-dtype checkpoint its own way: transformers' ``from_pretrained``
casts every tensor to one ``dtype`` (then re-raises ``_keep_in_fp32_modules`` to fp32), and
diffusers casts each tensor to the dtype of the parameter it lands in. So the loader lets the
library build and fill the model in the compute dtype (tied weights, key renames, buffers and
all), then puts back every tensor whose dtype differs from the file, read again from the file:
the result holds exactly the stored dtypes, which are the plan. Only the islands are read twice,
and they are small. Finally :mod:`.boundaries` hooks the places where the dtype changes.

The ``precision_convert`` record (docs/format.md) says why each island exists; without it (a
checkpoint that was never converted) the stored dtypes still load exactly and every island is
treated as one whose fp32 output must flow on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.conversion.io.source import (
    ModelSource,
    PipelineSource,
    open_source,
    resolve,
)
from precision_convert.conversion.io.tensors import LazyTensor, read_tensor
from precision_convert.conversion.plan import RECORD_KEY, PlanRecord
from precision_convert.conversion.runtime.builders import (
    KeyMap,
    build_pretrained,
    component_class,
    declared_classes_unquestioned,
    key_map,
    merged_key_map,
)
from precision_convert.conversion.runtime.devices import move, resolve_device
from precision_convert.conversion.runtime.fused import restore_fused
from precision_convert.conversion.runtime.record import (
    check_record,
    read_record,
    tensors_under,
)
from precision_convert.conversion.runtime.resave import SavedPlan, keep_plan_on_save
from precision_convert.core.dtypes import FP32, DType
from precision_convert.core.errors import InputError
from precision_convert.core.names import module_of
from precision_convert.core.progress import ledger_span

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["load", "read_record"]


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    variant: str | None = None,
    revision: str | None = None,
    *,
    trust_remote_code: bool = False,
) -> Any:
    """Load a converted model or pipeline with its per-module dtypes and safe boundaries.

    Args:
        path: a directory written by ``precision-convert model`` (a transformers or diffusers
            model, a whole diffusers pipeline, or an OpenCLIP model), or a Hub repo id, which
            is downloaded first. Unconverted directories load too, each tensor in the dtype it
            is stored in.
        device: where to put the result: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"auto"`` (CUDA
            when present), a ``torch.device``; ``None`` leaves it on the CPU.
        variant: load the Hub variant's weights (``model.<variant>.safetensors``…), as
            written by ``--variant`` and added to a source repo; a directory holding only one
            variant's weights loads that variant without being told.
        revision: a Hub branch, tag, commit or PR ref (``refs/pr/1``) of a repo id.
        trust_remote_code: run model code shipped with the checkpoint (``auto_map``). Off by
            default: a checkpoint is data until the user says otherwise.

    Returns:
        A transformers ``PreTrainedModel``, a diffusers ``ModelMixin`` or ``DiffusionPipeline``,
        or an OpenCLIP model, in eval mode, with boundary hooks installed
        (:func:`precision_convert.conversion.runtime.boundaries.remove` takes them off).
        Move it with ``.to(device)`` only: cast as a whole to float16 (``.half()``), the
        range islands overflow again, and the hooks log a warning at its next forward.

    Raises:
        InputError: the directory is not a model, the weights contradict their record, a module
            mixes dtypes within itself, remote code was needed but not allowed, or a library
            the model needs is missing.

    Example:
        >>> model = load("t5-small-fp16-safe")
        >>> model(input_ids=ids).last_hidden_state  # runs; fp32 islands intact
    """
    root = resolve(path, revision, variant=variant)  # a Hub repo: the variant's weights only
    target = resolve_device(device) if device is not None else None
    opened = open_source(root, variant)
    with ledger_span("load"):
        loaded: Any = (
            _load_pipeline(opened, trust_remote_code)
            if isinstance(opened, PipelineSource)
            else _load_model(opened, trust_remote_code)
        )
    if target is not None:
        loaded = move(loaded, target)
    return loaded


def _load_pipeline(source: PipelineSource, trust_remote_code: bool) -> Any:
    """Every weight-bearing component through :func:`_load_model`; diffusers does the rest.

    Each component is built with the class ``model_index.json`` names, as diffusers would
    (a safety checker's config reads as a plain CLIP config, but its class is diffusers').
    """
    import diffusers

    components = {
        name: _load_model(
            model, trust_remote_code, _component_class(name, source.model_index[name], source)
        )
        for name, model in source.components.items()
    }
    with declared_classes_unquestioned():
        return diffusers.DiffusionPipeline.from_pretrained(source.root, **components)


def _component_class(name: str, spec: list[Any], source: PipelineSource) -> type:
    """The class ``model_index.json`` gives a component: ``[library, class_name]``."""
    found = component_class(str(spec[0]), str(spec[-1]))
    if found is None:
        raise InputError(
            f"component {name!r}: {spec[0]} has no class {spec[-1]!r} to build it with",
            source.root / "model_index.json",
        )
    return found


def _load_model(source: ModelSource, trust_remote_code: bool, cls: type | None = None) -> nn.Module:
    from precision_convert.conversion.runtime.boundaries import find_boundaries, install

    record = read_record(source)
    tensors = list(source.tensors())
    compute = _compute_dtype(record, tensors, source)
    if record is not None:
        check_record(record, tensors, source)
    model = build_pretrained(source, compute.torch, trust_remote_code=trust_remote_code, cls=cls)
    key_of, merged_into = key_map(model, source), merged_key_map(model, source)
    _restore_stored_dtypes(model, tensors, key_of, merged_into, compute, source)
    reasons = model_reasons(
        record.islands if record else {}, tensors, key_of, merged_into=merged_into
    )
    install(model, find_boundaries(model, compute=compute.torch, reasons=reasons))
    if record is not None:  # a re-save writes back what the library's save drops
        keep_plan_on_save(model, SavedPlan.of(source, record))
    return model.eval()


# --- the record ----------------------------------------------------------------------------


def _compute_dtype(
    record: PlanRecord | None, tensors: list[LazyTensor], source: ModelSource
) -> DType:
    """The record's compute dtype; for an unrecorded checkpoint the one most elements are in."""
    if record is not None:
        found = record.compute
        if found is None:
            raise InputError(
                f"{RECORD_KEY} record has no usable compute_dtype ({record.compute_dtype!r})",
                source.root / source.config_name,
            )
        return found
    counts: dict[DType, int] = {}
    for t in tensors:
        if t.dtype.is_float:
            counts[t.dtype] = counts.get(t.dtype, 0) + math.prod(t.shape)
    return max(counts, key=counts.__getitem__) if counts else FP32


def model_reasons(
    islands: Mapping[str, str],
    tensors: list[LazyTensor],
    key_of: KeyMap,
    *,
    merged_into: KeyMap | None = None,
) -> dict[str, str]:
    """Island reasons re-keyed from checkpoint names to the model's module names; an island
    of tensors the library fuses (``merged_into``) gives its reason to the fused module."""
    out: dict[str, str] = {}
    for name, reason in islands.items():
        for t in tensors_under(name, tensors):
            fused = merged_into(t.name) if merged_into is not None else None
            if fused is not None:
                out[module_of(fused)] = str(reason)
                break
            key, suffix = key_of(t.name), t.name[len(name) :]
            if key is not None and key.endswith(suffix):
                out[key[: len(key) - len(suffix)]] = str(reason)
                break
    return out


# --- stored dtypes ---------------------------------------------------------------------------


def _restore_stored_dtypes(
    model: nn.Module,
    tensors: list[LazyTensor],
    key_of: KeyMap,
    merged_into: KeyMap,
    compute: DType,
    source: ModelSource,
) -> None:
    """Give every model tensor the dtype its file stores it in, reading it again where needed;
    a parameter the library fuses from several stored tensors (``merged_into``) takes the
    dtype they share (:mod:`.fused`).

    ``.data`` is replaced rather than the Parameter, so tied weights stay tied and the
    Parameter objects other code holds stay valid.
    """
    state = model.state_dict(keep_vars=True)
    merged: dict[str, list[LazyTensor]] = {}
    for t in tensors:
        if not t.dtype.is_float:
            continue
        fused = merged_into(t.name)
        if fused is not None:
            merged.setdefault(fused, []).append(t)
            continue
        key = key_of(t.name)
        if key is None or key not in state:
            if t.dtype != compute:
                raise InputError(
                    f"tensor {t.name!r} is stored as {t.dtype.short} but {type(model).__name__} "
                    "has no parameter it maps to one-to-one, so its dtype cannot be kept",
                    source.root,
                )
            continue
        target = state[key]
        if target.dtype != t.dtype.torch:
            target.data = read_tensor(t, t.dtype.torch, target.device)
    restore_fused(model, merged, compute, source)
