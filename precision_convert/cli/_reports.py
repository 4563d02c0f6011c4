"""The human-readable reports of ``inspect``, ``model`` and ``validate``, on stdout.

A model with 80 layers has 80 copies of every module; the reports fold them into one row per
role (``model.layers.{0..79}.mlp.down_proj``, see :mod:`precision_convert.core.folding`) and say
which instances differ, so a report of a real model fits on a screen and still names every
fp32 island. Tables are sized to the terminal: a name too long for its column loses its
middle, where a folded name repeats least (its head says where, its tail what).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from precision_convert.cli._common import console, elide, literal, out
from precision_convert.core.dtypes import WATCHED_RANGE, Target
from precision_convert.core.errors import printable
from precision_convert.core.folding import Role, fold
from precision_convert.core.patterns import code_files

if TYPE_CHECKING:
    from precision_convert.api.conversion import ConversionResult
    from precision_convert.api.inspection import ComponentReport, InspectReport
    from precision_convert.validation.certify.card_metrics import MetricRow
    from precision_convert.validation.certify.certificate import Certificate

#: A name column never gets narrower than this, however wide the other columns are.
MIN_NAME_WIDTH = 24
#: Most hazards listed per kind before the rest are counted.
MAX_HAZARD_ROLES = 10
#: Most roles in the table of modules nearest to fp16's limit.
MAX_NEAR_ROLES = 20
#: Metric rows (and failure lines) a summary report lists: it stays under 40 lines.
SUMMARY_ROWS = 8


#: A table cell: text printed as it is (:func:`cell`), or a styled :class:`Text`.
Cell = str | Text


def cell(value: Cell) -> Text:
    """A table cell as rich prints it: a string is data (a name, a probe, a number), its
    control characters escaped and its ``[`` never markup; a :class:`Text` is styled as made."""
    return value if isinstance(value, Text) else Text(printable(value))


def print_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[Cell]], *, right: Iterable[int] = ()
) -> None:
    """Print ``title`` and a table whose first column (a module name) is elided in the middle
    so the table fits the report console's width. Every cell is taken literally (:func:`cell`):
    a style comes only from a :class:`Text` made by the report. The title is a line of its
    own: a rich table title is padded with trailing blanks."""
    aligned = set(right)
    cells = [[cell(value) for value in row] for row in rows]
    widths = [max([len(h), *(r[i].cell_len for r in cells)]) for i, h in enumerate(headers)]
    # Each column costs its padding (2) and a border (1), plus the table's closing border.
    name_width = max(MIN_NAME_WIDTH, out.width - sum(widths[1:]) - 3 * len(headers) - 1)
    table = Table()
    for i, header in enumerate(headers):
        table.add_column(
            header,
            justify="right" if i in aligned else "left",
            # Names are elided above and numbers never break; only free text may wrap.
            no_wrap=i == 0 or i in aligned,
            min_width=widths[i] if i in aligned else None,
            overflow="ellipsis" if i == 0 else "fold",
        )
    for row in cells:
        name = row[0]
        if name.cell_len > name_width:  # a name is plain text: elided as text
            name = Text(elide(name.plain, name_width), style=name.style)
        table.add_row(name, *row[1:])
    out.print(literal(title), soft_wrap=True)
    out.print(table)


def islands_cell(role: Role, islands: Mapping[str, str]) -> str:
    """Which of ``role``'s instances are fp32 islands, by reason: ``all: precision``,
    ``0,79: range``; "" when none is."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for member in role.members:
        if member in islands:
            by_reason[islands[member]].append(member)
    parts = []
    for reason, members in by_reason.items():
        which = role.describe(members)
        parts.append(reason if which == "all" and not role.repeated else f"{which}: {reason}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- inspect


def print_inspect(report: InspectReport, *, full: bool) -> None:
    """``inspect``'s report: one row per role (every module with ``full``), then totals,
    island counts, hazards and the calibration."""
    for component in report.components:
        _module_table(component, full=full)
        counts = ", ".join(f"{k}: {v:,}" for k, v in sorted(component.parameters_by_dtype.items()))
        out.print(f"parameters by dtype — {counts}")
        if component.record is not None:
            out.print(literal(recorded_map_text(component.record)), soft_wrap=True)
        for target, islands in component.islands.items():
            out.print(f"{target}: {len(islands)} fp32 islands")
        _print_hazards(component)
        if component.calibration is not None:
            _print_calibration(component)


def recorded_map_text(record: Mapping[str, Any]) -> str:
    """The dtype map a converted model records (its ``precision_convert`` block), in a line:
    its target, compute dtype and how many modules it keeps in fp32."""
    kept = len(record.get("fp32_modules") or ())
    target = record.get("target") or "unknown target"
    return (
        f"dtype map recorded by precision-convert ({target}): {record.get('compute_dtype')} "
        f"compute, {kept} module{'' if kept == 1 else 's'} kept in fp32"
    )


def _module_table(component: ComponentReport, *, full: bool) -> None:
    """One row per role (or per module with ``full``): instances, parameters, fp32 islands.

    The dtype column only appears when the dtypes differ (the totals line says which one it
    is otherwise); the island column merges the targets when they agree, as they do but for
    fp16's range islands.
    """
    title = component.component or component.class_name or "model"
    heading = f"{title}: {component.class_name} — recipe {component.recipe}"
    names = [m.name for m in component.modules]
    known = set(names)
    # An island that owns no weight row still gets one, so every island is named.
    names += [n for islands in component.islands.values() for n in islands if n not in known]
    rows_by_name = {m.name: m for m in component.modules}
    mixed = len({m.dtypes for m in component.modules}) > 1
    roles = [Role.of(n) for n in dict.fromkeys(names)] if full else fold(names)
    rows = []
    for role in roles:
        modules = [rows_by_name[m] for m in role.members if m in rows_by_name]
        row = [role.label, str(len(role.members))]
        if mixed:
            dtypes: dict[str, list[str]] = defaultdict(list)
            for m in modules:
                dtypes[", ".join(m.dtypes)].append(m.name)
            row.append(
                next(iter(dtypes), "")
                if len(dtypes) <= 1
                else "; ".join(f"{d}: {role.describe(ms)}" for d, ms in dtypes.items())
            )
        row.append(f"{sum(m.parameters for m in modules):,}")
        cells = {t: islands_cell(role, islands) for t, islands in component.islands.items()}
        if len(set(cells.values())) <= 1:
            row.append(next(iter(cells.values()), ""))
        else:
            row.append("; ".join(f"{t} {cell}" for t, cell in cells.items() if cell))
        rows.append(row)
    headers = ["module", "count", *(["dtypes"] if mixed else []), "parameters", "fp32 islands"]
    print_table(heading, headers, rows, right=(1, len(headers) - 2))


def _print_hazards(component: ComponentReport) -> None:
    """Hazards folded like the modules: one line per kind and role, with its first detail."""
    if not component.hazards:
        out.print("[green]no hazards found[/]")
        return
    by_kind: dict[str, dict[str, str]] = defaultdict(dict)
    for hazard in component.hazards:
        by_kind[hazard.kind].setdefault(hazard.name, hazard.detail)
    for kind, details in by_kind.items():
        roles = fold(details)
        for role in roles[:MAX_HAZARD_ROLES]:
            first = details[role.members[0]]
            also = f" (and {len(role.members) - 1} more like it)" if role.repeated else ""
            out.print(
                f"[red]{literal(kind)}[/] {literal(role.label)}: {literal(first)}{also}",
                soft_wrap=True,
            )
        if len(roles) > MAX_HAZARD_ROLES:
            rest = sum(len(r.members) for r in roles[MAX_HAZARD_ROLES:])
            out.print(f"[red]{literal(kind)}[/] … {rest} more modules (see --json)")


def _print_calibration(component: ComponentReport) -> None:
    """The modules within 8x of fp16's limit, folded by role (``model.layers.{2..31}.
    input_layernorm``: the instances that came near, with their worst peaks), nearest first."""
    near = {row["module"]: row for row in component.nearest_to_limit(len(component.modules))}
    islands = component.islands.get(Target.FP16_SAFE, {})
    roles = sorted(fold(near), key=lambda r: min(near[m]["fp16_headroom"] for m in r.members))
    rows: list[list[Cell]] = []
    for role in roles[:MAX_NEAR_ROLES]:
        worst = [near[m] for m in role.members]
        headroom = min(row["fp16_headroom"] for row in worst)
        style = "red" if headroom < 1 else "yellow" if headroom < 2 else ""
        rows.append(
            [
                role.label,
                f"{max(row['max_in'] for row in worst):.4g}",
                f"{max(row['max_out'] for row in worst):.4g}",
                Text(f"{headroom:.3g}x", style=style),
                islands_cell(role, islands),
            ]
        )
    if rows:
        headers = ["module", "peak |in|", "peak |out|", "headroom", "fp16-safe island"]
        limit = f"{WATCHED_RANGE.name} limit ({WATCHED_RANGE.finite_max:g})"
        title = f"modules nearest to the {limit}, fp32 calibration run"
        print_table(title, headers, rows, right=(1, 2, 3))
    else:
        out.print("[green]no module comes within 8x of fp16's limit[/]")
    assert component.calibration is not None
    for warning in component.calibration.warnings:
        console.print(f"[yellow]warning[/]: {literal(warning)}")
    if component.chart is not None:
        out.print(f"chart: {literal(component.chart)}", soft_wrap=True)


# --------------------------------------------------------------------------- model


def print_conversion(result: ConversionResult, *, full: bool = False) -> None:
    """``model``'s summary: one row per component, then (with ``full``) each component's
    islands folded by role; the plan's warnings go to stderr."""
    out.print(literal(f"{result.source} → {result.output} ({result.target})"), soft_wrap=True)
    table = Table()
    for column in ("component", "recipe", "fp32 modules", "fp32 share", "warnings"):
        table.add_column(column)
    for component in result.components:
        summary = component.summary()
        table.add_row(
            cell(component.name or component.class_name or "model"),
            cell(summary["recipe"]),
            str(summary["fp32_modules"]),
            share_text(component.plan.fp32_share, bool(component.plan.islands)),
            str(len(summary["warnings"])),
        )
    out.print(table)
    for component in result.components if full else ():
        islands = {i.name: i.reason for i in component.plan.islands}
        if islands:
            units = dict.fromkeys(t.unit for t in component.plan.tensors if t.source.is_float)
            name = component.name or component.class_name or "model"
            print_islands(f"{name}: fp32 islands", units, islands)
    accounted = 0
    for component in result.components:
        # Spikes the plan keeps in fp32 are what the certificate judges: summed up in one
        # line before the verdict (each named with --report full), not a warning each.
        calibration = component.calibration
        summed = frozenset(() if full or calibration is None else calibration.accounted)
        accounted += len(summed)
        for warning in component.plan.warnings:
            if warning not in summed:
                console.print(f"[yellow]warning[/]: {literal(warning)}")
    if accounted:
        console.print(
            f"note: {accounted} activations near or past fp16's limit are kept in fp32 by the "
            "islands the verdict accounts for; --report full names them",
            highlight=False,
        )
    if code := code_files(result.files):
        console.print(code_note(code, "copied from the source"), highlight=False, soft_wrap=True)


def code_note(files: Sequence[str], how: str) -> str:
    """The line that says an output carries Python code a library runs on request: copied or
    pushed with the weights, it should not travel without a word."""
    return (
        f"note: code that runs if you pass trust_remote_code, {how}: "
        f"{', '.join(literal(f) for f in files)}"
    )


def share_text(share: float, has_islands: bool) -> str:
    """A share as a percentage that never reads 0.0% while there are fp32 islands (a few
    norm weights of a large model are a tiny but real share)."""
    if has_islands and share < 0.001:
        return "<0.1%"
    return f"{share:.1%}"


def print_islands(title: str, units: Iterable[str], islands: Mapping[str, str]) -> None:
    """The roles holding fp32 islands, with which of their instances are islands and why."""
    names = list(units)
    known = set(names)
    names += [n for n in islands if n not in known]
    rows = [
        [role.label, str(len(role.members)), islands_cell(role, islands)]
        for role in fold(dict.fromkeys(names))
        if any(m in islands for m in role.members)
    ]
    print_table(title, ["role", "count", "fp32 (which: why)"], rows, right=(1,))


# --------------------------------------------------------------------------- certificates


def note_uncertified(converted: Path, source: str) -> None:
    """Say (on stderr) that a ``--no-validate`` output holds no certificate, and how to get
    one: ``push`` refuses it until then."""
    console.print(
        literal(
            f"note: {converted} is not certified (--no-validate): precision-convert validate "
            f"{converted} --baseline {source}"
        ),
        soft_wrap=True,
        highlight=False,
    )


def note_unvalidated(converted: Path) -> None:
    """Say (on stderr) where the failing certificate of a validation that could not run went."""
    from precision_convert.validation.certify.certificate import CARD_NAME, CERTIFICATE_NAME

    if (converted / CERTIFICATE_NAME).is_file():
        console.print(
            f"[red]✗[/] not validated: {literal(converted / CERTIFICATE_NAME)} (verdict fail) "
            f"and {CARD_NAME} say what is missing",
            soft_wrap=True,
        )


def print_certificate(
    certificate: Certificate, directory: Path | None = None, *, full: bool = False
) -> None:
    """The judged metrics on stdout, folded: one row per output and metric with its worst
    value over every probe (block-wise comparisons folded by layer role), the failures, where
    the files are and the verdict. Without ``full`` only the rows nearest their bounds (and
    the failing ones, up to as many) are listed, so the report fits a screen for any model;
    with it every row, and the parity metric per probe when several were swept. ``directory``
    is where the certificate and its card were written."""
    from precision_convert.validation.certify.card import compared_with, outside_bounds
    from precision_convert.validation.certify.card_metrics import (
        BAR_LABEL,
        folded_metrics,
        probe_series,
    )
    from precision_convert.validation.certify.certificate import SMOKE_PASS
    from precision_convert.validation.certify.consistency import (
        BUDGET,
        budget_limited,
        modules_not_covered,
    )

    folded = folded_metrics(certificate.metrics)
    shown = folded if full else nearest_bounds(folded, SUMMARY_ROWS)
    rows: list[list[Cell]] = []
    for row in shown:
        value = "NaN/Inf" if row.value is None else f"{row.value:.4g}"
        rows.append(
            [
                row.where,
                row.metric,
                value,
                row.bound_text,
                Text("ok", style="green") if row.passed else Text("FAIL", style="red"),
                row.worst_probe,
            ]
        )
    headers = ["where", "metric", "worst", "bound", "", "worst probe (of n)"]
    title = f"{certificate.target or 'unknown target'}: parity with {compared_with(certificate)}"
    if not certificate.against_source:
        title += " (a smoke check, never a certification)"
    print_table(title, headers, rows, right=(2,))
    out.print(literal(judged_text(certificate)), soft_wrap=True)
    if len(shown) < len(folded):
        out.print(
            f"… {len(folded) - len(shown)} more rows within their bounds: --report full, or "
            f"{literal(certificate.file_name)}",
            soft_wrap=True,
        )
    for series in probe_series(certificate.metrics) if full else ():
        out.print(literal(f"{series.metric} per probe: {series.where}"), soft_wrap=True)
        table = Table()
        for column in ("probe", series.metric, BAR_LABEL):
            table.add_column(column, justify="right" if column == series.metric else "left")
        for probe, value, bar in series.rows():
            table.add_row(cell(probe), value, bar)
        out.print(table)
    failures = certificate.failures_beside_metrics()
    for line in failures if full else failures[:SUMMARY_ROWS]:
        out.print(f"[red]✗[/] {literal(line)}", soft_wrap=True)
    file_name = literal(certificate.file_name)
    if not full and len(failures) > SUMMARY_ROWS:
        out.print(f"[red]✗[/] … {len(failures) - SUMMARY_ROWS} more in {file_name}")
    if outside := outside_bounds(certificate):
        out.print(
            f"[red]✗[/] {literal(outside)}: the FAIL rows above (every one in {file_name})",
            soft_wrap=True,
        )
    if directory is not None:
        from precision_convert.validation.certify.certificate import CARD_NAME

        card = directory / CARD_NAME
        out.print(
            literal(f"written: {directory / certificate.file_name}, {card} (the card)"),
            soft_wrap=True,
        )
    colour = (
        "green" if certificate.passed else "yellow" if certificate.verdict == SMOKE_PASS else "red"
    )
    limited = budget_limited(certificate)
    if limited is not None:
        for item in certificate.not_covered or ():
            if item.get("why") == BUDGET:
                out.print(literal(f"not covered: {item['what']} (budget)"), soft_wrap=True)
    if (modules := modules_not_covered(certificate)) is not None:
        out.print(literal(modules), soft_wrap=True)
    verdict = f"verdict: [bold {colour}]{literal(certificate.verdict)}[/]"
    out.print(verdict + (f", {literal(limited)}" if limited else ""), soft_wrap=True)


def judged_text(certificate: Certificate) -> str:
    """What was judged, in one line: probes, outputs and measurements (blocks, when a
    block-wise comparison ran)."""
    from precision_convert.validation.certify.card_metrics import BLOCK

    probes = {m.probe for m in certificate.metrics if not m.probe.startswith(BLOCK)}
    blocks = {m.probe for m in certificate.metrics if m.probe.startswith(BLOCK)}
    outputs = {(m.component, m.output) for m in certificate.metrics if m.metric != "coverage"}
    parts = [f"{len(probes)} probes"] + ([f"{len(blocks)} blocks"] if blocks else [])
    return (
        f"judged: {' and '.join(parts)}, {len(outputs)} outputs, "
        f"{len(certificate.metrics)} measurements"
    )


def nearest_bounds(rows: Sequence[MetricRow], most: int) -> list[MetricRow]:
    """The failing rows, then the judged rows nearest their bounds, ``most`` in all, in the
    order of ``rows``: what a reader must see first whatever the model's size."""

    def closeness(row: MetricRow) -> float:
        if row.value is None:
            return math.inf
        assert row.threshold is not None
        if row.bound == "max":
            if row.threshold <= 0:  # nonfinite ≤ 0: at the bound only when over it
                return math.inf if row.value > 0 else 0.0
            return row.value / row.threshold
        # A lower bound on a similarity (cosine, top-1 agreement): the distance from 1 that
        # remains, as a share of the distance the bound allows.
        if row.threshold < 1:
            return (1 - row.value) / (1 - row.threshold)
        return row.threshold / row.value if row.value > 0 else math.inf

    judged = [r for r in rows if r.threshold is not None or not r.passed]
    ranked = sorted(judged, key=lambda r: (r.passed, -closeness(r) if r.threshold else 0))
    keep = {id(r) for r in ranked[:most]}
    return [r for r in rows if id(r) in keep]
