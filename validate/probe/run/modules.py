"""Which modules a run reached: the per-module half of :class:`~.execute.Coverage`.

A module is reached when a torch operation of a judged probe read one of its own parameters.
Those that no probe reached are grouped under their highest ancestor that no probe reached
either (a whole vision tower is one entry, not its 200 linears), and each group is told
apart by what would reach it: a module its parent's code never names (a pooler a head does
not call) is *unused* — no input the forward accepts runs it — while one the code names is
*unreached*: an input the probes never held would run it. A module that ran (the model
itself, or one whose children ran) without reading its own parameters is unused too: they
serve a path the call did not take.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from precision_convert.core.names import module_of
from precision_convert.validation.probe.inputs.model_inputs import parameters_of

#: Containers whose children run whenever the container is named (a ``Sequential`` calls
#: them all; a ``ModuleList`` or ``ModuleDict`` is indexed or iterated by its owner).
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class ModuleUsage:
    """The modules owning parameters, and which of them a run's judged probes reached."""

    #: Every module owning a parameter of its own ("" for the root).
    owners: tuple[str, ...] = ()
    #: Those a judged probe reached.
    reached: frozenset[str] = frozenset()
    #: The modules no probe reached, grouped under their highest unreached ancestor, each
    #: with whether its parent's code names it (code that cannot be read counts as naming it).
    groups: tuple[tuple[str, bool], ...] = ()
    #: The model's forward arguments: what inputs could reach a module no probe did.
    accepts: tuple[str, ...] = ()

    def members(self, group: str) -> list[str]:
        """The parameter-owning modules in ``group`` (itself and its descendants)."""
        prefix = f"{group}." if group else ""
        return [m for m in self.owners if m == group or m.startswith(prefix)]


def module_usage(model: nn.Module, used: Iterable[str]) -> ModuleUsage:
    """What ``used`` (parameter names a run read) says about ``model``'s modules."""
    owners = tuple(dict.fromkeys(module_of(name) for name, _ in model.named_parameters()))
    reached = frozenset(module_of(name) for name in used)
    idle = [m for m in owners if m not in reached]
    if not idle:
        return ModuleUsage(owners, reached)
    accepts = tuple(parameters_of(model.forward))
    ancestors_reached = {a for m in reached for a in _ancestors(m)}
    groups: list[tuple[str, bool]] = []
    for name in idle:
        if not name or name in ancestors_reached:
            # It ran (the model, or a module whose children ran) without reading its own
            # parameters: they serve a path the call did not take, like wav2vec2's
            # training-time mask embedding.
            groups.append((name, False))
            continue
        top = name
        for ancestor in _ancestors(name):  # nearest first
            if ancestor in ancestors_reached or ancestor in reached:
                break
            top = ancestor
        if all(top != g for g, _ in groups):
            groups.append((top, _named_by_parent(model, top)))
    return ModuleUsage(owners, reached, tuple(groups), accepts)


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b", "a"]`` (the root, "", left out)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _named_by_parent(model: nn.Module, name: str) -> bool:
    """Whether the code of the module holding ``name`` refers to it (``self.<attribute>``),
    going up through containers. Code that cannot be read counts as naming it: a module is
    called unused only where the code shows it."""
    if not name:
        return True
    parent_name, _, attribute = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    while isinstance(parent, _CONTAINERS) and parent_name:
        parent_name, _, attribute = parent_name.rpartition(".")
        parent = model.get_submodule(parent_name)
    return _class_names(type(parent), attribute)


def _class_names(cls: type, attribute: str) -> bool:
    name = re.escape(attribute)
    # A use, not the assignment that made it (``self.pooler = ...`` in ``__init__``).
    pattern = re.compile(rf"self\.{name}\b(?!\s*=[^=])|getattr\(self, *[\"']{name}[\"']")
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            return True
        if pattern.search(source):
            return True
    return False
