"""What a person sees running the command: counted on a terminal and in a pipe.

Each run is the real command in a child process (see ``_terminal.py``), its lines timestamped
as they arrive: at most a screen (40 lines) on stdout, nothing on stderr but the command's own
lines (no load report, warning or bar of transformers, diffusers or tqdm), and never more than
15 s without a new line on either stream, from the start to the exit.

The zoo's first families at default settings run one conversion per family and mode: minutes
on a CPU, so they are ``slow``; the same checks on GPT-2 at ``--coverage quick`` run always.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _corrupt import (
    TINY_CONFIG,
    TINY_STATE,
    assert_one_error_line,
    cli_command,
    cli_env,
    tiny_source,
)
from _terminal import Run, run_command
from typer.testing import CliRunner

from precision_convert.cli import _common
from precision_convert.cli.main import app
from precision_convert.core.errors import printable
from precision_convert.core.progress import Heartbeat
from precision_convert.validation.certify.certificate import CERTIFICATE_NAME

#: Lines the report may take on stdout: one screen.
SCREEN = 40
#: The longest stretch a person (or a log) may wait for a new line.
SILENCE = 15.0
#: What starts the command's own lines on stderr off a terminal.
OWN_PREFIXES = (_common.PROGRESS_PREFIX, "precision-convert: ")
#: A row of the terminal's progress display: it ends in the elapsed-time clock.
DISPLAY_ROW = re.compile(r"\d+:\d\d:\d\d$")
#: A forecast printed above the display (off a terminal it is a ``progress:`` line).
FORECAST = re.compile(r"(calibration|validation): (\d+ forwards to run|about .+ left) \(")
#: The families a newcomer tries first.
FIRST_FAMILIES = ("llama-3.2-1b", "gpt2", "flan-t5-base", "stable-diffusion-1.5")
MODES = (True, False)
MODE_IDS = ("terminal", "piped")


def foreign_lines(run: Run, terminal: bool) -> list[str]:
    """stderr lines the command did not write itself."""

    def own(line: str) -> bool:
        if line.startswith(OWN_PREFIXES):
            return True
        return terminal and bool(DISPLAY_ROW.search(line) or FORECAST.match(line))

    return [line for line in run.stderr.text if not own(line)]


def check_run(run: Run, terminal: bool) -> None:
    """The run passed and read as a person should read it."""
    said = "\n".join(run.stderr.text[-20:])
    assert run.returncode == 0, said
    report = run.report_lines()
    assert 0 < len(report) <= SCREEN, "\n".join(report)
    assert [line for line in report if line.strip()][-1] == "verdict: pass"
    assert foreign_lines(run, terminal) == []
    silence, ended_by = run.longest_silence()
    assert silence <= SILENCE, f"{silence:.1f} s without a line, ended by {ended_by!r}"


def _convert(
    source: Path, target: str, work: Path, terminal: bool, *extra: str
) -> tuple[Run, Path]:
    """``model SOURCE --to TARGET`` run in ``work``; the run and its output directory."""
    out = work / f"{source.name}-{target}-{'tty' if terminal else 'pipe'}"
    args = ["model", str(source), "--to", target, "-o", str(out), *extra]
    return run_command(args, terminal=terminal, cwd=work), out


@pytest.mark.parametrize("terminal", MODES, ids=MODE_IDS)
def test_a_quick_conversion_reads_well(
    tiny_model: Callable[[str], Path], tmp_path: Path, terminal: bool
) -> None:
    run, _ = _convert(tiny_model("gpt2"), "bf16-safe", tmp_path, terminal, "--coverage", "quick")
    check_run(run, terminal)
    if not terminal:
        assert "\x1b" not in run.stderr.raw.decode() + run.stdout.raw.decode()


@pytest.mark.slow
@pytest.mark.parametrize("terminal", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("family", FIRST_FAMILIES)
def test_a_first_conversion_at_default_settings_reads_well(
    tiny_model: Callable[[str], Path], tmp_path: Path, family: str, terminal: bool
) -> None:
    """README's first command on each family a newcomer tries: ``model DIR --to fp16-safe``
    (calibration, then validation at standard coverage); its certificate under a megabyte."""
    run, out = _convert(tiny_model(family), "fp16-safe", tmp_path, terminal)
    check_run(run, terminal)
    assert (out / CERTIFICATE_NAME).stat().st_size < 1_000_000


def test_the_command_own_and_foreign_lines_are_told_apart() -> None:
    """The check above would see a library's line: a load report or a tqdm bar."""
    from _terminal import Stream

    stderr = Stream()
    stderr.take(1.0, b"progress: validation: started\n")
    stderr.take(2.0, b"Writing model shards: 100%|##| 1/1 [00:00<00:00]\n")
    stderr.take(3.0, b"\x1b[2Kconverting \xe2\x94\x81\xe2\x94\x81 1.2 MB 0:00:03\r")
    stderr.take(4.0, b"precision-convert: unet: 2 fp32 islands\n")
    stderr.take(4.5, b"validation: 61 forwards to run (fp32 baseline 14)\n")
    run = Run(0, 5.0, Stream(), stderr)
    assert foreign_lines(run, terminal=True) == ["Writing model shards: 100%|##| 1/1 [00:00<00:00]"]
    assert foreign_lines(run, terminal=False) == [
        "Writing model shards: 100%|##| 1/1 [00:00<00:00]",
        "converting ━━ 1.2 MB 0:00:03",
        "validation: 61 forwards to run (fp32 baseline 14)",
    ]
    assert run.longest_silence()[0] == 1.0


def test_a_line_written_again_is_news_in_a_pipe_only() -> None:
    """A pipe carries no redraws: a line the command writes a second time (the same probes'
    progress run again) ends a silence there; on a terminal it is the display redrawn."""
    from _terminal import Stream

    longest = {}
    for redrawn in (False, True):
        stderr = Stream(redrawn=redrawn)
        for at, line in (
            (1.0, b"progress: a: 1 of 9\n"),
            (6.0, b"b\n"),
            (11.0, b"progress: a: 1 of 9\n"),
        ):
            stderr.take(at, line)
        longest[redrawn] = Run(0, 12.0, Stream(), stderr).longest_silence()
    assert longest == {False: (5.0, "progress: a: 1 of 9"), True: (6.0, "(exit)")}


def test_a_silent_stretch_gets_a_heartbeat_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Off a terminal, a stage that reports nothing for a while is said to be running."""
    steps = _common._PlainSteps("converting")
    steps.heartbeat = Heartbeat(steps._still, interval=0.2)
    with steps.heartbeat:
        steps.report("validation › baseline", 0, None, False)
        time.sleep(0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "progress: validation › baseline: started"
    beats = lines[1:]
    assert beats and all(
        re.fullmatch(r"progress: validation › baseline: still running \(\d+ s so far\)", b)
        for b in beats
    ), lines


# -- what reaches the terminal: names as data, any encoding, a reader that goes away ---------

#: A name that would change the terminal's title and colour if printed raw, holds HTML, and
#: holds rich markup that rich refuses (a closing tag nothing opened). As a folder name its
#: "/" makes two folders; the path still spells it whole.
HOSTILE = "\x1b]0;pwned\x07\x1b[31m<img src=x onerror=alert(1)>[red]x[/bold]"


def _hostile_tiny(root: Path) -> Path:
    """The hand-made tiny source in a folder named :data:`HOSTILE`, its class and one of
    its tensors named so too."""
    state = {**TINY_STATE, f"{HOSTILE}.weight": torch.ones(4)}
    src = tiny_source(root / HOSTILE, state)
    config = {**TINY_CONFIG, "architectures": [HOSTILE]}
    (src / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return src


def _shown_escaped(*streams: str) -> None:
    """The hostile name reached the streams as its escapes, never as bytes a terminal runs,
    and its markup printed as it is."""
    for text in streams:
        assert "\x1b" not in text and "\x07" not in text, repr(text)
    assert printable(HOSTILE) in "".join(streams)


def _invoke(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: escaped {result.exception!r}\n{result.stderr}")
    return result.exit_code, result.stdout, result.stderr


def test_model_and_inspect_print_a_hostile_name_escaped(tmp_path: Path) -> None:
    src = _hostile_tiny(tmp_path / "src")
    out = tmp_path / "out" / HOSTILE
    code, stdout, stderr = _invoke(
        ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(out), "--report", "full"]
    )
    assert code == 0, stderr
    _shown_escaped(stdout, stderr)
    assert stdout.startswith(f"{printable(str(src))} → {printable(str(out))} (bf16)")
    code, stdout, stderr = _invoke(["inspect", str(src)])
    assert code == 0, stderr
    _shown_escaped(stdout, stderr)
    assert f"{printable(HOSTILE)}: {printable(HOSTILE)} — recipe" in stdout  # the class name
    assert f"│ {printable(HOSTILE)} " in stdout  # the tensor's module


@pytest.fixture(scope="module")
def smoke_checked_bert(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Tiny BERT converted without a certificate into a folder named :data:`HOSTILE`: a
    ``validate`` without a baseline (a smoke check, exit 1) prints its whole report there."""
    from precision_convert.api.conversion import convert

    out = tmp_path_factory.mktemp("smoke") / HOSTILE / "bert"
    return convert(tiny_model("bert"), "bf16-safe", out, validate=False).output


def test_validate_prints_a_hostile_name_escaped(smoke_checked_bert: Path) -> None:
    code, stdout, stderr = _invoke(["validate", str(smoke_checked_bert), "--coverage", "quick"])
    assert code == 1, stderr  # a smoke check never certifies
    _shown_escaped(stdout, stderr)
    assert f"written: {printable(str(smoke_checked_bert / CERTIFICATE_NAME))}" in stdout
    assert stdout.rstrip().endswith("verdict: smoke-pass")


def _run(args: list[str], *, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    return subprocess.Popen(
        [*cli_command(), *args], env=env or cli_env(), stderr=subprocess.PIPE, **popen
    )


def _no_traceback(stderr: bytes) -> str:
    text = stderr.decode("utf-8", "replace")
    for sign in ("Traceback", "Exception ignored", "BrokenPipeError", "UnicodeEncodeError"):
        assert sign not in text, text
    return text


def test_a_stdout_that_is_not_utf8_gets_ascii_reports(tmp_path: Path) -> None:
    """``LANG=C``: the reports spell their symbols and tables in ASCII; ``--json`` parses."""
    src = tiny_source(tmp_path / "src")
    env = {k: v for k, v in cli_env().items() if not k.startswith(("LC_", "LANG", "PYTHONIO"))}
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    runs = {
        "model": ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(tmp_path / "o")],
        "inspect": ["inspect", str(src)],
        "json": ["inspect", str(src), "--json"],
    }
    procs = {name: _run(args, env=env, stdout=subprocess.PIPE) for name, args in runs.items()}
    printed = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        _no_traceback(stderr)
        printed[name] = stdout.decode("ascii")  # raises on any byte that is not ASCII
    assert printed["model"].startswith(f"{src} -> {tmp_path / 'o'} (bf16)\n+---")
    assert "TinyTestModel: TinyTestModel - recipe generic" in printed["inspect"]
    assert json.loads(printed["json"])["components"]


def _reader_gone_at_once() -> int:
    """A pipe's write end whose reader has already gone: every write to it fails (EPIPE)."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_a_reader_that_goes_away_is_no_error(tmp_path: Path) -> None:
    """``| head -1``: what is not read is dropped, the work is done, exit 0, no traceback."""
    src = tiny_source(tmp_path / "src")
    runs = {
        "model": ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(tmp_path / "a")],
        "json": ["inspect", str(src), "--json"],
    }
    procs = {}
    for name, args in runs.items():
        gone = _reader_gone_at_once()
        procs[name] = _run(args, stdout=gone)
        os.close(gone)
    # As head does it: the first line read, then the pipe closed.
    procs["head"] = _run(
        ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(tmp_path / "b")],
        stdout=subprocess.PIPE,
    )
    head = procs["head"].stdout
    assert head is not None
    assert head.readline().startswith(f"{src} → ".encode())
    head.close()
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, _no_traceback(stderr))
        _no_traceback(stderr)
    assert (tmp_path / "a" / "model.safetensors").is_file()


def test_a_failed_check_keeps_exit_1_when_the_reader_has_gone(smoke_checked_bert: Path) -> None:
    """The verdict wins over a closed stdout: the check still fails, saying so on stderr."""
    gone = _reader_gone_at_once()
    proc = _run(["validate", str(smoke_checked_bert), "--coverage", "quick"], stdout=gone)
    os.close(gone)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1
    assert_one_error_line(_no_traceback(stderr), "not certified: a smoke check that passed")
