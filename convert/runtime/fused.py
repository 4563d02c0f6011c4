"""Parameters a library builds from several stored tensors, given back their stored dtype.

transformers 5 fuses a mixture of experts at load time: Mixtral's checkpoint stores each
expert's ``block_sparse_moe.experts.E.w1/w2/w3`` and the model runs one ``mlp.experts`` module
whose ``gate_up_proj`` stacks every expert's ``w1`` and ``w3`` (its ``WeightConverter``). Its
``from_pretrained(dtype=float16)`` merges the per-expert tensors in fp16, so an fp32 island that
is a whole fused module has to be merged again from the files in fp32.

The merge is the library's own, run backwards: transformers' ``revert_weight_conversion`` (the
split ``save_pretrained`` performs) is applied to a tensor of element indices shaped like the
fused parameter, which says where each element of each stored tensor lands. Every conversion
of this kind only moves elements (stack, concatenate, split, transpose), so the stored values
are scattered into place exactly, with no second reading of the rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.io.tensors import LazyTensor, read_tensor
from precision_convert.core.dtypes import DType
from precision_convert.core.errors import InputError
from precision_convert.core.names import stored_spelling

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

__all__ = ["restore_fused"]


def restore_fused(
    model: nn.Module,
    merged: Mapping[str, Sequence[LazyTensor]],
    compute: DType,
    source: ModelSource,
) -> None:
    """Give each fused parameter the dtype its stored tensors share, merged again from them.

    Args:
        model: a transformers model built by ``from_pretrained`` in ``compute``.
        merged: state-dict key of a fused parameter -> the stored tensors merged into it.
        compute: the dtype the library loaded every tensor in.
        source: the directory the tensors are read from (named in errors).

    Raises:
        InputError: the tensors merged into one parameter are stored in different dtypes,
            or the library's split of the parameter does not give back the stored tensors.
    """
    state = model.state_dict(keep_vars=True)
    for key, stored in merged.items():
        by_dtype: dict[DType, list[str]] = {}
        for t in stored:
            by_dtype.setdefault(t.dtype, []).append(t.name)
        if len(by_dtype) > 1:
            found = ", ".join(
                f"{min(names)} {dtype.short}" + (f" and {len(names) - 1} more" if names[1:] else "")
                for dtype, names in sorted(by_dtype.items(), key=lambda item: len(item[1]))
            )
            raise InputError(
                f"{type(model).__name__} fuses the stored tensors of {key!r} into one "
                f"parameter, but they are stored in different dtypes ({found}), so their "
                "dtypes cannot be kept",
                source.root,
            )
        dtype = next(iter(by_dtype))
        target = state[key]
        if dtype != compute and target.dtype != dtype.torch:
            target.data = _merged(model, key, stored, dtype.torch, target, source)


def _merged(
    model: nn.Module,
    key: str,
    stored: Sequence[LazyTensor],
    dtype: torch.dtype,
    target: torch.Tensor,
    source: ModelSource,
) -> torch.Tensor:
    """The parameter ``key`` built from ``stored`` in ``dtype``, where the library's own
    split of it places each stored element."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    # Element indices cost as much as the fp32 parameter while the merge runs (int32 up to
    # 2**31 elements: a Mixtral-8x7B layer's gate_up_proj has 0.94e9).
    wide = target.numel() >= 2**31
    index = torch.arange(target.numel(), dtype=torch.int64 if wide else torch.int32)
    index = index.reshape(target.shape)
    # Only transformers fuses stored tensors (builders.merged_key_map): a PreTrainedModel.
    places = revert_weight_conversion(cast("PreTrainedModel", model), {key: index})
    names = {t.name for t in stored}
    # The split names tensors as the whole model saves them; the checkpoint may lack or add
    # the base-model prefix.
    prefix = getattr(model, "base_model_prefix", "") or ""
    by_name = {
        stored_spelling(name, prefix, names) or name: where for name, where in places.items()
    }
    if set(by_name) != names:
        missing = sorted(names ^ set(by_name))[:3]
        raise InputError(
            f"{type(model).__name__}'s split of the fused parameter {key!r} does not give back "
            f"its stored tensors (differing: {', '.join(missing)}), so their dtype cannot be "
            "kept",
            source.root,
        )
    out = torch.empty(target.shape, dtype=dtype, device=target.device)
    flat = out.view(-1)
    for t in stored:
        where = by_name[t.name]
        if tuple(where.shape) != tuple(t.shape):
            raise InputError(
                f"{t.name!r} is stored with shape {tuple(t.shape)} but {type(model).__name__} "
                f"fuses a {tuple(where.shape)} slice of it into {key!r}",
                source.root,
            )
        places_of = where.reshape(-1).to(device=target.device, dtype=torch.int64)
        flat[places_of] = read_tensor(t, dtype, target.device).reshape(-1)
    return out
