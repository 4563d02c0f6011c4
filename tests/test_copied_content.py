"""What a conversion copies from its source is bounded and said: a source's oversized metadata
entries are not copied (the certificate names them), and Python files that run under
``trust_remote_code`` are named by the report and the card."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from _corrupt import cli_command, cli_env
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from precision_convert.conversion.io.header import COPIED_METADATA_LIMIT, copied_metadata
from precision_convert.validation.certify.certificate import Certificate

#: A metadata value just past the limit: a hostile 95 MB one behaves the same, only slower.
HUGE = "x" * (COPIED_METADATA_LIMIT + 1)
CODE_FILE = "modeling_custom.py"


@pytest.fixture(scope="module")
def converted(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The tiny Llama with one oversized and one ordinary metadata entry and a code file that
    would fail loudly if anything ran it, converted and certified by the command."""
    root = tmp_path_factory.mktemp("copied")
    source = root / "llama"
    shutil.copytree(tiny_model("llama"), source)
    weights = source / "model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "note": "kept", "blob": HUGE})
    (source / CODE_FILE).write_text("raise SystemExit('remote code ran')\n", encoding="utf-8")
    out = root / "out"
    command = ["model", str(source), "--to", "bf16-safe", "--coverage", "quick", "-o", str(out)]
    done = subprocess.run(
        [*cli_command(), *command],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return out, done


def test_an_oversized_metadata_entry_is_not_copied_and_the_certificate_names_it(
    converted: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = converted
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    assert "blob" not in metadata
    assert metadata["note"] == "kept"
    assert "precision_convert" in metadata
    notes = Certificate.read(out).notes
    assert any(
        "source metadata not copied" in n and "'blob'" in n and f"{len(HUGE) + 4:,} bytes" in n
        for n in notes
    ), notes


def test_the_limit_counts_key_and_value_and_keeps_what_fits() -> None:
    limit = COPIED_METADATA_LIMIT
    kept, dropped = copied_metadata(
        {"a": "v" * (limit - 1), "b" * limit: "v", "c": {"nested": "x" * limit}, "d": "ok"}
    )
    assert kept == {"a": "v" * (limit - 1), "d": "ok"}
    assert dropped == {"b" * limit: limit + 1, "c": len(json.dumps({"nested": "x" * limit})) + 1}


def test_code_files_are_named_by_the_report_and_the_card(
    converted: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, done = converted
    assert (out / CODE_FILE).is_file()  # copied unchanged, like every other file
    notes = [line for line in done.stderr.splitlines() if "trust_remote_code" in line]
    assert notes == [
        f"note: code that runs if you pass trust_remote_code, copied from the source: {CODE_FILE}"
    ]
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "## Code" in card
    assert f"`trust_remote_code=True`: `{CODE_FILE}`" in card
    assert "remote code ran" not in done.stderr + done.stdout
