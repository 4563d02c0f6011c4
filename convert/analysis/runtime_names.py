"""The module each stored unit runs as, where the library renames or fuses it on load.

transformers 5 loads some checkpoints into modules of other names: Mixtral's stored
``model.layers.0.block_sparse_moe.experts.3.w1`` lands in the fused experts module
``model.layers.0.mlp.experts`` (one ``gate_up_proj`` for every expert's ``w1`` and ``w3``), its
router ``block_sparse_moe.gate`` in ``mlp.gate``. A plan is made of stored names (the record's
contract, docs/format.md), but users name the modules the model runs (``--keep-fp32
model.layers.0.mlp.experts``), and a fused module can only be kept in fp32 whole: the stored
units fused into one runtime module share one dtype.

The names are read from a meta-device skeleton through the library's own renaming rules
(:func:`~precision_convert.conversion.runtime.builders.key_map`); only models whose type has
such rules are built, and only when some stored name is not one the model has: asking
transformers for its rules imports its loading machinery (``torch.distributed.tensor`` with
it), which a checkpoint stored under the model's own names (every dense model) never needs.
"""

from __future__ import annotations

import logging
from typing import Any

from precision_convert.conversion.analysis.norms import skeleton_norms
from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.runtime.builders import build_skeleton, key_map, merged_key_map
from precision_convert.core.names import module_of, units

logger = logging.getLogger(__name__)

__all__ = ["runtime_modules"]


def runtime_modules(source: ModelSource, *, trust_remote_code: bool = False) -> dict[str, str]:
    """Stored unit -> the name of the module (or tensor, for a unit that is one tensor) the
    model runs it as, for every unit the library renames or fuses on load; stored units fused
    into one module all map to its name. Empty when nothing is renamed or no skeleton can be
    built (names are then taken as stored)."""
    if source.library != "transformers" or _stored_as_run(source, trust_remote_code):
        return {}
    if not _renames_on_load(source):
        return {}
    try:
        model = build_skeleton(source, trust_remote_code=trust_remote_code)
    except Exception as exc:  # no skeleton only means the stored names are the only names
        logger.info("no skeleton for %s (%s); modules named as stored", source.root, exc)
        return {}
    key_of, merged_into = key_map(model, source), merged_key_map(model, source)
    out: dict[str, str] = {}
    for name, unit in units(t.name for t in source.tensors()).items():
        fused = merged_into(name)
        key = key_of(name)
        if fused is not None:
            out[unit] = module_of(fused)
        elif key is not None and key != name:
            out[unit] = key if unit == name else module_of(key)
    return {unit: run_as for unit, run_as in out.items() if run_as != unit}


def _stored_as_run(source: ModelSource, trust_remote_code: bool) -> bool:
    """Whether every stored tensor name is a key of the model's state dict, or no skeleton can
    be built: either way :func:`runtime_modules` has nothing to say, so neither transformers'
    renaming rules nor a skeleton of its own need be asked.

    Sound whatever rules transformers has: :func:`runtime_modules` reports a stored name only
    where ``key_map`` maps it to another key or ``merged_key_map`` to a fused one, and for a
    name that is a key of the skeleton's state dict the first answers the name itself and the
    second nothing (it loads where it is, under 4.x and 5.x alike). The keys come from
    :func:`skeleton_norms`: the skeleton :func:`build_skeleton` builds with the same
    ``trust_remote_code``, read from the user cache when it holds them (then nothing of
    transformers' loading is imported); where that builds none, it builds none below either.
    """
    found = skeleton_norms(source, trust_remote_code=trust_remote_code)
    return found is None or found.state_keys.issuperset(t.name for t in source.tensors())


def _renames_on_load(source: ModelSource) -> bool:
    """Whether transformers has renaming rules for ``source``'s model type (none under 4.x)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    model_type: Any = source.config.get("model_type")
    return isinstance(model_type, str) and bool(get_checkpoint_conversion_mapping(model_type))
