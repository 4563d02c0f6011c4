"""Module names: whole-component glob matching and the units tensors belong to.

Names are compared component by component, never as substrings: ``wo`` must not match
``word_embeddings`` (transformers once kept every ``*wo*`` module in fp32 by substring match).
``*`` stands for exactly one component and ``**`` for any run of them, including none.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable
from functools import lru_cache


@lru_cache(maxsize=65536)
def _component_matches(pattern: str, text: str) -> bool:
    """Whether one name component matches one pattern component, where ``*`` stands for any
    run of characters (``*norm*`` matches ``ln_norm``; a component never holds a dot).

    The classic two-pointer glob: on a mismatch, retry from the last ``*`` one character
    further. At most len(pattern) x len(text) steps, where a backtracking regex takes
    exponential time on patterns like ``*a*a*a*a*a*a*a*a*a*a*a*a*b`` (patterns come from
    recipe files and ``--keep-fp32``; one must not be able to hang a run).
    """
    p = t = 0
    star, resume = -1, 0
    while t < len(text):
        if p < len(pattern) and pattern[p] == "*":
            star, resume = p, t
            p += 1
        elif p < len(pattern) and pattern[p] == text[t]:
            p += 1
            t += 1
        elif star >= 0:
            p, resume = star + 1, resume + 1
            t = resume
        else:
            return False
    return all(c == "*" for c in pattern[p:])


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
    """Whole-name matching, one pattern component at a time.

    ``reachable[j]``: the pattern components seen so far can match the first ``j`` name
    components. ``**`` keeps every reachable prefix and extends each by any run; another
    component extends a prefix by one matching component. len(pattern) x len(name) steps
    in all, however many ``**`` a pattern holds (recursing into every split of the name
    costs a power of the name's length).
    """
    reachable = [True] + [False] * len(name)
    for head in pattern:
        if head == "**":
            for j in range(1, len(name) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            reachable = [False] + [
                reachable[j] and _component_matches(head, part) for j, part in enumerate(name)
            ]
    return reachable[-1]


def matches_self_or_ancestor(pattern: str, name: str) -> bool:
    """True when ``pattern`` matches ``name`` or one of its ancestors (``a.b`` covers ``a.b.c``)."""
    parts = name.split(".")
    return any(matches(pattern, ".".join(parts[:i])) for i in range(len(parts), 0, -1))


def stored_spelling(name: str, prefix: str, stored: Container[str]) -> str | None:
    """``name`` (a model's module or tensor) as a checkpoint spells it: as is, or with the
    base-model ``prefix`` added or dropped (a checkpoint of the bare model lacks it, one of the
    model with its head has it); None when ``stored`` holds no spelling of it."""
    for candidate in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
        if candidate in stored:
            return candidate
    return None


#: Where ``torch.nn.utils.parametrize`` keeps a parametrized tensor's originals:
#: ``<module>.parametrizations.<tensor>.original`` (``original0``, ``original1``... when the
#: parametrization has several, as weight norm's g and v do).
_PARAMETRIZED = re.compile(r"(?:(?P<module>.+)\.)?parametrizations\.[^.]+\.original\d*")


def module_of(tensor_name: str) -> str:
    """The module that owns a tensor: its name minus the last component ("" for the root).

    A parametrized weight's originals belong to the module whose weight they make (wav2vec2's
    weight-normed positional conv), not to the parametrization's container: that module is the
    one a dtype is given to and whose output is judged.
    """
    parametrized = _PARAMETRIZED.fullmatch(tensor_name)
    if parametrized:
        return parametrized["module"] or ""
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
