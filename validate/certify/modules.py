"""Coverage by module: every module owning a parameter the plan casts must have run in a
judged probe, which every deciding way of loading runs too.

A module no judged probe reached fails the certificate with one line naming it and what
input would reach it; one its model's code never calls is listed as unused; one the user
named with ``--allow-unexercised`` is recorded as not covered. The ``coverage`` metric is the
share of the modules that must run which did (its bound is 1: all of them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from precision_convert.core.folding import fold
from precision_convert.core.names import matches_self_or_ancestor
from precision_convert.validation.certify.certificate import ComponentRecord
from precision_convert.validation.certify.components import Component
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.run.modules import ModuleUsage

#: Forward arguments that carry a modality of their own: a tower behind one runs only when a
#: probe holds it.
_MODALITY_INPUT = re.compile(r"pixel|image|video|audio|input_features|input_values|clip_input")
#: Module names that read as a modality's tower, and the inputs that feed it.
_TOWERS = (
    (re.compile(r"vision|visual|image|vit|patch|projector|mm_"), re.compile(r"pixel|image|video")),
    (re.compile(r"audio|speech|whisper|feature"), re.compile(r"audio|input_features|input_v")),
)
#: The ``why`` of a module recorded as not covered at the user's word.
ALLOWED = "--allow-unexercised"


@dataclass
class ModuleCoverage:
    """Each module owning a cast parameter: exercised, unused, not covered (allowed) or
    unreached (with what would reach it)."""

    exercised: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)
    unreached: dict[str, str] = field(default_factory=dict)  # group -> what would reach it
    unreached_members: int = 0
    #: Probes the fp32 baseline could not answer (its own output not finite there): they
    #: judged nothing, so what only they reach is not covered (an output holding an inf
    #: weight fails its smoke check here).
    unjudged: tuple[str, ...] = ()
    judged_share: float = 1.0

    @property
    def share(self) -> float:
        """The share of the modules that must run which did (1.0 when none must), times the
        share of the probes the fp32 baseline could answer."""
        must = len(self.exercised) + self.unreached_members
        return (len(self.exercised) / must if must else 1.0) * self.judged_share

    def record(self) -> dict[str, Any]:
        """The certificate's ``modules`` record: folded module names per status."""
        return {
            "exercised": _folded(self.exercised),
            "unused": self.unused,
            "not_covered": self.not_covered,
            "unreached": [f"{group}: {why}" for group, why in self.unreached.items()],
        }

    def failures(self, component: str) -> list[str]:
        """One line per input that would reach modules no probe reached."""
        by_reason: dict[str, list[str]] = {}
        for group, why in self.unreached.items():
            by_reason.setdefault(why, []).append(f"`{group or '(root)'}`")
        lines = [
            f"{component or 'model'}: {', '.join(groups)} never ran: {why} (pass --inputs that "
            "reach them, or --allow-unexercised MODULE to record them as not covered)"
            for why, groups in by_reason.items()
        ]
        if self.unjudged:
            lines.append(
                f"{component or 'model'}: {len(self.unjudged)} probe(s) not judged: the fp32 "
                f"baseline's own output is not finite there ({', '.join(self.unjudged)})"
            )
        return lines


def module_coverage(
    usage: ModuleUsage,
    inputs: ModelInputs,
    fp32_modules: Iterable[str],
    allowed: Sequence[str] = (),
) -> ModuleCoverage:
    """Classify ``usage``'s modules: those whose parameters all stay fp32 (``fp32_modules``)
    need not run; ``allowed`` (module patterns, each covering its descendants) are recorded
    as not covered."""
    kept = tuple(fp32_modules)

    def cast(module: str) -> bool:
        # The record spells modules as the checkpoint stores them, which may lack the
        # prefix the library's class adds (``model.`` in transformers 5's LLaVA).
        padded = f".{module}."
        return not any(f".{k}." in padded for k in kept)

    found = ModuleCoverage(
        exercised=[m for m in usage.owners if m in usage.reached and cast(m)],
        unjudged=tuple(inputs.unjudged),
        judged_share=inputs.judged_share,
    )
    held = {key for probe in inputs.probes for key in probe.kwargs}
    unfed = [a for a in usage.accepts if a not in held and _MODALITY_INPUT.search(a)]
    for group, named in usage.groups:
        members = [m for m in usage.members(group) if m not in usage.reached and cast(m)]
        if not members:
            continue
        label = group or "(root)"
        if any(matches_self_or_ancestor(p, m) for p in allowed for m in (group, *members)):
            found.not_covered.append(label)
        elif not named:
            found.unused.append(label)
        else:
            found.unreached[group] = _what_reaches(group, unfed)
            found.unreached_members += len(members)
    return found


def _what_reaches(group: str, unfed: Sequence[str]) -> str:
    """What input would reach ``group``: the unfed input of its modality, any unfed one, or
    none known."""
    for tower, feeds in _TOWERS:
        fitting = [a for a in unfed if feeds.search(a)]
        if tower.search(group.lower()) and fitting:
            return f"no probe held {_listed(fitting)}"
    if unfed:
        return f"no probe held {_listed(unfed)}"
    return "no probe reached it"


def _listed(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _folded(names: Iterable[str]) -> list[str]:
    return [role.label for role in fold(names)]


def judge_modules(
    component: Component, usage: ModuleUsage, inputs: ModelInputs, record: ComponentRecord
) -> ModuleCoverage:
    """:func:`module_coverage` of ``component`` under its plan and ``--allow-unexercised``,
    written into its certificate ``record``."""
    covered = module_coverage(
        usage, inputs, component.record.fp32_modules, component.allow_unexercised
    )
    record.modules = covered.record()
    return covered


def allowed_not_covered(component: str, modules: dict[str, Any] | None) -> list[dict[str, str]]:
    """The certificate's ``not_covered`` entries of the modules ``--allow-unexercised`` named."""
    return [
        {"what": f"{component or 'model'}: module `{m}` never ran", "why": ALLOWED}
        for m in (modules or {}).get("not_covered", ())
    ]
