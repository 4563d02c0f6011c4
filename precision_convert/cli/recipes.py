"""``precision-convert recipes [NAME]``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import typer

from precision_convert.cli._common import literal, out, reported_errors

if TYPE_CHECKING:
    from precision_convert.recipes import Recipe


def recipes(
    name: Annotated[
        str | None, typer.Argument(metavar="NAME", help="Show this recipe in full.")
    ] = None,
) -> None:
    """List the built-in recipes (one line each), or show one in full."""
    from precision_convert.recipes import builtin, get

    with reported_errors():
        if name is None:
            # One line per recipe, cut at the terminal's edge: the details are `recipes NAME`.
            recipes = builtin().values()
            width = max(len(r.name) for r in recipes)
            room = max(20, out.width - width - 2)
            for recipe in recipes:
                summary = recipe.description.partition(": ")[0]
                if len(summary) > room:
                    summary = summary[: room - 1] + "…"
                padded = literal(f"{recipe.name:<{width}}")
                out.print(f"[bold]{padded}[/]  {literal(summary)}", soft_wrap=True)
            out.print("precision-convert recipes NAME shows one in full")
            return
        recipe = get(name)
    for line in describe(recipe):
        out.print(line, soft_wrap=True, highlight=False)


def describe(recipe: Recipe) -> list[str]:
    """``recipes NAME``: the recipe in words, a line per fact (rich markup, values :func:`literal`);
    values as the TOML file writes them (``force_upcast = true``), never a Python repr."""
    lines = [f"[bold]{literal(recipe.name)}[/] ({recipe.library}) — {literal(recipe.description)}"]
    if recipe.class_names:
        lines.append(f"classes: {literal(', '.join(recipe.class_names))}")
    if recipe.model_types:
        lines.append(f"model types: {literal(', '.join(recipe.model_types))}")
    lines.append(f"normalization layers kept fp32: {'yes' if recipe.keep_normalization else 'no'}")
    for rule in recipe.fp32:
        why = f": {rule.why}" if rule.why else ""
        where = f"{', '.join(rule.targets)}; {rule.reason}"
        lines.append(literal(f"fp32 ({where}): {', '.join(rule.modules)}{why}"))
    by_flags: dict[str, list[str]] = {}
    for target, flags in recipe.config.items():
        by_flags.setdefault(_assignments(flags), []).append(target)
    lines += [literal(f"config for {', '.join(ts)}: {flags}") for flags, ts in by_flags.items()]
    if recipe.validation:
        lines.append(literal(f"validation: {_assignments(recipe.validation)}"))
    lines += [f"[yellow]hazard[/]: {literal(hazard)}" for hazard in recipe.hazards]
    return lines


def _assignments(values: Mapping[str, Any]) -> str:
    """``key = value, …`` with TOML's spelling of each value (JSON's is the same for these)."""
    return ", ".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
