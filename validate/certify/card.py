"""The converted model's ``README.md``: Hub metadata plus a readable account of the certificate.

The YAML front matter is a ``huggingface_hub.ModelCardData`` (``base_model``, tags, the
library, and a ``precision_convert:`` summary); the body is a table of the judged metrics, so a
reader on the Hub sees why the conversion is trusted without opening the JSON.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    CERTIFICATE_NAME,
    Certificate,
)
from precision_convert.validation.probe.metrics import Measurement

#: The activation-range chart the analysis stage saves; shown in the card when present.
CHART_NAME = "precision_activations.png"
#: Most metric rows in the card; the certificate keeps all of them.
MAX_ROWS = 60
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model_id(certificate: Certificate) -> str | None:
    """The Hub id to declare as ``base_model``: the source's repo id when it has one."""
    source_id = certificate.source.get("id")
    if isinstance(source_id, str) and _REPO_ID.match(source_id) and not Path(source_id).exists():
        return source_id
    return None


def tags(certificate: Certificate) -> list[str]:
    target = certificate.target or ""
    found = ["precision-convert", target.removesuffix("-safe")] if target else ["precision-convert"]
    if target.endswith("-safe"):
        found.append("precision-safe")
    if certificate.passed:
        found.append("parity-certified")
    return found


def summary(certificate: Certificate) -> dict[str, Any]:
    """The ``precision_convert:`` block of the YAML front matter."""
    failed = [m for m in certificate.metrics if not m.passed]
    return {
        "version": certificate.tool.get("version"),
        "target": certificate.target,
        "compute_dtype": certificate.compute_dtype,
        "verdict": certificate.verdict,
        "baseline": f"{certificate.baseline.get('dtype')} ({certificate.baseline.get('kind')})",
        "device": certificate.device.get("type"),
        "components": {c.name or c.class_name or "model": c.task for c in certificate.components},
        "metrics_judged": len(certificate.metrics),
        "metrics_failed": len(failed),
        "certificate": CERTIFICATE_NAME,
    }


def _fmt(value: float | None) -> str:
    if value is None:
        return "NaN/Inf"
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _rows(metrics: Iterable[Measurement]) -> list[str]:
    ordered = sorted(metrics, key=lambda m: m.passed)  # failures first
    rows = ["| where | metric | value | bound | |", "|---|---|---|---|---|"]
    for m in ordered[:MAX_ROWS]:
        bound = (
            "—" if m.threshold is None else f"{'≤' if m.bound == 'max' else '≥'} {m.threshold:g}"
        )
        rows.append(
            f"| `{m.where}` | {m.metric} | {_fmt(m.value)} | {bound} | "
            f"{'✅' if m.passed else '❌'} |"
        )
    if len(ordered) > MAX_ROWS:
        rows.append(f"| … | {len(ordered) - MAX_ROWS} more in `{CERTIFICATE_NAME}` | | | |")
    return rows


def render(certificate: Certificate, *, charts: Sequence[str] = ()) -> str:
    """The full README.md text for ``certificate``."""
    from huggingface_hub import ModelCardData

    library = next((c.library for c in certificate.components if c.library != "pipeline"), None)
    data = ModelCardData(
        base_model=base_model_id(certificate),
        tags=tags(certificate),
        library_name=library if library in ("transformers", "diffusers", "open_clip") else None,
        precision_convert=summary(certificate),
    )
    source = certificate.source.get("id") or "the source checkpoint"
    verdict = "**certified**" if certificate.passed else "**not certified**"
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {certificate.target} conversion of {source}",
        "",
        f"Converted with precision-convert {certificate.tool.get('version', '')} to "
        f"`{certificate.target}` (compute dtype `{certificate.compute_dtype}`), and {verdict} "
        f"against the source upcast to fp32 on {certificate.device.get('type')}.",
        "",
    ]
    if certificate.failures:
        lines += ["## Why it failed", "", *(f"- {f}" for f in certificate.failures), ""]
    lines += ["## Parity", "", *_rows(certificate.metrics), ""]
    lines += [
        "## Components",
        "",
        "| component | class | task | mode | recipe |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c.name or '—'} | {c.class_name} | {c.task} | {c.mode} | {c.recipe or '—'} |"
        for c in certificate.components
    ]
    lines.append("")
    if charts:
        lines += ["## Activation ranges", ""]
        lines += [
            f"![activation ranges of {c.rpartition('/')[0] or 'the model'}]({c})" for c in charts
        ]
        lines.append("")
    lines += [
        "## Loading",
        "",
        "```python",
        "import precision_convert as pc",
        'model = pc.load("<this repo or dir>")',
        "```",
        "",
        f"Every file's sha256 is listed in `{CERTIFICATE_NAME}`; `precision-convert push` refuses "
        "files that differ from it.",
        "",
    ]
    return "\n".join(lines)


def write_card(certificate: Certificate, directory: str | Path) -> Path:
    """Write README.md next to the certificate, showing any activation charts the analysis saved
    (``precision_activations.png`` at the top or in a pipeline component's folder)."""
    directory = Path(directory)
    charts = [p.relative_to(directory).as_posix() for p in sorted(directory.rglob(CHART_NAME))]
    path = directory / CARD_NAME
    path.write_text(render(certificate, charts=charts), encoding="utf-8")
    return path
