"""User calibration data (``--calibration-data FILE``): probes added to the sweep.

Two formats, told apart by the file's first non-empty line:

- **text lines**: one sample per line, fed through the model's own tokenizer (a model without
  one cannot take text: give JSONL instead);
- **JSONL**: one JSON object per line mapping forward-argument names to (nested lists of)
  numbers, e.g. ``{"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}``. Integers become
  int64 tensors, floats float32, booleans bool. In a pipeline, ``"<component>/<argument>"``
  keys address one component; a line naming none of a component's arguments is skipped there.

Both add probes for calibration and validation alike (:func:`~.user_probes.user_probes` builds
them); ``--inputs`` (a safetensors file) replaces the built probes instead.

Example:
    >>> data = read_calibration_data("prompts.txt")
    >>> inputs = sweep(model, chosen, "standard", tokenizer, data=data)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from precision_convert.core.errors import InputError

#: Files larger than this are refused: calibration data is a handful of samples, not a corpus.
MAX_BYTES = 64 << 20
#: What :func:`to_tensor` turns integers and floats into.
_INT64 = torch.iinfo(torch.int64)
_FLOAT32 = torch.finfo(torch.float32)


@dataclass(frozen=True)
class CalibrationData:
    """Parsed calibration data: text samples, or JSONL records (with their line numbers)."""

    path: Path
    texts: tuple[str, ...] = ()
    text_lines: tuple[int, ...] = ()  # the file line of each text sample
    records: tuple[tuple[int, Mapping[str, Any]], ...] = ()

    @property
    def kind(self) -> str:
        return "text" if self.texts else "jsonl"

    def describe(self) -> dict[str, Any]:
        return {"file": self.path.name, "kind": self.kind, "samples": len(self)}

    def __len__(self) -> int:
        return len(self.texts) or len(self.records)


def read_calibration_data(path: str | Path) -> CalibrationData:
    """Read and check ``path`` (text lines or JSONL).

    Raises:
        InputError: missing, unreadable, empty, or malformed (bad JSON on line N, a line that
            is not an object, a value that is not a rectangular array of numbers).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError("--calibration-data: no such file", path)
    if path.stat().st_size > MAX_BYTES:
        raise InputError(
            f"--calibration-data: file over {MAX_BYTES >> 20} MiB; give a few samples", path
        )
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--calibration-data: cannot read the file ({exc})", path) from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line]
    if not lines:
        raise InputError("--calibration-data: the file is empty (no text lines or JSONL)", path)
    if not (path.suffix.lower() in (".jsonl", ".json", ".ndjson") or lines[0][1].startswith("{")):
        return CalibrationData(
            path, texts=tuple(line for _, line in lines), text_lines=tuple(n for n, _ in lines)
        )
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(
                f"--calibration-data: bad JSON on line {n} ({exc.msg}, column {exc.colno})", path
            ) from None
        except RecursionError:  # json's decoder recurses once per nesting level
            raise InputError(f"--calibration-data: line {n} is nested too deeply", path) from None
        if not isinstance(record, dict) or not record:
            raise InputError(
                f"--calibration-data: line {n} is not a JSON object of named model inputs", path
            )
        for key, value in record.items():
            _check_array(value, path, n, key)
        records.append((n, record))
    return CalibrationData(path, records=tuple(records))


def _check_array(value: Any, path: Path, line: int, key: str) -> None:
    """A number, bool, or rectangular nested list of them; else a one-line InputError."""

    def shape(item: Any) -> tuple[int, ...]:
        if isinstance(item, bool | int | float):
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError("not finite")
            if isinstance(item, int) and not _INT64.min <= item <= _INT64.max:
                raise ValueError(f"{item} does not fit a 64-bit integer")
            if isinstance(item, float) and abs(item) > _FLOAT32.max:
                raise ValueError(f"{item} does not fit a 32-bit float")
            return ()
        if isinstance(item, list) and item:
            shapes = {shape(x) for x in item}
            if len(shapes) != 1:
                raise ValueError("ragged")
            return (len(item), *shapes.pop())
        raise ValueError("not a number")

    try:
        shape(value)
    except RecursionError:
        raise InputError(
            f"--calibration-data: line {line}: {key!r} is nested too deeply for a tensor", path
        ) from None
    except ValueError as exc:
        raise InputError(
            f"--calibration-data: line {line}: {key!r} must be a number or a rectangular nested "
            f"list of numbers ({exc})",
            path,
        ) from None


def to_tensor(value: Any) -> torch.Tensor:
    """Integers as int64, booleans as bool, anything with a float as float32."""

    def flat(item: Any) -> list[Any]:
        return [y for x in item for y in flat(x)] if isinstance(item, list) else [item]

    items = flat(value)
    if all(isinstance(x, bool) for x in items):
        dtype = torch.bool
    elif all(isinstance(x, int) for x in items):
        dtype = torch.long
    else:
        dtype = torch.float32
    return torch.tensor(value, dtype=dtype)


def addressed(record: Mapping[str, Any], component: str) -> dict[str, Any]:
    """The record's arguments for ``component``: ``<component>/<arg>`` keys, then plain keys
    (plain keys belong to a single model, or to every component that takes them)."""
    prefix = f"{component}/" if component else None
    mine = {k.removeprefix(prefix): v for k, v in record.items() if prefix and k.startswith(prefix)}
    if mine:
        return mine
    plain = {k: v for k, v in record.items() if "/" not in k}
    return plain


def decoder_start(model: Any) -> int:
    config = getattr(model, "config", None)
    for key in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return 0
