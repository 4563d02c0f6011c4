"""Filling a meta-device skeleton from its files, one tensor (or one block) at a time.

A :class:`Streamer` knows which file tensor fills each of a skeleton's tensors (ties share
one) and materializes a set of them on demand, then puts the placeholders back: the baseline
(:func:`~.builders.build_filled`) loads everything once, block-wise validation one block per
forward. :func:`install_placeholders` and :class:`LoadOnUse` keep weights that model code
touches outside their block answering correctly without being resident.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.io.tensors import LazyTensor, read_tensor
from precision_convert.conversion.runtime.memory import release_freed_memory
from precision_convert.core.dtypes import DType
from precision_convert.core.errors import WeightsDoNotMap

#: Checkpoint name -> state-dict key (see :mod:`.builders`).
KeyMap = Callable[[str], str | None]
#: The dtype a stored tensor is materialized in (stored dtypes, or fp32 for a baseline).
DtypeOf = Callable[[DType], torch.dtype]
#: (module, attribute, dotted name of the tensor)
Holder = tuple[nn.Module, str, str]

#: Tensor functions that only read metadata: a weight read this way was not computed with.
METADATA_FUNCTIONS = frozenset(
    {
        "dtype",
        "shape",
        "device",
        "size",
        "dim",
        "ndim",
        "numel",
        "is_floating_point",
        "requires_grad",
        "is_contiguous",
        "element_size",
        "stride",
        "layout",
        "is_cuda",
        "is_meta",
        "__len__",
        "names",
        "data_ptr",
        "is_complex",
        "nelement",
        "itemsize",
        "nbytes",
    }
)


def function_name(func: Any) -> str:
    """The name of a torch function as ``__torch_function__`` sees it (properties by name)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def stored_dtype(stored: DType) -> torch.dtype:
    """Materialize every tensor as the file stores it (what ``pc.load`` holds)."""
    return stored.torch


def fp32_dtype(stored: DType) -> torch.dtype:
    """Materialize floating tensors in fp32 (the baseline), others as stored."""
    return torch.float32 if stored.is_float else stored.torch


def owners(model: nn.Module) -> dict[str, list[Holder]]:
    """State-dict key -> every (module, attribute, name) holding that tensor (ties share a key)."""
    by_id: dict[int, str] = {}
    found: dict[str, list[Holder]] = {}
    for prefix, module in model.named_modules():
        tensors = list(module._parameters.items()) + [
            (n, b)
            for n, b in module._buffers.items()
            if n not in module._non_persistent_buffers_set
        ]
        for local, tensor in tensors:
            if tensor is None:
                continue
            name = f"{prefix}.{local}" if prefix else local
            found.setdefault(by_id.setdefault(id(tensor), name), []).append((module, local, name))
    return found


def weight_map(model: nn.Module, source: ModelSource, key_of: KeyMap) -> dict[str, LazyTensor]:
    """State-dict key -> the file tensor that fills it; a tied tensor stored under one of its
    names fills every holder.

    Raises:
        WeightsDoNotMap: a model tensor has no file tensor (the library fuses or renames on
            load in a way ``key_of`` does not express).
    """
    by_key = {key: t for t in source.tensors() if (key := key_of(t.name)) is not None}
    found: dict[str, LazyTensor] = {}
    for key, holders in owners(model).items():
        hit = next((by_key[name] for _, _, name in holders if name in by_key), None)
        if hit is None:
            raise WeightsDoNotMap(f"no stored tensor fills {key!r}", source.root)
        found[key] = hit
    return found


@dataclass
class Streamer:
    """Materializes sets of a skeleton's tensors and puts the placeholders back after."""

    model: nn.Module
    source: ModelSource
    key_of: KeyMap
    device: torch.device | str
    dtype_of: DtypeOf
    on_load: Callable[[nn.Parameter, str], None] | None = None  # told what each load is
    weights: dict[str, LazyTensor] = field(default_factory=dict)
    owners: dict[str, list[Holder]] = field(default_factory=dict)
    keys_by_block: dict[str, list[str]] = field(default_factory=dict)
    saved: dict[str, list[tuple[dict[str, Any], str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.owners = owners(self.model)
        self.weights = weight_map(self.model, self.source, self.key_of)

    def assign(self, blocks: list[str]) -> list[str]:
        """Give each tensor key to every block holding it (tied weights live in several);
        return the keys no block holds (they stay resident)."""
        rest = []
        for key, holders in self.owners.items():
            found = {b for b in blocks for _, _, name in holders if name.startswith(b + ".")}
            for block in found:
                self.keys_by_block.setdefault(block, []).append(key)
            if not found:
                rest.append(key)
        return rest

    def tensor(self, key: str) -> torch.Tensor:
        stored = self.weights[key]
        return read_tensor(stored, self.dtype_of(stored.dtype), self.device)

    def load_keys(self, tag: str, keys: list[str]) -> None:
        """Materialize ``keys`` in every module holding them; :meth:`unload` puts back what was
        there (the placeholders)."""
        saved = []
        for key in keys:
            value = self.tensor(key)
            param = nn.Parameter(value, requires_grad=False)  # one object: ties stay tied
            if self.on_load is not None:
                self.on_load(param, key)
            for module, local, _ in self.owners[key]:
                # The module's parameters or its buffers: each slot is put back where it was.
                table: dict[str, Any] = (
                    module._parameters if local in module._parameters else module._buffers
                )
                saved.append((table, local, table[local]))
                table[local] = param if table is module._parameters else value
        self.saved[tag] = saved

    def unload(self, tag: str) -> None:
        for table, local, old in self.saved.pop(tag, []):
            table[local] = old
        release_freed_memory()


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move the real buffers (``model.to`` would trip over the meta parameters)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)


Placeholders = dict[int, tuple[str, torch.Tensor]]


def install_placeholders(streamer: Streamer) -> Placeholders:
    """Replace every weight by a placeholder: right shape, dtype and device, no memory.

    Model code reads weights outside their module's forward (``self.device``, T5's
    ``relative_attention_bias.weight.device``), which meta tensors would answer with "meta".
    A placeholder is one NaN expanded to the full shape: its metadata is right, :class:`LoadOnUse`
    swaps in the real tensor wherever its values are used outside a streamed block, and any use
    that still slips through turns the output NaN, which is caught, never silent.

    Returns:
        id of each placeholder -> (key of the tensor it stands for, the placeholder).
    """
    found: Placeholders = {}
    for key, holders in streamer.owners.items():
        stored = streamer.weights[key].dtype
        shape = streamer.weights[key].shape
        fill = math.nan if stored.is_float else 0
        placeholder = torch.full(
            (1,) * len(shape), fill, dtype=streamer.dtype_of(stored), device=streamer.device
        ).expand(shape)
        is_param = any(local in module._parameters for module, local, _ in holders)
        param = nn.Parameter(placeholder, requires_grad=False) if is_param else None
        stand_in = param if param is not None else placeholder  # one object: ties stay tied
        for module, local, _ in holders:
            if local in module._parameters:
                module._parameters[local] = param
            else:
                module._buffers[local] = stand_in
        # Keyed by id, so the object is held too: a freed object's id can be reused.
        found[id(stand_in)] = (key, stand_in)
    return found


class LoadOnUse(TorchFunctionMode):
    """Weights used outside a streamed block — a parent reading ``child.weight`` (Whisper's
    positions), a module no hook covers — are read for that one operation and dropped."""

    def __init__(self, streamer: Streamer, placeholders: Placeholders) -> None:
        super().__init__()
        self.streamer = streamer
        self.placeholders = placeholders

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        # A placeholder answers metadata questions itself; only its values need the file.
        if function_name(func) not in METADATA_FUNCTIONS:
            loaded: dict[str, torch.Tensor] = {}

            def real(value: Any) -> Any:
                is_tensor = isinstance(value, torch.Tensor)
                entry = self.placeholders.get(id(value)) if is_tensor else None
                if entry is None or entry[1] is not value:
                    return value
                key = entry[0]
                if key not in loaded:
                    loaded[key] = self.streamer.tensor(key)
                return loaded[key]

            args, kwargs = tree_map(real, (args, kwargs))
        return func(*args, **kwargs)
