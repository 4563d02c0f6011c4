"""``inspect``: what a checkpoint really holds, and what would go wrong in low precision.

Dtypes come from the tensor headers, never from ``config.json``. Hazards are what breaks a
low-precision copy before it runs: a module whose parameters disagree in dtype (CogVLM's fp16
weight + fp32 bias), weights beyond fp16's range, weights that fp16 would flush to zero,
NaN/Inf weights.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.conversion.analysis.norms import normalization_modules, tied_tensors
from precision_convert.conversion.analysis.runtime_names import runtime_modules
from precision_convert.conversion.io.source import ModelSource, PipelineSource, open_source, resolve
from precision_convert.conversion.plan import PlanRecord, RangeStats, build_plan, scan_ranges
from precision_convert.conversion.runtime.record import read_record, record_mismatch
from precision_convert.core.dtypes import (
    FP32,
    SAFE_TARGETS,
    WATCHED_RANGE,
    Target,
    from_config_string,
)
from precision_convert.core.errors import InputError, one_line
from precision_convert.core.names import units
from precision_convert.core.quiet import quiet_libraries
from precision_convert.recipes import match as match_recipe

if TYPE_CHECKING:
    from precision_convert.validation.calibration.plans import Calibration


@dataclass(frozen=True)
class Hazard:
    # "mixed-dtype", "fp16-overflow", "fp16-flush", "non-finite", "config-dtype", "record"
    kind: str
    name: str
    detail: str


@dataclass(frozen=True)
class ModuleRow:
    name: str
    dtypes: tuple[str, ...]
    parameters: int


@dataclass
class ComponentReport:
    component: str
    library: str
    class_name: str | None
    model_type: str | None
    recipe: str
    parameters_by_dtype: dict[str, int]
    modules: list[ModuleRow]
    hazards: list[Hazard]
    islands: dict[str, dict[str, str]] = field(default_factory=dict)  # target -> name -> reason
    # Other names of stored tensors (a tied head's weight) -> the stored name.
    tied: dict[str, str] = field(default_factory=dict)
    # The precision_convert record of a converted model, as written (None: not converted).
    record: dict[str, Any] | None = None
    calibration: Calibration | None = None
    chart: Path | None = None

    def nearest_to_limit(self, count: int = 20, within: float = 8.0) -> list[dict[str, Any]]:
        """Calibrated modules whose peak activation is within ``within``x of the watched
        range's limit (fp16's) or over it, worst first, at most ``count``."""
        if self.calibration is None:
            return []
        fp16_islands = self.islands.get(Target.FP16_SAFE, {})
        weighted = {m.name for m in self.modules}  # containers repeat their children's peaks
        stats = [
            s
            for s in self.calibration.stats.values()
            if s.module in weighted and s.headroom() < within
        ]
        rows = sorted(stats, key=lambda s: s.headroom())[:count]
        return [
            {
                "module": s.module,
                "max_abs": max(s.max_in, s.max_out),
                "max_in": s.max_in,
                "max_out": s.max_out,
                "fp16_headroom": s.headroom(),
                "flushed_out": s.flushed_out,
                "island": fp16_islands.get(s.module),
            }
            for s in rows
        ]

    def to_json(self) -> dict[str, Any]:
        calibration = None
        if self.calibration is not None:
            calibration = {
                "task": self.calibration.task,
                "fp16_limit": WATCHED_RANGE.finite_max,
                "modules": self.nearest_to_limit(),
                # Every output (containers, functional products) that came near the limit.
                "near_limit": [w.to_json() for w in self.calibration.near_limit],
                "chart": str(self.chart) if self.chart else None,
                "warnings": list(self.calibration.warnings),
            }
        return {
            "component": self.component,
            "library": self.library,
            "class_name": self.class_name,
            "model_type": self.model_type,
            "recipe": self.recipe,
            "parameters_by_dtype": self.parameters_by_dtype,
            "modules": [
                {"name": m.name, "dtypes": list(m.dtypes), "parameters": m.parameters}
                for m in self.modules
            ],
            "hazards": [{"kind": h.kind, "name": h.name, "detail": h.detail} for h in self.hazards],
            "islands": self.islands,
            "tied": self.tied,
            "record": self.record,
            "calibration": calibration,
        }


#: ``inspect --json``'s format, documented in docs/json-schema.md; bumped when a field changes
#: meaning, so scripts can refuse what they do not understand.
SCHEMA = "precision-convert/inspect/1"


@dataclass
class InspectReport:
    source: str
    components: list[ComponentReport]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "source": self.source,
            "components": [c.to_json() for c in self.components],
        }


@quiet_libraries()
def inspect_source(
    source: str | Path,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    calibrate: bool = False,
    chart: str | Path | None = None,
    coverage: str | None = None,
    calibration_data: str | Path | None = None,
) -> InspectReport:
    """Read headers and weights of ``source`` and report dtypes, hazards and planned islands.

    With ``calibrate`` the model also runs once in fp32: the report lists the modules nearest
    to fp16's limit, the fp16-safe islands include what the activations need, and a chart is
    drawn to ``chart`` (default ``./<source-name>-activations.png``; one per pipeline
    component, suffixed with its name).
    """
    from precision_convert.api.conversion import read_user_data

    probes = _Probes(coverage, read_user_data(calibration_data, coverage))
    opened = open_source(resolve(source, revision))
    models = dict(opened.components) if isinstance(opened, PipelineSource) else {"": opened}
    base = Path(chart) if chart else Path.cwd() / f"{Path(str(source)).name}-activations.png"
    return InspectReport(
        str(source),
        [
            _inspect_model(
                name,
                model,
                trust_remote_code,
                chart=(base.with_stem(f"{base.stem}-{name}") if name else base)
                if calibrate
                else None,
                probes=probes,
            )
            for name, model in models.items()
        ],
    )


def _calibrate(
    report: ComponentReport,
    model: ModelSource,
    chart: Path,
    trust_remote_code: bool,
    norms: set[str],
    ranges: dict[str, RangeStats],
    probes: _Probes,
) -> None:
    """Run the fp16-safe calibration (no search) and draw its chart; reuses the norms and
    weight ranges the report already found."""
    from precision_convert.api.conversion import plan_model
    from precision_convert.conversion.analysis.chart import activation_chart

    plan, calibration = plan_model(
        model,
        Target.FP16_SAFE,
        calibrate=True,
        search=False,
        trust_remote_code=trust_remote_code,
        normalization=norms,
        ranges=ranges,
        coverage=probes.coverage,
        calibration_data=probes.data,
        component=report.component,
    )
    report.islands[Target.FP16_SAFE] = {i.name: i.reason for i in plan.islands}
    report.calibration = calibration
    if calibration is not None:
        units = list(dict.fromkeys(t.unit for t in plan.tensors if t.source.is_float))
        title = f"{report.component or report.class_name}: peak |activation| per module"
        report.chart = activation_chart(
            calibration.stats, units, report.islands[Target.FP16_SAFE], chart, title
        )


@dataclass(frozen=True)
class _Probes:
    """What calibration feeds the model: the coverage level and the user's extra inputs."""

    coverage: str | None
    data: Any | None  # CalibrationData


def _inspect_model(
    name: str, model: ModelSource, trust_remote_code: bool, chart: Path | None, probes: _Probes
) -> ComponentReport:
    """The report for one model; with ``chart``, calibrated and charted there too."""
    tensors = list(model.tensors())
    unit_of = units(t.name for t in tensors)
    by_dtype: Counter[str] = Counter()
    rows: dict[str, tuple[set[str], int]] = defaultdict(lambda: (set(), 0))
    for t in tensors:
        count = math.prod(t.shape)
        by_dtype[t.dtype.short] += count
        dtypes, params = rows[unit_of[t.name]]
        dtypes.add(t.dtype.short)
        rows[unit_of[t.name]] = (dtypes, params + count)
    modules = [ModuleRow(u, tuple(sorted(d)), p) for u, (d, p) in rows.items()]
    hazards = _mixed_dtype_hazards(tensors, unit_of)
    ranges = scan_ranges(tensors)
    hazards += _range_hazards(ranges)
    try:
        record = read_record(model)
    except InputError as exc:  # pc.load would refuse it: a hazard, not a reason to stop
        record = None
        hazards.append(Hazard("record", model.config_name, one_line(exc)))
    mismatch = record_mismatch(record, tensors) if record is not None else None
    if mismatch is not None:
        hazards.append(Hazard("record", model.config_name, mismatch))
    if not _recorded_map(record if mismatch is None else None, by_dtype):
        hazards += _config_dtype_hazard(model, by_dtype)
    recipe = match_recipe(model.library, model.class_name, model.model_type)
    norms = normalization_modules(model, trust_remote_code=trust_remote_code)
    runtime = runtime_modules(model, trust_remote_code=trust_remote_code)  # fused experts
    tied = tied_tensors(model, trust_remote_code=trust_remote_code)
    islands = {
        target: {
            i.name: i.reason
            for i in build_plan(
                tensors,
                target=target,
                recipe=recipe,
                normalization=norms,
                ranges=ranges,
                tied=tied,
                runtime=runtime,
            ).islands
        }
        for target in SAFE_TARGETS
    }
    report = ComponentReport(
        name,
        model.library,
        model.class_name,
        model.model_type,
        recipe.name,
        dict(by_dtype),
        modules,
        hazards,
        islands,
        tied,
        record.to_dict() if record is not None else None,
    )
    if chart is not None:
        _calibrate(report, model, chart, trust_remote_code, norms, ranges, probes)
    return report


def _mixed_dtype_hazards(tensors: list[Any], unit_of: dict[str, str]) -> list[Hazard]:
    per_unit: dict[str, dict[str, str]] = defaultdict(dict)
    for t in tensors:
        if t.dtype.is_float:
            per_unit[unit_of[t.name]][t.name.rpartition(".")[2]] = t.dtype.short
    return [
        Hazard(
            "mixed-dtype",
            unit,
            "parameters disagree in dtype ("
            + ", ".join(f"{k} {v}" for k, v in sorted(params.items()))
            + "): 'Input type and bias type should be the same' at run time",
        )
        for unit, params in per_unit.items()
        if len(set(params.values())) > 1
    ]


def _range_hazards(ranges: dict[str, RangeStats]) -> list[Hazard]:
    hazards: list[Hazard] = []
    for name, stats in ranges.items():
        if stats.non_finite:
            hazards.append(Hazard("non-finite", name, f"{stats.non_finite} NaN/Inf values"))
        if stats.overflows(WATCHED_RANGE):
            hazards.append(
                Hazard(
                    "fp16-overflow",
                    name,
                    f"max |x| = {stats.max_abs:.4g} exceeds {WATCHED_RANGE.finite_max:g}",
                )
            )
        if stats.flushes:
            hazards.append(
                Hazard(
                    "fp16-flush",
                    name,
                    f"{stats.flushed_fraction:.0%} of non-zero values flush to zero in fp16",
                )
            )
    return hazards


def _recorded_map(record: PlanRecord | None, by_dtype: Counter[str]) -> bool:
    """Whether the weights' dtypes are the map a ``precision_convert`` record (one they hold)
    explains: its compute dtype and its fp32 islands. The config of such an output declares
    one dtype for a mixed map by design (the compute dtype, or float32 where flowing islands
    need it), which is no hazard."""
    compute = record.compute if record is not None else None
    floats = {d for d in by_dtype if d.startswith(("fp", "bf"))}
    return compute is not None and floats <= {compute.short, FP32.short}


def _config_dtype_hazard(model: ModelSource, by_dtype: Counter[str]) -> list[Hazard]:
    declared = model.config.get("dtype") or model.config.get("torch_dtype")
    parsed = from_config_string(declared) if isinstance(declared, str) else None
    floats = {d for d in by_dtype if d.startswith(("fp", "bf"))}
    if parsed is None or not floats or floats == {parsed.short}:
        return []
    return [
        Hazard(
            "config-dtype",
            model.config_name,
            f"config declares {declared} but the weights are {', '.join(sorted(floats))}",
        )
    ]
