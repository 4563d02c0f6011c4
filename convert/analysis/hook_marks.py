"""Marks on forward hooks that say how they may be called.

The output head of a summarized probe (:mod:`~precision_convert.validation.probe.run.head`)
computes its rows in chunks, or only the kept ones, when the hooks on it allow that. A hook
marked :func:`row_wise` reduces what it sees row by row (peaks, sums, counts), so it may be
called on a tensor's rows a chunk at a time; any unmarked hook sees the head run whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

#: The attribute :func:`row_wise` sets on a hook.
ROW_WISE = "_precision_convert_row_wise"
_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def row_wise(hook: _Hook) -> _Hook:
    """Mark ``hook`` as reducing row by row (see the module docstring)."""
    setattr(hook, ROW_WISE, True)
    return hook
