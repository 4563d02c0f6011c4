"""``precision-convert inspect SOURCE``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from precision_convert.cli._common import (
    CalibrationDataOption,
    CoverageOption,
    VerboseOption,
    emit_json,
    reported_errors,
    step_progress,
)
from precision_convert.conversion.io.source import local_directory


def inspect(
    source: Annotated[
        str,
        typer.Argument(metavar="SOURCE", help="Model/pipeline/OpenCLIP directory or Hub repo id."),
    ],
    revision: Annotated[
        str | None, typer.Option(metavar="REV", help="Hub revision of SOURCE.")
    ] = None,
    trust_remote_code: Annotated[
        bool,
        typer.Option(
            "--trust-remote-code",
            help="Allow the model's own code (auto_map) to build its skeleton.",
        ),
    ] = False,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="Run the model once in fp32 and show the modules nearest to fp16's limit, "
            "with a PNG heatmap of every module's peak activation by layer role and index.",
        ),
    ] = False,
    chart: Annotated[
        Path | None,
        typer.Option(
            metavar="PNG",
            help="Where --calibrate writes its chart (default: ./<source>-activations.png).",
        ),
    ] = None,
    coverage: CoverageOption = None,
    calibration_data: CalibrationDataOption = None,
    full: Annotated[
        bool,
        typer.Option("--full", help="List every module instead of one row per layer role."),
    ] = False,
    verbose: VerboseOption = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON report (every module listed).")
    ] = False,
) -> None:
    """Show real tensor dtypes per module, the matching recipe, planned islands and hazards."""
    # Options that only change what --calibrate does: without it they would be ignored, and
    # a chart asked for would silently never be written.
    ignored = [
        flag
        for flag, value in (("--chart", chart), ("--calibration-data", calibration_data))
        if value is not None and not calibrate
    ]
    if ignored:
        with reported_errors():
            from precision_convert.core.errors import InputError

            verb = "applies" if len(ignored) == 1 else "apply"
            raise InputError(f"{' and '.join(ignored)} {verb} only with --calibrate: add it")
    with reported_errors():  # heavy imports: a Ctrl-C meanwhile still gets its line
        local_directory(source, revision)  # a mistyped path is said before them
        from precision_convert.api.inspection import inspect_source

    with reported_errors(), step_progress("calibrating", calibrate, verbose):
        report = inspect_source(
            source,
            revision=revision,
            trust_remote_code=trust_remote_code,
            calibrate=calibrate,
            chart=chart,
            coverage=coverage,
            calibration_data=calibration_data,
        )
    if json_output:
        emit_json(report.to_json())
    else:
        from precision_convert.cli._reports import print_inspect

        print_inspect(report, full=full)
