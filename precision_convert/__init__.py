"""precision-convert: rewrite PyTorch checkpoints to bf16/fp16 safely.

Example:
    >>> import precision_convert as pc
    >>> result = pc.convert("./tiny-t5", to="fp16-safe")
    >>> model = pc.load(result.output)

The public functions are imported on first use, so ``import precision_convert`` and
``precision-convert --help`` load neither torch nor transformers. The stages live in
``precision_convert.conversion`` (reading, planning, writing, loading, analysis),
``precision_convert.recipes`` and ``precision_convert.validation``; docs/architecture.md draws
the layers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from precision_convert.core._version import __version__

if TYPE_CHECKING:
    from precision_convert.api.conversion import convert
    from precision_convert.api.inspection import inspect_source as inspect
    from precision_convert.api.loading import load
    from precision_convert.hub import push
    from precision_convert.validation.certify.runner import validate

__all__ = ["__version__", "convert", "inspect", "load", "push", "validate"]

#: Public name -> (module, attribute) it is imported from on first use.
_LAZY = {
    "convert": ("precision_convert.api.conversion", "convert"),
    "inspect": ("precision_convert.api.inspection", "inspect_source"),
    "load": ("precision_convert.api.loading", "load"),
    "push": ("precision_convert.hub", "push"),
    "validate": ("precision_convert.validation.certify.runner", "validate"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'precision_convert' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later look-ups skip this function
    return value
