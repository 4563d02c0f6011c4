"""The card's lines on what the probes reached: per component, positions, context, token ids
and timesteps (``inputs.reach``), and per size family what ran against what the model
declares, and what was predicted there without running it (``inputs.sizes``)."""

from __future__ import annotations

from typing import Any

from precision_convert.validation.certify.card_text import code, escape
from precision_convert.validation.certify.certificate import Certificate
from precision_convert.validation.probe.run.growth import PREDICTED, WORDS


def reach_lines(certificate: Certificate) -> list[str]:
    """Per component, the positions, context length and token ids its probes reached (every
    range left untested named), or the timesteps they ran at, and the image side and frames
    run against those the model declares: one list item each."""
    lines = []
    for c in certificate.components:
        reach = c.inputs.get("reach") or {}
        parts = []
        if "positions" in reach:
            positions, context, vocab = reach["positions"], reach["context"], reach["vocabulary"]
            parts.append(
                f"positions reached: {positions['reached']} of {positions['limit']}"
                + _untested(positions["untested"], positions.get("why"))
            )
            parts.append(
                f"context length run: {context['reached']} of {context['limit']} tokens"
                + (
                    f" (contexts of {context['reached'] + 1} to {context['limit']} tokens untested)"
                    if context["untested"]
                    else ""
                )
            )
            parts.append(f"token ids reached: {vocab['reached']} of {vocab['size']}")
        if "timesteps" in reach:
            steps = ", ".join(f"{t:g}" for t in reach["timesteps"]["reached"])
            parts.append(f"timesteps run: {steps} (none between)")
        parts += sizes_run(c.inputs.get("sizes") or {})
        parts += arguments_run(c.inputs.get("arguments") or {})
        if parts:
            who = f"{code(c.name)}: " if c.name else ""
            level = c.inputs.get("coverage") or "no sweep"
            lines.append(
                f"- {who}{'; '.join(parts)}. Coverage {code(level)}, {escape(c.mode)} validation."
            )
    return lines


def _untested(ranges: list[Any], why: str | None) -> str:
    if not ranges:
        return ""
    shown = ", ".join(escape(r) if isinstance(r, str) else f"{r[0]}–{r[1]}" for r in ranges)
    return f" (untested: {shown}{'; ' + escape(why, code_spans=True) if why else ''})"


def sizes_run(sizes: dict[str, Any]) -> list[str]:
    """Per size the model declares: what ran against what it declares, and why a declared
    size was not run (so a reader knows whether 1024 px or 49 frames were judged); per size
    family fitted, the sizes run and the range predicted, not run, with its top fit."""
    growth: dict[str, Any] = sizes.get("growth") or {}
    parts = []
    for key, size in sizes.items():
        if key == "growth":
            continue
        declared = size.get("declared")
        said = f" of {declared} declared" if declared is not None else ""
        why = (
            f" ({declared} not run: {escape(size['not_run'], code_spans=True)})"
            if size.get("not_run")
            else ""
        )
        fitted = growth.get(key) or {}
        run = max(size.get("run") or 0, fitted.get("largest_run") or 0)
        parts.append(f"{WORDS.get(key) or escape(key)} run: {run}{said}{why}{_fitted(fitted)}")
    for key, entry in growth.items():
        if key not in sizes:
            words = WORDS.get(key) or escape(key)
            parts.append(f"{words} run: up to {entry['largest_run']}{_fitted(entry)}")
    return parts


def _fitted(entry: dict[str, Any] | None) -> str:
    """The growth fit of one family: the sizes run, the range claimed (predicted above the
    sizes run, not covered past it), the module predicted highest there and those predicted
    near fp16's limit, the largest size predicted safe for this output and where a plain
    fp16 cast is predicted to overflow."""
    if not entry:
        return ""
    run = ", ".join(str(s) for s in entry["sizes_run"])
    fitted = entry["fits"]["modules"]
    words = f"; peaks fitted over sizes {run}" if fitted else f"; sizes {run} run (too few to fit)"
    claimed = entry.get("claimed")
    # Certificates from before the claimed range name the range predicted ``not_covered``.
    predicted = entry.get("predicted") if claimed else entry.get("not_covered")
    ranges = [f"{predicted[0]}–{predicted[1]} {PREDICTED}"] if predicted else []
    beyond = entry.get("not_covered") if claimed else None
    if beyond:
        last = f"–{beyond[1]}" if beyond[1] else " and past"
        ranges.append(f"{beyond[0]}{last} not covered")
    if claimed:
        words += f"; claimed {claimed[0]}–{claimed[1]}"
    if ranges:
        words += f" ({'; '.join(ranges)})" if claimed else f"; {ranges[0]}"
    top = (entry.get("top") or [None])[0]
    if top is not None:
        how = (
            f"exponent {top['exponent']:.2f}, residual {top['residual']:.3f}"
            if top["extrapolated"]
            else "not extrapolated: flat or scattered peaks"
        )
        words += (
            f" (highest: {code(top['module'] or '<model>')}, {top['peak_run']:.4g} run, "
            f"{top['predicted_peak']:.4g} predicted, {how}, "
            f"margin {top['margin']}x to fp16's limit)"
        )
    near = [code(item["module"] or "<model>") for item in entry.get("near_limit", ())]
    if near:
        words += f"; predicted near fp16's limit: {', '.join(near)}"
    if "largest_predicted_safe" in entry:
        words += f"; predicted safe up to {entry['largest_predicted_safe']}"
    plain = entry.get("plain_cast")
    if plain and plain["overflow_at"] is not None:
        words += (
            f"; a plain fp16 cast is predicted past fp16's limit from {plain['overflow_at']} "
            f"({code(plain['module'] or '<model>')})"
        )
    elif plain and claimed:
        words += f"; a plain fp16 cast is predicted inside fp16's limit up to {claimed[1]}"
    return words


def arguments_run(arguments: dict[str, Any]) -> list[str]:
    """The range each forward argument was fed (per column for a row of scalars such as SDXL's
    ``time_ids``), and the arguments not covered: never fed, or one value in every probe."""
    fed = arguments.get("fed") or {}
    not_covered = arguments.get("not_covered") or {}
    parts = []
    shown = [
        f"{code(name)} {_span(entry)}"
        for name, entry in fed.items()
        if name not in not_covered and (entry.get("columns") or entry.get("range"))
    ]
    if shown:
        parts.append(f"arguments fed: {', '.join(shown)}")
    if not_covered:
        missing = ", ".join(f"{code(name)} ({escape(why)})" for name, why in not_covered.items())
        parts.append(f"arguments not covered: {missing}")
    return parts


def _span(entry: dict[str, Any]) -> str:
    columns = entry.get("columns")
    spans = columns if columns else [entry["range"]]
    text = ", ".join(f"{low:g}" if low == high else f"{low:g}–{high:g}" for low, high in spans)
    return f"[{text}]" if columns else text
