"""A streaming safetensors writer whose memory stays flat.

The whole header is computed up front from the plan (names, stored dtypes, shapes, offsets),
then tensor data is cast chunk by chunk and appended. Each chunk is cast straight into one of a
few reused, page-aligned staging buffers, and a background thread writes a filled buffer while
the next chunk is read and cast, so disk reads, casts and writes overlap and no memory is
allocated per chunk. Where the file system allows, the output is written with ``O_DIRECT``:
the data goes from the staging buffer to the disk without passing through (and filling up) the
page cache, which is most of what a large buffered write costs. The writer makes no dtype
decisions: it takes (tensor, stored dtype) pairs in order.

Casts run on the calling thread alone, in pieces small enough that torch never hands them to its
intra-op thread pool: a cast is a memory-bound copy far quicker than the disk, and pool workers
only contend with the reads, the writer thread and each other (measured: 2-4x the CPU time for
the same chunk on 2 cores). Torch's thread count is process-wide, so the writer never changes it.
The staging and read buffers belong to the run's :class:`IOContext`; nothing is kept at module
level.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from precision_convert.conversion.io import tensors as _tensors
from precision_convert.conversion.io.context import IOContext
from precision_convert.conversion.io.tensors import SERIAL_ELEMENTS, LazyTensor
from precision_convert.core import interrupts
from precision_convert.core.dtypes import DType

if TYPE_CHECKING:
    import torch

#: safetensors pads the header with spaces so tensor data starts 8-byte aligned.
_ALIGN = 8
#: File offsets, lengths and memory of ``O_DIRECT`` writes are multiples of this.
_BLOCK = 4096
#: Staging buffers: one being filled while the other is written.
_STAGES = 2


def header_bytes(items: Sequence[tuple[LazyTensor, DType]], metadata: dict[str, str]) -> bytes:
    """The serialized header for ``items`` stored in the given dtypes, padded to alignment."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor, dtype in items:
        if tensor.name in header:
            raise ValueError(f"tensor {tensor.name!r} given twice")
        size = math.prod(tensor.shape) * dtype.itemsize
        header[tensor.name] = {
            "dtype": dtype.code,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return len(raw).to_bytes(8, "little") + raw


def write_file(
    path: Path,
    items: Sequence[tuple[LazyTensor, DType]],
    metadata: dict[str, str],
    on_progress: Callable[[int], None] | None = None,
    *,
    io: IOContext | None = None,
) -> int:
    """Write ``items`` to ``path`` as safetensors, fsync it, and return its data size in bytes.

    ``on_progress`` is called with the number of *source* bytes consumed after each chunk.
    ``io`` lends the read and staging buffers (a run writing several files passes its own, so
    each file reuses the previous one's); without it the call uses buffers of its own.
    """
    header = header_bytes(items, metadata)
    expected = sum(math.prod(t.shape) * d.itemsize for t, d in items)
    if io is None:
        with IOContext() as own:
            size = _write(path, header, items, on_progress, own)
    else:
        size = _write(path, header, items, on_progress, io)
    written = size - len(header)
    if written != expected:
        raise OSError(f"{path}: wrote {written} data bytes, the header promises {expected}")
    return written


def _write(
    path: Path,
    header: bytes,
    items: Sequence[tuple[LazyTensor, DType]],
    on_progress: Callable[[int], None] | None,
    io: IOContext,
) -> int:
    with _Sink(path, io) as sink:
        sink.append(memoryview(header))
        for tensor, dtype in items:
            for chunk in tensor.chunks(io.reads):
                # A signal that some code caught and dropped still stops the write here,
                # one chunk after it arrived, instead of after the whole file.
                interrupts.check()
                consumed = chunk.numel() * tensor.dtype.itemsize
                sink.append_cast(chunk, dtype)
                del chunk  # frees its read buffer for the next chunk
                if on_progress is not None:
                    on_progress(consumed)
        return sink.close()


class _Sink:
    """Append-only output through page-aligned staging buffers and one writer thread.

    Bytes are appended to the current buffer; when it is full, the writer thread writes it
    while the next one fills. A buffer holds two source chunks' worth: writes are large (the
    per-request cost of a disk is what small writes pay) and data still reaches the file
    every couple of chunks. Every write starts and ends on a block boundary, as ``O_DIRECT``
    requires; ``close`` writes the last partial block padded and truncates the file to size.
    """

    def __init__(self, path: Path, io: IOContext, capacity: int | None = None) -> None:
        self.path = path
        self.io = io
        size = capacity or 2 * _tensors.CHUNK_BYTES
        self.capacity = max(_BLOCK, size + -size % _BLOCK)
        self.buffers = io.take_staging(_STAGES, self.capacity)
        self.pending: list[Future[None] | None] = [None] * _STAGES
        self.current = 0  # index of the buffer being filled
        self.fill = 0  # bytes in it
        self.base = 0  # file offset of its first byte (always block-aligned)
        self.fd, self.direct = _open_output(path)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pc-writer")

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.pool.shutdown(wait=True)  # no write is in flight after this
        finally:
            os.close(self.fd)
            self.io.give_back_staging(self.buffers)

    # -- appending -----------------------------------------------------------------------

    def append(self, data: memoryview) -> None:
        """Append raw bytes."""
        data = data.cast("B")
        done = 0
        while done < len(data):
            n = min(len(data) - done, self.capacity - self.fill)
            self.buffers[self.current][self.fill : self.fill + n] = data[done : done + n]
            self.fill += n
            done += n
            if self.fill == self.capacity:
                self._rotate()

    def append_cast(self, chunk: torch.Tensor, stored: DType) -> None:
        """Append the flat ``chunk`` converted to ``stored``, cast straight into the buffer."""
        import torch

        dtype, itemsize = stored.torch, stored.itemsize
        total = chunk.numel()
        done = 0
        while done < total:
            room = (self.capacity - self.fill) // itemsize
            if self.fill % itemsize == 0 and room > 0:
                n = min(total - done, room)
                out = torch.frombuffer(
                    self.buffers[self.current], dtype=dtype, count=n, offset=self.fill
                )
                _cast_into(out, chunk[done : done + n])
                del out
                self.fill += n * itemsize
                done += n
                if self.fill == self.capacity:
                    self._rotate()
            else:
                # An element would straddle the buffer's end, or the stream is not aligned for
                # this dtype (after an odd-sized tensor): cast a slice aside and append bytes.
                n = min(total - done, max(1, room))
                piece = torch.empty(n, dtype=dtype)
                _cast_into(piece, chunk[done : done + n])
                self.append(piece.view(torch.uint8).numpy().data)
                del piece
                done += n

    # -- writing -------------------------------------------------------------------------

    def _rotate(self) -> None:
        """The current buffer is full: the writer thread writes it while the other fills."""
        buffer = self.buffers[self.current]
        self.pending[self.current] = self.pool.submit(self._write, buffer, self.fill, self.base)
        self.base += self.fill
        self.current = (self.current + 1) % _STAGES
        self.fill = 0
        self._wait(self.current)

    def close(self) -> int:
        """Write what is left, wait for every write, fsync; the file's size in bytes."""
        size = self.base + self.fill
        if self.fill:
            buffer = self.buffers[self.current]
            length = self.fill
            if self.direct:
                length += -length % _BLOCK
                buffer[self.fill : length] = bytes(length - self.fill)
            self.pending[self.current] = self.pool.submit(self._write, buffer, length, self.base)
        for i in range(_STAGES):
            self._wait(i)
        os.ftruncate(self.fd, size)  # drops the padding of an O_DIRECT last block
        os.fsync(self.fd)
        return size

    def _wait(self, index: int) -> None:
        future = self.pending[index]
        if future is not None:
            self.pending[index] = None
            future.result()

    def _write(self, buffer: mmap.mmap, length: int, offset: int) -> None:
        view = memoryview(buffer)[:length]
        try:
            done = 0
            while done < length:
                try:
                    n = os.pwrite(self.fd, view[done:], offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self.direct:
                        raise
                    self._buffered()  # the file system refused O_DIRECT after all
                    continue
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                done += n
        finally:
            view.release()

    def _buffered(self) -> None:
        import fcntl

        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False


def _cast_into(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out.copy_(source)`` (flat, same length), on this thread only: in pieces at most ATen's
    grain size, so the copy never wakes torch's intra-op workers, whatever their number."""
    if out.numel() <= SERIAL_ELEMENTS:
        out.copy_(source)
        return
    for piece, part in zip(out.split(SERIAL_ELEMENTS), source.split(SERIAL_ELEMENTS), strict=True):
        piece.copy_(part)


_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _open_output(path: Path) -> tuple[int, bool]:
    """Open ``path`` for writing, with ``O_DIRECT`` where the platform and file system allow."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if _O_DIRECT and os.environ.get("PRECISION_CONVERT_DIRECT_IO", "1") != "0":
        try:
            return os.open(path, flags | _O_DIRECT, 0o666), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT
                raise
    return os.open(path, flags, 0o666), False
