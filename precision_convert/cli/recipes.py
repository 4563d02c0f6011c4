"""``precision-convert recipes [NAME]``."""

from __future__ import annotations

from typing import Annotated

import typer

from precision_convert.cli._common import out, reported_errors


def recipes(
    name: Annotated[str | None, typer.Argument(help="Show this recipe in full.")] = None,
) -> None:
    """List the built-in recipes (one line each), or show one in full."""
    from rich.markup import escape

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
                out.print(f"[bold]{recipe.name:<{width}}[/]  {escape(summary)}", soft_wrap=True)
            out.print("precision-convert recipes NAME shows one in full")
            return
        recipe = get(name)
    out.print(f"[bold]{recipe.name}[/] ({recipe.library}) — {recipe.description}")
    if recipe.class_names or recipe.model_types:
        out.print(f"matches: {', '.join(recipe.class_names + recipe.model_types)}")
    out.print(f"normalization layers kept fp32: {'yes' if recipe.keep_normalization else 'no'}")
    for rule in recipe.fp32:
        line = f"fp32 [{', '.join(rule.targets)}] ({rule.reason}): {', '.join(rule.modules)}"
        out.print(escape(line + (f" — {rule.why}" if rule.why else "")))
    for target, flags in recipe.config.items():
        out.print(f"config for {target}: {dict(flags)}")
    if recipe.validation:
        out.print(f"validation: {dict(recipe.validation)}")
    for hazard in recipe.hazards:
        out.print(f"[yellow]hazard[/]: {escape(hazard)}")
