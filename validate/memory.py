"""Giving freed memory back to the operating system.

glibc raises its mmap threshold after a large free, so later tensors of that size come from
the heap, and freed heap pages stay in the process's RSS. Without a trim, a dropped fp32
baseline (or a dropped block) keeps its memory while the next model loads: peak memory becomes
baseline + candidate instead of the larger of the two.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache


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
