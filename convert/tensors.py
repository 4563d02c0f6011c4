"""Lazy tensors: a name, a dtype, a shape and a way to read the data in bounded chunks.

Nothing is read until a chunk is asked for, and a chunk is at most ``CHUNK_BYTES`` of source
data, so converting or scanning a tensor of any size holds only one chunk in memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from precision_convert.convert.safetensors_header import TensorEntry
from precision_convert.dtypes import DType

if TYPE_CHECKING:
    import torch

#: Source bytes per chunk: large enough that the per-call overhead vanishes against disk
#: throughput, small enough that a conversion's memory stays flat (two buffers of this size).
CHUNK_BYTES = 64 * 1024 * 1024


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

        step = max(self.dtype.itemsize, CHUNK_BYTES - CHUNK_BYTES % self.dtype.itemsize)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for start in range(self.begin, self.end, step):
                buf = bytearray(min(step, self.end - start))
                view = memoryview(buf)
                got = 0
                while got < len(buf):
                    n = os.preadv(fd, [view[got:]], start + got)
                    if n == 0:
                        raise OSError(f"{self.path}: unexpected end of file")
                    got += n
                yield torch.frombuffer(buf, dtype=self.dtype.torch)
        finally:
            os.close(fd)


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
