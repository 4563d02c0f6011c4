"""What every command shares: the stderr console, error reporting and the progress bar."""

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

#: Human output goes to stderr so that ``--json`` leaves stdout machine-readable.
console = Console(stderr=True)
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
    """A rich progress bar fed with (label, bytes) callbacks; a no-op when disabled."""
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

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def advance(label: str, n: int) -> None:
            progress.update(task, advance=n, description=f"{description} {label}")

        yield advance


#: Options shared by the commands that run probes (model, validate, inspect --calibrate).
CoverageOption = Annotated[
    str | None,
    typer.Option(
        "--coverage",
        metavar="LEVEL",
        help="Probe budget of calibration and validation: quick, standard (default) or "
        "thorough.",
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
