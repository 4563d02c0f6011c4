"""The streaming writer's I/O paths: reused read buffers, staging buffers, O_DIRECT.

Every case compares the written file bit for bit with ``tensor.to(stored dtype)``, with chunk
and staging sizes shrunk so that chunks straddle staging buffers, the output stream becomes
misaligned for a dtype (after an odd-sized 2-byte tensor), and the last block is partial.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from precision_convert.conversion.io import tensors as tensors_module
from precision_convert.conversion.io import writer
from precision_convert.conversion.io.context import IOContext
from precision_convert.conversion.io.header import read_header
from precision_convert.conversion.io.tensors import FileTensor, MemoryTensor
from precision_convert.core.dtypes import BY_TORCH_NAME, DType

_GEN = torch.Generator().manual_seed(0)

#: name -> (source tensor, stored dtype)
_CASES: dict[str, tuple[torch.Tensor, torch.dtype]] = {
    "a.weight": (torch.randn(1000, 7, generator=_GEN), torch.bfloat16),
    "odd.bf16": (torch.randn(13, generator=_GEN).to(torch.bfloat16), torch.bfloat16),
    "norm.weight": (torch.randn(37, generator=_GEN), torch.float32),  # now misaligned for fp32
    "up.weight": (torch.randn(333, 3, generator=_GEN).to(torch.bfloat16), torch.float32),
    "half.weight": (torch.randn(4099, generator=_GEN), torch.float16),
    "ids": (torch.arange(11, dtype=torch.int64), torch.int64),
    "mask": (torch.tensor([True, False, True]), torch.bool),
    "empty": (torch.zeros(0, 5), torch.bfloat16),
    "special": (
        torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3.4e38, 65504.0, 1e5]),
        torch.float16,
    ),
    "big.weight": (torch.randn(50_000, generator=_GEN), torch.bfloat16),
}


@pytest.fixture
def small_io(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensors_module, "CHUNK_BYTES", 4096 + 24)  # not block-aligned


def _source(tmp_path: Path) -> Path:
    path = tmp_path / "src.safetensors"
    save_file({n: t for n, (t, _) in _CASES.items()}, path, metadata={"format": "pt"})
    return path


def _dtype(dtype: torch.dtype) -> DType:
    return BY_TORCH_NAME[str(dtype).removeprefix("torch.")]


def _items(path: Path) -> list[tuple[FileTensor, DType]]:
    """The file's tensors in the order of ``_CASES`` (not the file's), so that the output
    stream really does go out of alignment."""
    entries = {e.name: e for e in read_header(path).tensors}
    return [(FileTensor.from_entry(path, entries[n]), _dtype(s)) for n, (_, s) in _CASES.items()]


def _check(out: Path, names: list[str]) -> None:
    with safe_open(out, "pt") as f:
        assert list(f.keys()) == sorted(names)
        for name in names:
            source, stored = _CASES[name]
            got = f.get_tensor(name)
            expected = source.to(stored)
            assert got.dtype == stored and got.shape == expected.shape, name
            if got.is_floating_point():
                bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
                assert torch.equal(got.view(bits), expected.view(bits)), name
            else:
                assert torch.equal(got, expected), name


@pytest.mark.parametrize("direct", ["1", "0"])
def test_stream_is_bit_identical_to_a_whole_tensor_cast(
    small_io: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    monkeypatch.setenv("PRECISION_CONVERT_DIRECT_IO", direct)
    source = _source(tmp_path)
    items = _items(source)
    out = tmp_path / "out.safetensors"
    consumed: list[int] = []

    size = writer.write_file(out, items, {"format": "pt"}, consumed.append)

    header = writer.header_bytes(items, {"format": "pt"})
    assert out.stat().st_size == len(header) + size
    assert sum(consumed) == sum(t.end - t.begin for t, _ in items)
    _check(out, [t.name for t, _ in items])


def test_reused_staging_and_read_buffers_across_files(small_io: None, tmp_path: Path) -> None:
    source = _source(tmp_path)
    items = _items(source)
    with IOContext() as io:
        for i in range(3):  # buffers from the previous file are reused
            out = tmp_path / f"out{i}.safetensors"
            writer.write_file(out, items, {"format": "pt"}, io=io)
            _check(out, [t.name for t, _ in items])


def test_memory_tensors_and_the_real_chunk_size(tmp_path: Path) -> None:
    items = [
        (MemoryTensor(name, _dtype(t.dtype), tuple(t.shape), t), _dtype(stored))
        for name, (t, stored) in _CASES.items()
    ]
    out = tmp_path / "out.safetensors"
    writer.write_file(out, items, {"format": "pt"})
    _check(out, list(_CASES))


def test_kept_chunks_keep_their_own_data(small_io: None, tmp_path: Path) -> None:
    """A caller that keeps every chunk (``list(t.chunks())``) never sees one overwritten."""
    source = _source(tmp_path)
    (big,) = [t for t, _ in _items(source) if t.name == "big.weight"]
    first = list(big.chunks())
    assert len(first) > 2
    again = list(big.chunks())  # reading again must not reuse the kept buffers
    assert torch.equal(torch.cat(first), _CASES["big.weight"][0])
    assert torch.equal(torch.cat(again), _CASES["big.weight"][0])


def test_released_chunks_recycle_one_buffer(small_io: None, tmp_path: Path) -> None:
    source = _source(tmp_path)
    (big,) = [t for t, _ in _items(source) if t.name == "big.weight"]
    pointers = set()
    parts = []
    for chunk in big.chunks():
        pointers.add(chunk.data_ptr())
        parts.append(chunk.clone())
        del chunk
    assert len(pointers) == 1
    assert torch.equal(torch.cat(parts), _CASES["big.weight"][0])


def test_fp16_and_fp32_targets_on_tmpfs_fall_back_cleanly(small_io: None, tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    source = _source(tmp_path)
    items = _items(source)
    out = shm / f"pc-test-{os.getpid()}.safetensors"
    try:
        writer.write_file(out, items, {"format": "pt"})
        _check(out, [t.name for t, _ in items])
    finally:
        out.unlink(missing_ok=True)
