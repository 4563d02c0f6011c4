"""``~`` in a path the shell did not expand (``--output=~/x``, a manifest's strings) is the home
folder, never a folder literally named ``~``; what a command prints is the path it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
from _corrupt import assert_one_error_line, tiny_source
from typer.testing import CliRunner

from precision_convert.batch.manifest import read_manifest
from precision_convert.cli.main import app
from precision_convert.core.errors import InputError


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home folder of the test's own, and a working directory beside it (where a literal
    ``~`` folder would appear)."""
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home


def test_model_writes_to_the_home_folder_and_says_so(home: Path) -> None:
    tiny_source(home / "src")
    done = CliRunner().invoke(
        app, ["model", "~/src", "--to", "bf16", "--no-validate", "--output=~/out"]
    )
    assert done.exit_code == 0, done.output
    assert (home / "out" / "model.safetensors").is_file()
    assert list(Path.cwd().iterdir()) == []  # no "~" folder here
    assert f"{home / 'src'} → {home / 'out'} (bf16)" in done.stdout
    assert "~" not in done.stdout


@pytest.mark.parametrize("option", ["--inputs", "--calibration-data"])
def test_file_options_are_looked_up_in_the_home_folder(home: Path, option: str) -> None:
    tiny_source(home / "src")
    done = CliRunner().invoke(
        app, ["model", "~/src", "--to", "bf16", "-o", "out", f"{option}=~/missing.txt"]
    )
    assert done.exit_code == 2, done.output
    assert_one_error_line(done.stderr, str(home / "missing.txt"))
    assert list(Path.cwd().iterdir()) == []


def test_validate_baseline_in_the_home_folder(home: Path) -> None:
    tiny_source(home / "src")
    made = CliRunner().invoke(
        app, ["model", "~/src", "--to", "bf16", "--no-validate", "--output=~/c"]
    )
    assert made.exit_code == 0, made.output
    done = CliRunner().invoke(app, ["validate", "~/c", "--baseline=~/nowhere"])
    assert done.exit_code == 2, done.output
    assert_one_error_line(done.stderr, str(home / "nowhere"))


def test_manifest_paths_are_expanded(home: Path) -> None:
    tiny_source(home / "src")
    (home / "calibration.txt").write_text("a line of text\n", encoding="utf-8")
    manifest = Path.cwd() / "manifest.toml"
    manifest.write_text(
        '[defaults]\nto = ["bf16"]\noutput_dir = "~/converted"\n'
        'calibration_data = "~/calibration.txt"\n\n[[model]]\nsource = "~/src"\n',
        encoding="utf-8",
    )
    read = read_manifest(manifest)
    assert read.output_dir == home / "converted"
    (job,) = read.jobs
    assert job.source == str(home / "src")
    assert job.output == home / "converted" / "src-bf16"
    assert job.options.calibration_data == str(home / "calibration.txt")


def test_a_home_of_no_user_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """``~name`` for a user this system does not know (pathlib raises RuntimeError) is refused
    as bad input, on the command line and in a manifest, nothing written."""
    import subprocess
    import sys

    command = Path(sys.executable).with_name("precision-convert")
    done = subprocess.run(
        [str(command), "model", "~0", "--to", "bf16"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert_one_error_line(done.stderr, "~0", "no user's home folder matches its '~'")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "batch.toml").write_text('[[model]]\nsource = "~0/m"\nto = ["bf16"]\n')
    with pytest.raises(InputError, match="no user's home folder"):
        read_manifest(tmp_path / "batch.toml")
