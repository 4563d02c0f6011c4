"""Run-scoped I/O resources: read buffers, the writer's staging buffers, the prefetch thread.

A conversion reuses its buffers from tensor to tensor and shard to shard (fresh memory costs a
page fault per 4 KiB, a large share of a conversion's time) and reads its source ahead in a
background thread. All of that belongs to one :class:`IOContext`, opened by the run and closed
when it ends, successfully or not: closing stops *and joins* the prefetch thread and drops every
buffer. Nothing lives at module level, so conversions in several threads of one process, or one
after another in a notebook, neither share nor keep anything.

Usage::

    with IOContext() as io:
        io.prefetch(model.tensors())
        write_file(path, items, metadata, io=io)
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from precision_convert.conversion.io.tensors import BufferPool, FileTensor, LazyTensor

#: Name of the prefetch threads (tests look for leftovers by it).
PREFETCH_THREAD = "pc-prefetch"
#: Bytes per prefetch read: few enough calls that the thread seldom waits for the GIL, and
#: stopping it waits for at most one of them.
_PREFETCH_STEP = 64 * 1024 * 1024


class IOContext:
    """The buffers and threads of one run's reads and writes; a context manager.

    ``reads`` is the pool of read buffers to pass to ``LazyTensor.chunks``/``read_tensor``;
    the streaming writer takes its staging buffers from :meth:`take_staging`. Safe to use from
    the run's own threads; meant to be used by one run.
    """

    def __init__(self, read_buffers: int = 2) -> None:
        self.reads = BufferPool(read_buffers)
        self._staging: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def __enter__(self) -> IOContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- staging buffers -------------------------------------------------------------------

    def take_staging(self, count: int, capacity: int) -> list[mmap.mmap]:
        """``count`` staging buffers of ``capacity`` bytes: the previous file's when they fit
        (already faulted in), else new ones."""
        with self._lock:
            if len(self._staging) == count and all(len(b) == capacity for b in self._staging):
                taken, self._staging = self._staging, []
                return taken
        return [mmap.mmap(-1, capacity) for _ in range(count)]

    def give_back_staging(self, buffers: list[mmap.mmap]) -> None:
        """Keep ``buffers`` for the next file (only the latest set; none once closed)."""
        with self._lock:
            if not self._closed:
                self._staging = list(buffers)

    # -- prefetch --------------------------------------------------------------------------

    def prefetch(self, tensors: Iterable[LazyTensor]) -> None:
        """Start reading the files behind ``tensors`` into the page cache, in the background.

        A conversion spends its first seconds importing torch and transformers and building
        the meta-device skeleton; reading the source meanwhile takes the disk off the critical
        path. The thread reads through one reused buffer in large steps, so it holds little
        memory and rarely needs the interpreter lock; reading (not just
        ``POSIX_FADV_WILLNEED``) also makes the first touch of each freshly cached page (costly
        on virtual machines) happen here, not in the writer's loop. At most half of the
        available memory is read ahead, so what is read is still cached when the writer gets
        to it; the writer's own sequential reads (and the kernel's readahead) cover the rest.

        The thread stops, and is joined, when the context closes.
        """
        if self._closed:
            raise RuntimeError("IOContext is closed")
        spans: list[tuple[Path, int, int]] = []
        for tensor in tensors:
            if not isinstance(tensor, FileTensor) or tensor.end <= tensor.begin:
                continue
            if spans and spans[-1][0] == tensor.path and spans[-1][2] == tensor.begin:
                spans[-1] = (tensor.path, spans[-1][1], tensor.end)
            else:
                spans.append((tensor.path, tensor.begin, tensor.end))
        budget = _available_memory() // 2
        if not spans or budget <= 0:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("IOContext is closed")
            thread = threading.Thread(
                target=_prefetch,
                args=(spans, budget, self._stop),
                name=PREFETCH_THREAD,
                daemon=True,  # never keeps the interpreter alive, should close() be skipped
            )
            self._threads.append(thread)
            thread.start()

    def stop_prefetch(self) -> None:
        """Stop the prefetch threads and wait until they have finished."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop and join the prefetch threads and drop every buffer. Idempotent."""
        with self._lock:
            self._closed = True
            self._staging = []
        self.stop_prefetch()
        self.reads.clear()


def _prefetch(spans: list[tuple[Path, int, int]], budget: int, stop: threading.Event) -> None:
    buffer = mmap.mmap(-1, _PREFETCH_STEP)  # pages come in only as far as used
    view = memoryview(buffer)
    try:
        for path, begin, end in spans:
            if budget <= 0 or stop.is_set():
                return
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
    finally:
        view.release()
        buffer.close()


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
