"""Hand-edited certificates: each edit is written back with the card the edited certificate
renders, so the edit is the only thing wrong (the weights, and so every hash the certificate
records, are untouched). Used by the integrity, push and batch tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from precision_convert.validation.certify.card import render_card
from precision_convert.validation.certify.certificate import (
    CERTIFICATE_NAME,
    Certificate,
    compact_json,
)

Edit = Callable[[dict[str, Any]], None]


def rewrite(out: Path, *edits: Edit) -> dict[str, Any]:
    """Apply ``edits`` to ``out``'s certificate (its JSON, as a reader gets it), write it and
    the card it renders; returns the edited JSON."""
    path = out / CERTIFICATE_NAME
    data = json.loads(path.read_text(encoding="utf-8"))
    for edit in edits:
        edit(data)
    path.write_text(compact_json(data) + "\n", encoding="utf-8")
    (out / "README.md").write_text(render_card(Certificate.from_dict(data), out), "utf-8")
    return data


def every_record_failed(data: dict[str, Any]) -> None:
    """The report's certificate: every measurement (the comparison's and each way of
    loading's) at 1e9 and marked failed, the verdict left ``pass``."""
    for series in data["metrics"]["series"]:
        series["value"] = [1e9] * len(series["value"])
        series["passed"] = [False] * len(series["passed"])
    for way in data["load_paths"]:
        for m in way["metrics"]:
            m.update(value=1e9, passed=False)


def coverage_dropped(data: dict[str, Any]) -> None:
    """A required record missing: the coverage measurement, the verdict left ``pass``."""
    series = data["metrics"]["series"]
    series[:] = [s for s in series if s["metric"] != "coverage"]


def plain_load_dropped(data: dict[str, Any]) -> None:
    """A required record missing: the plain default load of the model."""
    data["load_paths"] = [p for p in data["load_paths"] if p["way"] != "plain"]


def marks_stripped(data: dict[str, Any]) -> None:
    """As a certificate written before ``deciding`` and ``not_covered`` existed."""
    for series in data["metrics"]["series"]:
        series.pop("deciding", None)
    data.pop("not_covered", None)


def first_deciding(data: dict[str, Any]) -> str:
    """How a contradiction names the first deciding measurement: ``<where> <metric>``."""
    probes = data["metrics"]["probes"]
    s = next(s for s in data["metrics"]["series"] if s["threshold"] is not None)
    where = "/".join(p for p in (s["component"], probes[s["probe"][0]], s["output"]) if p)
    return f"{where} {s['metric']}"
