"""``validate()``: run the fp32 baseline, then the converted model, compare, certify.

Baseline and candidate are never resident together: the baseline (the source, upcast to fp32
and run in fp32) runs first, its outputs go to the CPU, it is freed, and only then is the
candidate loaded with :func:`~precision_convert.conversion.runtime.loader.load` — the same
loader users get, with its boundary hooks. A model whose fp32 copy does not fit the memory
budget is compared block by block instead (:mod:`.blockwise`). A diffusers pipeline is
validated component by component, then end to end with a short seeded run.

After ``pc.load``, the candidate is loaded every other way a user would (the library's plain
``from_pretrained``, ``dtype="auto"``, the explicit compute dtype; :mod:`.load_paths`), one
model at a time, on the same probes; the verdict is ``pass`` only when ``pc.load`` and the
plain default load both pass, and only against the source: compared with the converted weights
themselves it is ``smoke-pass`` at best. What the baseline is, and whether this run may replace
the certificate in place, is settled before anything runs (:mod:`.reference`).

The certificate and the model card are written into the converted directory whatever the
verdict, so a user can see why a conversion failed; a model that cannot be fed at all
(:class:`~precision_convert.errors.CannotValidateError`) still gets a failing certificate that
says what is missing, and the error is raised as before.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from precision_convert._version import __version__
from precision_convert.conversion.io.source import (
    ModelSource,
    PipelineSource,
    Source,
    open_source,
)
from precision_convert.conversion.io.staging import check_apart
from precision_convert.conversion.plan import PlanRecord
from precision_convert.conversion.runtime.baseline import load_fp32
from precision_convert.conversion.runtime.devices import resolve_device
from precision_convert.conversion.runtime.loader import load, read_record
from precision_convert.conversion.runtime.memory import free_model
from precision_convert.errors import CannotValidateError, InputError
from precision_convert.progress import diffusers_bars_off, expect, forecasting, stage
from precision_convert.validation.certify.blockwise import validate_blockwise
from precision_convert.validation.certify.card import render_card
from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    FAIL,
    PASS,
    SELF_BASELINE,
    SMOKE_PASS,
    SOURCE_BASELINE,
    Certificate,
    ComponentRecord,
    metric_failures,
    write,
)
from precision_convert.validation.certify.components import (
    SEED,
    Component,
    ComponentResult,
    check_baseline,
    component_record,
)
from precision_convert.validation.certify.load_paths import (
    blockwise_paths,
    check_model,
    check_pipeline,
    failure_lines,
    planned_forwards,
    skipped_pipeline,
)
from precision_convert.validation.certify.reference import (
    SourceInfo,
    check_replaceable,
    check_same_architecture,
    models_of,
    same_conversion,
    source_files,
    source_info,
    without_local_paths,
)
from precision_convert.validation.certify.verify import hash_files
from precision_convert.validation.probe.budgets import DEFAULT_LEVEL, budget_for
from precision_convert.validation.probe.execute import (
    RUN_ERRORS,
    Coverage,
    Outputs,
    outputs_on_disk,
    run_probes,
)
from precision_convert.validation.probe.inputs import ModelInputs, pipeline_inputs
from precision_convert.validation.probe.metrics import Measurement, measure
from precision_convert.validation.probe.parity import compare_outputs, thresholds_for
from precision_convert.validation.probe.preflight import check_user_inputs
from precision_convert.validation.probe.session import (
    PriorRuns,
    Swept,
    fp32_session,
    weights_digest,
)
from precision_convert.validation.probe.sweep import SweepSettings
from precision_convert.validation.probe.tokenizers import tokenizer_for
from precision_convert.validation.probe.userdata import CalibrationData, read_calibration_data

__all__ = ["parse_memory", "thresholds_for", "validate"]

#: Whole-model validation needs the fp32 weights plus activations, allocator slack and the
#: outputs kept for comparison; past this share of the budget the model goes block by block.
WHOLE_MODEL_HEADROOM = 1.25


# --------------------------------------------------------------------------- public entry


@stage("validation")
def validate(
    converted: str | Path,
    baseline: str | Path | None = None,
    device: str | torch.device | None = None,
    *,
    inputs: str | Path | Mapping[str, torch.Tensor] | None = None,
    max_memory: str | int | None = None,
    coverage: str = DEFAULT_LEVEL,
    calibration_data: str | Path | CalibrationData | None = None,
    trust_remote_code: bool = False,
    prior: Mapping[str, PriorRuns] | None = None,
) -> Certificate:
    """Certify ``converted`` against its fp32 baseline and write the certificate and card.

    Args:
        converted: a directory written by ``precision-convert model``.
        baseline: the source (directory or Hub id); only a comparison with it can certify
            (verdict ``pass``). Default: the converted weights upcast to fp32, a smoke check
            that catches activation overflow and compute-precision loss but not the rounding
            of the weights themselves: its verdict is at best ``smoke-pass``.
        device: ``"auto"``/None (CUDA when present), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        inputs: a safetensors file (or dict) of named tensors to feed instead of the built
            inputs; for a pipeline, names are ``<component>/<argument>``.
        max_memory: memory budget ("8GB", "512MiB" or bytes). A model whose fp32 copy does not
            fit is compared block by block, one block resident at a time.
        coverage: how much of the input space the probes sweep: ``"quick"``, ``"standard"``
            (default: every vocabulary id and position, contexts to 2048 tokens, timestep
            quartiles with the first step) or ``"thorough"`` (contexts to the position limit,
            every timestep decile); see
            :data:`~precision_convert.validation.probe.budgets.BUDGETS`.
        calibration_data: a file of text lines or JSONL model inputs whose probes are added
            to the sweep (see :mod:`~precision_convert.validation.probe.userdata`).
        trust_remote_code: let a model that ships its own code (``auto_map``) run it, for the
            baseline, ``pc.load`` and the library's loads alike. Off: such a model cannot be
            validated (the certificate says so).
        prior: by component name, what the conversion that wrote ``converted`` already ran
            (``convert`` passes its calibration's): its fp32 sweep stands in for the baseline
            when it was made from the same source with the same probes on the same device, and
            its last candidate's outputs for ``pc.load``'s when the output's weight files are
            byte for byte that candidate's.

    Returns:
        The :class:`Certificate` (also written to ``precision_certificate.json``).

    Raises:
        InputError: ``converted`` or ``baseline`` is not a usable directory; a baseline of
            another architecture; a certificate in ``converted`` that this run would replace
            with a weaker or unrelated one (made against the source, or against another
            source); an unknown coverage level; unreadable or malformed calibration data.
        CannotValidateError: no inputs could be built for a model; pass ``inputs``. A failing
            certificate and card saying so are written first.
    """
    root = Path(converted)
    if not root.is_dir():
        raise InputError("no such directory: validate takes a converted model directory", root)
    budget_for(coverage)  # an unknown level fails before anything runs
    data = _calibration_data(calibration_data)
    run = _set_up(root, baseline, device, inputs, max_memory, data, trust_remote_code)
    results: list[ComponentResult] = []
    try:
        _validate_all(run, SweepSettings(coverage, data), prior or {}, results)
    except CannotValidateError as exc:
        # Nothing is left half-explained: the output still gets a failing certificate and card
        # that say what is missing and how to supply it; the error still reaches the caller.
        results += _not_run(run.opened, run.components, results)
        _write_certificate(run, results, cannot=exc)
        raise
    return _write_certificate(run, results)


@dataclass(frozen=True)
class _Run:
    """What one validation compares, where and with what: set up, and checked, before
    anything runs."""

    root: Path
    opened: Source
    source: SourceInfo
    weights: dict[str, str]  # the source's weight files and their digests
    device: torch.device
    memory: int  # bytes: past them, a model is validated block by block
    max_memory: str | int | None  # as the user gave it, for the certificate
    supplied: Mapping[str, torch.Tensor] | None
    components: list[Component]


def _calibration_data(given: str | Path | CalibrationData | None) -> CalibrationData | None:
    """The user's calibration data, read when given as a path."""
    if given is None or isinstance(given, CalibrationData):
        return given
    return read_calibration_data(given)


def _set_up(
    root: Path,
    baseline: str | Path | None,
    device: str | torch.device | None,
    inputs: str | Path | Mapping[str, torch.Tensor] | None,
    max_memory: str | int | None,
    data: CalibrationData | None,
    trust_remote_code: bool,
) -> _Run:
    """The converted model and its baseline opened, the device, memory budget and supplied
    inputs resolved: everything that can be refused is refused here, before anything runs."""
    opened = open_source(root)
    source = source_info(baseline, root)
    if source.kind == SOURCE_BASELINE:  # the certificate and card are written into ``converted``
        check_apart(root, [source.path], "the converted directory")
    reference = opened if source.kind == SELF_BASELINE else open_source(source.path)
    check_same_architecture(opened, reference, root, source)
    if source.kind == SOURCE_BASELINE and same_conversion(opened, reference):
        source = replace(source, kind=SELF_BASELINE)  # a copy of the output is not its source
    weights = source_files(source.path, reference)
    check_replaceable(root, source, weights)
    target_device = resolve_device(device)
    budget = parse_memory(max_memory) if max_memory is not None else available_memory(target_device)
    supplied = read_inputs(inputs)
    check_user_inputs(  # what the model cannot take: refused before anything runs
        opened, data=data, inputs=supplied, trust_remote_code=trust_remote_code,
        inputs_path=inputs if isinstance(inputs, str | Path) else None,
    )  # fmt: skip
    components = _components(opened, source, trust_remote_code)
    return _Run(
        root, opened, source, weights, target_device, budget, max_memory, supplied, components
    )


def _validate_all(
    run: _Run,
    sweep_for: SweepSettings,
    prior: Mapping[str, PriorRuns],
    results: list[ComponentResult],
) -> None:
    """Each component, then a pipeline end to end; each result is appended to ``results``
    as it comes, so a run that stops still certifies what it finished."""
    cheaper = "--coverage quick runs fewer probes" if sweep_for.level != "quick" else ""
    with _library_bars_off(run.opened), forecasting("validation", cheaper):
        for c in run.components:
            here = _inputs_for(run.supplied, c.name, run.opened)
            results.append(
                _validate_component(c, run.device, run.memory, here, sweep_for, prior.get(c.name))
            )
        if isinstance(run.opened, PipelineSource):
            latent_side = budget_for(sweep_for.level).pipeline_latent_side
            results.append(
                _validate_pipeline(run.opened, run.source, results, run.device, latent_side)
            )


def _write_certificate(
    run: _Run, results: list[ComponentResult], *, cannot: CannotValidateError | None = None
) -> Certificate:
    """:func:`_certificate`, written with its card into the converted directory."""
    certificate = _certificate(run, results, cannot=cannot)
    write(certificate, run.root, {CARD_NAME: render_card(certificate, run.root)})
    return certificate


# --------------------------------------------------------------------------- setup


def _library_bars_off(opened: Source) -> AbstractContextManager[None]:
    """diffusers' own loading bars off while a diffusers model or pipeline is validated (their
    switch costs diffusers' import, which nothing else here needs)."""
    uses = any(m.library == "diffusers" for m in models_of(opened).values())
    return diffusers_bars_off() if uses or isinstance(opened, PipelineSource) else nullcontext()


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(value: str | int) -> int:
    """Bytes from ``"8GB"``, ``"512MiB"``, ``"1.5 GB"`` or a plain number of bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    unit = match[2].lower() if match else ""
    if not match or unit not in _UNITS:
        raise InputError(f"cannot read memory size {value!r}; write e.g. 8GB, 512MiB or 1e9")
    return int(float(match[1]) * _UNITS[unit])


def available_memory(device: torch.device) -> int:
    """What a whole-model comparison may use: free GPU memory, or available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def read_inputs(
    inputs: str | Path | Mapping[str, torch.Tensor] | None,
) -> Mapping[str, torch.Tensor] | None:
    """The tensors of an ``--inputs`` safetensors file (a mapping passes through)."""
    if inputs is None or isinstance(inputs, Mapping):
        return inputs
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(inputs))
    except (OSError, SafetensorError) as exc:
        raise InputError(
            f"--inputs must be a safetensors file of named tensors ({exc})", inputs
        ) from None


def _inputs_for(
    supplied: Mapping[str, torch.Tensor] | None, name: str, opened: Any
) -> Mapping[str, torch.Tensor] | None:
    """The supplied tensors meant for one component (``<component>/<arg>`` in pipelines)."""
    if supplied is None:
        return None
    if not isinstance(opened, PipelineSource):
        return supplied
    prefix = f"{name}/"
    mine = {k.removeprefix(prefix): v for k, v in supplied.items() if k.startswith(prefix)}
    return mine or None


def _components(
    opened: ModelSource | PipelineSource, source: SourceInfo, trust_remote_code: bool
) -> list[Component]:
    if isinstance(opened, PipelineSource):
        found = list(opened.components.items())
    else:
        found = [("", opened)]
    components = []
    for name, model in found:
        baseline_dir = source.path / name if name else source.path
        record = read_record(model) or PlanRecord()
        components.append(Component(name, model, baseline_dir, record, trust_remote_code))
    return components


# --------------------------------------------------------------------------- comparison


def _validate_component(
    component: Component,
    device: torch.device,
    budget: int,
    supplied: Mapping[str, torch.Tensor] | None,
    sweep_for: SweepSettings,
    prior: PriorRuns | None,
) -> ComponentResult:
    if component.fp32_bytes * WHOLE_MODEL_HEADROOM > budget:
        result = validate_blockwise(component, device, budget, supplied, sweep_for)
        result.load_paths = blockwise_paths(component, result.metrics, result.errors)
        return result
    # Compared whole, every probe's outputs kept on disk until compared: a sweep's kept
    # outputs are not small next to a mid-size model.
    with outputs_on_disk():
        return _validate_whole(component, device, supplied, sweep_for, prior)


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
    metrics = measure(component.name, "forward", "*", {"coverage": swept.coverage}, thresholds)
    if shared is not None and shared.candidate is not None:
        compared = compare_outputs(component.name, frozen, base_out, shared.candidate, thresholds)
        errors: list[str] = []
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
        )
    metrics += compared
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

    def run(model: Any, inputs: ModelInputs) -> Outputs:
        with coverage.track(model):
            return run_probes(model, inputs, device, torch.float32)

    def build() -> Any:
        trusted = component.trust_remote_code
        return load_fp32(component.baseline_dir, trust_remote_code=trusted).to(device).eval()

    with stage("baseline"):
        return fp32_session(
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
            coverage=lambda: coverage.fraction,
            before=lambda inputs, others: _expect(
                component, inputs, others, baseline=True, candidate=True
            ),
            attention=True,
        )


def _expect(
    component: Component, inputs: ModelInputs, attention: int, *, baseline: bool, candidate: bool
) -> None:
    """Say how many forwards validating ``component`` on ``inputs`` runs, before they run:
    the fp32 baseline under the default attention implementation and each of ``attention``
    others, ``pc.load`` (unless calibration ran it), then the other ways."""
    n = len(inputs.probes)
    fp32 = n * (1 + attention)
    others = planned_forwards(component, inputs, attention, shared=not candidate)
    parts = [f"fp32 baseline {fp32}"] if baseline else []
    parts += [f"pc.load {n}"] if candidate else []
    parts.append(f"other ways of loading at most {others}")
    expect(fp32 * baseline + n * candidate + others, ", ".join(parts))


def _shared_candidate(component: Component, prior: PriorRuns | None) -> PriorRuns | None:
    """``prior`` when the outputs ``pc.load`` gives on this output are its candidate's:
    calibration's last candidate's weight files are byte for byte the output's."""
    if prior is None or prior.candidate is None or prior.candidate_weights is None:
        return None
    same = weights_digest(component.converted.root) == prior.candidate_weights
    return prior if same else None


def _validate_pipeline(
    opened: PipelineSource,
    source: SourceInfo,
    parts: list[ComponentResult],
    device: torch.device,
    latent_side: int,
) -> ComponentResult:
    """A short seeded end-to-end run (at most ``latent_side`` latents a side): baseline
    pipeline in fp32, then the converted one."""
    task = "pipeline"
    thresholds = thresholds_for(task)
    record = ComponentRecord(
        name="pipeline",
        class_name=opened.model_index.get("_class_name"),
        library="diffusers",
        task=task,
        mode="pipeline",
    )
    if any(p.record.mode == "blockwise" for p in parts):
        note = "end-to-end run skipped: a component only fits in memory block by block"
        record.inputs = {"skipped": note}
        return ComponentResult(record, [], [], skipped_pipeline(opened, note))
    baseline = load_fp32(source.path).to(device)
    inputs = pipeline_inputs(baseline, seed=SEED, latent_side=latent_side)
    record.inputs = inputs.describe()
    try:
        base_out = run_probes(baseline, inputs, device)
    except RUN_ERRORS as exc:
        raise CannotValidateError(
            f"cannot run the {record.class_name} pipeline end to end "
            f"({_first_line(exc)}); pass --inputs"
        ) from None
    gone = weakref.ref(baseline)
    del baseline
    free_model(gone, device)
    metrics, errors = _compare_candidate(
        lambda: load(opened.root, device=device), "pipeline", inputs, base_out, thresholds, device
    )
    paths = check_pipeline(opened, inputs, base_out, thresholds, device, metrics, errors)
    return ComponentResult(record, metrics, errors, paths)


def _compare_candidate(
    load_candidate: Callable[[], Any],
    name: str,
    inputs: ModelInputs,
    baseline: Outputs,
    thresholds: Mapping[str, float],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> tuple[list[Measurement], list[str]]:
    """The converted model (or pipeline) through ``pc.load``, run on ``inputs`` and compared
    with the baseline's outputs; freed before returning, so the library's own loads that
    follow come in one at a time. A candidate that fails to run is an error, not a crash."""
    candidate: Any = None
    try:
        candidate = load_candidate()
        with stage("pc.load"):
            outputs = run_probes(candidate, inputs, device, dtype)
        return compare_outputs(name, inputs, baseline, outputs, thresholds), []
    except RUN_ERRORS as exc:
        what = "pipeline" if name == "pipeline" else "model"
        return [], [f"{name or 'model'}: the converted {what} failed to run: {_first_line(exc)}"]
    finally:
        if candidate is not None:
            gone = weakref.ref(candidate)
            candidate = None
            free_model(gone, device)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# --------------------------------------------------------------------------- certificate


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in (
        "precision-convert",
        "torch",
        "transformers",
        "diffusers",
        "accelerate",
        "safetensors",
        "huggingface_hub",
        "open_clip_torch",
    ):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _device_record(
    device: torch.device, max_memory: str | int | None, modes: set[str]
) -> dict[str, Any]:
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine())
    )
    record: dict[str, Any] = {"type": device.type, "name": name, "modes": sorted(modes)}
    if max_memory is not None:
        record["max_memory"] = str(max_memory)
    return record


def _certificate(
    run: _Run, results: list[ComponentResult], *, cannot: CannotValidateError | None = None
) -> Certificate:
    """The certificate of ``results`` (``cannot``: why the run stopped before the end)."""
    root, source, components = run.root, run.source, run.components
    metrics = [m for r in results for m in r.metrics]
    paths = [p for r in results for p in r.load_paths]
    failures = [e for r in results for e in r.errors] + metric_failures(metrics)
    failures += failure_lines(paths)  # the plain default load decides too
    if cannot is not None:
        failures = [*_cannot_validate_lines(cannot), *failures]
    records = {c.record.target for c in components} - {None}
    compute = {c.record.compute_dtype for c in components} - {None}
    notes = [r.record.inputs["skipped"] for r in results if "skipped" in r.record.inputs]
    notes += [note for r in results for note in r.notes]
    for r in results:  # a tokenizer that could not be used: its token probes are seeded ids
        tokenizer = r.record.inputs.get("tokenizer") or {}
        if tokenizer.get("usable") is False:
            notes.append(
                f"{r.record.name}: {tokenizer['note']}" if r.record.name else tokenizer["note"]
            )
    if source.kind == SELF_BASELINE:
        notes.append(
            "a smoke check, not a certification: the baseline is the converted weights "
            "upcast to fp32, so overflow and compute precision are measured but the rounding "
            "of the weights is not; certify with --baseline SOURCE"
        )
    passed = not failures and metrics
    certificate = Certificate(
        verdict=(PASS if source.kind == SOURCE_BASELINE else SMOKE_PASS) if passed else FAIL,
        target=next(iter(records)) if len(records) == 1 else ",".join(sorted(records)) or None,
        compute_dtype=next(iter(compute))
        if len(compute) == 1
        else ",".join(sorted(compute)) or None,
        source={
            "id": source.id,
            "revision": source.revision,
            "path": source.id,
            "files": run.weights,
            "card": source_card_data(source.path),
            # A --variant output: its files are added to the source repo under this variant.
            "variant": next((c.converted.variant for c in components if c.converted.variant), None),
        },
        baseline={"dtype": "float32", "kind": source.kind},
        device=_device_record(run.device, run.max_memory, {r.record.mode for r in results}),
        versions=_versions(),
        components=[r.record for r in results],
        metrics=metrics,
        failures=failures,
        files=hash_files(root),
        notes=notes,
        tool={"name": "precision-convert", "version": __version__},
        load_paths=paths,
    )
    return without_local_paths(certificate, {root: ".", source.path: source.id})


def _not_run(
    opened: ModelSource | PipelineSource,
    components: list[Component],
    results: list[ComponentResult],
) -> list[ComponentResult]:
    """Records of what validation never reached, for the certificate of a run that stopped."""
    done = {r.record.name for r in results}
    missing = [
        ComponentRecord(
            name=c.name,
            class_name=c.converted.class_name,
            library=c.converted.library,
            task="unknown",
            mode="not-run",
            recipe=c.record.recipe,
            plan_sha256=c.record.plan_sha256,
        )
        for c in components
        if c.name not in done
    ]
    if isinstance(opened, PipelineSource) and "pipeline" not in done:
        missing.append(
            ComponentRecord(
                name="pipeline",
                class_name=opened.model_index.get("_class_name"),
                library="diffusers",
                task="pipeline",
                mode="not-run",
            )
        )
    return [ComponentResult(record, [], []) for record in missing]


def _cannot_validate_lines(exc: CannotValidateError) -> list[str]:
    """Why validation could not run, and how to give it what it needs."""
    how = (
        "validation could not run, so nothing was compared; to certify, give it what is "
        "missing: `precision-convert validate DIR --baseline SOURCE --inputs FILE`, FILE a "
        "safetensors file of named tensors, one per argument the model's forward needs "
        "(for a pipeline: `<component>/<argument>`)"
    )
    if "trust-remote-code" in str(exc):
        how += ", or trust the model's own code (--trust-remote-code) so it can be built"
    return [str(exc), how]


#: Fields of the source's own model card that a converted copy inherits (Hub metadata).
INHERITED_CARD_FIELDS = ("license", "pipeline_tag", "library_name")


def source_card_data(path: Path) -> dict[str, Any]:
    """The source card's license, pipeline tag and library, kept in the certificate so the
    converted card stays a pure function of it. Empty when the source has no readable card."""
    card = path / "README.md"
    if not card.is_file():
        return {}
    from huggingface_hub import ModelCard

    try:
        data = ModelCard.load(card).data.to_dict()
    except (OSError, ValueError, TypeError):
        return {}
    return {k: data[k] for k in INHERITED_CARD_FIELDS if isinstance(data.get(k), str)}
