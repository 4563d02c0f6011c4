"""A streaming safetensors writer whose memory stays flat.

The whole header is computed up front from the plan (names, stored dtypes, shapes, offsets),
then tensor data is cast chunk by chunk and appended. A background thread writes chunk *n*
while the next one is read and cast, so disk reads, casts and writes overlap. The writer makes
no dtype decisions: it takes (tensor, stored dtype) pairs in order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from precision_convert.convert.tensors import LazyTensor
from precision_convert.dtypes import DType

#: safetensors pads the header with spaces so tensor data starts 8-byte aligned.
_ALIGN = 8


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
) -> int:
    """Write ``items`` to ``path`` as safetensors, fsync it, and return its data size in bytes.

    ``on_progress`` is called with the number of *source* bytes consumed after each chunk.
    """
    import torch

    header = header_bytes(items, metadata)
    expected = sum(math.prod(t.shape) * d.itemsize for t, d in items)
    written = 0
    with path.open("wb") as f, ThreadPoolExecutor(1, thread_name_prefix="pc-writer") as pool:
        f.write(header)
        pending: Future[int] | None = None
        for tensor, dtype in items:
            for chunk in tensor.chunks():
                out = chunk if chunk.dtype == dtype.torch else chunk.to(dtype.torch)
                data = out.contiguous().view(torch.uint8).numpy()
                if pending is not None:
                    written += pending.result()
                pending = pool.submit(f.write, data)
                if on_progress is not None:
                    on_progress(chunk.numel() * tensor.dtype.itemsize)
        if pending is not None:
            written += pending.result()
        if written != expected:
            raise OSError(f"{path}: wrote {written} data bytes, the header promises {expected}")
        f.flush()
        os.fsync(f.fileno())
    return written
