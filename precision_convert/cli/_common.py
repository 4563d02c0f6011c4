"""What every command shares: the two consoles, error reporting and the progress display."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

#: Progress, warnings and notes: stderr, so they never mix into a report or ``--json`` output.
console = Console(stderr=True)
#: A command's human-readable report is its output: stdout, so ``| less`` and ``> file`` work.
#: Commands with ``--json`` print either the report or the JSON there, never both. Rich
#: honours ``NO_COLOR`` and writes no escape codes when stdout is not a terminal.
out = Console()
#: Set to 1 to see tracebacks; off by default because they may hold tokens and paths.
DEBUG_VARIABLE = "PRECISION_CONVERT_DEBUG"


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn library errors into one line on stderr and the error's exit code."""
    from precision_convert.errors import PrecisionConvertError

    try:
        yield
    except PrecisionConvertError as exc:
        if os.environ.get(DEBUG_VARIABLE):
            raise
        print(f"precision-convert: {exc}", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        print("precision-convert: interrupted; no output was written", file=sys.stderr)
        raise typer.Exit(130) from None


def emit_json(payload: Any) -> None:
    """The one machine-readable result of a command, on stdout."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")


@contextmanager
def byte_progress(description: str, enabled: bool) -> Iterator[Callable[[str, int], None]]:
    """Progress on stderr for one command: a bar fed with (label, bytes) callbacks, plus one
    line per stage the library reports (probe k of n, candidate k of at most m) with an ETA.

    A no-op when disabled or when stderr is not a terminal (logs get no redraw noise).
    """
    if not enabled or not console.is_terminal:
        yield lambda label, n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from precision_convert.progress import reporting

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)
        steps = _StepDisplay(progress)

        def advance(label: str, n: int) -> None:
            progress.update(task, advance=n, description=f"{description} {label}")

        with reporting(steps.report):
            yield advance


@contextmanager
def step_progress(description: str, enabled: bool) -> Iterator[None]:
    """:func:`byte_progress` for commands that move no bytes worth counting (validate)."""
    with byte_progress(description, enabled):
        yield


class _StepDisplay:
    """The library's stage reports as rich tasks: one line per label, gone when finished.

    A label reported again from a lower count (the next model's probes, a new search round)
    restarts its line, so the ETA is measured on the current run only.
    """

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}
        self.last: dict[str, int] = {}

    def report(self, label: str, done: int, total: int | None, at_most: bool) -> None:
        task = self.tasks.get(label)
        if task is None or done < self.last[label]:
            if task is not None:
                self.progress.remove_task(task)
            task = self.tasks[label] = self.progress.add_task(label, total=total)
        self.last[label] = done
        if total is not None and done >= total:
            self.progress.remove_task(task)
            del self.tasks[label], self.last[label]
            return
        bound = "at most " if at_most else ""
        count = f"{done} of {bound}{total}" if total is not None else str(done)
        self.progress.update(task, completed=done, total=total, description=f"{label} {count}")


#: Options shared by the commands that run probes (model, validate, inspect --calibrate).
CoverageOption = Annotated[
    str | None,
    typer.Option(
        "--coverage",
        metavar="LEVEL",
        help="Probe budget of calibration and validation: quick, standard (default) or thorough.",
        show_default=False,
    ),
]
CalibrationDataOption = Annotated[
    Path | None,
    typer.Option(
        "--calibration-data",
        metavar="FILE",
        help="Text lines or JSONL of model inputs, added to the probes.",
    ),
]
