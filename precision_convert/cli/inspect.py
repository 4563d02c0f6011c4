"""``precision-convert inspect SOURCE``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from precision_convert.cli._common import (
    CalibrationDataOption,
    CoverageOption,
    console,
    emit_json,
    reported_errors,
)

if TYPE_CHECKING:
    from precision_convert.api.inspection import ComponentReport


def inspect(
    source: Annotated[
        str, typer.Argument(help="Model/pipeline/OpenCLIP directory or Hub repo id.")
    ],
    revision: Annotated[str | None, typer.Option(help="Hub revision of SOURCE.")] = None,
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
            "with a PNG chart of every module's peak activation.",
        ),
    ] = False,
    chart: Annotated[
        Path | None,
        typer.Option(
            help="Where --calibrate writes its chart (default: ./<source>-activations.png)."
        ),
    ] = None,
    coverage: CoverageOption = None,
    calibration_data: CalibrationDataOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON report.")] = False,
) -> None:
    """Show real tensor dtypes per module, the matching recipe, planned islands and hazards."""
    from precision_convert.api.inspection import inspect_source

    with reported_errors():
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
        return
    from rich.table import Table

    for component in report.components:
        title = component.component or component.class_name or "model"
        modules = Table(title=f"{title}: {component.class_name} — recipe {component.recipe}")
        modules.add_column("module")
        modules.add_column("dtypes")
        modules.add_column("parameters", justify="right")
        for row in component.modules:
            modules.add_row(row.name, ", ".join(row.dtypes), f"{row.parameters:,}")
        console.print(modules)
        counts = ", ".join(f"{k}: {v:,}" for k, v in sorted(component.parameters_by_dtype.items()))
        console.print(f"parameters by dtype — {counts}")
        for target, islands in component.islands.items():
            console.print(f"{target}: {len(islands)} fp32 islands")
        if not component.hazards:
            console.print("[green]no hazards found[/]")
        for hazard in component.hazards:
            console.print(f"[red]{hazard.kind}[/] {hazard.name}: {hazard.detail}")
        if component.calibration is not None:
            _print_calibration(component)


def _print_calibration(component: ComponentReport) -> None:
    from rich.table import Table

    table = Table(title="modules nearest to the fp16 limit (65504), fp32 calibration run")
    table.add_column("module", overflow="fold")
    for column in ("peak |in|", "peak |out|", "headroom", "fp16-safe island"):
        table.add_column(column)
    for row in component.nearest_to_limit():
        headroom = row["fp16_headroom"]
        style = "red" if headroom < 1 else "yellow" if headroom < 2 else ""
        table.add_row(
            row["module"],
            f"{row['max_in']:.4g}",
            f"{row['max_out']:.4g}",
            f"[{style}]{headroom:.3g}x[/]" if style else f"{headroom:.3g}x",
            row["island"] or "",
        )
    if table.row_count:
        console.print(table)
    else:
        console.print("[green]no module comes within 8x of fp16's limit[/]")
    assert component.calibration is not None
    for warning in component.calibration.warnings:
        console.print(f"[yellow]warning[/]: {warning}")
    if component.chart is not None:
        console.print(f"chart: {component.chart}")
