"""Per-architecture precision policies, kept as data in ``recipes/*.toml``.

A recipe says which modules stay fp32 for which target and why, which config flags to set,
how to validate, and which hazards are known. Files are parsed once into frozen objects and
looked up by class name first, then ``model_type``; ``generic`` covers everything else.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from precision_convert.core.dtypes import SAFE_TARGETS as SAFE_TARGETS
from precision_convert.core.dtypes import TARGETS as TARGETS
from precision_convert.core.errors import InputError
from precision_convert.core.names import validate_pattern

#: Why a module stays fp32; the loader lets a "precision" island hand its output back in the
#: compute dtype, and lets every other kind's fp32 output flow on (see docs/format.md).
ISLAND_REASONS = ("precision", "range", "search", "user")
GENERIC = "generic"
#: Files in this folder that hold other data than recipes.
_NOT_RECIPES = frozenset({"tasks.toml"})


@dataclass(frozen=True)
class Fp32Rule:
    """Modules matching ``modules`` stay fp32 under ``targets``, for ``reason``."""

    modules: tuple[str, ...]
    targets: tuple[str, ...]
    reason: str
    why: str


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    library: str  # "transformers", "diffusers", "open_clip" or "any"
    class_names: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    keep_normalization: bool = True
    fp32: tuple[Fp32Rule, ...] = ()
    config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    validation: Mapping[str, Any] = field(default_factory=dict)
    hazards: tuple[str, ...] = ()
    path: str = ""

    def rules_for(self, target: str) -> tuple[Fp32Rule, ...]:
        return tuple(rule for rule in self.fp32 if target in rule.targets)

    def config_flags(self, target: str) -> Mapping[str, Any]:
        return self.config.get(target, {})


_TOP_KEYS = frozenset(
    {
        "name",
        "description",
        "library",
        "match",
        "keep_normalization",
        "fp32",
        "config",
        "validation",
        "hazards",
    }
)
_MATCH_KEYS = frozenset({"class_names", "model_types"})
_RULE_KEYS = frozenset({"modules", "targets", "reason", "why"})


def _parse(data: dict[str, Any], origin: str) -> Recipe:
    """Validate a recipe's TOML into a :class:`Recipe`; any defect is one ``InputError`` naming
    the file. Unknown keys are refused at every level: a misspelt ``reason`` must not quietly
    become a ``precision`` island, whose output the loader casts back."""

    def fail(problem: str) -> InputError:
        return InputError(f"invalid recipe: {problem}", origin)

    def table(value: Any, where: str, keys: frozenset[str] | None = None) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise fail(f"{where} must be a table")
        unknown = set(value) - keys if keys is not None else set()
        if unknown:
            raise fail(f"unknown keys {sorted(unknown)} in {where}")
        return value

    def strings(value: Any, where: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(f"{where} must be a list of strings")
        return tuple(value)

    def text(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise fail(f"{where} must be a string")
        return value

    table(data, "the recipe", _TOP_KEYS)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise fail("'name' must be a non-empty string")
    match = table(data.get("match", {}), "[match]", _MATCH_KEYS)
    raw_rules = data.get("fp32", [])
    if not isinstance(raw_rules, list):
        raise fail("fp32 rules must be an array of tables ([[fp32]])")
    rules = []
    for index, raw in enumerate(raw_rules):
        where = f"[[fp32]] #{index + 1}"
        table(raw, where, _RULE_KEYS)
        targets = strings(raw.get("targets", list(SAFE_TARGETS)), f"{where} targets")
        reason = raw.get("reason", "precision")
        if not set(targets) <= set(TARGETS):
            raise fail(f"fp32 rule targets {targets} must be among {TARGETS}")
        if reason not in ISLAND_REASONS:
            raise fail(f"fp32 rule reason {reason!r} must be one of {ISLAND_REASONS}")
        patterns = raw.get("modules")
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise fail(f"{where} needs a list of module patterns (modules)")
        try:
            modules = tuple(validate_pattern(p) for p in patterns)
        except ValueError as exc:
            raise fail(f"{where}: {exc}") from None
        rules.append(Fp32Rule(modules, targets, reason, text(raw.get("why", ""), f"{where} why")))
    config = table(data.get("config", {}), "[config]")
    if not set(config) <= set(TARGETS):
        raise fail(f"[config] tables must be named after targets {TARGETS}")
    keep_normalization = data.get("keep_normalization", True)
    if not isinstance(keep_normalization, bool):
        raise fail("keep_normalization must be true or false")
    return Recipe(
        name=name,
        description=text(data.get("description", ""), "description"),
        library=text(data.get("library", "any"), "library"),
        class_names=strings(match.get("class_names", []), "[match] class_names"),
        model_types=strings(match.get("model_types", []), "[match] model_types"),
        keep_normalization=keep_normalization,
        fp32=tuple(rules),
        config=MappingProxyType(
            {k: MappingProxyType(dict(table(v, f"[config.{k}]"))) for k, v in config.items()}
        ),
        validation=MappingProxyType(dict(table(data.get("validation", {}), "[validation]"))),
        hazards=strings(data.get("hazards", []), "hazards"),
        path=origin,
    )


def load_file(path: Path) -> Recipe:
    """Load a user's recipe file (``--recipe FILE``)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"cannot read recipe: {exc}", path) from None
    return _parse(data, str(path))


@cache
def builtin() -> Mapping[str, Recipe]:
    """Every recipe shipped with the package, by name."""
    found: dict[str, Recipe] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml") and entry.name not in _NOT_RECIPES:
            recipe = _parse(tomllib.loads(entry.read_text(encoding="utf-8")), entry.name)
            found[recipe.name] = recipe
    return MappingProxyType(found)


def get(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or a recipe file by path."""
    recipes = builtin()
    if name_or_path in recipes:
        return recipes[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return load_file(path)
    raise InputError(f"unknown recipe {name_or_path!r}; known: {', '.join(sorted(recipes))}")


def match(library: str, class_name: str | None, model_type: str | None) -> Recipe:
    """The recipe for a model: by class name first, then model_type, else ``generic``."""
    candidates = [
        r for r in builtin().values() if r.name != GENERIC and r.library in (library, "any")
    ]
    for recipe in candidates:
        if class_name and class_name in recipe.class_names:
            return recipe
    for recipe in candidates:
        if model_type and model_type in recipe.model_types:
            return recipe
    return builtin()[GENERIC]
