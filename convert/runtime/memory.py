"""Giving freed memory back to the operating system.

glibc raises its mmap threshold after a large free, so later tensors of that size come from
the heap, and freed heap pages stay in the process's RSS. Without a trim, a dropped fp32
baseline (or a dropped block) keeps its memory while the next model loads: peak memory becomes
baseline + candidate instead of the larger of the two.
"""

from __future__ import annotations

import ctypes
import gc
import weakref
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, where there is one (Linux); None elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return free heap pages to the OS (a no-op where the C library has no ``malloc_trim``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def free_model(gone: weakref.ref[Any], device: torch.device | None = None) -> None:
    """Make sure a deleted model's memory is back before the next one loads.

    Call after the last reference is dropped, with a weak reference to the model. Reference
    counting frees most models at ``del``; a full ``gc.collect()`` (a fifth of a second with
    transformers imported) runs only when a reference cycle kept this one alive.
    """
    if gone() is not None:
        gc.collect()
    release_freed_memory()
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
