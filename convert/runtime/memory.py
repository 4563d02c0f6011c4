"""Giving freed memory back to the operating system.

glibc raises its mmap threshold after a large free, so later tensors of that size come from
the heap, and freed heap pages stay in the process's RSS. Without a trim, a dropped fp32
baseline (or a dropped block) keeps its memory while the next model loads: peak memory becomes
baseline + candidate instead of the larger of the two. Within one forward no trim can help;
in processes the command owns (:func:`own_heap`), recording hooks (calibration's, the fp32
baseline's factor peaks) run with large allocations mapped afresh
(:func:`large_allocations_mapped`), and everything else under a fixed threshold.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


#: Allocations this large or larger get a mapping of their own, unmapped when freed.
LARGE_ALLOCATION = 1 << 20
#: Where an owned heap's threshold stays outside :func:`large_allocations_mapped`: glibc's
#: own ceiling for its moving threshold (32 MiB on 64-bit), where a sweep's frees take it.
OWNED_THRESHOLD = 32 << 20
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
#: Whether this process's heap is the command's (:func:`own_heap`), and how many
#: :func:`large_allocations_mapped` blocks are open.
_owned = False
_open = 0
_open_lock = threading.Lock()


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
    """Serve every allocation of :data:`LARGE_ALLOCATION` or more from its own mapping, until
    the threshold is set again (a no-op where the C library is not glibc); in the command's
    processes only inside :func:`large_allocations_mapped`, where it pays.

    By default glibc raises its mmap threshold to the size of each block of up to 32 MiB it
    frees, so after a forward's first MLP activation is freed, the rest come from the heap;
    there they interleave with smaller live blocks, and the heap grows past what is live. On a
    1B Llama's hooked fp32 sweep this made one forward's peak above its start 0.18 GiB in one
    run and 0.96 GiB in another (same inputs; the heap's history differs); at a fixed 1 MiB it
    was 0.17 to 0.19 GiB in every run (8 MiB still let it reach 0.53). The price is page
    faults on every fresh mapping (kernel time), hence :func:`large_allocations_mapped`.
    """
    _set_threshold(LARGE_ALLOCATION)


def own_heap() -> None:
    """Declare this process's heap the command's, for the rest of the process: allocations
    below :data:`OWNED_THRESHOLD` come from the heap (no page faults on reuse), larger ones
    from mappings of their own, and inside :func:`large_allocations_mapped` those of
    :data:`LARGE_ALLOCATION` or more too. Process-wide and permanent (glibc has no way back to
    its moving threshold), so only the command and its batch workers, which own their
    processes, call it; in any other process the heap is left as it is. Large tensors there
    go on transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE``)."""
    global _owned
    _owned = True
    _set_threshold(OWNED_THRESHOLD)
    # torch reads this once, at its first allocation (so before torch is imported): tensors of
    # 2 MiB or more are then aligned to and advised onto transparent huge pages, one page
    # fault per 2 MiB instead of 512 (the zoo's Llama-3.2 bf16-safe: kernel time 21 s -> 17 s).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@contextmanager
def large_allocations_mapped() -> Iterator[None]:
    """Inside the block, in a process whose heap the command owns (:func:`own_heap`), every
    allocation of :data:`LARGE_ALLOCATION` or more is mapped afresh and unmapped when freed.

    The block covers the hooked sweeps (calibration's recording, the fp32 baseline's factor
    peaks), where glibc's heap grew past what is live (see :func:`map_large_allocations`):
    their hooks hold small running statistics between a forward's large activations, and
    their long probes grow the heap without hooks too (a 265M certificate whose baseline sweep
    ran neither hooks nor the block peaked 2.18 GiB above the fp32 model; 0.76 with both).
    Elsewhere fresh mappings only cost page faults (kernel time equal to user time on
    language-model conversions), so the block is kept to those sweeps.
    Anywhere else (library calls, other C libraries) it changes nothing."""
    global _open
    if not _owned:
        yield
        return
    with _open_lock:  # conversions may run in several threads at once
        _open += 1
        if _open == 1:
            map_large_allocations()
    try:
        yield
    finally:
        with _open_lock:
            _open -= 1
            if _open == 0:
                _set_threshold(OWNED_THRESHOLD)


def _set_threshold(size: int) -> None:
    """A fixed mmap threshold of ``size`` bytes, and a trim threshold of twice that (what
    glibc's moving threshold keeps: trimming the heap's top on every free of a block above
    128 KiB would fault its pages in again on the next allocation)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, size)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * size)


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
