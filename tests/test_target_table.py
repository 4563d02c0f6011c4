"""Targets are rows of one table: each target writes what it wrote before the table (golden
certificates and dtype maps), and what lists or describes targets (the JSON schemas' enums,
``--to``'s help) reads the table."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _target_golden as golden
import pytest


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
