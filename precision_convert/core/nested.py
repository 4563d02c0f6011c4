"""Walking the nested values models take and return: tensors inside dicts, lists, tuples,
named tuples and ``ModelOutput``-style mappings.

Calibration, validation and block-wise comparison all need "every tensor in this output" or
"this output with each tensor replaced"; one walker keeps them agreeing on what a nested value
is. (The boundary hooks keep their own, stricter walk: they run on every forward.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def leaves(value: Any) -> Iterator[Any]:
    """Every leaf of ``value`` (what is not a mapping, list or tuple), depth first, in order."""
    if isinstance(value, Mapping):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from leaves(item)
    else:
        yield value


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, depth first, in order."""
    import torch

    return (leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor))


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``; other leaves kept as they are.

    Mappings come back as plain dicts, which every ``**kwargs`` call accepts.
    """
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(map_tensors(v, fn) for v in value)
    return value
