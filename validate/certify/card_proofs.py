"""The card's proof table: per component, the share of parameters whose modules are proven
within the format's range from the weights alone, kept in fp32, or sampled only, and the
name of every module left sampled only (folded by layer role).

It reads the certificate's ``calibration.modules`` record
(:func:`~precision_convert.conversion.analysis.proofs.module_status`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from precision_convert.validation.certify.card_text import code, escape
from precision_convert.validation.certify.certificate import Certificate

#: How the card names each status (:data:`~precision_convert.conversion.analysis.proofs.STATUSES`).
TITLES = {
    "proven": "proven (weights-only bound below the limit by the margin)",
    "islanded": "islanded (kept in fp32)",
    "sampled_only": "sampled only (range as the probes measured it)",
}

#: Most sampled-only module roles a component's line names (the certificate names them all).
MAX_NAMED = 12


def proof_lines(certificate: Certificate) -> list[str]:
    """The ``## Range proofs`` section, or nothing where no component has the record."""
    records = [
        (c.name, c.calibration["modules"])
        for c in certificate.components
        if isinstance(c.calibration, Mapping) and isinstance(c.calibration.get("modules"), Mapping)
    ]
    if not records:
        return []
    lines = ["## Range proofs", ""]
    for name, record in records:
        lines += _component(name, record)
    return lines


def _component(name: str, record: Mapping[str, Any]) -> list[str]:
    who = f"{code(name)}: " if name else ""
    lines = [
        f"{who}every module that owns a parameter, against {record['limit']:.6g} (the compute "
        f"dtype's largest finite value) with a margin of {record['margin']:g}x:",
        "",
        "| status | parameters | modules |",
        "|---|---|---|",
    ]
    for status, title in TITLES.items():
        entry = record.get(status) or {}
        share = 100 * entry.get("share", 0.0)
        lines.append(f"| {escape(title)} | {share:.1f}% | {entry.get('count', 0)} |")
    sampled = (record.get("sampled_only") or {}).get("modules") or []
    lines.append("")
    if sampled:
        shown = [code(m) if m else "the model's own parameters" for m in sampled[:MAX_NAMED]]
        more = len(sampled) - MAX_NAMED
        rest = f" and {more} more (the certificate's `calibration.modules`)" if more > 0 else ""
        lines.append("Sampled only: " + ", ".join(shown) + rest + ".")
        top = record.get("largest_unproven")
        if isinstance(top, Mapping):
            lines.append(
                f"Largest sound bound not proven: {code(top['module'])} {top['bound']:.4g}."
            )
    else:
        lines.append("No module is sampled only.")
    return [*lines, ""]
