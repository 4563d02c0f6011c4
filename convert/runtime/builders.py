"""One way to turn a model directory into a model, per library.

Skeleton analysis (which modules are norms), the loader (``pc.load``), the fp32 baseline and
block-wise validation all build models; they ask this table, so what validation certifies is
built exactly as what users load. An :class:`Adapter` says, for one library, how to find the
class, build a weightless skeleton, load with the library's own ``from_pretrained`` and map
checkpoint names onto state-dict keys; :func:`read_tensor` reads one stored tensor.

Skeletons have parameters on the meta device and real buffers: non-persistent buffers (rotary
frequencies, causal masks) are computed at construction and are not in the checkpoint.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.plan import DIFFUSERS_RECORD_KEY, RECORD_KEY
from precision_convert.dtypes import DType
from precision_convert.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Maps a tensor name in the weight files to the model's state-dict key (None: no such key).
KeyMap = Callable[[str], str | None]


@dataclass(frozen=True)
class Adapter:
    """How one library builds a model from a directory (see the module docstring)."""

    library: str
    model_class: Callable[[ModelSource, bool], type]
    skeleton: Callable[[ModelSource, type, bool], nn.Module]  # (source, class, trust_remote_code)
    pretrained: Callable[[ModelSource, type, torch.dtype, bool], nn.Module]
    key_map: Callable[[nn.Module], KeyMap]


def adapter(source: ModelSource) -> Adapter:
    """The adapter of ``source``'s library."""
    return _ADAPTERS[source.library]


def model_class(source: ModelSource, *, trust_remote_code: bool = False) -> type:
    """The class that builds ``source``: its config's class, remote code only when trusted.

    Raises:
        InputError: no class can be found, remote code is needed but not allowed, or the
            library is not installed.
    """
    return adapter(source).model_class(source, trust_remote_code)


def build_skeleton(
    source: ModelSource, *, trust_remote_code: bool = False, cls: type | None = None
) -> nn.Module:
    """``source``'s module tree with parameters on the meta device (no weight memory), in eval
    mode and with tied weights tied."""
    from accelerate import init_empty_weights

    chosen = adapter(source)
    cls = cls or chosen.model_class(source, trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = chosen.skeleton(source, cls, trust_remote_code)
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    return model.eval()


def build_pretrained(
    source: ModelSource,
    dtype: torch.dtype,
    *,
    trust_remote_code: bool = False,
    cls: type | None = None,
) -> nn.Module:
    """``source`` loaded by its library's own ``from_pretrained`` with every tensor in
    ``dtype`` (OpenCLIP: its skeleton filled from the files)."""
    chosen = adapter(source)
    cls = cls or chosen.model_class(source, trust_remote_code)
    return chosen.pretrained(source, cls, dtype, trust_remote_code)


def key_map(model: nn.Module, source: ModelSource) -> KeyMap:
    """Checkpoint tensor name -> ``model``'s state-dict key, by the library's own rules."""
    return adapter(source).key_map(model)


def build_filled(
    source: ModelSource,
    dtype_of: Callable[[DType], torch.dtype],
    *,
    trust_remote_code: bool = False,
    cls: type | None = None,
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


def variant_keyword(source: ModelSource) -> dict[str, str]:
    """``variant=`` for the library's ``from_pretrained`` when the weights are a variant's."""
    return {"variant": source.variant} if source.variant else {}


def without_record(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config without our record: libraries would otherwise warn that they ignore it."""
    return {k: v for k, v in config.items() if k not in (RECORD_KEY, DIFFUSERS_RECORD_KEY)}


# --- transformers ------------------------------------------------------------------------------


def _transformers_class(source: ModelSource, trust_remote_code: bool) -> type:
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


def _transformers_skeleton(source: ModelSource, cls: type, trust_remote_code: bool) -> nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        source.root, trust_remote_code=trust_remote_code
    )
    if cls.__name__.startswith("AutoModel"):
        return cls.from_config(config, trust_remote_code=trust_remote_code)
    return cls(config)


def _transformers_pretrained(
    source: ModelSource, cls: type, dtype: torch.dtype, trust_remote_code: bool
) -> nn.Module:
    return cls.from_pretrained(
        source.root, dtype=dtype, trust_remote_code=trust_remote_code, **variant_keyword(source)
    )


def _transformers_key_map(model: nn.Module) -> KeyMap:
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


# --- diffusers ---------------------------------------------------------------------------------


def _diffusers_class(source: ModelSource, trust_remote_code: bool) -> type:
    import diffusers

    cls = getattr(diffusers, source.class_name or "", None)
    if not isinstance(cls, type):
        raise InputError(f"diffusers has no model class {source.class_name!r}", source.root)
    return cls


def _diffusers_skeleton(source: ModelSource, cls: type, trust_remote_code: bool) -> nn.Module:
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
    source: ModelSource, cls: type, dtype: torch.dtype, trust_remote_code: bool
) -> nn.Module:
    return cls.from_pretrained(
        source.root, **{_diffusers_dtype_keyword(): dtype}, **variant_keyword(source)
    )


# --- open_clip ---------------------------------------------------------------------------------


def _open_clip_class(source: ModelSource, trust_remote_code: bool) -> type:
    try:
        import open_clip
    except ImportError:
        raise InputError(
            "an OpenCLIP model needs open_clip_torch: pip install 'precision-convert[openclip]'",
            source.root,
        ) from None
    text = source.config.get("model_cfg", {}).get("text_cfg", {})
    return open_clip.model.CustomTextCLIP if text.get("hf_model_name") else open_clip.model.CLIP


def _open_clip_skeleton(source: ModelSource, cls: type, trust_remote_code: bool) -> nn.Module:
    # The class itself, not open_clip.create_model: that moves the model to a device (meta
    # cannot) and, without pretrained weights, logs that the model is random.
    return cls(**dict(source.config["model_cfg"]))


def _open_clip_pretrained(
    source: ModelSource, cls: type, dtype: torch.dtype, trust_remote_code: bool
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


def component_class(library: str, class_name: str) -> type | None:
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
