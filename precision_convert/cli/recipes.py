"""``precision-convert recipes [NAME]``."""

from __future__ import annotations

from typing import Annotated

import typer

from precision_convert.cli._common import console, reported_errors


def recipes(
    name: Annotated[str | None, typer.Argument(help="Show this recipe in full.")] = None,
) -> None:
    """List the built-in recipes, or show one."""
    from rich.markup import escape
    from rich.table import Table

    from precision_convert.recipes import builtin, get

    with reported_errors():
        if name is None:
            table = Table(title="recipes")
            for column in ("name", "library", "matches", "description"):
                table.add_column(column)
            for recipe in builtin().values():
                matches = ", ".join(recipe.class_names[:3] + recipe.model_types[:3]) or "anything"
                table.add_row(recipe.name, recipe.library, matches, recipe.description)
            console.print(table)
            return
        recipe = get(name)
    console.print(f"[bold]{recipe.name}[/] ({recipe.library}) — {recipe.description}")
    if recipe.class_names or recipe.model_types:
        console.print(f"matches: {', '.join(recipe.class_names + recipe.model_types)}")
    console.print(f"normalization layers kept fp32: {'yes' if recipe.keep_normalization else 'no'}")
    for rule in recipe.fp32:
        line = f"fp32 [{', '.join(rule.targets)}] ({rule.reason}): {', '.join(rule.modules)}"
        console.print(escape(line + (f" — {rule.why}" if rule.why else "")))
    for target, flags in recipe.config.items():
        console.print(f"config for {target}: {dict(flags)}")
    if recipe.validation:
        console.print(f"validation: {dict(recipe.validation)}")
    for hazard in recipe.hazards:
        console.print(f"[yellow]hazard[/]: {escape(hazard)}")
