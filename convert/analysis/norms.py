"""Find normalization modules, and modules that share their weights, on a meta-device skeleton
of the model.

The model is built from its config with no weights by
:func:`~precision_convert.conversion.runtime.builders.build_skeleton` (the builder ``pc.load``
and validation use), so even a 70B model costs no memory. When no class can be built (remote
code not allowed, a library not installed, an unknown class), names are used instead.

What a skeleton found is kept in a user cache (:mod:`.norm_cache`), so a later run on the same
class and config imports neither the library nor builds anything.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from precision_convert.conversion.analysis import norm_cache
from precision_convert.conversion.analysis.norm_cache import SkeletonNorms
from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.runtime import builders
from precision_convert.conversion.runtime.builders import build_skeleton
from precision_convert.core.names import module_of, stored_spelling

logger = logging.getLogger(__name__)

#: Class names of normalization layers across torch, transformers, diffusers and open_clip
#: (LayerNorm, RMSNorm, T5LayerNorm, LlamaRMSNorm, GroupNorm, LayerNormFp32, BatchNorm2d…).
_NORM_CLASS = re.compile(r".*(Norm|Norm\dd|NormFp32|Norm2D|NormNd)$")
#: Name components that denote a normalization module when there is no class to look at.
_NORM_NAME = re.compile(r"(?i).*norm.*|ln|ln_.*|ln\d+")


def normalization_modules(source: ModelSource, *, trust_remote_code: bool = False) -> set[str]:
    """Names (as in the checkpoint) of every normalization module that owns parameters."""
    found = skeleton_norms(source, trust_remote_code=trust_remote_code)
    if found is None:
        return _by_name(t.name for t in source.tensors() if len(t.shape) <= 1)
    return _align_names(found, {module_of(t.name) for t in source.tensors()})


def skeleton_norms(
    source: ModelSource, *, trust_remote_code: bool = False, use_cache: bool = True
) -> SkeletonNorms | None:
    """The normalization modules of ``source``'s skeleton (and the rest of
    :class:`SkeletonNorms`), in the skeleton's own names; None when no skeleton can be built.
    Read from the cache when it holds them (``use_cache``)."""
    if not trust_remote_code and builders.uses_remote_code(source, trust_remote_code=False):
        return None  # remote code is never run to find norms; names serve instead
    key = None
    remote = builders.uses_remote_code(source, trust_remote_code=trust_remote_code)
    if use_cache and not remote:  # remote code may change: not cached
        key = norm_cache.cache_key(source.library, source.class_name, source.config, _CODE)
    if key is not None and (cached := norm_cache.load(key)) is not None:
        return cached
    model = _skeleton(source, trust_remote_code=trust_remote_code)
    if model is None:
        return None  # failures are not cached: a missing library may be installed later
    found = SkeletonNorms(
        frozenset(
            name for name, module in model.named_modules() if name and _is_normalization(module)
        ),
        getattr(model, "base_model_prefix", "") or "",
        _tied_groups(model),
        frozenset(model.state_dict()),
    )
    if key is not None:
        norm_cache.store(key, found)
    return found


def tied_tensors(source: ModelSource, *, trust_remote_code: bool = False) -> dict[str, str]:
    """Parameters that share their storage with a tensor the checkpoint stores (a head tied
    to the embedding: ``lm_head.weight`` -> ``model.embed_tokens.weight``): every name of the
    skeleton's shared parameter that the checkpoint does not store -> the one it stores. Names
    are the checkpoint's where it stores the tensor's module, else the model's. Empty when no
    skeleton can be built.

    The checkpoint stores a tied parameter once, under one of its names, so a user's name for
    the other module matches no stored tensor of it; this says which stored one it is. A name
    the checkpoint stores too is its own tensor, not an alias: transformers leaves such names
    untied when their values differ (a T5 whose config unties the head stores all four)."""
    found = skeleton_norms(source, trust_remote_code=trust_remote_code)
    if found is None:
        return {}
    names = {t.name for t in source.tensors()}
    modules = {module_of(name) for name in names}
    out: dict[str, str] = {}
    for group in found.tied:
        spelled = [_spelled(name, found.prefix, names, modules) for name in group]
        holder = next((name for name, stored in spelled if stored), None)
        if holder is None:
            continue
        out.update({name: holder for name, stored in spelled if not stored})
    return out


def _spelled(parameter: str, prefix: str, names: set[str], modules: set[str]) -> tuple[str, bool]:
    """``parameter`` as the checkpoint spells it, and whether the checkpoint stores it: its
    own stored name, else its module's stored spelling with its own leaf, else as is."""
    stored = stored_spelling(parameter, prefix, names)
    if stored is not None:
        return stored, True
    module, _, leaf = parameter.rpartition(".")
    owner = stored_spelling(module, prefix, modules) if module else None
    return (f"{owner}.{leaf}" if owner else parameter), False


def _tied_groups(model: Any) -> tuple[tuple[str, ...], ...]:
    """Groups of parameter names (``lm_head.weight``) that are one parameter object, sorted."""
    names: dict[int, set[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), set()).add(name)
    return tuple(sorted({tuple(sorted(group)) for group in names.values() if len(group) > 1}))


def _is_normalization(module: Any) -> bool:
    """A leaf normalization layer that owns parameters.

    Normalization is decided by class (torch's norm classes and anything named ``*Norm``); a
    "norm" with child modules (diffusers' AdaLayerNorm: a large Linear plus a LayerNorm) is a
    conditioning projection, not a normalization layer, and is left to its children.
    """
    import torch.nn as nn

    norm_types = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)
    is_norm = isinstance(module, norm_types) or bool(_NORM_CLASS.match(type(module).__name__))
    has_children = any(True for _ in module.children())
    return is_norm and not has_children and any(True for _ in module.parameters(recurse=False))


def _by_name(tensor_names: Iterable[str]) -> set[str]:
    # Only 1-D tensors are considered (norm scales and shifts), so an "AdaLayerNorm" whose
    # parameters are a 2-D Linear never matches.
    modules = {module_of(n) for n in tensor_names}
    return {m for m in modules if m and _NORM_NAME.fullmatch(m.rpartition(".")[2])}


def _align_names(found: SkeletonNorms, checkpoint_modules: set[str]) -> set[str]:
    """Map skeleton module names onto checkpoint names (base-model prefix added or dropped)."""
    aligned = (stored_spelling(name, found.prefix, checkpoint_modules) for name in found.modules)
    return {name for name in aligned if name is not None}


#: The code a cached answer depends on besides the libraries: this module and the builders.
_CODE = (Path(__file__), Path(builders.__file__))


def _skeleton(source: ModelSource, *, trust_remote_code: bool) -> Any | None:
    try:
        return build_skeleton(source, trust_remote_code=trust_remote_code)
    except Exception as exc:  # any failure only means "fall back to names"
        logger.info("no skeleton for %s (%s); finding norms by name", source.root, exc)
        return None
