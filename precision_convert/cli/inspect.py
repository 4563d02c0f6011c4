"""``precision-convert inspect SOURCE``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from precision_convert.cli._common import console, emit_json, reported_errors


def inspect(
    source: Annotated[
        str, typer.Argument(help="Model/pipeline/OpenCLIP directory or Hub repo id.")
    ],
    revision: Annotated[str | None, typer.Option(help="Hub revision of SOURCE.")] = None,
    trust_remote_code: Annotated[
        bool, typer.Option(help="Allow the model's own code (auto_map) to build its skeleton.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON report.")] = False,
) -> None:
    """Show real tensor dtypes per module, the matching recipe, planned islands and hazards."""
    from precision_convert.convert.inspection import inspect_source

    with reported_errors():
        report = inspect_source(source, revision=revision, trust_remote_code=trust_remote_code)
    if json_output:
        emit_json(report.to_json())
        return
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
