"""Giving freed memory back to the operating system.

glibc raises its mmap threshold after a large free, so later tensors of that size come from
the heap, and freed heap pages stay in the process's RSS. Without a trim, a dropped fp32
baseline (or a dropped block) keeps its memory while the next model loads: peak memory becomes
baseline + candidate instead of the larger of the two. Within one forward no trim can help;
:func:`map_large_allocations` keeps the threshold where it starts for processes the command
owns.
"""

from __future__ import annotations

import ctypes
import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


#: Allocations this large or larger get a mapping of their own, unmapped when freed.
LARGE_ALLOCATION = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


@cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, where there is one (Linux); None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def release_freed_memory() -> None:
    """Return free heap pages to the OS (a no-op where the C library is not glibc)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def map_large_allocations() -> None:
    """Serve every allocation of :data:`LARGE_ALLOCATION` or more from its own mapping, for the
    rest of the process (a no-op where the C library is not glibc).

    By default glibc raises its mmap threshold to the size of each block of up to 32 MiB it
    frees, so after a forward's first MLP activation is freed, the rest come from the heap;
    there they interleave with smaller live blocks, and the heap grows past what is live. On a
    1B Llama's fp32 sweep this made one forward's peak above its start 0.18 GiB in one run and
    0.96 GiB in another (same inputs; the heap's history differs); at a fixed 1 MiB it was 0.17
    to 0.19 GiB in every run (8 MiB still let it reach 0.53). The price is page faults on
    every fresh mapping: the certificate bench's runs took 15% (265M) to 44% (55M) longer
    against floors within 9%. Process-wide and permanent (glibc has no way back to the moving
    threshold), so only the command and its batch workers, which own their processes, call it.
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION)


def _free_model(gone: weakref.ref[Any], device: torch.device | None = None) -> None:
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


class Held:
    """The one strong reference to a model inside a :func:`freed` block: code in the block
    reads and sets ``model`` here and keeps no other reference past the block."""

    __slots__ = ("model",)

    def __init__(self, model: Any) -> None:
        self.model = model


@contextmanager
def freed(model: Any = None, device: torch.device | None = None) -> Iterator[Held]:
    """Hold ``model`` (or the one the block loads into ``held.model``) for the block, and free
    it at the block's end, whatever ends it: the reference dropped, then :func:`_free_model`
    (``device``'s cache emptied too), so the next model to load is the only one resident.

    A context manager cannot drop its caller's variables, so the model lives in the yielded
    :class:`Held` only::

        with freed(load(directory), device) as candidate:
            run_probes(candidate.model, inputs)
    """
    held = Held(model)
    del model
    try:
        yield held
    finally:
        model, held.model = held.model, None
        if model is not None:
            gone = weakref.ref(model)
            del model
            _free_model(gone, device)
