"""One fp32 probe session: pick inputs, sweep, run, check the baseline, resolve, free.

Calibration, whole-model validation and block-wise validation all run the fp32 model the same
way: the first input layout the model accepts, then the coverage level's sweep, in one run so
that whatever the run records (activation statistics, block activations, parameter coverage)
spans every probe. This module is that sequence, written once; what differs between them is
only how a run is recorded (``run``) and how the model is held (loaded whole and freed after,
or streamed block by block by the caller).

A :class:`Swept` is what a session leaves: the probes as run, resolved against the fp32
outputs, and the outputs themselves. Calibration and validation of one ``convert`` run sweep
the same source with the same settings, so calibration's :class:`Swept` *is* validation's
baseline (:meth:`Swept.matches` says when it may stand in for it).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN
from precision_convert.conversion.analysis.factors import (
    Bound,
    FactorRecorder,
    holding,
    recording_factors,
)
from precision_convert.conversion.analysis.proofs import (
    SoundBound,
    module_status,
    parameter_owners,
    sound_bounds,
)
from precision_convert.conversion.io.hashing import hash_paths
from precision_convert.conversion.runtime.memory import freed, large_allocations_mapped
from precision_convert.core.dtypes import WATCHED_RANGE
from precision_convert.validation.probe.inputs.budgets import activation_allowance, budget_for
from precision_convert.validation.probe.inputs.layouts import input_candidates, inputs_from_tensors
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.spots import attention_spot
from precision_convert.validation.probe.inputs.sweep import SweepSettings
from precision_convert.validation.probe.run.attention import (
    AttentionChoices,
    attention_choices,
    outputs_by_attention,
)
from precision_convert.validation.probe.run.contexts import search_contexts, sound_targets
from precision_convert.validation.probe.run.execute import (
    Outputs,
    resolve,
    run_probes,
    run_sweep,
    select_inputs,
)
from precision_convert.validation.probe.run.modules import ModuleUsage
from precision_convert.validation.probe.run.time_budget import fit_to_budget

#: Seed of every built input: fixed, so two certificates of one model are comparable, and so
#: calibration and validation of one run build the very same probes.
SEED = 0

#: How a session runs probes on the fp32 model (and records what it needs while they run).
Run = Callable[[Any, ModelInputs], Outputs]

#: What one fp32 second of a probe costs a certificate whose caller does not say (block-wise
#: validation): the fp32 run, then ``pc.load`` and the plain load at three times its pace
#: (fp16 on a CPU without fast half-precision kernels).
CERTIFICATE_PER_FP32_SECOND = 7.0


@dataclass(frozen=True)
class Swept:
    """The fp32 model's session: its probes, their outputs, and where they were made."""

    task: str  # the chosen layout's task
    inputs: ModelInputs  # the probes as run (references to other probes' outputs kept)
    outputs: Outputs  # the fp32 outputs, by probe
    source: Path  # the weights the fp32 model was built from
    device: str  # where it ran ("cpu", "cuda:0")
    settings: SweepSettings
    #: The modules owning parameters, and which of them the judged probes reached.
    usage: ModuleUsage = field(default_factory=ModuleUsage)
    #: The implementations judged, when the session ran the other ones a user can pick.
    attention: AttentionChoices | None = None
    #: The fp32 outputs under each other implementation, on the resolved probes.
    by_attention: Mapping[str, Outputs] = field(default_factory=dict)
    #: What the factor peaks bound (:mod:`~precision_convert.conversion.analysis.factors`),
    #: the context probes included, and the record of the search for the worst context.
    bounds: tuple[Bound, ...] = ()
    context_search: Mapping[str, Any] | None = None
    #: Bounds a probe passed (:func:`~precision_convert.conversion.analysis.factors.holding`):
    #: reported, not used.
    refuted: tuple[Bound, ...] = ()
    #: The weights-only bounds (:mod:`~precision_convert.conversion.analysis.proofs`) and the
    #: parameters of every module, for the proven/islanded/sampled table.
    proofs: tuple[SoundBound, ...] = ()
    owners: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def calibration_record(
        self, fp32_modules: tuple[str, ...] = (), compute: torch.dtype | None = None
    ) -> dict[str, Any]:
        """The certificate's ``calibration`` record of this session: the bound table, the
        context search and, for a ``compute`` dtype below fp32, each module as proven,
        islanded (one of ``fp32_modules``) or sampled only against its finite range."""
        record: dict[str, Any] = {
            "bounds": [b.to_json() for b in self.bounds],
            "context_search": dict(self.context_search) if self.context_search else None,
            "refuted": [b.to_json() for b in self.refuted],
        }
        if compute is not None and compute.is_floating_point and compute.itemsize < 4:
            limit = float(torch.finfo(compute).max)
            record["modules"] = module_status(
                self.owners, self.proofs, fp32_modules, limit, ACTIVATION_MARGIN
            )
        return record

    @property
    def resolved(self) -> ModelInputs:
        """The probes with every reference to an fp32 output replaced by that output: what a
        candidate is fed."""
        return resolve(self.inputs, self.outputs)

    def matches(self, source: Path, device: torch.device, settings: SweepSettings) -> bool:
        """Whether this session is the one validation would run: the same weights, built
        inputs swept with the same settings, on the same device (a GPU's fp32 differs from a
        CPU's in its last bits; a baseline from elsewhere would blur the comparison)."""
        return (
            self.inputs.origin != "file"
            and Path(source).resolve() == self.source.resolve()
            and str(device) == self.device
            and settings == self.settings
        )


@dataclass(frozen=True)
class PriorRuns:
    """What a conversion already ran, handed to its validation so nothing runs twice: the
    fp32 session, and the outputs of the last candidate it checked through ``pc.load`` (under
    the default attention implementation and each other one) with the digest of that
    candidate's weight files (:func:`weights_digest`): when the output's files are byte for
    byte the same, ``pc.load`` of the output gives these very outputs, and the dtypes that
    candidate loaded in disagreed with its record as ``candidate_mismatch`` says (None: they
    agreed)."""

    swept: Swept
    candidate_weights: str | None = None
    candidate: Outputs | None = None
    candidate_by_attention: Mapping[str, Outputs] = field(default_factory=dict)
    candidate_mismatch: str | None = None


def weights_digest(directory: Path) -> str:
    """sha256 over the contents of the safetensors files in ``directory`` (names aside: a
    ``--variant`` output names the same bytes otherwise)."""
    files = hash_paths(directory, [p.name for p in directory.glob("*.safetensors")])
    digests = sorted(f.sha256 for f in files.values())
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def sweep_model(
    model: Any,
    run: Run,
    settings: SweepSettings,
    *,
    tokenizer: Any | None,
    component: str,
    directory: Path,
    supplied: Mapping[str, torch.Tensor] | None = None,
    memory: int | None = None,
    before: Callable[[ModelInputs], None] | None = None,
    per_probe: Callable[[ModelInputs], float] | None = None,
    began: float | None = None,
) -> tuple[str, ModelInputs, Outputs]:
    """The fp32 model run on its first working input layout (``supplied`` tensors instead,
    when given), then on that layout followed by the sweep ``settings`` make (``memory``: the
    probes sized for block-wise runs; ``before`` is told them before they run); returns the
    layout's task, the probes and outputs.

    With a time budget (``settings.budget``) the sweep is first cut to what it affords
    (:func:`~.time_budget.fit_to_budget`), counted from ``began`` (default: now), one fp32
    second of a probe costing the certificate ``per_probe(sweep)`` seconds (default
    :data:`CERTIFICATE_PER_FP32_SECOND`)."""
    began = time.perf_counter() if began is None else began
    candidates: Iterator[ModelInputs]
    if supplied is not None:
        candidates = iter([inputs_from_tensors(model, supplied, seed=SEED)])
    else:
        candidates = input_candidates(model, seed=SEED, tokenizer=tokenizer)
    chosen, outputs = select_inputs(model, candidates, run)
    del candidates  # a candidate generator holds the model too
    swept = settings.apply(
        model, chosen, tokenizer=tokenizer, component=component, directory=directory, memory=memory
    )
    if settings.budget is not None:
        swept = fit_to_budget(
            model,
            chosen,
            swept,
            run,
            seconds=settings.budget,
            began=began,
            per_probe=per_probe(swept) if per_probe is not None else CERTIFICATE_PER_FP32_SECOND,
        )
    if before is not None:
        before(swept)
    swept, outputs = run_sweep(model, chosen, swept, run, outputs)
    return chosen.task, swept, outputs


def fp32_session(
    build: Callable[[], Any],
    run: Run,
    settings: SweepSettings,
    *,
    source: Path,
    device: torch.device,
    tokenizer: Any | None,
    component: str,
    directory: Path | None = None,
    supplied: Mapping[str, torch.Tensor] | None = None,
    check: Callable[[Outputs], None] | None = None,
    usage: Callable[[], ModuleUsage] | None = None,
    before: Callable[[ModelInputs, int], None] | None = None,
    per_probe: Callable[[ModelInputs, int], float] | None = None,
    attention: bool = False,
) -> Swept:
    """Build the fp32 model (from ``source``), sweep it (:func:`sweep_model`; ``directory``:
    where its pipeline's scheduler is looked for, default ``source``), with ``attention``
    run the probes of :func:`~.spots.attention_spot` (those with padding, and a spot
    subset) again under each other attention implementation a user can pick, the default's outputs
    standing in for the rest where the two agree (:func:`~.attention.outputs_by_attention`;
    ``before`` is told the probes and how many other implementations will run them),
    ``check`` its outputs, and free it before returning, so that the next model to load is
    the only one resident. ``per_probe`` says what one fp32 second of a probe costs the
    certificate, for a time budget (see :func:`sweep_model`), given the probes and how many
    other implementations run them; the budget counts from the model's build."""
    by_attention: dict[str, Outputs] = {}
    built = time.perf_counter()
    with freed(build(), device) as fp32:
        choices = attention_choices(fp32.model) if attention else None
        others = len(choices.others) if choices is not None else 0
        factors = FactorRecorder(fp32.model)
        proofs = sound_bounds(fp32.model)

        def recorded(model: Any, probes: ModelInputs) -> Outputs:
            # The factor hooks keep small blocks live between a forward's activations, as
            # calibration's do: unless those are mapped, the heap grows past what is live (a
            # 265M bf16-safe baseline peaked 1.0 GiB higher in one run than in another).
            with large_allocations_mapped(), recording_factors(model, factors):
                return run(model, probes)

        began = time.perf_counter()
        task, inputs, outputs = sweep_model(
            fp32.model,
            recorded,
            settings,
            tokenizer=tokenizer,
            component=component,
            directory=directory or source,
            supplied=supplied,
            before=(lambda swept: before(swept, others)) if before is not None else None,
            per_probe=(lambda swept: per_probe(swept, others)) if per_probe is not None else None,
            began=built,
        )
        inputs, outputs, searched = _worst_contexts(
            fp32.model,
            recorded,
            inputs,
            outputs,
            holding(factors.bounds(fp32.model))[0],
            proofs,
            settings,
            time.perf_counter() - began,
            device,
        )
        bounds, refuted = holding(factors.bounds(fp32.model))  # the contexts' peaks included
        owners = parameter_owners(fp32.model)
        if choices is not None:
            choices, by_attention = outputs_by_attention(
                fp32.model,
                choices,
                resolve(inputs, outputs),
                outputs,
                lambda model, probes: run_probes(model, probes, device, torch.float32),
                allowance=activation_allowance(fp32.model),
                spot=attention_spot,
            )
    if check is not None:
        check(outputs)
    return Swept(
        task,
        inputs,
        outputs,
        Path(source),
        str(device),
        settings,
        usage() if usage is not None else ModuleUsage(),
        choices,
        by_attention,
        tuple(bounds),
        searched,
        tuple(refuted),
        tuple(proofs),
        owners,
    )


def _worst_contexts(
    model: Any,
    run: Run,
    inputs: ModelInputs,
    outputs: Outputs,
    bounds: list[Bound],
    proofs: list[SoundBound],
    settings: SweepSettings,
    swept_seconds: float,
    device: torch.device,
) -> tuple[ModelInputs, Outputs, dict[str, Any]]:
    """The sweep's probes and outputs with the worst contexts the search finds for the
    bounds near fp16's limit and the largest sound bounds ``proofs`` do not prove below it
    (run with ``run``, so what it records sees them too), and the
    search's record. Its budget is the level's share of the floor, estimated as twice the fp32
    sweep's ``swept_seconds`` (the fp32 sweep, and the candidate's of the same probes)."""
    budget = budget_for(settings.level)
    if inputs.origin == "file":
        return inputs, outputs, {"not_searched": "the probes came from --inputs"}
    if not budget.context_steps:
        return inputs, outputs, {"not_searched": f"no context search at {budget.level}"}
    probes, record = search_contexts(
        model,
        inputs,
        bounds,
        seconds=budget.context_search * 2 * swept_seconds,
        steps=budget.context_steps,
        device=device,
        seed=inputs.seed,
        sound=sound_targets(model, proofs, bounds, WATCHED_RANGE),
    )
    if not probes:
        return inputs, outputs, record
    found = run(model, replace(inputs, probes=tuple(probes)))
    kept = [p for p in probes if all(torch.isfinite(t).all() for t in found[p.name].values())]
    for probe in kept:
        outputs[probe.name] = found[probe.name]
    record["probes"] = [p.name for p in kept]
    if len(kept) < len(probes):
        record["not_judged"] = "the fp32 model's own output is not finite on the other contexts"
    return replace(inputs, probes=(*inputs.probes, *kept)), outputs, record
