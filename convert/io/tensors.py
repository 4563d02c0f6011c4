"""Lazy tensors: a name, a dtype, a shape and a way to read the data in bounded chunks.

Nothing is read until a chunk is asked for, and a chunk is at most ``CHUNK_BYTES`` of source
data, so converting or scanning a tensor of any size holds only one chunk in memory.

Reads go into recycled buffers: fresh memory costs a page fault per 4 KiB (a large share of a
conversion's time), so a chunk buffer that nobody holds any more is read into again, by this
tensor's next chunk or, through a :class:`BufferPool` the caller passes in (a conversion's
:class:`~precision_convert.conversion.io.context.IOContext` owns one), by the next tensor. A
chunk that is kept (``list(t.chunks())``) keeps its buffer to itself: recycling only ever takes
a buffer whose chunk tensors are all gone. Nothing is kept between calls at module level: with
no pool, a call's buffer is dropped when the call is done.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from precision_convert.conversion.io.header import TensorEntry
from precision_convert.core.dtypes import DType

if TYPE_CHECKING:
    import torch

#: Source bytes per chunk: large enough that the per-call overhead vanishes against disk
#: throughput, small enough that a conversion's memory stays flat (a few buffers of this size).
CHUNK_BYTES = 16 * 1024 * 1024
#: Elements per element-wise call that must stay on the calling thread: ATen's grain size
#: (``at::internal::GRAIN_SIZE``). An op over at most this many elements never wakes torch's
#: intra-op pool, whose workers only contend with a run's reads and writes (on 2 busy cores a
#: 16 MiB sum took 11 ms through the pool, 0.8 ms in pieces on one thread).
SERIAL_ELEMENTS = 32768


class LazyTensor(Protocol):
    # Read-only: the tensor classes are frozen dataclasses, or views of one (PooledTensor).
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def shape(self) -> tuple[int, ...]: ...

    def chunks(self, pool: BufferPool | None = None) -> Iterator[torch.Tensor]:
        """The flattened data in source dtype, at most CHUNK_BYTES at a time; file reads go
        into ``pool``'s buffers when one is given."""
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

    def chunks(self, pool: BufferPool | None = None) -> Iterator[torch.Tensor]:
        """The data in chunks read into ``pool``'s free buffers (without one, into a buffer of
        this call's own, reused from chunk to chunk while nobody keeps a chunk)."""
        import torch

        itemsize = self.dtype.itemsize
        step = max(itemsize, CHUNK_BYTES - CHUNK_BYTES % itemsize)
        fd = os.open(self.path, os.O_RDONLY)
        buffer: _Buffer | None = None
        try:
            for start in range(self.begin, self.end, step):
                size = min(step, self.end - start)
                if buffer is None or not buffer.free() or len(buffer.data) < size:
                    buffer = pool.take(step) if pool is not None else _Buffer(step)
                view = buffer.lend(size)
                _read_exact(fd, view, start, self.path)
                yield torch.frombuffer(view, dtype=self.dtype.torch, count=size // itemsize)
                del view
        finally:
            os.close(fd)
            if buffer is not None and pool is not None:
                pool.give_back(buffer)

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

    def free(self) -> bool:
        return self._loan is None or self._loan() is None

    def lend(self, size: int) -> memoryview:
        view = memoryview(self.data)[:size]
        self._loan = weakref.ref(view)
        return view


class BufferPool:
    """Free read buffers kept between tensors, so that each tensor does not fault in new
    memory. One belongs to one run (an ``IOContext``); it is safe to share between threads."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> _Buffer:
        """A free pooled buffer of at least ``size`` bytes, else a new one."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if len(buffer.data) >= size:
                    return self._free.pop(i)
        return _Buffer(size)

    def give_back(self, buffer: _Buffer) -> None:
        """Pool ``buffer`` for the next tensor, unless a chunk still uses it (then it is left
        to that chunk and freed with it) or the pool is full."""
        if buffer.free():
            with self._lock:
                if len(self._free) < self.size:
                    self._free.append(buffer)

    def clear(self) -> None:
        """Drop the pooled buffers (their memory goes back once no chunk uses them)."""
        with self._lock:
            self._free.clear()


@dataclass(frozen=True)
class PooledTensor:
    """``tensor``, with ``chunks()`` reading through ``pool`` unless told otherwise: for code
    that iterates plain ``LazyTensor`` s (``scan_ranges``) but should reuse a run's buffers."""

    tensor: LazyTensor
    pool: BufferPool

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def dtype(self) -> DType:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    def chunks(self, pool: BufferPool | None = None) -> Iterator[torch.Tensor]:
        return self.tensor.chunks(pool if pool is not None else self.pool)


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

    def chunks(self, pool: BufferPool | None = None) -> Iterator[torch.Tensor]:
        del pool  # nothing is read: the chunks are views of the tensor
        flat = self.tensor.reshape(-1)
        step = max(1, CHUNK_BYTES // self.dtype.itemsize)
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]


def numel(tensor: LazyTensor) -> int:
    return math.prod(tensor.shape)


def read_tensor(
    tensor: LazyTensor,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    pool: BufferPool | None = None,
) -> torch.Tensor:
    """One stored tensor in ``dtype`` on ``device``, with no more than one copy in memory.

    When the file already holds ``dtype`` its bytes are read straight into the result.
    Otherwise chunks are converted into one preallocated result, so the peak is the result plus
    one chunk; each chunk is released before the next is read, so its buffer is reused (and,
    with ``pool``, kept there for the caller's next tensor).
    """
    import torch

    out = torch.empty(numel(tensor), dtype=dtype)
    if isinstance(tensor, FileTensor) and tensor.dtype.torch == dtype and out.numel():
        tensor.read_into(out.view(torch.uint8).numpy().data.cast("B"))
    else:
        start = 0
        for chunk in tensor.chunks(pool):
            out[start : start + chunk.numel()] = chunk
            start += chunk.numel()
            del chunk
    return out.reshape(tensor.shape).to(device)
