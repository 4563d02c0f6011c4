"""Module names: whole-component glob matching and the units tensors belong to.

Names are compared component by component, never as substrings: ``wo`` must not match
``word_embeddings`` (transformers once kept every ``*wo*`` module in fp32 by substring match).
``*`` stands for exactly one component and ``**`` for any run of them, including none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache


@lru_cache(maxsize=1024)
def _component_regex(component: str) -> re.Pattern[str]:
    # Inside one component "*" is a wildcard that never crosses a dot ("*norm*" matches "ln_norm").
    return re.compile("^" + re.escape(component).replace(r"\*", "[^.]*") + "$")


def validate_pattern(pattern: str) -> str:
    """Return ``pattern`` unchanged, or raise ValueError when it can never be a module name."""
    if not pattern or any(not part for part in pattern.split(".")):
        raise ValueError(f"invalid module pattern {pattern!r}: empty name component")
    return pattern


def matches(pattern: str, name: str) -> bool:
    """True when ``name`` (dot-separated) is matched by ``pattern`` as a whole."""
    return _match_parts(tuple(validate_pattern(pattern).split(".")), tuple(name.split(".")))


@lru_cache(maxsize=65536)
def _match_parts(pattern: tuple[str, ...], name: tuple[str, ...]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_parts(rest, name[i:]) for i in range(len(name) + 1))
    if not name or not _component_regex(head).match(name[0]):
        return False
    return _match_parts(rest, name[1:])


def matches_self_or_ancestor(pattern: str, name: str) -> bool:
    """True when ``pattern`` matches ``name`` or one of its ancestors (``a.b`` covers ``a.b.c``)."""
    parts = name.split(".")
    return any(matches(pattern, ".".join(parts[:i])) for i in range(len(parts), 0, -1))


def module_of(tensor_name: str) -> str:
    """The module that owns a tensor: its name minus the last component ("" for the root)."""
    return tensor_name.rpartition(".")[0]


def units(tensor_names: Iterable[str]) -> dict[str, str]:
    """Map each tensor to the unit whose dtype it follows.

    A tensor follows its module, except when that module also has child modules (a container
    such as OpenCLIP's ``visual`` holding ``class_embedding``) or is the root (``logit_scale``):
    making the container fp32 would drag every descendant with it, so such a tensor is a unit
    of its own.
    """
    names = list(tensor_names)
    containers: set[str] = set()
    for name in names:
        parts = module_of(name).split(".")
        containers.update(".".join(parts[:i]) for i in range(1, len(parts)))
    out: dict[str, str] = {}
    for name in names:
        module = module_of(name)
        out[name] = name if module == "" or module in containers else module
    return out
