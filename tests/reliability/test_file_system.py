"""The file system refusing a write anywhere in a run: one line naming the path and what to do.

A full disk, a read-only or unwritable folder, a name or path too long: exit 2, one line, no
traceback, nothing left at or beside the target but what was there before, the source
untouched, and the rerun succeeds. The faults are injected in-process at each write a run
makes after its weights (the weights' own write: ``test_interruptions``), so they always run;
a real full tmpfs is an extra where the machine lets the test mount one.

A full ``TMPDIR`` is not the output's disk: validation cannot keep its probe outputs there,
so the output is kept with a ``fail`` certificate that names ``TMPDIR`` (exit 1), as for any
validation that cannot run; the model is never blamed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import _harness
import pytest
import torch
from _corrupt import (
    cli_command,
    cli_env,
    leftovers,
    tiny_source,
    tree_digest,
)

VALIDATE = ["--to", "bf16", "--coverage", "quick"]
NO_SPACE = os.strerror(errno.ENOSPC)


def _one_line(stderr: str, *fragments: str) -> None:
    """The run's last word is one ``precision-convert:`` line holding ``fragments``, and no
    traceback (in-process, the libraries' loading bars share stderr)."""
    assert "Traceback" not in stderr, stderr
    line = _harness.last_line(stderr)
    assert line.startswith("precision-convert: "), stderr
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"


def _beside(parent: Path) -> list[str]:
    """This tool's hidden files in ``parent``: staging, trash, locks, temporary files."""
    return leftovers(parent) + [
        p.name for p in parent.iterdir() if p.name.endswith((".pc-lock", ".tmp"))
    ]


def _refuse_write(
    monkeypatch: pytest.MonkeyPatch, name: str, error: int = errno.ENOSPC
) -> list[Path]:
    """Every ``write_text`` into a file called ``name`` fails with ``error``, as ``write()``
    does on a full disk (naming no file). Returns the paths it refused."""
    refused: list[Path] = []
    write_text = Path.write_text

    def failing(self: Path, *args: object, **kwargs: object) -> int:
        if self.name == name:
            refused.append(self)
            raise OSError(error, os.strerror(error))
        return write_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", failing)
    return refused


@pytest.mark.parametrize("name", ["precision_certificate.json", "README.md"])
def test_a_full_disk_as_the_certificate_or_card_is_written(
    name: str, tmp_path: Path, sources: _harness.Sources, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = tree_digest(sources.llama)
    output = tmp_path / "out"
    args = ["model", str(sources.llama), *VALIDATE, "-o", str(output)]
    with monkeypatch.context() as patch:
        refused = _refuse_write(patch, f".{name}.tmp")
        done = _harness.run_in_process(args)

    assert refused, "the fault must come as the certificate or card is written"
    assert done.exit_code == 2, done.stderr
    _one_line(done.stderr, f"{output}/{name}", NO_SPACE, "free space")
    assert not output.exists() and _beside(tmp_path) == []
    assert tree_digest(sources.llama) == before
    assert _harness.run_in_process(args).exit_code == 0
    _harness.verify(output)


def test_validate_on_a_full_disk_keeps_the_certificate_and_card_it_had(
    tmp_path: Path, sources: _harness.Sources, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The card cannot be written after the certificate was: neither is replaced (a new
    certificate beside the old card would not verify)."""
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    before = tree_digest(output)
    args = ["validate", str(output), "--baseline", str(sources.llama), "--coverage", "quick"]
    with monkeypatch.context() as patch:
        _refuse_write(patch, ".README.md.tmp")
        done = _harness.run_in_process(args)

    assert done.exit_code == 2, done.stderr
    _one_line(done.stderr, f"{output}/README.md", NO_SPACE)
    assert tree_digest(output) == before and _beside(output) == [] and _beside(tmp_path) == []
    _harness.verify(output)
    assert _harness.run_in_process(args).exit_code == 0


def test_a_folder_made_unwritable_mid_run(
    tmp_path: Path, sources: _harness.Sources, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output's folder stops taking writes while the run validates (injected: as root,
    permissions do not apply): the card's write fails, and so does the lock's unlink. One
    line, no traceback; the lock file kept there locks nothing, and the rerun takes it over."""
    output = tmp_path / "out"
    lock = tmp_path / ".out.pc-lock"
    args = ["model", str(sources.llama), *VALIDATE, "-o", str(output)]
    unlink = Path.unlink

    def unwritable(self: Path, missing_ok: bool = False) -> None:
        if self == lock:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        unlink(self, missing_ok)

    with monkeypatch.context() as patch:
        _refuse_write(patch, ".README.md.tmp", errno.EACCES)
        patch.setattr(Path, "unlink", unwritable)
        done = _harness.run_in_process(args)

    assert done.exit_code == 2, done.stderr
    _one_line(done.stderr, f"{output}/README.md", "Permission denied", "permissions")
    assert not output.exists() and leftovers(tmp_path) == []
    assert _harness.run_in_process(args).exit_code == 0
    _harness.verify(output)
    assert _beside(tmp_path) == []


# --------------------------------------------------------------------------- a full TMPDIR


class FullTmpdir:
    """While ``full``, every ``torch.save`` into the temporary folder fails as torch fails on
    a full disk (a RuntimeError that names no errno); ``refused``: the files it refused."""

    def __init__(self) -> None:
        self.full = True
        self.refused: list[Path] = []
        self.temporary = Path(tempfile.gettempdir())
        self.save = torch.save

    def __call__(self, obj: object, f: object, *args: object, **kwargs: object) -> None:
        if self.full and isinstance(f, str | Path) and self.temporary in Path(f).parents:
            self.refused.append(Path(f))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")
        self.save(obj, f, *args, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def full_tmpdir(monkeypatch: pytest.MonkeyPatch) -> FullTmpdir:
    fault = FullTmpdir()
    monkeypatch.setattr(torch, "save", fault)
    return fault


def _assert_kept_with_tmpdir_named(output: Path, stderr: str, exit_code: int) -> None:
    assert exit_code == 1, stderr
    assert "Traceback" not in stderr and "rejected every built input" not in stderr
    assert "TMPDIR" in stderr and "temporary folder" in stderr, stderr
    certificate = json.loads((output / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "fail"
    assert "TMPDIR" in json.dumps(certificate)
    assert "rejected every built input" not in json.dumps(certificate)


def test_a_full_tmpdir_is_named_and_the_output_kept_with_a_failing_certificate(
    tmp_path: Path, sources: _harness.Sources, full_tmpdir: list[Path]
) -> None:
    output = tmp_path / "out"
    done = _harness.run_in_process(["model", str(sources.llama), *VALIDATE, "-o", str(output)])

    assert full_tmpdir.refused, "validation must have tried to spill its probe outputs"
    _assert_kept_with_tmpdir_named(output, done.stderr, done.exit_code)
    assert leftovers(tmp_path) == [] and not any(p.exists() for p in full_tmpdir.refused)
    full_tmpdir.full = False  # room again: validate certifies the kept output
    args = ["validate", str(output), "--baseline", str(sources.llama), "--coverage", "quick"]
    assert _harness.run_in_process(args).exit_code == 0
    _harness.verify(output)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of one page, full at once; skipped where this machine cannot mount one."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_real_full_tmpdir(tmp_path: Path, sources: _harness.Sources, tiny_tmpfs: Path) -> None:
    output = tmp_path / "out"
    done = subprocess.run(
        [*cli_command(), "model", str(sources.llama), *VALIDATE, "-o", str(output)],
        env={**cli_env(), "TMPDIR": str(tiny_tmpfs)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    _assert_kept_with_tmpdir_named(output, done.stderr, done.returncode)
    assert list(tiny_tmpfs.iterdir()) == [] and leftovers(tmp_path) == []


# --------------------------------------------------------------------------- long names


def test_a_250_character_output_name_works(tmp_path: Path) -> None:
    """Legal (up to 255 bytes), though ``.<name>.pc-staging-<pid>-<hex>`` beside it would not
    be: the staging and lock names are shortened (the name's start and a digest)."""
    source = tiny_source(tmp_path / "src")
    output = tmp_path / ("n" * 250)
    args = ["model", str(source), "--to", "bf16", "--no-validate", "-o", str(output)]
    done = _harness.run_in_process(args)

    assert done.exit_code == 0, done.stderr
    assert (output / "model.safetensors").is_file()
    assert _beside(tmp_path) == []


def test_an_output_path_too_long_is_refused_before_any_work(tmp_path: Path) -> None:
    source = tiny_source(tmp_path / "src")
    output = tmp_path.joinpath(*["d" * 250] * 16, "out")  # over 4096 bytes
    done = _harness.run_in_process(["model", str(source), "--to", "bf16", "-o", str(output)])

    assert done.exit_code == 2, done.stderr
    _one_line(done.stderr, "too long", "choose a shorter -o")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
