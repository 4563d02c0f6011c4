"""``convert()``: source → inspect → plan → write (streaming, atomic) → validate.

Every input check happens before the staging directory is created, so bad input leaves no
trace; the output path only ever receives a complete, fsynced directory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.api.options import ConversionOptions, OptionKeywords
from precision_convert.conversion.analysis.norms import normalization_modules, tied_tensors
from precision_convert.conversion.analysis.runtime_names import runtime_modules
from precision_convert.conversion.io.context import IOContext
from precision_convert.conversion.io.finite import Observer, SourceRead, SourceWatch
from precision_convert.conversion.io.source import (
    ModelSource,
    PipelineSource,
    Source,
    open_source,
    resolve,
)
from precision_convert.conversion.io.staging import StagedOutput
from precision_convert.conversion.io.tensors import BufferPool, PooledTensor
from precision_convert.conversion.output import NEVER_COPY, ProgressHook, copy_entry, write_model
from precision_convert.conversion.plan import (
    Island,
    ModelPlan,
    RangeScan,
    RangeStats,
    build_plan,
    check_target,
    range_warnings,
    scan_ranges,
)
from precision_convert.core.dtypes import IslandChoice, Target
from precision_convert.core.errors import CannotValidateError, InputError
from precision_convert.core.patterns import VARIANT_NAME
from precision_convert.core.quiet import quiet_libraries
from precision_convert.recipes import Recipe
from precision_convert.recipes import get as get_recipe
from precision_convert.recipes import match as match_recipe

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from precision_convert.validation.calibration.plans import Calibration
    from precision_convert.validation.certify.certificate import Certificate
    from precision_convert.validation.probe.inputs.userdata import CalibrationData
    from precision_convert.validation.probe.run.session import PriorRuns


@dataclass(frozen=True)
class ConvertedComponent:
    """What happened to one model (the model itself, or one pipeline component)."""

    name: str  # "" for a single model, the component folder for pipelines
    library: str
    class_name: str | None
    plan: ModelPlan
    calibration: Calibration | None = None

    def summary(self) -> dict[str, Any]:
        calibration = self.calibration
        kept = self.plan.island_parameters
        return {
            "component": self.name,
            "library": self.library,
            "class_name": self.class_name,
            "recipe": self.plan.recipe,
            "fp32_modules": len(self.plan.islands),
            "fp32_share": round(self.plan.fp32_share, 6),
            "fp32_parameters": sum(kept.values()),
            "fp32_bytes": 4 * sum(kept.values()),
            "islands": {
                i.name: {"reason": i.reason, "rule": i.rule, "parameters": kept[i.name]}
                for i in self.plan.islands
            },
            "warnings": list(self.plan.warnings),
            "plan_sha256": self.plan.sha256,
            "calibration": None
            if calibration is None
            else {
                "task": calibration.task,
                "islands_added": len(calibration.islands),
                "search_evaluations": calibration.evaluations,
                "candidate_matched_fp32": calibration.passed,
                "near_limit": [w.to_json() for w in calibration.near_limit],
            },
        }


#: ``model --json``'s format, in docs/json-schema.md (bumped when a field changes meaning).
RESULT_SCHEMA = "precision-convert/conversion/1"


@dataclass
class ConversionResult:
    source: str
    output: Path
    target: Target
    components: list[ConvertedComponent]
    files: list[str] = field(default_factory=list)
    certificate: Any | None = None  # a validate.certificate.Certificate when validation ran

    @property
    def passed(self) -> bool | None:
        return None if self.certificate is None else self.certificate.verdict == "pass"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": RESULT_SCHEMA,
            "source": self.source,
            "output": str(self.output),
            "target": self.target,
            "components": [c.summary() for c in self.components],
            "files": self.files,
            "validated": self.certificate is not None,
        }
        if self.certificate is not None:
            out["verdict"] = self.certificate.verdict
            if self.certificate.not_covered:  # what the verdict leaves out (--budget, ...)
                out["not_covered"] = self.certificate.not_covered
        return out


def default_output(source: str | Path, target: str) -> Path:
    """``./<source-name>-<target>`` in the working directory."""
    name = Path(str(source).rstrip("/")).name or "model"
    return Path.cwd() / f"{name}-{target}"


def plan_model(
    model: ModelSource,
    target: str,
    *,
    recipe: str | Recipe | None = None,
    keep_fp32: Sequence[str] = (),
    trust_remote_code: bool = False,
    calibrate: bool = False,
    search: bool = True,
    normalization: Iterable[str] | None = None,
    ranges: Mapping[str, RangeStats] | None = None,
    pool: BufferPool | None = None,
    coverage: str | None = None,
    calibration_data: str | Path | CalibrationData | None = None,
    component: str = "",
    budget: float | None = None,
) -> tuple[ModelPlan, Calibration | None]:
    """The dtype plan for one model, reading weight data only where fp16 ranges matter.

    ``normalization`` and ``ranges`` are the skeleton's norm modules and the weights' fp16
    ranges, for a caller that already has them (``inspect``); otherwise they are found here,
    reading through ``pool``'s buffers when one is given (a run's ``IOContext.reads``).

    With ``calibrate`` (``-safe`` targets), the model also runs in fp32 on seeded inputs and
    the plan gains the islands its activations need (see :mod:`.calibration`); ``search``
    also checks the fp16 candidate against fp32 and bisects for what is missing. A model that
    cannot be built or fed keeps the recipe's plan, with a warning saying so.
    """
    chosen = (
        recipe
        if isinstance(recipe, Recipe)
        else get_recipe(recipe)
        if recipe
        else match_recipe(model.library, model.class_name, model.model_type)
    )
    decoded = check_target(target)
    tensors = list(model.tensors())
    if normalization is not None:
        norms = set(normalization)
    elif decoded.safe and chosen.keep_normalization:
        norms = normalization_modules(model, trust_remote_code=trust_remote_code)
    else:
        norms = set()
    if ranges is None and decoded.range_limited:
        ranges = scan_ranges(tensors if pool is None else [PooledTensor(t, pool) for t in tensors])
    # Names that only a module sharing a stored one's weights answers to (a tied lm_head):
    # what a pattern may name, what follows an island, and what the record lists as tied.
    tied = tied_tensors(model, trust_remote_code=trust_remote_code)
    # The modules the model runs where they differ from the stored ones (fused MoE experts):
    # what a pattern may name, and what islands must cover whole.
    runtime = (
        runtime_modules(model, trust_remote_code=trust_remote_code)
        if keep_fp32 or decoded.safe
        else {}
    )

    def plan_with(extra: Iterable[Island]) -> ModelPlan:
        return build_plan(
            tensors,
            target=decoded,
            recipe=chosen,
            normalization=norms,
            keep_fp32=keep_fp32,
            ranges=ranges,
            extra_islands=extra,
            tied=tied,
            runtime=runtime,
        )

    if not (calibrate and decoded.safe):
        return plan_with(()), None
    from precision_convert.core.progress import forecasting
    from precision_convert.validation.calibration.plans import calibrated_plan
    from precision_convert.validation.probe.inputs.budgets import DEFAULT_LEVEL

    level = coverage or DEFAULT_LEVEL
    cheaper = "--coverage quick runs fewer probes" if level != "quick" else ""
    try:
        with forecasting("calibration", cheaper):
            return calibrated_plan(
                model,
                decoded,
                plan_with,
                search=search,
                trust_remote_code=trust_remote_code,
                coverage=level,
                calibration_data=calibration_data,
                component=component,
                budget=budget,
            )
    except CannotValidateError as exc:
        plan = plan_with(())
        return replace(plan, warnings=(*plan.warnings, f"not calibrated: {exc}")), None


def convert(
    source: str | Path,
    to: str = "bf16-safe",
    output: str | Path | None = None,
    validate: bool = True,
    device: str | None = None,
    *,
    options: ConversionOptions | None = None,
    overwrite: bool = False,
    on_progress: ProgressHook | None = None,
    hub_timeout: float | None = None,
    **keywords: Unpack[OptionKeywords],
) -> ConversionResult:
    """Convert ``source`` to target ``to`` and (by default) certify it against fp32.

    Args:
        source: a model/pipeline/OpenCLIP directory or a Hub repo id.
        to: ``bf16-safe``, ``fp16-safe``, ``bf16`` or ``fp16``.
        output: output directory; default ``./<source-name>-<to>``.
        validate: run the validation stage and write ``precision_certificate.json``.
        options: every other choice of the conversion in one
            :class:`~precision_convert.api.options.ConversionOptions`; or pass them as
            keywords of the same names (``device``, ``revision``, ``recipe``, ``keep_fp32``,
            ``calibrate``, ``trust_remote_code``, ``coverage``, ``calibration_data``,
            ``inputs``, ``variant``, ``allow_nonfinite_source``, each described there). A
            field given both ways must have the same value in both (an :class:`InputError`
            otherwise).
        overwrite: replace an output directory this tool wrote before (or an empty one).
        on_progress: called with (what is being written, source bytes just consumed).
        hub_timeout: seconds a Hub download may wait for metadata (see
            :func:`~precision_convert.conversion.io.source.resolve`); default: the
            huggingface_hub settings.

    The call changes no process-wide state (torch's thread count, matplotlib's backend,
    huggingface_hub's client, loggers), and the threads and buffers it uses are its own: it
    can run in several threads of one process at once.

    Returns:
        A :class:`ConversionResult`; ``result.passed`` is the certificate's verdict.
    """
    given: dict[str, Any] = {"device": device} if device is not None else {}
    chosen = ConversionOptions.given(options, **given, **keywords)
    run = _Run(validate, overwrite, on_progress, hub_timeout)
    return _convert(source, check_target(to), output, chosen, run)


@dataclass(frozen=True)
class _Run:
    """How one call runs, beside what it converts: which stages, and who hears of progress."""

    validate: bool
    overwrite: bool
    on_progress: ProgressHook | None
    hub_timeout: float | None


@quiet_libraries()
def _convert(
    source: str | Path,
    target: Target,
    output: str | Path | None,
    options: ConversionOptions,
    run: _Run,
) -> ConversionResult:
    """:func:`convert`, its options gathered: every input checked before the staging
    directory is made, then plan, write and (with ``run.validate``) certify there."""
    check_variant(options.variant)
    budget_seconds(options.budget)  # a bad --budget: refused before any work
    data = read_user_data(options.calibration_data, options.coverage)
    supplied = None
    if run.validate and options.inputs is not None:  # bad --inputs: refused before any writing
        from precision_convert.validation.certify.runner import read_inputs

        supplied = read_inputs(options.inputs)
    root = resolve(source, options.revision, timeout=run.hub_timeout)
    opened = open_source(root)
    check_not_converted(opened, source)
    target_dir = Path(output) if output is not None else default_output(source, target)
    staged = StagedOutput(target_dir, overwrite=run.overwrite, sources=(root,))
    staged.check()
    if data is not None or supplied is not None:
        from precision_convert.validation.probe.inputs.preflight import check_user_inputs

        check_user_inputs(
            opened, data=data, inputs=supplied, inputs_path=options.inputs,
            trust_remote_code=options.trust_remote_code, warn_of_cuts=not run.validate,
        )  # fmt: skip
    models = _models(opened)
    if options.variant is not None and any(m.library == "open_clip" for m in models.values()):
        raise InputError("OpenCLIP has no variant weight files: drop --variant", root)
    if options.calibrate is None:  # on where the target's row measures its islands' range
        measured = target.row.islands is IslandChoice.RECIPE_PLUS_MEASURED_RANGE
        options = replace(options, calibrate=measured)
    # The source's weights, read once: hashed for the certificate (when one is made), and
    # refused when they hold NaN or ±inf. The writer's reads are that read, but calibration
    # runs the model on the weights before anything is written, and a pickle's tensors are
    # in memory already: those are read now, before anything is planned.
    # A plain fp16 target stores every floating tensor in fp16 whatever its range: the ranges
    # only warn, so they are measured on the writer's read too, not on a read of their own.
    scan = RangeScan() if target.range_limited and not target.safe else None
    watch = SourceWatch(
        root,
        models,
        allow_nonfinite=options.allow_nonfinite_source,
        hashed=run.validate,
        observe=None if scan is None else _by_component(scan),
    )
    watch.read_ahead(everything=bool(options.calibrate) and target.safe)
    # Validated in the staging directory and renamed into place with its certificate, so the
    # target holds nothing or a complete, certified output, however the run is stopped.
    # Calibration's probe outputs wait on disk for validation, which reuses them.
    with staged, _probe_outputs(bool(options.calibrate) and run.validate):
        components, written = _plan_and_write(
            opened, models, staged, target, options, data, run.on_progress, watch, scan
        )
        certificate = None
        if run.validate:
            read = watch.result()
            prior = {
                c.name: c.calibration.runs
                for c in components
                if c.calibration is not None and c.calibration.runs is not None
            }
            certificate = _certify(staged, root, options, supplied, data, prior, read)
        staged.commit()
    return ConversionResult(
        source=str(source),
        output=target_dir,
        target=target,
        components=[_without_runs(c) for c in components],
        files=sorted(written),
        certificate=certificate,
    )


def _certify(
    staged: StagedOutput,
    root: Path,
    options: ConversionOptions,
    supplied: Any,
    data: CalibrationData | None,
    prior: dict[str, PriorRuns],
    read: SourceRead,
) -> Certificate:
    """Validate the staged output against ``root`` (reusing ``prior``: calibration's probe
    runs, by component, and ``read``: the source's weights as the conversion read them); a
    run that cannot validate keeps its output, with the failing certificate that says what
    is missing."""
    from precision_convert.validation.certify.runner import validate
    from precision_convert.validation.probe.inputs.budgets import DEFAULT_LEVEL

    try:
        return validate(
            staged.path,
            baseline=root,
            device=options.device,
            inputs=supplied,
            coverage=options.coverage or DEFAULT_LEVEL,
            calibration_data=data,
            budget=options.budget,
            trust_remote_code=options.trust_remote_code,
            allow_nonfinite_source=options.allow_nonfinite_source,
            allow_unexercised=options.allow_unexercised,
            prior=prior,
            source_read=read,
        )
    except CannotValidateError:
        staged.commit()
        raise


def _plan_and_write(
    opened: Source,
    models: dict[str, ModelSource],
    staged: StagedOutput,
    target: Target,
    options: ConversionOptions,
    data: CalibrationData | None,
    on_progress: ProgressHook | None,
    watch: SourceWatch,
    scan: RangeScan | None,
) -> tuple[list[ConvertedComponent], list[str]]:
    """Plan every model and write the output into the staging directory, the writer's reads
    of the source watched by ``watch`` (and, when it observes them, measured by ``scan``:
    the plans' range warnings are added once the write has read every tensor)."""
    ranges_on_write = scan is not None and watch.observe is not None
    # The run's buffers and prefetch thread: all released, the thread joined, before
    # validation (whether the conversion succeeds or fails).
    with IOContext() as io:
        # Read the weights into the page cache while planning imports torch/transformers.
        io.prefetch(t for model in models.values() for t in model.tensors())
        planned = {
            name: plan_model(
                model,
                target,
                pool=io.reads,
                component=name,
                recipe=options.recipe,
                keep_fp32=options.keep_fp32,
                trust_remote_code=options.trust_remote_code,
                calibrate=bool(options.calibrate),
                coverage=options.coverage,
                calibration_data=data,
                budget=budget_seconds(options.budget),
                ranges={} if ranges_on_write else None,
            )
            for name, model in models.items()
        }
        components = [
            ConvertedComponent(name, m.library, m.class_name, *planned[name])
            for name, m in models.items()
        ]
        try:
            written = _write(
                opened, models, components, staged.path, on_progress, io, options.variant, watch
            )
        except OSError as exc:  # disk full, permissions, a vanished source file: nothing kept
            raise InputError(f"cannot write output: {exc.strerror or exc}", staged.given) from None
    if scan is not None and ranges_on_write:
        components = [_with_range_warnings(c, models[c.name], scan, target) for c in components]
    return components, written


def _by_component(scan: RangeScan) -> Observer:
    """``scan.add`` for the chunks of every component, each tensor named by component."""

    def observe(component: str, name: str, chunk: torch.Tensor) -> None:
        scan.add(f"{component}/{name}" if component else name, chunk)

    return observe


def _with_range_warnings(
    component: ConvertedComponent, model: ModelSource, scan: RangeScan, target: Target
) -> ConvertedComponent:
    """``component`` whose plan warns of the ranges ``scan`` measured, as a plan made from
    them up front would (in the model's tensor order)."""
    measured = scan.stats()
    prefix = f"{component.name}/" if component.name else ""
    ranges = {
        t.name: measured[prefix + t.name] for t in model.tensors() if prefix + t.name in measured
    }
    warnings = (*range_warnings(ranges, target), *component.plan.warnings)
    return replace(component, plan=replace(component.plan, warnings=warnings))


def _probe_outputs(spill: bool) -> AbstractContextManager[None]:
    """Probe outputs on disk for the whole run when calibration's are kept for validation."""
    if not spill:
        return nullcontext()
    from precision_convert.validation.probe.run.execute import outputs_on_disk

    return outputs_on_disk()


def _without_runs(component: ConvertedComponent) -> ConvertedComponent:
    """``component`` without the probe runs kept for validation (their files are gone)."""
    if component.calibration is None or component.calibration.runs is None:
        return component
    return replace(component, calibration=replace(component.calibration, runs=None))


def check_variant(variant: str | None) -> None:
    """A variant name goes into file names: letters, digits and ``_`` only."""
    if variant is not None and not VARIANT_NAME.fullmatch(variant):
        raise InputError(
            f"--variant {variant!r}: a variant name is letters, digits and _ (e.g. fp16)"
        )


def check_not_converted(opened: Source, given: str | Path) -> None:
    """Refuse a source that is itself a precision-convert output (its weights or config carry
    the ``precision_convert`` record): converting it again would round already-rounded
    weights, and its certificate would compare them with themselves. The source it was made
    from is named when its certificate records one.

    Raises:
        InputError: naming ``given`` as the user wrote it (never a download or staging path).
    """
    from precision_convert.conversion.runtime.record import read_record

    converted = next(
        (record for model in _models(opened).values() if (record := read_record(model))), None
    )
    if converted is None:
        return
    from precision_convert.validation.certify.certificate import Certificate

    made_from = None
    with suppress(OSError, ValueError, TypeError, KeyError):  # no certificate, or unreadable
        made_from = Certificate.read(opened.root).source.get("id")
    origin = f"converted from {made_from}" if made_from else "its source is not recorded"
    raise InputError(
        f"is a precision-convert output ({converted.target or 'converted'}, {origin}): "
        "convert the source instead",
        given,
    )


def budget_seconds(budget: str | float | None) -> float | None:
    """``--budget`` in seconds (None: none); a bad value is an :class:`InputError`."""
    from precision_convert.validation.probe.inputs.budgets import budget_seconds as seconds

    return seconds(budget)


def read_user_data(path: str | Path | None, coverage: str | None) -> CalibrationData | None:
    """Check ``--coverage`` and read ``--calibration-data`` before any work: bad input exits
    2 with nothing written."""
    if coverage is not None:
        from precision_convert.validation.probe.inputs.budgets import budget_for

        budget_for(coverage)
    if path is None:
        return None
    from precision_convert.validation.probe.inputs.userdata import read_calibration_data

    return read_calibration_data(path)


def _models(opened: Source) -> dict[str, ModelSource]:
    if isinstance(opened, PipelineSource):
        return dict(opened.components)
    return {"": opened}


def _write(
    opened: Source,
    models: dict[str, ModelSource],
    components: list[ConvertedComponent],
    staging: Path,
    on_progress: ProgressHook | None,
    io: IOContext,
    variant: str | None,
    watch: SourceWatch,
) -> list[str]:
    written: list[str] = []
    if isinstance(opened, PipelineSource):
        for entry in sorted(opened.root.iterdir()):
            if entry.name in NEVER_COPY or entry.name in models:
                continue
            written += copy_entry(entry, staging / entry.name)
    for component in components:
        name = component.name
        out_dir = staging / name if name else staging
        out_dir.mkdir(exist_ok=True)
        files = write_model(
            models[name], component.plan, out_dir, on_progress, io=io, variant=variant,
            watch=watch,
        )  # fmt: skip
        if component.calibration is not None:
            files.append(_write_chart(component, out_dir))
        written += [f"{name}/{f}" if name else f for f in files]
    return written


def _write_chart(component: ConvertedComponent, directory: Path) -> str:
    from precision_convert.conversion.analysis.chart import CHART_NAME, activation_chart

    assert component.calibration is not None
    units = list(dict.fromkeys(t.unit for t in component.plan.tensors if t.source.is_float))
    islands = {i.name: i.reason for i in component.plan.islands}
    title = (
        f"{component.name or component.class_name}: peak |activation| per module "
        f"({component.plan.target})"
    )
    activation_chart(component.calibration.stats, units, islands, directory / CHART_NAME, title)
    return CHART_NAME
