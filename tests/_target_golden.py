"""Golden certificates and dtype maps of the four targets, written before targets became rows
of one table (tests/data/targets/): the table must not change what any target writes.

Each golden file is one model converted to one target at ``quick`` coverage: its certificate
with the fields that differ between runs of the same code replaced by a placeholder, and the
dtype of every tensor in its weight files. Regenerate them (only when a change of output is
meant) with ``python tests/_target_golden.py``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models

GOLDEN = Path(__file__).parent / "data" / "targets"

#: Spelled out rather than read from the table: the goldens judge the table.
TARGETS = ("bf16", "fp16", "bf16-safe", "fp16-safe")

#: T5 v1.1's feed-forward output weights scaled as pretrained ones grow: its activations
#: overflow fp16 (its weights stay inside), so fp16 fails and fp16-safe keeps range islands.
T5_WO_SCALE = 3e5

#: Certificate fields that differ between two runs of the same code on the same machine
#: (dotted paths): the run's clock and the installed versions.
VOLATILE = ("created", "versions", "tool.version")

PLACEHOLDER = "<varies>"


def t5_overflowing(path: Path) -> Path:
    """The zoo's T5 encoder with every block's ``wo`` scaled by ``T5_WO_SCALE``."""
    model = _models.make("t5-encoder")
    for block in model.encoder.block:
        block.layer[1].DenseReluDense.wo.weight.data.mul_(T5_WO_SCALE)
    model.save_pretrained(path)
    return path


#: name -> builder of its source directory; the first runs by default, the rest under ``slow``.
SOURCES: dict[str, Callable[[Path], Path]] = {
    "t5-overflowing": t5_overflowing,
    "llama": lambda path: _models.save("llama", path),
}


def _blank(value: Any, path: list[str]) -> Any:
    if not path:
        return PLACEHOLDER
    if isinstance(value, dict):
        return {k: _blank(v, path[1:]) if k == path[0] else v for k, v in value.items()}
    return value


def normalised_certificate(output: Path) -> dict[str, Any]:
    """``output``'s certificate with the ``VOLATILE`` fields replaced by ``PLACEHOLDER``."""
    certificate: dict[str, Any] = json.loads((output / "precision_certificate.json").read_text())
    for field in VOLATILE:
        certificate = _blank(certificate, field.split("."))
    return certificate


def dtype_map(output: Path) -> dict[str, dict[str, str]]:
    """weight file (relative to ``output``) -> tensor name -> safetensors dtype code."""
    from safetensors import safe_open

    found: dict[str, dict[str, str]] = {}
    for weights in sorted(output.rglob("*.safetensors")):
        with safe_open(weights, framework="pt") as f:
            found[weights.relative_to(output).as_posix()] = {
                name: f.get_slice(name).get_dtype() for name in sorted(f.keys())
            }
    return found


def golden_text(output: Path) -> str:
    """What a golden file holds for a converted ``output``: the normalised certificate and
    the dtype map, as sorted, indented JSON (so a difference reads as a line diff)."""
    record = {"certificate": normalised_certificate(output), "dtypes": dtype_map(output)}
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def golden_path(source: str, target: str) -> Path:
    return GOLDEN / f"{source}.{target}.json"


def convert_for_golden(source: Path, target: str, output: Path) -> Path:
    from precision_convert.api.conversion import convert

    convert(source, to=target, output=output, coverage="quick")
    return output


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PRECISION_CONVERT_CACHE", tempfile.mkdtemp(prefix="pc-golden-cache-"))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pc-golden-") as tmp:
        root = Path(tmp)
        for name, build in SOURCES.items():
            # The source's directory name is in the certificate: the test's must match it.
            source = build(root / name)
            for target in TARGETS:
                output = convert_for_golden(source, target, root / f"{name}-{target}")
                golden_path(name, target).write_text(golden_text(output))
                print(golden_path(name, target), file=sys.stderr)


if __name__ == "__main__":
    main()
