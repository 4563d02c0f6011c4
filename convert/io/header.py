"""Read and check safetensors headers without touching tensor data.

The header is parsed by hand (8-byte little-endian length, then JSON) instead of through
``safe_open`` because the converter needs byte offsets to stream data in chunks, and because a
hostile file must be rejected with a message that names the problem before anything is read.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precision_convert.core.dtypes import BY_CODE, DType
from precision_convert.core.errors import InputError

#: safetensors' own reader refuses headers above 100 MB; a larger one is corrupt or hostile.
MAX_HEADER_BYTES = 100_000_000
#: Dimensions a tensor may declare: real tensors have a handful; more is a hostile header.
MAX_DIMS = 64
#: A source's own metadata value (a shard's ``__metadata__`` entry, an index's ``metadata``
#: entry) copied into the output at most this long: real ones are names, versions and short
#: JSON; a larger one is not something a user expects a conversion to carry (a 95 MB value is
#: a hostile file's way of doubling every output).
COPIED_METADATA_LIMIT = 64 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its file's header describes it."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: tuple[TensorEntry, ...]  # in data-offset order
    metadata: dict[str, str]
    data_start: int


def copied_metadata(metadata: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """The entries of a source's metadata an output keeps, and those it drops (key -> bytes):
    an entry over :data:`COPIED_METADATA_LIMIT` bytes (key and value as UTF-8, a value that is
    not a string as JSON) is dropped, and the certificate names it."""
    kept: dict[str, Any] = {}
    dropped: dict[str, int] = {}
    for key, value in metadata.items():
        text = key + (value if isinstance(value, str) else json.dumps(value))
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > COPIED_METADATA_LIMIT:
            dropped[key] = size
        else:
            kept[key] = value
    return kept, dropped


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate ``path``'s header; raise InputError naming the file on any defect."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InputError(
                    "not a safetensors file: shorter than its 8-byte header size", path
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise InputError(f"header length {header_len} exceeds the 100 MB limit", path)
            if 8 + header_len > size:
                raise InputError(
                    f"truncated: header length {header_len} runs past the end of the "
                    f"{size}-byte file",
                    path,
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path) from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # deep nesting: hostile
        raise InputError(f"header is not valid JSON ({exc})", path) from None
    if not isinstance(header, dict):
        raise InputError("header is not a JSON object", path)
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InputError("__metadata__ must map strings to strings", path)
    entries = [_entry(path, name, info, data_start) for name, info in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    previous: TensorEntry | None = None
    for entry in entries:
        if entry.end > size:
            raise InputError(
                f"truncated: tensor {entry.name!r} ends at byte {entry.end} but the file has "
                f"{size} bytes",
                path,
            )
        if previous is not None and entry.begin < previous.end and entry.nbytes:
            raise InputError(
                f"tensors {previous.name!r} and {entry.name!r} overlap in the data section", path
            )
        if entry.nbytes:
            previous = entry
    return SafetensorsHeader(path, tuple(entries), dict(metadata), data_start)


def _entry(path: Path, name: str, info: Any, data_start: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise InputError(f"tensor {name!r}: header entry is not an object", path)
    code = info.get("dtype")
    dtype = BY_CODE.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise InputError(f"tensor {name!r}: unknown dtype {code!r}", path)
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InputError(f"tensor {name!r}: shape must be a list of non-negative integers", path)
    offsets = info.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise InputError(
            f"tensor {name!r}: data_offsets must be [begin, end] with begin <= end", path
        )
    span = offsets[1] - offsets[0]
    if len(shape) > MAX_DIMS:
        raise InputError(f"tensor {name!r}: {len(shape)} dimensions (at most {MAX_DIMS})", path)
    # One dimension at a time, stopping once past the span: a hostile shape's full product
    # can be astronomically large (quadratic to compute, too long even to print).
    expected = dtype.itemsize if 0 not in shape else 0
    needs = ""
    for index, size in enumerate(shape):
        expected *= size
        if expected > span and index < len(shape) - 1:
            needs = f"needs more than {span}"
            break
    if needs or expected != span:
        needs = needs or f"needs {expected}"
        shown = f"{dtype.code}{shape}" if len(shape) <= 8 else f"a {len(shape)}-d {dtype.code}"
        raise InputError(
            f"tensor {name!r}: data_offsets span {span} bytes but {shown} {needs}", path
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
