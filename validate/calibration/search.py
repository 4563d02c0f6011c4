"""The fp16 candidate search: candidate plans written, loaded as users load them and run.

First the candidate is made to carry every near-limit tensor in fp32 (one range island per
round, under dtype hooks); then candidates are compared with the fp32 session's outputs under
every attention implementation the certificate judges, and the island search bisects for the
modules that must also stay fp32. A candidate stops at its first failing probe, and the
probes earlier candidates failed on run first.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from precision_convert.conversion.analysis.activations import (
    CONTAINER,
    LEAF,
    ActivationStats,
    Carriage,
    NearLimit,
    carriage,
    search_islands,
)
from precision_convert.conversion.io.source import ModelSource, open_source
from precision_convert.conversion.output import write_model
from precision_convert.conversion.plan import MEASURED, Island, ModelPlan
from precision_convert.conversion.runtime.loader import load
from precision_convert.conversion.runtime.memory import freed
from precision_convert.conversion.runtime.record import loaded_mismatch
from precision_convert.core.dtypes import FiniteRange
from precision_convert.core.names import module_of
from precision_convert.validation.calibration.watch import (
    CARRIED,
    STILL_LOW,
    UNCHECKED,
    _near,
    _unit_of,
)
from precision_convert.validation.probe.run.attention import attention
from precision_convert.validation.probe.run.execute import RUN_ERRORS, run_probes
from precision_convert.validation.probe.run.parity import (
    compare_outputs,
)
from precision_convert.validation.probe.run.session import (
    PriorRuns,
    Swept,
    weights_digest,
)

logger = logging.getLogger(__name__)

#: Builds the plan with extra islands on top of the recipe's.
PlanWith = Callable[[Iterable[Island]], ModelPlan]
#: Candidate runs spent carrying near-limit tensors in fp32 (one island added per run), in all
#: and per tensor: a tensor still carried in fp16 after that many islands is reported instead.
WATCH_ROUNDS = 24
WATCH_TRIES = 4


class _Search:
    """The fp16 candidates of one calibration: each written, loaded as users load it and
    compared with the fp32 session's outputs under every attention implementation the
    certificate judges (eager attention's masked scores overflow where sdpa's do not)."""

    def __init__(
        self,
        model: ModelSource,
        plan_with: PlanWith,
        trust_remote_code: bool,
        swept: Swept,
        thresholds: dict[str, float],
    ) -> None:
        self.model, self.plan_with, self.trust_remote_code = model, plan_with, trust_remote_code
        self.swept, self.thresholds = swept, thresholds
        self.evaluations = 0
        self.passed: bool | None = None  # the final candidate matched fp32 (None: not run)
        self.carried: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        self.last: dict[str, Any] = {}  # the last passing candidate: plan sha256, outputs
        #: (attention implementation, probe) pairs on which some candidate failed, newest
        #: last: each candidate runs them first, so one that fails the same way stops early.
        self.failed: dict[tuple[str | None, str], None] = {}

    def run(
        self,
        added: list[Island],
        free: list[str],
        near: Sequence[NearLimit],
        stats: dict[str, ActivationStats],
        limit: FiniteRange,
    ) -> list[Island]:
        """``added`` with the islands that make the candidate carry every tensor near
        ``limit`` in fp32, then those the search over the other ``free`` units finds."""
        frozen = self.swept.resolved
        baselines: dict[str | None, Any] = {None: self.swept.outputs}
        baselines.update(self.swept.by_attention.items())
        with tempfile.TemporaryDirectory(prefix="pc-candidate-") as scratch:
            if near:
                fixes, self.carried = _carry_in_fp32(
                    self.model,
                    self.plan_with,
                    added,
                    near,
                    stats,
                    Path(scratch),
                    self.trust_remote_code,
                    frozen,
                    limit,
                )
                added = [*added, *fixes]

            def passes(extra: frozenset[str]) -> bool:
                return _candidate_passes(
                    self.model,
                    self.plan_with([*added, *_searched(extra)]),
                    Path(scratch),
                    self.trust_remote_code,
                    frozen,
                    baselines,
                    self.thresholds,
                    self.last,
                    self.failed,
                )

            analysed = {i.name for i in added}
            result = search_islands([u for u in free if u not in analysed], passes)
        self.evaluations, self.passed = result.evaluations, result.passed
        return [*added, *_searched(result.added)]

    def prior(self, plan: ModelPlan) -> PriorRuns:
        """What validation may reuse: the fp32 session, and the last candidate's runs when
        it is the plan written."""
        last = self.last if self.last.get("plan") == plan.sha256 else {}
        return PriorRuns(
            self.swept,
            last.get("weights"),
            last.get("outputs"),
            last.get("by_attention", {}),
            last.get("mismatch"),
        )


def _carry_in_fp32(
    model: ModelSource,
    plan_with: PlanWith,
    islands: Sequence[Island],
    near: Sequence[NearLimit],
    stats: dict[str, ActivationStats],
    scratch: Path,
    trust_remote_code: bool,
    inputs: Any,
    limit: FiniteRange,
) -> tuple[list[Island], dict[tuple[str, str], tuple[str, tuple[str, ...]]]]:
    """Range islands until the candidate carries every near-limit tensor in fp32.

    Each round loads the candidate as users do and runs it under dtype hooks; the earliest
    near-limit tensor still carried in fp16 gets one island (:func:`_fix_for`) and the
    candidate is checked again. Returns the islands added and, per ``(module, side)``, its
    outcome and the islands added for it.
    """
    fixes: list[Island] = []
    outcome: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
    pending = {(n.module, n.side): n for n in near}
    fixed_for: dict[tuple[str, str], list[str]] = {}
    seen = _candidate_carriage(model, plan_with(islands), scratch, trust_remote_code, inputs, limit)
    rounds = 0
    while seen is not None:
        low = sorted((seen.low[key], key) for key in pending if key in seen.low)
        if not low:
            break
        _, key = low[0]
        plan = plan_with([*islands, *fixes])
        tries = len(fixed_for.get(key, ()))
        fix = rounds < WATCH_ROUNDS and tries < WATCH_TRIES
        unit = _fix_for(pending[key], seen, plan, stats) if fix else None
        if unit is None:
            outcome[key] = (STILL_LOW, tuple(fixed_for.get(key, ())))
            del pending[key]
            continue
        item = pending[key]
        fixes.append(
            Island(
                unit,
                "range",
                f"{MEASURED}{item.label} peaks at {item.peak:.4g} ({_near(item.peak, limit)}); "
                "this island makes the candidate carry it in fp32",
            )
        )
        fixed_for.setdefault(key, []).append(unit)
        rounds += 1
        seen = _candidate_carriage(
            model, plan_with([*islands, *fixes]), scratch, trust_remote_code, inputs, limit
        )
    for key in pending:
        state = UNCHECKED if seen is None else CARRIED
        outcome[key] = (state, tuple(fixed_for.get(key, ())))
    return fixes, outcome


def _fix_for(
    item: NearLimit, seen: Carriage, plan: ModelPlan, stats: dict[str, ActivationStats]
) -> str | None:
    """The unit whose fp32 island should make the candidate carry ``item`` in fp32.

    A weighted module's own output: its unit (the module, or the one it shares weights
    with). A container's output (the stream it hands on):
    the last weighted module in it that ran before the output was handed on and does not yet
    let fp32 flow (for a residual block, the projection added into the stream last). What a
    module receives, or a weightless module's output: the same, searched in the module's
    parent, then further up.
    """
    flowing = {i.name for i in plan.islands if i.reason != "precision"}
    units = {t.unit for t in plan.tensors if t.source.is_float} - flowing
    event = seen.low[(item.module, item.side)]

    def latest(scope: str) -> str | None:
        ran = [
            (seen.post[u], u)
            for u in units
            if u in seen.post and seen.post[u] < event and _within(u, scope)
        ]
        return max(ran)[1] if ran else None

    own = _unit_of(item.module, stats, units) if item.kind == LEAF else None
    if item.side == "output" and own is not None:
        return own
    if item.side == "output" and item.kind == CONTAINER:
        found = latest(item.module)
        if found is not None:
            return found
    scope = item.module
    while scope:
        scope = module_of(scope)
        found = latest(scope)
        if found is not None:
            return found
    return None


def _within(name: str, scope: str) -> bool:
    return not scope or name == scope or name.startswith(scope + ".")


def _candidate_carriage(
    model: ModelSource,
    plan: ModelPlan,
    scratch: Path,
    trust_remote_code: bool,
    inputs: Any,
    limit: FiniteRange,
) -> Carriage | None:
    """Write ``plan``, load it as a user would and record the dtypes it carries the tensors
    near ``limit`` in (None: the candidate does not run)."""
    import torch

    directory = _write_candidate(model, plan, scratch)
    with freed(load(directory, trust_remote_code=trust_remote_code)) as candidate:
        try:
            with carriage(candidate.model, limit) as seen, torch.no_grad():
                run_probes(candidate.model, inputs, "cpu", plan.compute.torch)
            return seen
        except RUN_ERRORS as exc:
            logger.info("candidate failed to run: %s", exc)
            return None


def _write_candidate(model: ModelSource, plan: ModelPlan, scratch: Path) -> Path:
    """Write ``plan`` under ``scratch`` where it loads as the source does: a pipeline
    component in a folder of its name beside the pipeline's ``model_index.json``, whose class
    for it is the one users get (a safety checker's config alone reads as a ``CLIPModel``)."""
    index = model.root.parent / "model_index.json"
    directory = scratch / model.root.name if index.is_file() else scratch / "candidate"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    if index.is_file():
        shutil.copyfile(index, scratch / index.name)
    write_model(model, plan, directory)
    return directory


def _searched(units: Iterable[str]) -> list[Island]:
    return [Island(u, "search", "search: needed to match fp32") for u in units]


def _candidate_passes(
    model: ModelSource,
    plan: ModelPlan,
    scratch: Path,
    trust_remote_code: bool,
    inputs: Any,
    baselines: Mapping[str | None, Any],
    thresholds: dict[str, float],
    passing: dict[str, Any],
    failed: dict[tuple[str | None, str], None],
) -> bool:
    """Write ``plan``, load it as a user would, and compare with the fp32 outputs under each
    attention implementation of ``baselines`` (None: the one it loads with); a plan that
    passes leaves its sha256, its files' digest and its outputs under each implementation in
    ``passing`` (validation reuses them when the output's files are these). The candidate is freed
    (memory given back) before this returns.

    A candidate is judged probe by probe and stops at its first failure, which is added to
    ``failed``; the implementations and probes earlier candidates failed on run first (a
    bisection's failing candidates mostly fail where the last one did), so a failing candidate
    costs a few forwards and only a passing one runs every probe.
    """
    directory = _write_candidate(model, plan, scratch)
    with freed() as candidate:
        try:
            candidate.model = load(directory, trust_remote_code=trust_remote_code)
            by_attention: dict[str | None, Any] = {}
            for implementation in _failed_first(list(baselines), failed):
                first = [name for impl, name in reversed(failed) if impl == implementation]
                with attention(candidate.model, implementation):
                    outputs, failure = _run_until_failure(
                        candidate.model,
                        _probes_first(inputs, first),
                        baselines[implementation],
                        thresholds,
                        plan.compute.torch,
                    )
                if failure is not None:
                    failed.pop((implementation, failure), None)
                    failed[(implementation, failure)] = None
                    return False
                by_attention[implementation] = outputs
            passing.update(
                plan=plan.sha256,
                weights=weights_digest(directory),
                outputs=by_attention.pop(None),
                by_attention=by_attention,
                mismatch=_record_mismatch(candidate.model, directory),
            )
            return True
        except RUN_ERRORS as exc:
            logger.info("candidate failed to run: %s", exc)
            return False


def _record_mismatch(model: Any, directory: Path) -> str | None:
    """How the dtypes of the candidate ``model`` loaded from ``directory`` disagree with the
    record written there (validation's check, made here where ``pc.load`` built it)."""
    written = open_source(directory)
    return loaded_mismatch(model, written) if isinstance(written, ModelSource) else None


def _run_until_failure(
    candidate: Any, inputs: Any, baseline: Any, thresholds: dict[str, float], dtype: Any
) -> tuple[Any, str | None]:
    """``candidate``'s outputs on ``inputs``, each probe compared with ``baseline`` as it
    comes, and the first probe that failed (None: every one passed). The run stops there."""
    failure: list[str] = []

    def stop(name: str, outputs: dict[str, Any]) -> bool:
        rows = compare_outputs("", inputs, {name: baseline[name]}, {name: outputs}, thresholds)
        if not all(row.passed for row in rows):
            failure.append(name)
        return bool(failure)

    outputs = run_probes(candidate, inputs, "cpu", dtype, stop=stop)
    return outputs, failure[0] if failure else None


def _failed_first(
    implementations: list[str | None], failed: Mapping[tuple[str | None, str], None]
) -> list[str | None]:
    """``implementations`` with the one a candidate failed under most recently first."""
    latest = {impl: k for k, (impl, _) in enumerate(failed)}
    return sorted(implementations, key=lambda impl: -latest.get(impl, -1))


def _probes_first(inputs: Any, names: Sequence[str]) -> Any:
    """``inputs`` (resolved: no probe reads another's output) with the probes ``names`` first,
    in that order, then the rest in their own order."""
    if not names:
        return inputs
    rank = {name: k for k, name in enumerate(names)}
    order = sorted(inputs.probes, key=lambda p: rank.get(p.name, len(rank)))
    return replace(inputs, probes=tuple(order))
