"""One model compared whole: its fp32 baseline swept (or calibration's sweep reused), then the
converted model through ``pc.load`` on the same probes, then every other way users load it.

The baseline runs first and is freed before the candidate is loaded, so the two are never
resident together; a candidate that fails to run is an error of the certificate, not a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.runtime.baseline import load_fp32
from precision_convert.conversion.runtime.loader import load
from precision_convert.conversion.runtime.memory import freed
from precision_convert.conversion.runtime.record import loaded_mismatch
from precision_convert.core.dtypes import WATCHED_RANGE
from precision_convert.core.errors import one_line
from precision_convert.core.progress import expect, stage
from precision_convert.validation.certify.components import (
    Component,
    ComponentResult,
    check_baseline,
    component_record,
)
from precision_convert.validation.certify.load_paths import check_model, planned_forwards
from precision_convert.validation.certify.modules import judge_modules
from precision_convert.validation.certify.sizes import judge_sizes, predictions_decide
from precision_convert.validation.probe.inputs.contexts import with_bounds
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.spots import attention_spot
from precision_convert.validation.probe.inputs.sweep import SweepSettings
from precision_convert.validation.probe.inputs.tokenizers import tokenizer_for
from precision_convert.validation.probe.run.execute import (
    RUN_ERRORS,
    Coverage,
    Outputs,
    all_finite,
    run_probes,
)
from precision_convert.validation.probe.run.growth import SizedRun, run_sized, size_growth
from precision_convert.validation.probe.run.metrics import Measurement, measure
from precision_convert.validation.probe.run.parity import compare_outputs
from precision_convert.validation.probe.run.session import (
    PriorRuns,
    Swept,
    fp32_session,
    weights_digest,
)
from precision_convert.validation.probe.run.time_budget import half_precision_pace


def _validate_whole(
    component: Component,
    device: torch.device,
    supplied: Mapping[str, torch.Tensor] | None,
    sweep_for: SweepSettings,
    prior: PriorRuns | None = None,
) -> ComponentResult:
    notes: list[str] = []
    # The conversion's calibration may already have swept this source with these probes here.
    if prior is not None and (
        supplied is not None
        or not prior.swept.matches(component.baseline_dir, device, sweep_for)
        or prior.swept.attention is None  # it did not run the other attention implementations
    ):
        prior = None
    shared = _shared_candidate(component, prior)
    if prior is not None:
        swept = prior.swept
        check_baseline(swept.outputs, component)
        others = len(swept.attention.others) if swept.attention is not None else 0
        _expect(component, swept.inputs, others, baseline=False, candidate=shared is None)
        notes.append(
            f"{component.name or 'model'}: the fp32 baseline is the sweep calibration ran in "
            "this conversion (the same source, probes and device), not run again"
        )
    else:
        swept = _baseline(component, device, supplied, sweep_for)
    frozen, base_out = swept.resolved, swept.outputs
    record, thresholds = component_record(component, swept.task, swept.inputs, "whole")
    choices = swept.attention
    record.attention = choices.to_json() if choices is not None and choices.default else None
    record.calibration = swept.calibration_record(
        component.record.fp32_modules, component.compute_dtype
    )
    record.inputs["triggers"] = with_bounds(record.inputs.get("triggers", {}), record.calibration)
    covered = judge_modules(component, swept.usage, swept.inputs, record)
    metrics = measure(component.name, "forward", "*", {"coverage": covered.share}, thresholds)
    if shared is not None and shared.candidate is not None:
        compared = compare_outputs(component.name, frozen, base_out, shared.candidate, thresholds)
        # Calibration's pc.load of these very files was checked against their record.
        mismatch = shared.candidate_mismatch
        errors = [f"{component.name or 'model'}: {mismatch}"] if mismatch else []
    else:
        compared, errors = _compare_candidate(
            lambda: load(
                component.converted.root,
                device=device,
                trust_remote_code=component.trust_remote_code,
            ),
            component.name,
            frozen,
            base_out,
            thresholds,
            device,
            component.compute_dtype,
            recorded=component.converted,
        )
    metrics += compared
    errors += covered.failures(component.name)
    sizes, failed = judge_sizes(component, record.inputs.get("sizes") or {})
    if sizes:
        record.inputs["sizes"] = sizes
    errors += failed
    paths = check_model(
        component,
        frozen,
        base_out,
        thresholds,
        device,
        metrics,
        errors,
        swept.by_attention,
        shared=shared.candidate_by_attention if shared is not None else None,
    )
    return ComponentResult(record, metrics, errors, paths, notes)


def _baseline(
    component: Component,
    device: torch.device,
    supplied: Mapping[str, torch.Tensor] | None,
    sweep_for: SweepSettings,
) -> Swept:
    """The fp32 baseline's session: the source upcast to fp32 on ``device``, swept, checked
    and freed."""
    coverage = Coverage()
    sized: list[SizedRun] = []  # the last run's: the one whose probes were kept

    def run(model: Any, inputs: ModelInputs) -> Outputs:
        with coverage.track(model):
            deciding = predictions_decide(component)
            outputs, found = run_sized(model, inputs, device, torch.float32, id_sweeps=deciding)
            if not all_finite(outputs):
                coverage.unjudged()
        sized[:] = [found]
        return outputs

    def build() -> Any:
        trusted = component.trust_remote_code
        return load_fp32(component.baseline_dir, trust_remote_code=trusted).to(device).eval()

    with stage("baseline"):
        swept = fp32_session(
            build,
            run,
            sweep_for,
            source=component.baseline_dir,
            directory=component.converted.root,
            device=device,
            tokenizer=tokenizer_for(component.converted.root),
            component=component.name,
            supplied=supplied,
            check=lambda outputs: check_baseline(outputs, component),
            usage=lambda: coverage.usage,
            before=lambda inputs, others: _expect(
                component, inputs, others, baseline=True, candidate=True
            ),
            per_probe=lambda inputs, others: _per_probe(component, inputs, others, device),
            attention=True,
        )
    if not sized:
        return swept
    # The growth record every certificate carries, whatever the target: against fp16's range.
    return replace(swept, inputs=size_growth(swept.inputs, sized[-1], WATCHED_RANGE)[0])


def _expect(
    component: Component, inputs: ModelInputs, attention: int, *, baseline: bool, candidate: bool
) -> None:
    """Say how many forwards validating ``component`` on ``inputs`` runs, before they run:
    the fp32 baseline under the default attention implementation and, on the probes of
    :func:`attention_spot`, each of ``attention`` others, ``pc.load`` (unless calibration ran
    it), then the other ways."""
    fp32, n, others = _forwards(component, inputs, attention, candidate=candidate)
    parts = [f"fp32 baseline {fp32}"] if baseline else []
    parts += [f"pc.load {n}"] if candidate else []
    parts.append(f"other ways of loading at most {others}")
    expect(fp32 * baseline + n * candidate + others, ", ".join(parts), fp32=fp32 * baseline)


def _forwards(
    component: Component, inputs: ModelInputs, attention: int, *, candidate: bool
) -> tuple[int, int, int]:
    """The forwards of :func:`_expect`: fp32's, ``pc.load``'s and the other ways' (at most)."""
    n = len(inputs.probes)
    fp32 = n + attention * len(attention_spot(inputs).probes)
    return fp32, n, planned_forwards(component, inputs, attention, shared=not candidate)


def _per_probe(
    component: Component, inputs: ModelInputs, attention: int, device: torch.device
) -> float:
    """What one fp32 second of a probe costs this certificate (for ``--budget``): fp32's
    forwards, then ``pc.load``'s and the other ways' at the device's half-precision pace,
    over the probes."""
    fp32, n, others = _forwards(component, inputs, attention, candidate=True)
    pace = half_precision_pace(device, component.compute_dtype)
    return (fp32 + pace * (n + others)) / max(1, n)


def _shared_candidate(component: Component, prior: PriorRuns | None) -> PriorRuns | None:
    """``prior`` when the outputs ``pc.load`` gives on this output are its candidate's:
    calibration's last candidate's weight files are byte for byte the output's."""
    if prior is None or prior.candidate is None or prior.candidate_weights is None:
        return None
    same = weights_digest(component.converted.root) == prior.candidate_weights
    return prior if same else None


def _compare_candidate(
    load_candidate: Callable[[], Any],
    name: str,
    inputs: ModelInputs,
    baseline: Outputs,
    thresholds: Mapping[str, float],
    device: torch.device,
    dtype: torch.dtype | None = None,
    *,
    recorded: ModelSource | None = None,
) -> tuple[list[Measurement], list[str]]:
    """The converted model (or pipeline) through ``pc.load``, run on ``inputs`` and compared
    with the baseline's outputs; freed before returning, so the library's own loads that
    follow come in one at a time. A candidate that fails to run is an error, not a crash, and
    so is a model whose parameters' dtypes are not the ones the record of ``recorded`` (the
    files it was loaded from) says (:func:`loaded_mismatch`)."""
    with freed(device=device) as candidate:
        try:
            candidate.model = load_candidate()
            mismatch = loaded_mismatch(candidate.model, recorded) if recorded else None
            errors = [f"{name or 'model'}: {mismatch}"] if mismatch else []
            with stage("pc.load"):
                outputs = run_probes(candidate.model, inputs, device, dtype)
            return compare_outputs(name, inputs, baseline, outputs, thresholds), errors
        except RUN_ERRORS as exc:
            what = "pipeline" if name == "pipeline" else "model"
            return [], [f"{name or 'model'}: the converted {what} failed to run: {one_line(exc)}"]
