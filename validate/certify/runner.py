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
(:class:`~precision_convert.core.errors.CannotValidateError`) still gets a failing certificate that
says what is missing, and the error is raised as before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from precision_convert.conversion.io.finite import SourceRead
from precision_convert.conversion.io.source import (
    ModelSource,
    PipelineSource,
    Source,
    open_source,
)
from precision_convert.conversion.io.staging import TargetLock, check_apart, real_path
from precision_convert.conversion.plan import PlanRecord
from precision_convert.conversion.runtime.devices import resolve_device
from precision_convert.conversion.runtime.loader import read_record
from precision_convert.core.errors import CannotValidateError, InputError
from precision_convert.core.names import validate_pattern
from precision_convert.core.progress import forecasting, stage
from precision_convert.core.quiet import quiet_libraries
from precision_convert.validation.certify.assembly import _certificate, _not_run, _Run
from precision_convert.validation.certify.blockwise import validate_blockwise
from precision_convert.validation.certify.card import render_card
from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    SELF_BASELINE,
    SOURCE_BASELINE,
    Certificate,
    write,
)
from precision_convert.validation.certify.components import (
    Component,
    ComponentResult,
)
from precision_convert.validation.certify.load_paths import blockwise_paths
from precision_convert.validation.certify.pipeline import _validate_pipeline
from precision_convert.validation.certify.reference import (
    SourceInfo,
    check_replaceable,
    check_same_architecture,
    models_of,
    read_baseline,
    same_conversion,
    source_info,
)
from precision_convert.validation.certify.whole import _validate_whole
from precision_convert.validation.probe.inputs.budgets import (
    DEFAULT_LEVEL,
    budget_for,
    budget_seconds,
)
from precision_convert.validation.probe.inputs.preflight import check_user_inputs
from precision_convert.validation.probe.inputs.sweep import SweepSettings
from precision_convert.validation.probe.inputs.userdata import (
    CalibrationData,
    read_calibration_data,
)
from precision_convert.validation.probe.run.execute import (
    outputs_on_disk,
)
from precision_convert.validation.probe.run.parity import thresholds_for
from precision_convert.validation.probe.run.session import (
    PriorRuns,
)

__all__ = ["parse_memory", "thresholds_for", "validate"]

#: Whole-model validation needs the fp32 weights plus activations, allocator slack and the
#: outputs kept for comparison; past this share of the budget the model goes block by block.
WHOLE_MODEL_HEADROOM = 1.25


# --------------------------------------------------------------------------- public entry


@stage("validation")
@quiet_libraries()
def validate(
    converted: str | Path,
    baseline: str | Path | None = None,
    device: str | torch.device | None = None,
    *,
    inputs: str | Path | Mapping[str, torch.Tensor] | None = None,
    max_memory: str | int | None = None,
    coverage: str = DEFAULT_LEVEL,
    calibration_data: str | Path | CalibrationData | None = None,
    budget: str | float | None = None,
    trust_remote_code: bool = False,
    allow_nonfinite_source: bool = False,
    allow_unexercised: Sequence[str] = (),
    prior: Mapping[str, PriorRuns] | None = None,
    source_read: SourceRead | None = None,
    locked: bool = False,
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
            :data:`~precision_convert.validation.probe.inputs.budgets.BUDGETS`.
        calibration_data: a file of text lines or JSONL model inputs whose probes are added
            to the sweep (see :mod:`~precision_convert.validation.probe.inputs.userdata`).
        budget: the certificate's time budget, a duration (``"10m"``, ``"1h30m"``) or
            seconds: the probes ordered by what each kind has caught, those it cannot afford
            are not run and are listed in ``not_covered`` (see
            :mod:`~precision_convert.validation.probe.run.time_budget`).
        trust_remote_code: let a model that ships its own code (``auto_map``) run it, for the
            baseline, ``pc.load`` and the library's loads alike. Off: such a model cannot be
            validated (the certificate says so).
        allow_nonfinite_source: go on when the baseline's own weights hold NaN or ±inf
            (beyond masks stored as ±inf by design); the verdict is then ``fail``, and the
            certificate names the tensors. Off: such a baseline is refused.
        allow_unexercised: module patterns (``COMPONENT/MODULE`` in a pipeline; each covers
            the module's descendants) that no probe may run: recorded as not covered
            (``not_covered``, the card's first lines) instead of failing the certificate.
        prior: by component name, what the conversion that wrote ``converted`` already ran
            (``convert`` passes its calibration's): its fp32 sweep stands in for the baseline
            when it was made from the same source with the same probes on the same device, and
            its last candidate's outputs for ``pc.load``'s when the output's weight files are
            byte for byte that candidate's.
        source_read: the baseline's weight files as ``convert`` already read them (digests
            and non-finite tensors), so they are not read twice; read here otherwise.
        locked: hold the output's lock (the one every writer of an output takes) from the end
            of the checks until the certificate is written, so no other run replaces
            ``converted`` meanwhile; the command asks for it, ``convert`` holds its own.

    Returns:
        The :class:`Certificate` (also written to ``precision_certificate.json``).

    Raises:
        InputError: ``converted`` or ``baseline`` is not a usable directory; a baseline of
            another architecture; a certificate in ``converted`` that this run would replace
            with a weaker or unrelated one (made against the source, or against another
            source); a baseline whose own weights are not finite (without
            ``allow_nonfinite_source``); an unknown coverage level; an empty module name
            in ``allow_unexercised``; unreadable or malformed
            calibration data; a bad ``budget``, or one below the smallest certificate of
            the model (before the sweep runs, nothing written).
        CannotValidateError: no inputs could be built for a model; pass ``inputs``. A failing
            certificate and card saying so are written first.
    """
    root = Path(converted)
    if not root.is_dir():
        raise InputError("no such directory: validate takes a converted model directory", root)
    budget_for(coverage)  # an unknown level fails before anything runs
    seconds = budget_seconds(budget)
    data = _calibration_data(calibration_data)
    allowed = _allowed_modules(allow_unexercised)
    run = _set_up(
        root, baseline, device, inputs, max_memory, data, trust_remote_code,
        _Baseline(allow_nonfinite_source, source_read), allowed,
    )  # fmt: skip
    # Taken only once everything that can be refused was (a refused run touches nothing, not
    # even the folder the lock file would go in).
    lock: AbstractContextManager[object] = TargetLock(real_path(root)) if locked else nullcontext()
    with lock:
        results: list[ComponentResult] = []
        try:
            _validate_all(run, SweepSettings(coverage, data, seconds), prior or {}, results)
        except CannotValidateError as exc:
            # Nothing is left half-explained: the output still gets a failing certificate and
            # card that say what is missing and how to supply it; the error still reaches the
            # caller.
            results += _not_run(run.opened, run.components, results)
            _write_certificate(run, results, cannot=exc)
            raise
        return _write_certificate(run, results)


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
    given: _Baseline,
    allowed: Mapping[str, tuple[str, ...]],
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
    # Read once: hashed for the certificate, and refused here when its weights are broken.
    if source.kind == SELF_BASELINE:
        # The converted weights are no source: what they got wrong is what the check finds.
        read = replace(read_baseline(source.path, reference), nonfinite={})
    else:
        read = given.read or read_baseline(source.path, reference)
        read.refuse_broken(source.path, given.allow_nonfinite)
    check_replaceable(root, source, read.files)
    target_device = resolve_device(device)
    budget = parse_memory(max_memory) if max_memory is not None else available_memory(target_device)
    supplied = read_inputs(inputs)
    check_user_inputs(  # what the model cannot take: refused before anything runs
        opened, data=data, inputs=supplied, trust_remote_code=trust_remote_code,
        inputs_path=inputs if isinstance(inputs, str | Path) else None,
    )  # fmt: skip
    components = _components(opened, source, trust_remote_code, allowed)
    return _Run(
        root, opened, source, read, reference, target_device, budget, max_memory, supplied,
        components,
    )  # fmt: skip


@dataclass(frozen=True)
class _Baseline:
    """What the caller says of the baseline's weights: whether broken ones may go on, and
    their read when it was done already."""

    allow_nonfinite: bool
    read: SourceRead | None


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
            budget = budget_for(sweep_for.level)
            results.append(_validate_pipeline(run.opened, run.source, results, run.device, budget))


def _write_certificate(
    run: _Run, results: list[ComponentResult], *, cannot: CannotValidateError | None = None
) -> Certificate:
    """:func:`_certificate`, written with its card into the converted directory."""
    certificate = _certificate(run, results, cannot=cannot)
    write(certificate, run.root, {CARD_NAME: render_card(certificate, run.root)})
    return certificate


# --------------------------------------------------------------------------- setup


def _library_bars_off(opened: Source) -> AbstractContextManager[None]:
    """diffusers' own loading bars off too while a diffusers model or pipeline is validated
    (their switch costs diffusers' import, which nothing else here needs)."""
    uses = any(m.library == "diffusers" for m in models_of(opened).values())
    if uses or isinstance(opened, PipelineSource):
        return quiet_libraries("diffusers")
    return nullcontext()


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


def _allowed_modules(patterns: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``--allow-unexercised`` patterns by component (``COMPONENT/MODULE``; a bare pattern
    is every component's, under the key ``*``), each checked to be a module name."""
    found: dict[str, list[str]] = {}
    for given in patterns:
        component, _, pattern = given.rpartition("/")
        try:
            validate_pattern(pattern)
        except ValueError as exc:
            raise InputError(f"--allow-unexercised {given!r}: {exc}") from None
        found.setdefault(component or "*", []).append(pattern)
    return {k: tuple(v) for k, v in found.items()}


def _components(
    opened: ModelSource | PipelineSource,
    source: SourceInfo,
    trust_remote_code: bool,
    allowed: Mapping[str, tuple[str, ...]],
) -> list[Component]:
    if isinstance(opened, PipelineSource):
        found = list(opened.components.items())
    else:
        found = [("", opened)]
    components = []
    for name, model in found:
        baseline_dir = source.path / name if name else source.path
        record = read_record(model) or PlanRecord()
        mine = (*allowed.get("*", ()), *allowed.get(name, ()))
        components.append(
            Component(name, model, baseline_dir, record, trust_remote_code, tuple(mine))
        )
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
