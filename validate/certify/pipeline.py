"""A diffusers pipeline run end to end: short seeded runs of the fp32 baseline pipeline (small,
and at the sizes its call defaults to where the coverage level's budget allows), then of the
converted one through ``pc.load``, compared, then the pipeline's other ways of loading.

It runs after the components were compared one by one, and is skipped when one of them only
fits in memory block by block.
"""

from __future__ import annotations

import torch

from precision_convert.conversion.io.source import (
    PipelineSource,
)
from precision_convert.conversion.runtime.baseline import load_fp32
from precision_convert.conversion.runtime.loader import load
from precision_convert.conversion.runtime.memory import freed
from precision_convert.core.errors import CannotValidateError, one_line
from precision_convert.validation.certify.certificate import (
    ComponentRecord,
)
from precision_convert.validation.certify.components import (
    SEED,
    ComponentResult,
)
from precision_convert.validation.certify.load_paths import check_pipeline, skipped_pipeline
from precision_convert.validation.certify.reference import (
    SourceInfo,
)
from precision_convert.validation.certify.whole import _compare_candidate
from precision_convert.validation.probe.inputs.budgets import Budget
from precision_convert.validation.probe.inputs.pipelines import pipeline_inputs
from precision_convert.validation.probe.run.execute import (
    RUN_ERRORS,
    run_probes,
)
from precision_convert.validation.probe.run.parity import thresholds_for


def _validate_pipeline(
    opened: PipelineSource,
    source: SourceInfo,
    parts: list[ComponentResult],
    device: torch.device,
    budget: Budget,
) -> ComponentResult:
    """Short seeded end-to-end runs, at small sizes and at the call's defaults where
    ``budget`` allows (:func:`~.pipelines.pipeline_inputs`): baseline pipeline in fp32, then
    the converted one."""
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
    with freed(load_fp32(source.path).to(device), device) as baseline:
        inputs = pipeline_inputs(baseline.model, budget, seed=SEED)
        record.inputs = inputs.describe()
        try:
            base_out = run_probes(baseline.model, inputs, device)
        except RUN_ERRORS as exc:
            raise CannotValidateError(
                f"cannot run the {record.class_name} pipeline end to end "
                f"({one_line(exc)}); pass --inputs"
            ) from None
    metrics, errors = _compare_candidate(
        lambda: load(opened.root, device=device), "pipeline", inputs, base_out, thresholds, device
    )
    paths = check_pipeline(opened, inputs, base_out, thresholds, device, metrics, errors)
    return ComponentResult(record, metrics, errors, paths)
