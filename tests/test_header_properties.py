"""``read_header`` on real, mutated and hostile safetensors files.

The header is parsed by hand to get byte offsets, so it has to agree with safetensors on every
file safetensors writes, and on anything else it must either return a header that is
self-consistent (offsets inside the file, sizes matching dtype x shape, no overlaps) or raise
InputError naming the file: never another exception, never a read of a gigantic length.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from precision_convert.conversion.io.header import (
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    read_header,
)
from precision_convert.core.dtypes import BY_CODE, from_torch
from precision_convert.core.errors import InputError

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
FAST = settings(max_examples=40, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(
        0,
        256,
        (math.prod(shape) * from_torch(dtype).itemsize,),
        dtype=torch.uint8,
        generator=generator,
    )
    return data.view(dtype).reshape(shape) if data.numel() else torch.empty(shape, dtype=dtype)


def write_raw(directory: Path, header: object, data: bytes = b"", *, name: str = "x") -> Path:
    """A file with ``header`` (JSON-encoded unless bytes) as its header, then ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = directory / f"{name}.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def assert_consistent(header: SafetensorsHeader, size: int) -> None:
    """What the converter relies on whenever read_header returns."""
    assert 8 <= header.data_start <= size
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())
    previous_end = header.data_start
    names = set()
    for entry in header.tensors:
        assert entry.name not in names
        names.add(entry.name)
        assert entry.dtype in BY_CODE.values()
        assert all(isinstance(d, int) and d >= 0 for d in entry.shape)
        assert header.data_start <= entry.begin <= entry.end <= size
        assert entry.nbytes == math.prod(entry.shape) * entry.dtype.itemsize
        if entry.nbytes:
            assert entry.begin >= previous_end  # in offset order, no overlap
            previous_end = entry.end
    begins = [(e.begin, e.end) for e in header.tensors]
    assert begins == sorted(begins)


# --- round trip with the safetensors writer -------------------------------------------------

tensor_specs = st.dictionaries(
    keys=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=20).filter(
        lambda s: s != "__metadata__"
    ),
    values=st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 5), max_size=3).map(tuple),
        st.integers(0, 2**31),
    ),
    min_size=1,
    max_size=6,
)
metadata = st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=3)


@FAST
@given(tensor_specs, metadata)
def test_round_trip_of_files_written_by_safetensors(specs, meta) -> None:
    tensors = {
        name: make_tensor(dtype, shape, seed) for name, (dtype, shape, seed) in specs.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(tensors, str(path), metadata=meta or None)
        blob = path.read_bytes()
        header = read_header(path)
        assert header.path == path
        assert_consistent(header, len(blob))
        assert header.metadata == meta
        assert {e.name for e in header.tensors} == set(tensors)
        (header_len,) = struct.unpack("<Q", blob[:8])
        assert header.data_start == 8 + header_len
        with safe_open(str(path), framework="pt") as f:
            for entry in header.tensors:
                original = tensors[entry.name]
                assert entry.dtype == from_torch(original.dtype)
                assert entry.shape == tuple(original.shape)
                assert list(f.get_slice(entry.name).get_shape()) == list(entry.shape)
                # the offsets point at exactly this tensor's bytes
                assert blob[entry.begin : entry.end] == raw_bytes(original)


def test_round_trip_example(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1, 2], dtype=torch.int64)
    save_file({"layer.a": a, "layer.b": b, "empty": torch.empty(0, 4)}, str(path))
    header = read_header(path)
    by_name = {e.name: e for e in header.tensors}
    assert by_name["layer.a"].dtype == BY_CODE["F32"] and by_name["layer.a"].shape == (2, 3)
    assert by_name["layer.a"].nbytes == 24 and by_name["layer.a"].numel == 6
    assert by_name["layer.b"].dtype == BY_CODE["I64"] and by_name["layer.b"].nbytes == 16
    assert by_name["empty"].shape == (0, 4) and by_name["empty"].nbytes == 0
    assert header.metadata == {}
    blob = path.read_bytes()
    assert blob[by_name["layer.b"].begin : by_name["layer.b"].end] == raw_bytes(b)


# --- mutated files --------------------------------------------------------------------------


def _valid_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        save_file(
            {
                "w": torch.ones(3, 2),
                "b": torch.zeros(2, dtype=torch.float16),
                "i": torch.arange(4, dtype=torch.int32),
            },
            str(path),
            metadata={"format": "pt"},
        )
        return path.read_bytes()


VALID = _valid_file_bytes()
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]


def parse_bytes(blob: bytes) -> None:
    """read_header on ``blob``: a consistent header or an InputError naming the file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        path.write_bytes(blob)
        try:
            header = read_header(path)
        except InputError as exc:
            assert exc.path == str(path)
            assert "\n" not in str(exc)
            return
        assert_consistent(header, len(blob))


@settings(max_examples=100, deadline=2000)
@given(
    st.lists(st.tuples(st.integers(0, HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=8)
)
def test_byte_mutations_of_the_header(mutations) -> None:
    blob = bytearray(VALID)
    for position, value in mutations:
        blob[position] = value
    parse_bytes(bytes(blob))


@settings(max_examples=60, deadline=2000)
@given(st.integers(0, len(VALID) - 1))
def test_truncations(length: int) -> None:
    parse_bytes(VALID[:length])


@settings(max_examples=100, deadline=2000)
@given(st.integers(8, HEADER_END), st.binary(max_size=16), st.integers(0, 8))
def test_header_splices(position: int, inserted: bytes, deleted: int) -> None:
    """Bytes inserted into or cut out of the JSON (the declared length left as it was)."""
    parse_bytes(VALID[:position] + inserted + VALID[position + deleted :])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
entry_like = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "F16", "I8", "BOOL", "X9", 3]) | json_values,
        "shape": st.lists(st.integers(-2, 2**40), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-2, 2**41), max_size=3) | json_values,
    },
)


@settings(max_examples=60, deadline=2000)
@given(
    st.dictionaries(st.text(max_size=8), entry_like | json_values, max_size=4),
    st.integers(0, 64),
)
def test_structurally_random_headers(header: dict, data_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_raw(Path(tmp), header, b"\0" * data_size)
        try:
            parsed = read_header(path)
        except InputError as exc:
            assert exc.path == str(path)
            return
        assert_consistent(parsed, path.stat().st_size)


# --- hostile files, each rejected with a message that says why -------------------------------


def reject(path: Path, message: str) -> InputError:
    with pytest.raises(InputError, match=message) as info:
        read_header(path)
    assert info.value.path == str(path)
    return info.value


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_oversized_declared_header_length_is_rejected_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    reject(path, "exceeds the 100 MB limit")
    path.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    reject(path, "exceeds the 100 MB limit")


def test_header_length_past_the_end_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    reject(path, "truncated: header length 1000 runs past the end of the 10-byte file")


@pytest.mark.parametrize("blob", [b"", b"\x01\x00", b"1234567"])
def test_shorter_than_the_size_prefix(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(blob)
    reject(path, "shorter than its 8-byte header size")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    reject(tmp_path / "absent.safetensors", "cannot read")
    reject(tmp_path, "cannot read")


def test_overlapping_offsets(tmp_path: Path) -> None:
    header = {"a": entry("F32", [4], 0, 16), "b": entry("F32", [2], 8, 16)}
    reject(write_raw(tmp_path, header, bytes(16)), "'a' and 'b' overlap")


def test_a_tensor_inside_another_overlaps(tmp_path: Path) -> None:
    header = {
        "big": entry("U8", [100], 0, 100),
        "inner": entry("U8", [10], 10, 20),
        "after": entry("U8", [10], 100, 110),
    }
    reject(write_raw(tmp_path, header, bytes(110)), "overlap")


def test_empty_tensors_may_sit_anywhere_inside_the_data(tmp_path: Path) -> None:
    header = {"a": entry("F32", [4], 0, 16), "e": entry("F32", [0, 3], 8, 8)}
    parsed = read_header(write_raw(tmp_path, header, bytes(16)))
    assert [e.name for e in parsed.tensors] == ["a", "e"]


def test_offsets_past_the_end_of_the_file(tmp_path: Path) -> None:
    header = {"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 16, 32)}
    reject(write_raw(tmp_path, header, bytes(20)), "tensor 'b' ends at byte .* has .* bytes")


@pytest.mark.parametrize(
    "shape",
    [[2**40, 2**40], [2**62, 2**62, 2**62], [10**30], [65536] * 8],
)
def test_gigantic_declared_shapes(tmp_path: Path, shape: list[int]) -> None:
    nbytes = math.prod(shape) * 4
    # consistent with the dtype but far beyond the file
    reject(write_raw(tmp_path, {"w": entry("F32", shape, 0, nbytes)}, bytes(8)), "truncated")
    # inconsistent with the dtype: the offsets span less than the shape needs
    reject(write_raw(tmp_path, {"w": entry("F32", shape, 0, 8)}, bytes(8)), "needs")


def test_integer_too_long_for_python_is_rejected(tmp_path: Path) -> None:
    raw = b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'
    reject(write_raw(tmp_path, raw, bytes(4)), "not valid JSON")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"w": entry("F32", [2], 0, 4)}, r"span 4 bytes but F32\[2\] needs 8"),
        ({"w": entry("Q7", [1], 0, 4)}, "unknown dtype 'Q7'"),
        ({"w": {"dtype": None, "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype None"),
        ({"w": entry("F32", [-1], 0, 4)}, "shape must be a list of non-negative integers"),
        ({"w": entry("F32", [True], 0, 4)}, "shape must be"),
        ({"w": entry("F32", [1.0], 0, 4)}, "shape must be"),
        ({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, "shape must be"),
        ({"w": {"dtype": "F32", "shape": [1]}}, "data_offsets must be"),
        ({"w": entry("F32", [1], 4, 0)}, "data_offsets must be"),
        ({"w": entry("F32", [1], -4, 0)}, "data_offsets must be"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, "data_offsets must"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}}, "data_offsets must"),
        ({"w": [1, 2]}, "header entry is not an object"),
        ([1, 2], "header is not a JSON object"),
        ({"__metadata__": {"k": 1}}, "__metadata__ must map strings to strings"),
        ({"__metadata__": "text"}, "__metadata__ must map strings to strings"),
    ],
)
def test_malformed_entries(tmp_path: Path, header: object, message: str) -> None:
    reject(write_raw(tmp_path, header, bytes(8)), message)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"w": {"dtype": "F32"}, "w": {"dtype": "F16"}}', "duplicate key 'w'"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # nesting deep enough to recurse
        (b'{"w": \xff}', "not valid JSON"),  # not UTF-8
        (b"", "not valid JSON"),
        (b"    ", "not valid JSON"),
    ],
)
def test_invalid_json(tmp_path: Path, raw: bytes, message: str) -> None:
    reject(write_raw(tmp_path, raw), message)


# A hostile shape: its element count would have thousands of digits (too long for str(int))
# and multiplying thousands of huge dimensions costs quadratic time; both must be refused
# quickly with the file named.


def test_shape_too_large_to_print_is_an_input_error(tmp_path: Path) -> None:
    shape = [2**62] * 250  # 6 KB of header; the element count has 4,666 digits
    reject(write_raw(tmp_path, {"w": entry("F32", shape, 0, 8)}, bytes(8)), "tensor 'w'")


def test_shape_with_thousands_of_huge_dimensions_is_rejected_quickly(tmp_path: Path) -> None:
    shape = [2**62] * 8_000  # 170 KB of header
    path = write_raw(tmp_path, {"w": entry("F32", shape, 0, 8)}, bytes(8))
    start = time.perf_counter()
    reject(path, "tensor 'w'")
    assert time.perf_counter() - start < 0.25
