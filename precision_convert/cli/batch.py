"""``precision-convert batch MANIFEST``: every (model, target) of a manifest, one job each."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from precision_convert.cli._common import console, literal, out, reported_errors, say
from precision_convert.core import interrupts

if TYPE_CHECKING:
    from precision_convert.batch.job import Outcome
    from precision_convert.batch.runner import BatchReport


class Executor(StrEnum):
    local = "local"
    ray = "ray"


def batch(
    manifest: Annotated[
        Path,
        typer.Argument(help="TOML manifest of models and targets (README: Batch conversion)."),
    ],
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            min=1,
            help="Jobs at once: warm worker processes (local), or the share of each node's "
            "CPUs a job asks for (ray).",
        ),
    ] = 1,
    executor: Annotated[
        Executor, typer.Option(help="Run jobs in local worker processes or as Ray tasks.")
    ] = Executor.local,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            metavar="ADDR",
            help="Ray cluster to run on (default: RAY_ADDRESS, else a new local one).",
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Keep jobs whose output has a passing certificate matching its files and "
            "whose push is done; redo the rest, replacing their outputs.",
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Redo every job, replacing the outputs that exist when the run starts (without "
            "it or --resume, an existing output stops the run before anything runs). An output "
            "another run writes while a job runs is never replaced: that job fails.",
        ),
    ] = False,
) -> None:
    """Convert, certify and (optionally) push every model × target of MANIFEST.

    A failing job never stops the others. The run ends with a table on stdout and writes its
    report into the output folder (batch_reports/<started>.json, and batch_report.json for
    the latest run).

    Exit 1: some job failed. Exit 2, nothing run: a bad manifest, outputs that exist (without
    --resume or --overwrite), a Hub token that is missing or cannot make the manifest's
    pushes, or another batch run writing to the same output folder.
    """
    with reported_errors():
        from precision_convert.batch.manifest import read_manifest
        from precision_convert.batch.runner import REPORT_NAME, run_batch

        plan = read_manifest(manifest)
        try:
            with _Progress(len(plan.jobs)) as progress:
                report = run_batch(
                    plan,
                    jobs=jobs,
                    executor=executor.value,
                    ray_address=ray_address,
                    resume=resume,
                    overwrite=overwrite,
                    on_event=progress.event,
                )
            print_report(report)
            latest = report.output_dir / REPORT_NAME
            console.print(
                literal(f"report: {report.file} (latest: {latest})"),
                highlight=False,
                soft_wrap=True,
            )
        except KeyboardInterrupt as exc:
            say(
                f"{interrupts.stopped_by(exc)}; jobs that finished are kept in "
                f"{plan.output_dir}: run again with --resume to do the rest"
            )
            raise typer.Exit(interrupts.exit_code(exc)) from None
    if report.failed:
        raise typer.Exit(1)


#: The statuses as the JSON report words them, coloured.
_LABELS = {"done": "[green]done[/]", "skipped": "[cyan]skipped[/]", "failed": "[red]failed[/]"}


def print_report(report: BatchReport) -> None:
    """The report on stdout: the table of every job, in the JSON report's words, then each
    failed job's reason on a line of its own (a reason is often longer than a terminal is
    wide: in a table column it would fold letter by letter)."""
    from rich.table import Table

    counts = report.counts()
    table = Table(
        title=f"batch: {counts['done']} done, {counts['skipped']} skipped, "
        f"{counts['failed']} failed in {report.seconds:.1f} s"
    )
    for column in ("job", "status", "time", "fp32 share", "key metric", "pushed"):
        table.add_column(column, overflow="fold")
    for o in report.outcomes:
        share = "" if o.fp32_share is None else f"{o.fp32_share:.1%}"
        pushed = o.push["url"] if o.push else ""
        time = f"{o.seconds:.1f} s" if o.timings else ""
        table.add_row(literal(o.key), _LABELS[o.status], time, share, _metric(o), literal(pushed))
    out.print(table)
    for o in report.failed:
        out.print(
            f"[red]✗[/] {literal(o.key)}: {literal(o.reason or '')}",
            highlight=False,
            soft_wrap=True,
        )


def _metric(outcome: Outcome) -> str:
    m = outcome.key_metric
    if not m:
        return ""
    value = "NaN/Inf" if m["value"] is None else f"{m['value']:.3g}"
    bound = "≤" if m["bound"] == "max" else "≥"
    return literal(f"{m['metric']} {value} ({bound} {m['threshold']:g})")


class _Progress:
    """Overall and per-job progress on stderr: live bars on a terminal, one line per finished
    job otherwise (logs get no redraw noise)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.finished = 0
        self.live: Any = None  # a rich Progress on a terminal
        self.overall: Any = None
        self.rows: dict[str, Any] = {}

    def __enter__(self) -> _Progress:
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.live = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self.live.__enter__()
            self.overall = self.live.add_task("jobs", total=self.total)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.live is not None:
            self.live.__exit__(kind, exc, tb)

    def event(self, key: str, stage: str) -> None:
        if stage not in _LABELS:
            if self.live is not None:
                row = self.rows.get(key)
                if row is None:
                    row = self.rows[key] = self.live.add_task("", total=None)
                self.live.update(row, description=literal(f"  {key}: {stage}"))
            return
        self.finished += 1
        line = f"[{self.finished}/{self.total}] {literal(key)}: {_LABELS[stage]}"
        if self.live is None:
            console.print(line, highlight=False, soft_wrap=True)
            return
        row = self.rows.pop(key, None)
        if row is not None:
            self.live.remove_task(row)
        self.live.advance(self.overall)
        self.live.console.print(line, highlight=False, soft_wrap=True)
