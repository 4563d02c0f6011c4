"""Targets are rows of one table: each target writes what it wrote before the table (golden
certificates and dtype maps), and what lists or describes targets (the JSON schemas' enums,
``--to``'s help) reads the table."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _target_golden as golden
import pytest
import torch

from precision_convert.core.dtypes import (
    FORMATS,
    FP16,
    FP16_MAX,
    MEASURED_TARGETS,
    SAFE_TARGETS,
    TARGETS,
    WATCHED_RANGE,
    FiniteRange,
    Target,
    register,
)


@pytest.fixture(scope="module")
def t5_overflowing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Named as the golden's source was: the certificate carries the directory's name.
    return golden.t5_overflowing(tmp_path_factory.mktemp("golden") / "t5-overflowing")


def _assert_as_golden(output: Path, source: str, target: str) -> None:
    expected = golden.golden_path(source, target).read_text()
    got = golden.golden_text(output)
    if got != expected:
        diff = difflib.unified_diff(
            expected.splitlines(), got.splitlines(), "golden", "now", n=2, lineterm=""
        )
        pytest.fail(f"{source} → {target} differs from its golden:\n" + "\n".join(list(diff)[:60]))


@pytest.mark.parametrize("target", golden.TARGETS)
def test_target_writes_its_golden_certificate_and_dtypes(
    t5_overflowing: Path, tmp_path: Path, target: str
) -> None:
    output = golden.convert_for_golden(t5_overflowing, target, tmp_path / target)
    _assert_as_golden(output, "t5-overflowing", target)


@pytest.mark.slow
@pytest.mark.parametrize("target", golden.TARGETS)
def test_llama_writes_its_golden_certificate_and_dtypes(
    zoo_converted: Callable[[str, str], Any], target: str
) -> None:
    _assert_as_golden(zoo_converted("llama", target).output, "llama", target)


# --------------------------------------------------------------------------- the table itself


def test_every_target_reads_its_row() -> None:
    """A target's facts are its row's: fp16's rows watch fp16's finite maximum, bf16's none
    (fp32's exponent); plain and safe targets of one format pair up; no row carries scales."""
    assert [t.value for t in Target] == list(FORMATS) == list(TARGETS)
    for target in Target:
        row = FORMATS[target.value]
        assert target.row is row and row.name == target.value
        assert (target.compute, target.storage, target.safe) == (row.compute, row.storage, row.safe)
        assert target.range_limited == (row.range is not None)
        assert not row.scaled_weights
        assert target.plain.storage == target.storage and not target.plain.safe
        assert target.with_islands.storage == target.storage and target.with_islands.safe
    assert Target.FP16_SAFE.range == Target.FP16.range == FiniteRange(FP16, FP16_MAX)
    assert Target.BF16_SAFE.range is Target.BF16.range is None
    assert WATCHED_RANGE.finite_max == FP16_MAX == float(torch.finfo(torch.float16).max)
    assert SAFE_TARGETS == ("bf16-safe", "fp16-safe")
    assert MEASURED_TARGETS == ("fp16-safe",)
    assert {t: FORMATS[t].variant for t in TARGETS} == {
        "bf16-safe": "bf16",
        "fp16-safe": "fp16",
        "bf16": "bf16",
        "fp16": "fp16",
    }


def test_a_target_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register(FORMATS["fp16"])


def _enums(value: Any) -> Iterator[list[Any]]:
    if isinstance(value, dict):
        if isinstance(value.get("enum"), list):
            yield value["enum"]
        for inner in value.values():
            yield from _enums(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _enums(inner)


def test_schema_enums_of_targets_are_the_table() -> None:
    """Every enum in docs/schema/ that names a target lists the table's targets (or its safe
    ones), in the table's order: a target added to the table fails here until the schemas
    name it too."""
    schemas = Path(__file__).resolve().parents[1] / "docs" / "schema"
    found: dict[str, list[list[Any]]] = {}
    for path in sorted(schemas.glob("*.schema.json")):
        enums = list(_enums(json.loads(path.read_text(encoding="utf-8"))))
        found[path.name] = [e for e in enums if set(e) & set(TARGETS)]
    for name, enums in found.items():
        for enum in enums:
            assert tuple(enum) in (TARGETS, SAFE_TARGETS), f"{name}: enum {enum} is not the table"
    # The documents that carry a target: the certificate, model --json, inspect's islands.
    assert {name: len(enums) for name, enums in found.items()} == {
        "certificate.schema.json": 1,
        "conversion.schema.json": 1,
        "inspect.schema.json": 1,
    }


def test_to_help_and_batch_read_the_table(tmp_path: Path) -> None:
    """``--to``'s help lists the table's targets; a manifest's variant PR without a variant is
    refused with the target's usual variant as the example."""
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    helped = CliRunner().invoke(app, ["model", "--help"], env={"COLUMNS": "300"})
    shown = " ".join(w for w in helped.output.split() if w != "│")
    assert "bf16-safe, fp16-safe, bf16 or fp16 (plain cast)." in shown
    assert "default: on for fp16-safe only" in shown

    manifest = tmp_path / "batch.toml"
    manifest.write_text('[defaults]\noutput_dir = "out"\n\n[[model]]\nsource = "ns/tiny"\n'
                        'to = ["fp16-safe"]\npush = "pr"\n')  # fmt: skip
    done = CliRunner().invoke(app, ["batch", str(manifest)])
    assert done.exit_code == 2, done.output
    assert 'push = "pr" needs a variant (e.g. variant = "fp16")' in done.stderr
