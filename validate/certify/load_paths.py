"""Every way users load a converted checkpoint, run on the validation probes and judged.

A certificate that holds only under ``precision_convert.load`` promises little: the Hub shows
``<Class>.from_pretrained(repo)`` for transformers and diffusers repos, and that is how most
people load one. So after the candidate has been compared through ``pc.load``, the converted
files are loaded each other way a user would, one model resident at a time (each freed before
the next loads), and run on the same probes (already resolved against the fp32 baseline's
outputs) under the same thresholds:

===========  ================================================================  ==========
way          call                                                              decides
===========  ================================================================  ==========
``pc.load``  ``precision_convert.load(dir)``                                   yes
``plain``    the library's ``from_pretrained(dir)`` with default arguments     yes
             (pipelines: ``DiffusionPipeline.from_pretrained(dir)``; OpenCLIP:
             ``open_clip.create_model("local-dir:dir")``)
``auto``     ``from_pretrained(dir, dtype="auto")`` (transformers only)        no
``compute``  the compute dtype passed explicitly (``dtype=torch.float16``;      no
             OpenCLIP: ``precision="fp16"``)
===========  ================================================================  ==========

A transformers model with attention is loaded the deciding ways again under each other
attention implementation a user can pick (:mod:`~precision_convert.validation.probe.run.attention`:
``eager`` where the default is ``sdpa``, ``sdpa`` where the model supports it and defaults to
``eager``): ``pc.load`` then ``model.set_attn_implementation(...)``, and ``from_pretrained(dir,
attn_implementation=...)``, judged against the fp32 baseline run under the same
implementation. These decide too (their record names the ``attention``): eager attention turns
a fully masked row into NaN in fp16 where sdpa does not.

The certificate's verdict is ``pass`` only when every deciding way passes; the others are
recorded (and shown in the model card) so that users know what they get. A way that loads the
very same tensors in the same dtypes as one already run (transformers' default dtype *is*
``"auto"``) is not run again. Block-wise validation never loads the model whole, so there the
library's loads are "not checked".

Then the user's round trip: ``precision_convert.load(dir).save_pretrained(new)`` and ``new``
loaded again with the library's default (``resave:plain``), ``dtype="auto"``
(``resave:auto``, transformers) and ``precision_convert.load`` (``resave:pc.load``). These are
shown, never decide, and run on few probes (the layout's and the real-text one, named in each
record's detail) to keep their cost small: a save and up to three loads. A pipeline is re-saved
whole (its components through their own ``save_pretrained``), not component by component.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from precision_convert.conversion.io.source import ModelSource, PipelineSource, open_source
from precision_convert.conversion.runtime.devices import move
from precision_convert.conversion.runtime.loader import load
from precision_convert.conversion.runtime.memory import freed
from precision_convert.core.dtypes import from_torch, range_binds
from precision_convert.core.errors import InputError, one_line
from precision_convert.core.progress import ledger_span, stage
from precision_convert.validation.certify.certificate import LoadPath, failure_line
from precision_convert.validation.certify.components import Component
from precision_convert.validation.certify.load_ways import (
    PC_LOAD,
    RESAVED,
    Way,
    _input_dtype,
    _resave_ways,
    _signature,
    attention_ways,
    model_ways,
    parameter_dtypes,
    pc_load_call,
    pipeline_variant,
    pipeline_ways,
    stored_dtypes,
)
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.spots import one_key_rows_at_ends, spot_inputs
from precision_convert.validation.probe.run.execute import RUN_ERRORS, Outputs, run_probes
from precision_convert.validation.probe.run.metrics import METRICS, Measurement
from precision_convert.validation.probe.run.parity import compare_outputs

__all__ = [
    "blockwise_paths",
    "check_model",
    "check_pipeline",
    "failure_lines",
    "skipped_pipeline",
]

#: The sweep probe a re-save is checked on besides the layout's own: real text.
RESAVE_PROBE = "forward:text"
#: Failed metrics kept per way (the worst first); the count of the rest is added.
MAX_FAILURES = 5
#: Errors a load or a run through a library may raise (missing files, refused configs too).
LOAD_ERRORS = (*RUN_ERRORS, InputError, OSError, ImportError, NotImplementedError)


# --------------------------------------------------------------------------- checking


def check_model(
    component: Component,
    inputs: ModelInputs,
    baseline: Outputs,
    thresholds: dict[str, float],
    device: torch.device,
    pc_metrics: list[Measurement],
    pc_errors: list[str],
    attention: Mapping[str, Outputs] | None = None,
    shared: Mapping[str, Outputs] | None = None,
) -> list[LoadPath]:
    """Every way of loading one model: ``pc.load`` from its comparison, the others run here,
    the deciding ones again under each other attention implementation (``attention``: the
    fp32 baseline's outputs under each), then the re-save round trip (a single model only: a
    pipeline is re-saved whole).

    ``shared``: when given, ``pc.load``'s outputs came from calibration's last candidate
    (its weight files are these), and these are that candidate's outputs under each other
    attention implementation: ``pc.load`` under those is judged on them, not run again.

    Each attention implementation is checked apart: ways under different ones never share
    outputs, even when they load the very same tensors. The library's own load under another
    implementation is a cross of two things each checked on every probe (its dtypes by
    ``plain``, that attention by ``pc.load``): it decides on the spot subset."""
    first = _pc_load(component, pc_metrics, pc_errors)
    if shared is not None:
        first.detail = SHARED_WITH_CANDIDATE
    spot, cross = spot_inputs(inputs), spot_inputs(inputs, crossed=True)
    library = _library_crossed(component, inputs)
    ways = model_ways(component)
    records = [first, *_check(component.name, ways, inputs, baseline, thresholds, device, spot)]
    for implementation, outputs in (attention or {}).items():
        pc_way, *ways = attention_ways(component, implementation)
        if shared is not None and implementation in shared:
            records.append(
                _judged_shared(
                    component, pc_way, inputs, outputs, shared[implementation], thresholds
                )
            )
        else:
            ways.insert(0, pc_way)
        records += _check(
            component.name, ways, inputs, outputs, thresholds, device, cross, library=library
        )
    if not component.name:
        records += _resaved(component, inputs, baseline, thresholds, device)
    return records


def _library_crossed(component: Component, inputs: ModelInputs) -> ModelInputs:
    """What ``pc.load`` runs under another attention implementation: every probe, or under
    a compute format with fp32's exponent range, the one-key rows at their ends only."""
    if range_binds(from_torch(component.compute_dtype)):
        return inputs
    return one_key_rows_at_ends(inputs)


#: Why ``pc.load`` under another attention left first-position rows out (bf16 compute).
ONE_KEY_ROWS = (
    "the first-position rows between the first and last, which attend to one or two keys: in a "
    "format with fp32's exponent range attention implementations differ there by rounding "
    "only, judged on the rows kept, and the default attention ran every row"
)


#: The detail of a ``pc.load`` record judged on outputs calibration already ran.
SHARED_WITH_CANDIDATE = (
    "outputs shared with calibration's last candidate, whose weight files are byte for byte "
    "these and which was loaded with pc.load here: same tensors in, same numbers out"
)


def _judged_shared(
    component: Component,
    way: Way,
    inputs: ModelInputs,
    baseline: Outputs,
    outputs: Outputs,
    thresholds: dict[str, float],
) -> LoadPath:
    """``way`` (``pc.load`` under another attention implementation) judged on the outputs
    calibration's last candidate gave that way."""
    record = LoadPath(
        component.name,
        way.key,
        way.call,
        "fail",
        way.decides,
        stored_dtypes([component.converted]),
        attention=way.attention,
    )
    _judge(record, compare_outputs(component.name, inputs, baseline, outputs, thresholds))
    record.detail = SHARED_WITH_CANDIDATE
    return record


def check_pipeline(
    opened: PipelineSource,
    inputs: ModelInputs,
    baseline: Outputs,
    thresholds: dict[str, float],
    device: torch.device,
    pc_metrics: list[Measurement],
    pc_errors: list[str],
) -> list[LoadPath]:
    """Every way of loading the whole pipeline, judged on its end-to-end run, then the re-save
    round trip of the whole pipeline."""
    first = _pc_load(opened, pc_metrics, pc_errors)
    return [
        first,
        *_check("pipeline", pipeline_ways(opened), inputs, baseline, thresholds, device),
        *_resaved(opened, inputs, baseline, thresholds, device),
    ]


def blockwise_paths(
    component: Component, pc_metrics: list[Measurement], pc_errors: list[str]
) -> list[LoadPath]:
    """A model compared block by block: ``pc.load``'s record (its blocks were loaded as
    ``pc.load`` loads them); the library's loads would need the whole model in memory."""
    first = _pc_load(component, pc_metrics, pc_errors)
    why = "the model only fits in memory block by block; it was not loaded whole"
    ways = model_ways(component)
    if not component.name:
        ways += _resave_ways(component, None)
    return [first, *_not_checked(component.name, ways, why)]


def skipped_pipeline(opened: PipelineSource, why: str) -> list[LoadPath]:
    """A pipeline whose end-to-end run was skipped (``why``): no way of loading it ran."""
    first = Way(PC_LOAD, pc_load_call("pipeline", pipeline_variant(opened)), None)
    ways = [first, *pipeline_ways(opened), *_resave_ways(opened, None)]
    records = _not_checked("pipeline", ways, why)
    records[0].dtypes = stored_dtypes(opened.components.values())
    return records


def _not_checked(component: str, ways: Iterable[Way], why: str) -> list[LoadPath]:
    return [
        LoadPath(
            component,
            w.key,
            w.call,
            "not-checked",
            w.decides,
            detail=w.why_not or why,
            attention=w.attention,
        )
        for w in ways
    ]


def _check(
    component: str,
    ways: list[Way],
    inputs: ModelInputs,
    baseline: Outputs,
    thresholds: dict[str, float],
    device: torch.device,
    spot: ModelInputs | None = None,
    library: ModelInputs | None = None,
) -> list[LoadPath]:
    """Each way loaded and run: ``pc.load`` and any deciding way on every probe, the others
    on ``spot`` (a recorded subset) when given; with ``library`` (the ways under another
    attention implementation), ``pc.load`` on ``library`` and every other way on ``spot``."""
    records: list[LoadPath] = []
    seen: dict[tuple[Any, ...], LoadPath] = {}
    crossed = library is not None
    for way in ways:
        if way.build is None:
            records += _not_checked(component, [way], "")
            continue
        on_spot = not way.decides or (crossed and way.key != PC_LOAD)
        subset = spot if spot is not None and on_spot else None
        if library is not None and way.key == PC_LOAD and len(library.probes) < len(inputs.probes):
            subset = library
        judged = {p.name: baseline[p.name] for p in subset.probes} if subset else baseline
        record = _run(
            component, way, subset or inputs, judged, thresholds, device, seen, subset is None
        )
        if subset is not None and record.verdict != "not-checked" and record.metrics:
            scope = _scope(subset, inputs)
            if subset is library:
                left = len(inputs.probes) - len(subset.probes)
                scope = f"{left} of {len(inputs.probes)} probes not run under it: {ONE_KEY_ROWS}"
            elif way.decides:
                scope += (
                    f": its dtypes are judged on every probe by `{way.key}` under the default "
                    f"attention, {way.attention} attention by `{PC_LOAD}`"
                )
            if not record.detail or not record.detail.startswith("loads the same tensors"):
                record.detail = f"{record.detail}; {scope}" if record.detail else scope
        records.append(record)
    return records


def _scope(subset: ModelInputs, inputs: ModelInputs) -> str:
    names = [p.name for p in subset.probes]
    return f"checked on {len(names)} of {len(inputs.probes)} probes ({', '.join(names)})"


def planned_forwards(
    component: Component, inputs: ModelInputs, attention: int = 0, *, shared: bool = False
) -> int:
    """At most how many forwards the library's ways (under the default attention and each of
    ``attention`` others; ``shared``: ``pc.load``'s under those came from calibration) and the
    re-save round trip run on ``inputs`` after ``pc.load`` (a way loading what one already
    ran runs none)."""
    every, spot = len(inputs.probes), len(spot_inputs(inputs).probes)
    count = sum(every if w.decides else spot for w in model_ways(component) if w.build is not None)
    cross = len(spot_inputs(inputs, crossed=True).probes)
    library = len(_library_crossed(component, inputs).probes)
    count += attention * ((0 if shared else library) + cross)
    if not component.name and component.converted.library != "open_clip":
        count += len(resave_inputs(inputs).probes) * len(RESAVED)
    return count


def _run(
    component: str,
    way: Way,
    inputs: ModelInputs,
    baseline: Outputs,
    thresholds: dict[str, float],
    device: torch.device,
    seen: dict[tuple[Any, ...], LoadPath],
    every_probe: bool = True,
) -> LoadPath:
    """Load one way, run the probes, free the model; an error is the way's failure. A way
    loading what one in ``seen`` loaded takes its verdict; one run on ``every_probe`` joins
    ``seen`` (a subset's verdict is no other way's)."""
    record = LoadPath(component, way.key, way.call, "fail", way.decides, attention=way.attention)
    outputs: Outputs | None = None
    step = "load"
    with freed(device=device) as loaded:
        try:
            with ledger_span(f"load {record.label}"):
                loaded.model = way.build()  # type: ignore[misc]
            if hasattr(loaded.model, "eval"):
                loaded.model.eval()
            record.dtypes = parameter_dtypes(loaded.model)
            signature = _signature(loaded.model)
            same = seen.get(signature)
            if same is not None:
                record.verdict, record.metrics, record.failures = (
                    same.verdict,
                    same.metrics,
                    same.failures,
                )
                record.detail = f"loads the same tensors in the same dtypes as `{same.call}`"
                if same.detail and same.verdict == "fail":
                    record.detail += f"; {same.detail}"
                return record
            if every_probe:
                seen[signature] = record
            step = "run"
            loaded.model = move(loaded.model, device)
            dtype = way.input_dtype if way.input_dtype is not None else _input_dtype(loaded.model)
            with stage(record.label):  # ways under another attention run apart
                outputs = run_probes(loaded.model, inputs, device, dtype)
        except LOAD_ERRORS as exc:
            record.detail = f"fails to {step}: {one_line(exc)}"
    if outputs is not None:
        _judge(record, compare_outputs(component, inputs, baseline, outputs, thresholds))
    return record


def _pc_load(
    loaded: Component | PipelineSource, metrics: list[Measurement], errors: list[str]
) -> LoadPath:
    """``pc.load``'s record, from the comparison already run through it."""
    if isinstance(loaded, PipelineSource):
        name, variant = "pipeline", pipeline_variant(loaded)
        dtypes = stored_dtypes(loaded.components.values())
    else:
        name, variant = loaded.name, loaded.converted.variant
        dtypes = stored_dtypes([loaded.converted])
    record = LoadPath(name, PC_LOAD, pc_load_call(name, variant), "fail", True, dtypes)
    if errors:
        record.detail = errors[0].partition(": ")[2] or errors[0]
    _judge(record, metrics, errors=bool(errors))
    return record


def _judge(record: LoadPath, rows: list[Measurement], *, errors: bool = False) -> None:
    failed = sorted((m for m in rows if not m.passed), key=_badness)
    record.verdict = "pass" if rows and not failed and not errors else "fail"
    worst: dict[str, Measurement] = {}
    for m in rows:
        if m.metric not in worst or _badness(m) < _badness(worst[m.metric]):
            worst[m.metric] = m
    record.metrics = list(worst.values())
    record.failures = [failure_line(m) for m in failed[:MAX_FAILURES]]
    if len(failed) > MAX_FAILURES:
        record.failures.append(f"… {len(failed) - MAX_FAILURES} more failed metrics")
    if not rows and not errors and record.detail is None:
        record.detail = "no output was compared"


def _badness(m: Measurement) -> tuple[int, int, float]:
    """Sort key: failures first, fatal metrics (NaN/Inf) before the others, then the value
    furthest on the wrong side (a NaN value furthest of all)."""
    fatal = 0 if METRICS[m.metric].fatal_threshold is not None else 1
    if m.value is None:
        return (int(m.passed), fatal, -math.inf)
    return (int(m.passed), fatal, -m.value if m.bound == "max" else m.value)


def failure_lines(records: Iterable[LoadPath]) -> list[str]:
    """The certificate's failure lines for deciding ways other than ``pc.load`` (whose
    failures the comparison itself lists) that failed."""
    lines = []
    for record in records:
        own = record.way == PC_LOAD and record.attention is None  # listed by the comparison
        if own or not record.decides or record.verdict != "fail":
            continue
        where = record.component or "model"
        why = record.detail or (record.failures[0] if record.failures else "outputs differ")
        what = "the load" if record.way == PC_LOAD else "the plain load"
        lines.append(f"{where}: {what} `{record.call}` {_as_clause(why)}")
    return lines


def _as_clause(why: str) -> str:
    return why if why.startswith("fails") else f"differs from fp32: {why}"


# --------------------------------------------------------------------------- re-saved


def _resaved(
    loaded: Component | PipelineSource,
    inputs: ModelInputs,
    baseline: Outputs,
    thresholds: dict[str, float],
    device: torch.device,
) -> list[LoadPath]:
    """The user's round trip: ``pc.load``, ``save_pretrained`` into a temporary directory,
    then each way of loading that, run on :func:`resave_inputs` only."""
    name = "pipeline" if isinstance(loaded, PipelineSource) else loaded.name
    if not isinstance(loaded, PipelineSource) and loaded.converted.library == "open_clip":
        return _not_checked(name, _resave_ways(loaded, None), "OpenCLIP has no save_pretrained")
    subset = resave_inputs(inputs)
    names = [p.name for p in subset.probes]
    scope = _scope(subset, inputs)
    with tempfile.TemporaryDirectory(prefix="precision-convert-resave-") as scratch:
        saved, error = _save_again(loaded, Path(scratch) / "resaved")
        if saved is None:
            records = _not_checked(name, _resave_ways(loaded, None), "")
            for record in records:
                record.verdict, record.detail = "fail", f"fails to re-save: {error}"
            return records
        kept = {n: baseline[n] for n in names}
        records = _check(name, _resave_ways(loaded, saved), subset, kept, thresholds, device)
    for record in (r for r in records if r.verdict != "not-checked"):
        record.detail = f"{record.detail}; {scope}" if record.detail else scope
    return records


def resave_inputs(inputs: ModelInputs) -> ModelInputs:
    """The probes a re-save is checked on: the layout's own (every probe no sweep made: one
    forward, or an autoencoder's encode and decode) and real text when there is some."""
    kept = tuple(p for p in inputs.probes if not p.sweep or p.name == RESAVE_PROBE)
    return replace(inputs, probes=kept)


def _save_again(
    loaded: Component | PipelineSource, directory: Path
) -> tuple[ModelSource | PipelineSource | None, str | None]:
    """``pc.load`` the converted files, ``save_pretrained`` them into ``directory`` and open
    what was written; else None and the error's first line."""
    root = loaded.root if isinstance(loaded, PipelineSource) else loaded.converted.root
    trusted = not isinstance(loaded, PipelineSource) and loaded.trust_remote_code
    with freed() as held:
        try:
            held.model = load(root, trust_remote_code=trusted)
            with ledger_span("re-save"):
                held.model.save_pretrained(directory)
            return open_source(directory), None
        except LOAD_ERRORS as exc:
            return None, one_line(exc)
