"""One way to turn a model directory into a model, per library.

Skeleton analysis (which modules are norms), the loader (``pc.load``), the fp32 baseline and
block-wise validation all build models; they ask this table, so what validation certifies is
built exactly as what users load. An :class:`Adapter` says, for one library, how to find the
class, build a weightless skeleton, load with the library's own ``from_pretrained`` and map
checkpoint names onto state-dict keys; :func:`read_tensor` reads one stored tensor.

Skeletons have parameters on the meta device and real buffers: non-persistent buffers (rotary
frequencies, causal masks) are computed at construction and are not in the checkpoint.

Whatever a library raises while building from a config it rejects (``num_attention_heads: 0``
is a ZeroDivisionError, ``hidden_size: "16"`` a validation error, an unknown ``model_type`` a
ValueError) leaves here as one :class:`~precision_convert.core.errors.CannotBuildModel` naming the
config key at fault when it can be told: a source that cannot be built is bad input.
"""

from __future__ import annotations

import importlib
import json
import linecache
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.plan import DIFFUSERS_RECORD_KEY, RECORD_KEY
from precision_convert.core.dtypes import DType
from precision_convert.core.errors import (
    CannotBuildModel,
    InputError,
    PrecisionConvertError,
    one_line,
)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

#: Maps a tensor name in the weight files to the model's state-dict key (None: no such key).
KeyMap = Callable[[str], str | None]
#: A model class of transformers, diffusers or open_clip. Their loaders (``from_config``,
#: ``from_pretrained``, ``load_config``) differ from library to library and are called as each
#: documents them, so the class is typed only as a class.
ModelClass = type[Any]


@dataclass(frozen=True)
class Adapter:
    """How one library builds a model from a directory (see the module docstring)."""

    library: str
    model_class: Callable[[ModelSource, bool], ModelClass]
    # (source, class, trust_remote_code)
    skeleton: Callable[[ModelSource, ModelClass, bool], nn.Module]
    pretrained: Callable[[ModelSource, ModelClass, torch.dtype, bool], nn.Module]
    key_map: Callable[[nn.Module], KeyMap]


def adapter(source: ModelSource) -> Adapter:
    """The adapter of ``source``'s library."""
    return _ADAPTERS[source.library]


def model_class(source: ModelSource, *, trust_remote_code: bool = False) -> ModelClass:
    """The class that builds ``source``: its config's class, remote code only when trusted.

    Raises:
        InputError: no class can be found, remote code is needed but not allowed, or the
            library is not installed.
    """
    with library_errors(source):
        return adapter(source).model_class(source, trust_remote_code)


def uses_remote_code(source: ModelSource, *, trust_remote_code: bool) -> bool:
    """Whether building ``source`` runs code shipped with the checkpoint: its config maps
    classes to that code (``auto_map``), and the user trusts it or transformers has no class
    of its own (Phi-3 ships an ``auto_map`` its native transformers class replaces)."""
    if source.library != "transformers" or not source.config.get("auto_map"):
        return False
    return trust_remote_code or _native_transformers_class(source) is None


#: Bytes of tensors the weight files do not hold that building a model may allocate beyond
#: the weights' own fp32 size: buffers its library computes from the config (rotary tables,
#: position ids, sincos position embeddings) and parameters larger than those stored. A
#: config that declares 10^9 positions, 10^6 frames or a 10^9 vocabulary would otherwise
#: have the library allocate gigabytes before anything runs; a real model's buffers are a
#: small part of its weights (CogVideoX-2B's 49-frame position table: 136 MB of 6.6 GB).
UNSTORED_ALLOWANCE = 256 << 20


def build_skeleton(
    source: ModelSource, *, trust_remote_code: bool = False, cls: ModelClass | None = None
) -> nn.Module:
    """``source``'s module tree with parameters on the meta device (no weight memory), in eval
    mode and with tied weights tied."""
    from accelerate import init_empty_weights

    chosen = adapter(source)
    cls = cls or model_class(source, trust_remote_code=trust_remote_code)
    check_declared_sizes(source, cls, trust_remote_code=trust_remote_code)
    with library_errors(source, cls), init_empty_weights(include_buffers=False):
        model = chosen.skeleton(source, cls, trust_remote_code)
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()
    return model.eval()


def build_pretrained(
    source: ModelSource,
    dtype: torch.dtype,
    *,
    trust_remote_code: bool = False,
    cls: ModelClass | None = None,
) -> nn.Module:
    """``source`` loaded by its library's own ``from_pretrained`` with every tensor in
    ``dtype`` (OpenCLIP: its skeleton filled from the files)."""
    chosen = adapter(source)
    cls = cls or model_class(source, trust_remote_code=trust_remote_code)
    check_declared_sizes(source, cls, trust_remote_code=trust_remote_code)
    with library_errors(source, cls):
        return chosen.pretrained(source, cls, dtype, trust_remote_code)


#: Configs :func:`check_declared_sizes` has passed in this process (see there).
_SIZES_CHECKED: set[tuple[str, str, int]] = set()


def _canonical_config(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def check_declared_sizes(source: ModelSource, cls: ModelClass, *, trust_remote_code: bool) -> None:
    """Refuse a config whose model would take more memory in tensors the weight files do not
    hold than the weights take in fp32 (and than :data:`UNSTORED_ALLOWANCE`): measured on a
    build with every tensor on the meta device, so nothing is allocated.

    Raises:
        CannotBuildModel: naming the largest such tensor and its shape.
    """
    from accelerate import init_empty_weights

    stored = sum(math.prod(t.shape) for t in source.tensors())
    # A run builds the same model many times (baseline, candidates, each way of loading): the
    # answer depends on the class, the config and the stored size only, so it is found once.
    key = (f"{cls.__module__}.{cls.__qualname__}", _canonical_config(source.config), stored)
    if key in _SIZES_CHECKED:
        return
    try:
        with init_empty_weights(include_buffers=True):
            model = adapter(source).skeleton(source, cls, trust_remote_code)
    except Exception:  # code that needs real values at construction: the real build decides
        return
    tensors = {name: (4 * p.numel(), p.shape) for name, p in model.named_parameters()}
    buffers = {name: (b.numel() * b.element_size(), b.shape) for name, b in model.named_buffers()}
    extra = sum(size for size, _ in tensors.values()) - 4 * stored
    unstored = sum(size for size, _ in buffers.values()) + max(0, extra)
    if unstored <= max(UNSTORED_ALLOWANCE, 4 * stored):
        _SIZES_CHECKED.add(key)
        return
    tensors.update(buffers)
    largest = max(tensors, key=lambda name: tensors[name][0])
    raise CannotBuildModel(
        f"{source.library} would allocate {unstored / 2**30:.1f} GiB that the weights "
        f"({4 * stored / 2**20:.1f} MiB in fp32) do not hold to build {cls.__name__} from it "
        f"(largest: {largest} {list(tensors[largest][1])}): a size it declares (positions, "
        "vocabulary, sample size, frames) is out of range",
        source.root / source.config_name,
    )


def key_map(model: nn.Module, source: ModelSource) -> KeyMap:
    """Checkpoint tensor name -> ``model``'s state-dict key, by the library's own rules."""
    return adapter(source).key_map(model)


def build_filled(
    source: ModelSource,
    dtype_of: Callable[[DType], torch.dtype],
    *,
    trust_remote_code: bool = False,
    cls: ModelClass | None = None,
) -> nn.Module:
    """The skeleton filled from the files one tensor at a time, each in ``dtype_of(stored)``.

    Peak memory is the model plus one tensor (``from_pretrained(dtype=float32)`` of a bf16
    checkpoint keeps the file's mapped pages next to the fp32 weights).

    Raises:
        WeightsDoNotMap: the weights do not map one-to-one onto the model's tensors (a
            library that fuses them on load); build with :func:`build_pretrained` instead.
    """
    from precision_convert.conversion.runtime.streaming import Streamer

    model = build_skeleton(source, trust_remote_code=trust_remote_code, cls=cls)
    streamer = Streamer(model, source, key_map(model, source), "cpu", dtype_of)
    streamer.load_keys("", list(streamer.owners))
    return model


@contextmanager
def library_errors(source: ModelSource, cls: ModelClass | None = None) -> Iterator[None]:
    """What the library raises while building ``source`` as one :class:`CannotBuildModel`.

    Only this project's own errors and running out of memory pass through unchanged (the
    first say what is wrong already, the second is not the source's fault).
    """
    try:
        yield
    except (PrecisionConvertError, MemoryError):
        raise
    except Exception as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # torch's, without importing torch here
            raise
        field = _field_at_fault(exc, source.config)
        what = f"{cls.__name__} " if cls is not None else ""
        at_fault = f" ({field!r} = {source.config[field]!r})" if field else ""
        raise CannotBuildModel(
            f"{source.library} cannot build the model {what}from it{at_fault}: "
            f"{_shortened(one_line(exc))}",
            source.root / source.config_name,
            field,
        ) from exc


def _shortened(text: str) -> str:
    """``text`` cut to 200 characters: a library's config error may quote the whole config."""
    return text if len(text) <= 200 else text[:199] + "…"


def _field_at_fault(exc: BaseException, config: Mapping[str, Any]) -> str | None:
    """The config key a library error is about, when the error tells.

    A key named in quotes in the message (``Validation error for field 'hidden_size'``); a
    value the message quotes or, when long enough not to match by chance, names
    (``model type `no-such-type```, ``NoSuchBlock2D does not exist``); for a division by zero,
    a key whose value is 0 that the failing code reads (``hidden_size % self.
    num_attention_heads``), searched from the innermost frame outwards.
    """
    message = str(exc)
    keys = [k for k in config if isinstance(k, str) and k != RECORD_KEY]
    for key in keys:
        if re.search(rf"[`'\"]{re.escape(key)}[`'\"]", message):
            return key
    for key in keys:
        for text in _strings(config[key]):
            quoted = rf"[`'\"]{re.escape(text)}[`'\"]"
            named = rf"\b{re.escape(text)}\b" if len(text) >= 6 else quoted
            if len(text) > 1 and re.search(f"{quoted}|{named}", message):
                return key
    if isinstance(exc, ZeroDivisionError):
        zero = [k for k in keys if config[k] == 0 and not isinstance(config[k], bool)]
        for line in _lines_outwards(exc.__traceback__):
            found = next((k for k in zero if re.search(rf"\b{re.escape(k)}\b", line)), None)
            if found:
                return found
    return None


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, str)]
    return []


def _lines_outwards(tb: TracebackType | None) -> list[str]:
    """The source line of each frame of a traceback, innermost first."""
    lines = []
    while tb is not None:
        lines.append(linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return lines[::-1]


def variant_keyword(source: ModelSource) -> dict[str, str]:
    """``variant=`` for the library's ``from_pretrained`` when the weights are a variant's."""
    return {"variant": source.variant} if source.variant else {}


def without_record(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config without our record: libraries would otherwise warn that they ignore it."""
    return {k: v for k, v in config.items() if k not in (RECORD_KEY, DIFFUSERS_RECORD_KEY)}


# --- transformers ------------------------------------------------------------------------------


def _native_transformers_class(source: ModelSource) -> ModelClass | None:
    """The class ``architectures`` names: transformers', or for a pipeline component the one
    its ``model_index.json`` names (diffusers' ``StableDiffusionSafetyChecker`` is a
    transformers model whose config reads as CLIP's), as diffusers itself would build it."""
    import transformers

    architecture = (source.config.get("architectures") or [None])[0]
    if not isinstance(architecture, str):
        return None
    native = getattr(transformers, architecture, None)
    if native is not None:  # not a model class: the model's own code (auto_map) names it
        return native if _model_like(native, architecture) else None
    entry = _model_index(source.root.parent).get(source.root.name)
    if isinstance(entry, list) and len(entry) == 2 and entry[1] == architecture:
        return component_class(str(entry[0]), architecture)
    return None


def _model_like(found: object, architecture: str) -> bool:
    """Whether ``found``, transformers' attribute named ``architecture``, is a model class."""
    import transformers

    return (
        isinstance(found, type)
        and not architecture.startswith("_")
        and (
            issubclass(found, transformers.PreTrainedModel)
            or found.__name__.startswith("AutoModel")
        )
    )


def _model_index(directory: Path) -> dict[str, Any]:
    """The pipeline index in ``directory`` ({} when there is none or it cannot be read)."""
    try:
        index = json.loads((directory / "model_index.json").read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _transformers_class(source: ModelSource, trust_remote_code: bool) -> ModelClass:
    """The class named in ``architectures``; remote code (``auto_map``) only when trusted."""
    import transformers

    architecture = (source.config.get("architectures") or [None])[0]
    auto_map = source.config.get("auto_map") or {}
    named = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if named is not None and not auto_map and not _model_like(named, architecture):
        # ``__class__`` is an attribute of transformers, but not a model
        raise CannotBuildModel(
            f"'architectures' names {architecture!r}, which is not a transformers model class",
            source.root / source.config_name,
            "architectures",
        )
    native = _native_transformers_class(source)
    if uses_remote_code(source, trust_remote_code=trust_remote_code):
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


def _transformers_skeleton(
    source: ModelSource, cls: ModelClass, trust_remote_code: bool
) -> nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        source.root, trust_remote_code=trust_remote_code
    )
    if cls.__name__.startswith("AutoModel"):
        return cls.from_config(config, trust_remote_code=trust_remote_code)
    return cls(config)


def _transformers_pretrained(
    source: ModelSource, cls: ModelClass, dtype: torch.dtype, trust_remote_code: bool
) -> nn.Module:
    return cls.from_pretrained(
        source.root, dtype=dtype, trust_remote_code=trust_remote_code, **variant_keyword(source)
    )


def _transformers_key_map(model: nn.Module) -> KeyMap:
    """Checkpoint key -> state-dict key, through transformers' own renaming rules.

    A key that transformers merges with others (a ``WeightConverter``: fused experts, fused
    qkv) maps to None: it lands in a parameter it shares (see :func:`merged_key_map`).
    """
    state = model.state_dict()
    rename = _transformers_renaming(model, state)
    if rename is None:  # transformers 4.x: no renaming tables, only the base-model prefix
        prefix = getattr(model, "base_model_prefix", "") or ""
        return lambda key: next(
            (k for k in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")) if k in state),
            None,
        )

    def key_of(key: str) -> str | None:
        if key in state:
            return key
        renamed, merged = rename(key)
        return renamed if not merged and renamed in state else None

    return key_of


def merged_key_map(model: nn.Module, source: ModelSource) -> KeyMap:
    """Checkpoint key -> the state-dict key of the parameter the library builds from it and
    other stored tensors together (transformers 5's ``WeightConverter``: Mixtral's per-expert
    ``experts.3.w1.weight`` lands in the fused ``mlp.experts.gate_up_proj``); None for a key
    that maps one-to-one or not at all, and for every key of other libraries."""
    state: dict[str, Any] = model.state_dict() if source.library == "transformers" else {}
    rename = _transformers_renaming(model, state) if state else None
    if rename is None:
        return lambda key: None

    def merged_into(key: str) -> str | None:
        if key in state:
            return None
        renamed, merged = rename(key)
        return renamed if merged and renamed in state else None

    return merged_into


def _transformers_renaming(
    model: nn.Module, state: dict[str, Any]
) -> Callable[[str], tuple[str, bool]] | None:
    """Checkpoint key -> (the key transformers loads it as, whether a ``WeightConverter``
    merges it there with other keys); None under transformers 4.x, which has no such rules."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return None
    # transformers' adapter builds only transformers models (PreTrainedModel subclasses).
    mapping = get_model_conversion_mapping(cast("PreTrainedModel", model))
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]

    def rename(key: str) -> tuple[str, bool]:
        renamed, merged = rename_source_key(key, renamings, converters, prefix, state)
        return renamed, merged is not None

    return rename


# --- diffusers ---------------------------------------------------------------------------------


def _diffusers_class(source: ModelSource, trust_remote_code: bool) -> ModelClass:
    import diffusers

    cls = getattr(diffusers, source.class_name or "", None)
    if not isinstance(cls, type):
        raise InputError(f"diffusers has no model class {source.class_name!r}", source.root)
    return cls


def _diffusers_skeleton(source: ModelSource, cls: ModelClass, trust_remote_code: bool) -> nn.Module:
    return cls.from_config(without_record(cls.load_config(source.root)))


@cache
def _diffusers_dtype_keyword() -> str:
    """``dtype`` where diffusers takes it (its pipelines then warn that ``torch_dtype`` is
    deprecated), else the ``torch_dtype`` every older release honours.

    ``from_pretrained`` takes ``**kwargs`` only, so the signature cannot tell; the loader's own
    code does (it pops ``"dtype"``), which holds across releases where a version number would
    have to be kept up to date by hand.
    """
    import inspect

    import diffusers

    try:
        code = inspect.getsource(diffusers.ModelMixin.from_pretrained)
    except (OSError, TypeError):  # no source shipped: the keyword every release takes
        return "torch_dtype"
    return "dtype" if 'kwargs.pop("dtype"' in code else "torch_dtype"


def _diffusers_pretrained(
    source: ModelSource, cls: ModelClass, dtype: torch.dtype, trust_remote_code: bool
) -> nn.Module:
    return cls.from_pretrained(
        source.root, **{_diffusers_dtype_keyword(): dtype}, **variant_keyword(source)
    )


# --- open_clip ---------------------------------------------------------------------------------


def _open_clip_class(source: ModelSource, trust_remote_code: bool) -> ModelClass:
    try:
        import open_clip
    except ImportError:
        raise InputError(
            "an OpenCLIP model needs open_clip_torch: pip install 'precision-convert[openclip]'",
            source.root,
        ) from None
    text = source.config.get("model_cfg", {}).get("text_cfg", {})
    return open_clip.model.CustomTextCLIP if text.get("hf_model_name") else open_clip.model.CLIP


def _open_clip_skeleton(source: ModelSource, cls: ModelClass, trust_remote_code: bool) -> nn.Module:
    # The class itself, not open_clip.create_model: that moves the model to a device (meta
    # cannot) and, without pretrained weights, logs that the model is random.
    return cls(**dict(source.config["model_cfg"]))


def _open_clip_pretrained(
    source: ModelSource, cls: ModelClass, dtype: torch.dtype, trust_remote_code: bool
) -> nn.Module:
    return build_filled(source, lambda stored: dtype if stored.is_float else stored.torch, cls=cls)


def _exact_keys(model: nn.Module) -> KeyMap:
    state = set(model.state_dict())
    return lambda key: key if key in state else None


_ADAPTERS: dict[str, Adapter] = {
    "transformers": Adapter(
        "transformers",
        _transformers_class,
        _transformers_skeleton,
        _transformers_pretrained,
        _transformers_key_map,
    ),
    "diffusers": Adapter(
        "diffusers", _diffusers_class, _diffusers_skeleton, _diffusers_pretrained, _exact_keys
    ),
    "open_clip": Adapter(
        "open_clip", _open_clip_class, _open_clip_skeleton, _open_clip_pretrained, _exact_keys
    ),
}


def component_class(library: str, class_name: str) -> ModelClass | None:
    """The class a pipeline's ``model_index.json`` names for a component (``[library, cls]``),
    or None when it cannot be imported."""
    module = (
        library if library in ("transformers", "diffusers") else f"diffusers.pipelines.{library}"
    )
    try:
        found = getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


#: The diffusers logger that questions a component passed to ``from_pretrained``, and what it
#: says of one whose class comes from a pipeline module (a safety checker).
_LOADING_LOGGER = "diffusers.pipelines.pipeline_loading_utils"
_NON_STANDARD = "You have passed a non-standard module"


def _drop_non_standard(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_NON_STANDARD)


@contextmanager
def declared_classes_unquestioned() -> Iterator[None]:
    """Drop diffusers' "non-standard module" warning (with the component's whole module
    printout) while the pipeline is assembled: each component passed is of the very class
    ``model_index.json`` declares, and a plain ``DiffusionPipeline.from_pretrained`` of the
    same folder says nothing. The filter is removed afterwards: no trace on the logger."""
    logger = logging.getLogger(_LOADING_LOGGER)
    logger.addFilter(_drop_non_standard)
    try:
        yield
    finally:
        logger.removeFilter(_drop_non_standard)
