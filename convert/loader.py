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

import json
import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.convert.source import ModelSource, PipelineSource, open_source
from precision_convert.convert.tensors import LazyTensor
from precision_convert.dtypes import FP32, DType, from_config_string
from precision_convert.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["load"]

#: Maps a tensor name in the weight files to the model's state-dict key (None: no such key).
KeyMap = Callable[[str], str | None]
#: Key of the record in configs and shard metadata (docs/format.md).
RECORD_KEY = "precision_convert"


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    *,
    trust_remote_code: bool = False,
) -> Any:
    """Load a converted model or pipeline with its per-module dtypes and safe boundaries.

    Args:
        path: a directory written by ``precision-convert model`` (a transformers or diffusers
            model, a whole diffusers pipeline, or an OpenCLIP model). Unconverted directories
            load too, each tensor in the dtype it is stored in.
        device: where to put the result: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"auto"`` (CUDA
            when present), a ``torch.device``; ``None`` leaves it on the CPU.
        trust_remote_code: run model code shipped with the checkpoint (``auto_map``). Off by
            default: a checkpoint is data until the user says otherwise.

    Returns:
        A transformers ``PreTrainedModel``, a diffusers ``ModelMixin`` or ``DiffusionPipeline``,
        or an OpenCLIP model, in eval mode, with boundary hooks installed
        (:func:`precision_convert.convert.boundaries.remove` takes them off).

    Raises:
        InputError: the directory is not a model, the weights contradict their record, a module
            mixes dtypes within itself, remote code was needed but not allowed, or a library
            the model needs is missing.

    Example:
        >>> model = load("t5-small-fp16-safe")
        >>> model(input_ids=ids).last_hidden_state  # runs; fp32 islands intact
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError("no such directory: load() takes a converted model directory", root)
    target = _device(device)
    opened = open_source(root)
    loaded: Any = (
        _load_pipeline(opened, trust_remote_code)
        if isinstance(opened, PipelineSource)
        else _load_model(opened, trust_remote_code)
    )
    if target is not None:
        loaded = loaded.to(target)
    return loaded


def _device(device: str | torch.device | None) -> torch.device | None:
    import torch

    if device is None:
        return None
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None


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
    return diffusers.DiffusionPipeline.from_pretrained(source.root, **components)


def _component_class(name: str, spec: list[Any], source: PipelineSource) -> type:
    """The class ``model_index.json`` gives a component: ``[library, class_name]``."""
    import importlib

    library, class_name = str(spec[0]), str(spec[-1])
    module = (
        library if library in ("transformers", "diffusers") else f"diffusers.pipelines.{library}"
    )
    try:
        found = getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError):
        found = None
    if not isinstance(found, type):
        raise InputError(
            f"component {name!r}: {library} has no class {class_name!r} to build it with",
            source.root / "model_index.json",
        )
    return found


def _load_model(source: ModelSource, trust_remote_code: bool, cls: type | None = None) -> nn.Module:
    from precision_convert.convert.boundaries import find_boundaries, install

    record = _record(source)
    tensors = list(source.tensors())
    compute = _compute_dtype(record, tensors, source)
    if record is not None:
        _check_record(record, tensors, source)
    builders = {
        "transformers": _build_transformers,
        "diffusers": _build_diffusers,
        "open_clip": _build_open_clip,
    }
    model, key_of = builders[source.library](source, compute.torch, trust_remote_code, cls)
    _restore_stored_dtypes(model, tensors, key_of, compute, source)
    reasons = _model_reasons(record.get("islands", {}) if record else {}, tensors, key_of)
    install(model, find_boundaries(model, compute=compute.torch, reasons=reasons))
    return model.eval()


# --- the record ----------------------------------------------------------------------------


def _record(source: ModelSource) -> dict[str, Any] | None:
    """The ``precision_convert`` block: from the config, else from the first shard's metadata."""
    block = source.config.get(RECORD_KEY)
    where: Path = source.root / source.config_name
    if block is None:
        from precision_convert.convert.safetensors_header import read_header

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
    if not isinstance(block, dict) or not isinstance(block.get("fp32_modules", []), list):
        raise InputError(f"{RECORD_KEY} record is not an object with an fp32_modules list", where)
    return block


def _compute_dtype(
    record: dict[str, Any] | None, tensors: list[LazyTensor], source: ModelSource
) -> DType:
    """The record's compute dtype; for an unrecorded checkpoint the one most elements are in."""
    if record is not None:
        found = from_config_string(str(record.get("compute_dtype", "")))
        if found is None or not found.is_float:
            raise InputError(
                f"{RECORD_KEY} record has no usable compute_dtype "
                f"({record.get('compute_dtype')!r})",
                source.root / source.config_name,
            )
        return found
    counts: dict[DType, int] = {}
    for t in tensors:
        if t.dtype.is_float:
            counts[t.dtype] = counts.get(t.dtype, 0) + math.prod(t.shape)
    return max(counts, key=counts.__getitem__) if counts else FP32


def _under(name: str, tensors: Iterable[LazyTensor]) -> list[LazyTensor]:
    """Tensors a record name covers: the tensor itself, or everything below the module."""
    return [t for t in tensors if t.name == name or t.name.startswith(name + ".")]


def _check_record(record: dict[str, Any], tensors: list[LazyTensor], source: ModelSource) -> None:
    """Refuse weights that contradict their record: the plan is only worth what the files hold."""
    for island in record.get("fp32_modules", []):
        covered = _under(str(island), tensors)
        if not covered:
            raise InputError(
                f"the {RECORD_KEY} record keeps {island!r} in fp32 but no tensor belongs to it; "
                "the weights do not match their record, convert again",
                source.root,
            )
        wrong = next((t for t in covered if t.dtype.is_float and t.dtype != FP32), None)
        if wrong is not None:
            raise InputError(
                f"the {RECORD_KEY} record keeps {island!r} in fp32 but {wrong.name!r} is stored "
                f"as {wrong.dtype.short}; the weights do not match their record, convert again",
                source.root,
            )


def _model_reasons(
    islands: dict[str, str], tensors: list[LazyTensor], key_of: KeyMap
) -> dict[str, str]:
    """Island reasons re-keyed from checkpoint names to the model's module names."""
    out: dict[str, str] = {}
    for name, reason in islands.items():
        for t in _under(name, tensors):
            key, suffix = key_of(t.name), t.name[len(name) :]
            if key is not None and key.endswith(suffix):
                out[key[: len(key) - len(suffix)]] = str(reason)
                break
    return out


# --- stored dtypes ---------------------------------------------------------------------------


def _read(tensor: LazyTensor) -> torch.Tensor:
    """One tensor's data in its stored dtype, copied out of the converter's chunked reader.

    The reader lends each chunk from a pooled buffer of up to ``CHUNK_BYTES``; keeping the
    chunk itself would pin that whole buffer to a small norm weight, and holding it when the
    reader finishes would keep the buffer out of the pool, so every read would allocate anew.
    """
    import torch

    out = torch.empty(math.prod(tensor.shape), dtype=tensor.dtype.torch)
    offset = 0
    for chunk in tensor.chunks():
        out[offset : offset + chunk.numel()] = chunk
        offset += chunk.numel()
        del chunk  # released before the reader's cleanup runs, so its buffer is pooled
    return out.reshape(tensor.shape)


def _restore_stored_dtypes(
    model: nn.Module,
    tensors: list[LazyTensor],
    key_of: KeyMap,
    compute: DType,
    source: ModelSource,
) -> None:
    """Give every model tensor the dtype its file stores it in, reading it again where needed.

    ``.data`` is replaced rather than the Parameter, so tied weights stay tied and the
    Parameter objects other code holds stay valid.
    """
    state = model.state_dict(keep_vars=True)
    for t in tensors:
        if not t.dtype.is_float:
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
            target.data = _read(t).to(target.device)


# --- builders --------------------------------------------------------------------------------


def _build_transformers(
    source: ModelSource, compute: torch.dtype, trust_remote_code: bool, cls: type | None
) -> tuple[nn.Module, KeyMap]:
    cls = cls or _transformers_class(source, trust_remote_code)
    model = cls.from_pretrained(source.root, dtype=compute, trust_remote_code=trust_remote_code)
    return model, transformers_key_map(model)


def _transformers_class(source: ModelSource, trust_remote_code: bool) -> Any:
    """The class named in ``architectures``; remote code (``auto_map``) only when trusted."""
    import transformers

    architecture = (source.config.get("architectures") or [None])[0]
    native = getattr(transformers, architecture, None) if architecture else None
    native = native if isinstance(native, type) else None
    auto_map = source.config.get("auto_map") or {}
    if auto_map and (trust_remote_code or native is None):
        if not trust_remote_code:
            raise InputError(
                "the model's code ships with the checkpoint (auto_map in config.json); pass "
                "trust_remote_code=True (--trust-remote-code) to run it",
                source.root,
            )
        auto_names = [k for k in auto_map if k.startswith("AutoModel")]
        chosen = next(
            (k for k in auto_names if str(auto_map[k]).rpartition(".")[2] == architecture),
            auto_names[0] if auto_names else None,
        )
        if chosen is None or not hasattr(transformers, chosen):
            raise InputError("auto_map in config.json names no AutoModel class", source.root)
        return getattr(transformers, chosen)
    return native or transformers.AutoModel


def transformers_key_map(model: nn.Module) -> KeyMap:
    """Checkpoint key -> state-dict key, through transformers' own renaming rules.

    A key that transformers merges with others (a ``WeightConverter``: fused experts, fused
    qkv) maps to None: its stored dtype cannot survive the merge.
    """
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # transformers 4.x: no renaming tables, only the base-model prefix
        return lambda key: next(
            (k for k in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")) if k in state),
            None,
        )
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]

    def key_of(key: str) -> str | None:
        if key in state:
            return key
        renamed, merged = rename_source_key(key, renamings, converters, prefix, state)
        return renamed if merged is None and renamed in state else None

    return key_of


def _exact_keys(model: nn.Module) -> KeyMap:
    state = model.state_dict()
    return lambda key: key if key in state else None


def _build_diffusers(
    source: ModelSource, compute: torch.dtype, trust_remote_code: bool, cls: type | None
) -> tuple[nn.Module, KeyMap]:
    import diffusers

    cls = cls or getattr(diffusers, source.class_name or "", None)
    if not isinstance(cls, type):
        raise InputError(f"diffusers has no model class {source.class_name!r}", source.root)
    _quiet_about_our_record()
    model = cls.from_pretrained(source.root, dtype=compute)
    return model, _exact_keys(model)


class _OurRecordFilter(logging.Filter):
    """Drops diffusers' "config attributes {'precision_convert': …} … not expected" warning:
    the record is ours, diffusers is right to ignore it, and users need not be told so."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (RECORD_KEY in message and "not expected" in message)


_RECORD_FILTER = _OurRecordFilter()


def _quiet_about_our_record() -> None:
    logger = logging.getLogger("diffusers.configuration_utils")
    if _RECORD_FILTER not in logger.filters:
        logger.addFilter(_RECORD_FILTER)


def _build_open_clip(
    source: ModelSource, compute: torch.dtype, trust_remote_code: bool, cls: type | None
) -> tuple[nn.Module, KeyMap]:
    """OpenCLIP's own factory builds the model; the weights are assigned as stored.

    The model is built in fp32 (open_clip's ``precision="fp32"``: plain LayerNorm, no cast
    dtype) because its ``LayerNormFp32`` refuses bf16 weights, which plain ``bf16`` plans hold;
    the boundary hooks do for every plan what ``LayerNormFp32`` does for open_clip's own one.
    """
    try:
        import open_clip
    except ImportError:
        raise InputError(
            "an OpenCLIP model needs open_clip_torch: pip install 'precision-convert[openclip]'",
            source.root,
        ) from None
    model = open_clip.create_model(f"local-dir:{source.root}", load_weights=False)
    state = {t.name: _read(t) for t in source.tensors()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        first = (result.missing_keys or result.unexpected_keys)[0]
        raise InputError(
            f"weights do not fit {type(model).__name__} built from open_clip_config.json "
            f"({len(result.missing_keys)} missing, {len(result.unexpected_keys)} unexpected, "
            f"e.g. {first!r})",
            source.root,
        )
    return model, _exact_keys(model)
