"""Lazy tensors: a name, a dtype, a shape and a way to read the data in bounded chunks.

Nothing is read until a chunk is asked for, and a chunk is at most ``CHUNK_BYTES`` of source
data, so converting or scanning a tensor of any size holds only one chunk in memory.

Reads go into recycled buffers: fresh memory costs a page fault per 4 KiB (a large share of a
conversion's time), so a chunk buffer that nobody holds any more is read into again, by this
tensor's next chunk or the next tensor. A chunk that is kept (``list(t.chunks())``) keeps its
buffer to itself: recycling only ever takes a buffer whose chunk tensors are all gone.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from precision_convert.conversion.io.header import TensorEntry
from precision_convert.dtypes import DType

if TYPE_CHECKING:
    import torch

#: Source bytes per chunk: large enough that the per-call overhead vanishes against disk
#: throughput, small enough that a conversion's memory stays flat (a few buffers of this size).
CHUNK_BYTES = 16 * 1024 * 1024


class LazyTensor(Protocol):
    name: str
    dtype: DType
    shape: tuple[int, ...]

    def chunks(self) -> Iterator[torch.Tensor]:
        """The flattened data in source dtype, at most CHUNK_BYTES at a time."""
        ...


@dataclass(frozen=True)
class FileTensor:
    """A tensor inside a safetensors file, read with ``os.pread`` (no mmap: it inflates RSS)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    path: Path
    begin: int
    end: int

    @classmethod
    def from_entry(cls, path: Path, entry: TensorEntry) -> FileTensor:
        return cls(entry.name, entry.dtype, entry.shape, path, entry.begin, entry.end)

    def chunks(self) -> Iterator[torch.Tensor]:
        import torch

        itemsize = self.dtype.itemsize
        step = max(itemsize, CHUNK_BYTES - CHUNK_BYTES % itemsize)
        fd = os.open(self.path, os.O_RDONLY)
        buffer: _Buffer | None = None
        try:
            for start in range(self.begin, self.end, step):
                size = min(step, self.end - start)
                if buffer is None or not buffer.free() or len(buffer.data) < size:
                    buffer = _Buffer.take(step)
                view = buffer.lend(size)
                _read_exact(fd, view, start, self.path)
                yield torch.frombuffer(view, dtype=self.dtype.torch, count=size // itemsize)
                del view
        finally:
            os.close(fd)
            if buffer is not None:
                buffer.give_back()

    def read_into(self, view: memoryview) -> None:
        """Read the raw bytes straight into ``view`` (exactly ``end - begin`` bytes long)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            _read_exact(fd, view, self.begin, self.path)
        finally:
            os.close(fd)


class _Buffer:
    """A reusable read buffer, lent to one chunk at a time through a fresh memoryview.

    ``torch.frombuffer`` keeps that memoryview alive for as long as any tensor shares the
    chunk's storage, so the buffer is free again exactly when the last of them is gone.
    """

    def __init__(self, size: int) -> None:
        # Anonymous memory, faulted in only where a read lands: a buffer of CHUNK_BYTES costs
        # next to nothing when the tensors it serves are small.
        self.data = mmap.mmap(-1, size)
        self._loan: weakref.ref[memoryview] | None = None

    @staticmethod
    def take(size: int) -> _Buffer:
        """A free pooled buffer of at least ``size`` bytes, else a new one."""
        with _POOL_LOCK:
            for i, buffer in enumerate(_POOL):
                if len(buffer.data) >= size:
                    return _POOL.pop(i)
        return _Buffer(size)

    def free(self) -> bool:
        return self._loan is None or self._loan() is None

    def lend(self, size: int) -> memoryview:
        view = memoryview(self.data)[:size]
        self._loan = weakref.ref(view)
        return view

    def give_back(self) -> None:
        """Pool the buffer for the next tensor, unless a chunk still uses it (then it is
        left to that chunk and freed with it)."""
        if self.free():
            with _POOL_LOCK:
                if len(_POOL) < _POOL_SIZE:
                    _POOL.append(self)


#: Free read buffers kept between tensors, so that each tensor does not fault in new memory.
_POOL_SIZE = 2
_POOL: list[_Buffer] = []
_POOL_LOCK = threading.Lock()


def release_buffers() -> None:
    """Drop the pooled read buffers (their memory goes back once no chunk uses them)."""
    with _POOL_LOCK:
        _POOL.clear()


def _read_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise OSError(f"{path}: unexpected end of file")
        got += n


@dataclass(frozen=True)
class MemoryTensor:
    """A tensor already in memory (from a ``torch.load(mmap=True)`` pickle checkpoint)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    tensor: torch.Tensor

    def chunks(self) -> Iterator[torch.Tensor]:
        flat = self.tensor.reshape(-1)
        step = max(1, CHUNK_BYTES // self.dtype.itemsize)
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]


def numel(tensor: LazyTensor) -> int:
    return math.prod(tensor.shape)


def read_tensor(
    tensor: LazyTensor, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One stored tensor in ``dtype`` on ``device``, with no more than one copy in memory.

    When the file already holds ``dtype`` its bytes are read straight into the result.
    Otherwise chunks are converted into one preallocated result, so the peak is the result plus
    one chunk; each chunk is released before the next is read, so its buffer is reused.
    """
    import torch

    out = torch.empty(numel(tensor), dtype=dtype)
    if isinstance(tensor, FileTensor) and tensor.dtype.torch == dtype and out.numel():
        tensor.read_into(memoryview(out.view(torch.uint8).numpy()).cast("B"))
    else:
        start = 0
        for chunk in tensor.chunks():
            out[start : start + chunk.numel()] = chunk
            start += chunk.numel()
            del chunk
    return out.reshape(tensor.shape).to(device)


def prefetch(tensors: Iterable[LazyTensor]) -> threading.Event:
    """Start reading the files behind ``tensors`` into the page cache, in the background.

    A conversion spends its first seconds importing torch and transformers and building the
    meta-device skeleton; reading the source meanwhile takes the disk off the critical path.
    The thread reads through one reused buffer in large steps, so it holds little memory and
    rarely needs the interpreter lock; reading (not just ``POSIX_FADV_WILLNEED``) also makes
    the first touch of each freshly cached page (costly on virtual machines) happen here, not
    in the writer's loop. At most half of the available memory is read ahead, so what is read
    is still cached when the writer gets to it; the writer's own sequential reads (and the
    kernel's readahead) cover the rest.

    Returns an event; setting it stops the prefetch early.
    """
    stop = threading.Event()
    spans: list[tuple[Path, int, int]] = []
    for tensor in tensors:
        if not isinstance(tensor, FileTensor) or tensor.end <= tensor.begin:
            continue
        if spans and spans[-1][0] == tensor.path and spans[-1][2] == tensor.begin:
            spans[-1] = (tensor.path, spans[-1][1], tensor.end)
        else:
            spans.append((tensor.path, tensor.begin, tensor.end))
    budget = _available_memory() // 2
    if spans and budget > 0:
        thread = threading.Thread(
            target=_prefetch, args=(spans, budget, stop), name="pc-prefetch", daemon=True
        )
        thread.start()
    return stop


def _prefetch(spans: list[tuple[Path, int, int]], budget: int, stop: threading.Event) -> None:
    view = memoryview(mmap.mmap(-1, _PREFETCH_STEP))  # pages come in only as far as used
    for path, begin, end in spans:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_SEQUENTIAL)
            offset = begin
            while offset < end and budget > 0 and not stop.is_set():
                n = os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
                if n <= 0:
                    break
                offset += n
                budget -= n
        except OSError:
            pass  # prefetching is only ever an optimisation
        finally:
            os.close(fd)
        if budget <= 0 or stop.is_set():
            return


#: Bytes per prefetch read: few enough calls that the thread seldom waits for the GIL.
_PREFETCH_STEP = 64 * 1024 * 1024


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
