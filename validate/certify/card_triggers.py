"""The card's line on triggers: per component, which kinds of context that can drive an
activation past the format's range the probes searched (and how far), and which they did not.

It reads the certificate's ``inputs.triggers`` record (:func:`~.contexts.triggers`), so a
reader sees at once that, say, token pairs were not enumerated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from precision_convert.validation.certify.card_text import code, escape
from precision_convert.validation.certify.certificate import Certificate


def trigger_lines(certificate: Certificate) -> list[str]:
    """One list item per component whose record states its triggers: the kinds searched,
    with their reach, then the kinds not searched."""
    lines = []
    for c in certificate.components:
        record = c.inputs.get("triggers")
        if not isinstance(record, Mapping):
            continue
        searched = [
            f"{escape(kind)} ({_reach(kind, entry)})" if _reach(kind, entry) else escape(kind)
            for kind, entry in record.items()
            if isinstance(entry, Mapping) and entry.get("searched")
        ]
        left = [escape(kind) for kind, entry in record.items() if not entry.get("searched")]
        who = f"{code(c.name)}: " if c.name else ""
        said = f"triggers searched: {', '.join(searched)}" if searched else "no trigger searched"
        lines.append(f"- {who}{said}; not searched: {', '.join(left) or 'none'}.")
    return lines


def _reach(kind: str, entry: Mapping[str, Any]) -> str:
    """How far one searched kind reached, in words."""
    if kind == "ids":
        return f"{entry['reached']} of {entry['of']}"
    if kind == "positions":
        parts = [f"{entry['reached']} of {entry['of']}"]
        first = entry.get("first_position")
        if isinstance(first, Mapping):
            bos = first["after_bos"]
            after = f", {bos} after BOS" if isinstance(bos, int) else ", the family has no BOS"
            parts.append(f"{first['ids']} ids at position 0{after}")
        repeats = entry.get("repeats")
        if isinstance(repeats, Mapping):
            parts.append(
                f"{repeats['ids']} ids repeated at distances "
                f"{repeats['distances'][0]}–{repeats['distances'][-1]}"
            )
        return "; ".join(parts)
    if kind == "generation":
        return (
            f"{entry['prompts']} prompts x {entry['new_tokens']} greedy fp32 tokens, "
            "teacher-forced; free generation checked for NaN/Inf"
        )
    if kind == "bound":
        top = entry["highest"]
        return (
            f"{entry['modules']} modules bounded, highest {code(top['module'])} "
            f"{escape(top['side'])} "
            f"{top['bound']:.4g}, conditional on the factor peaks seen"
        )
    if kind == "pairs":
        peak = entry.get("highest_peak")
        return f"worst-context search over {entry['modules']} modules in {entry['seconds']} s" + (
            f", highest peak {peak:.4g}" if peak is not None else ""
        )
    return escape(entry.get("reach", ""))
