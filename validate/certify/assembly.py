"""Certificate assembly: what one validation run compared, and the certificate its results make.

The failures (errors, metrics out of bounds, load paths that fail), the notes, the source's
files and card fields, the device and library versions, and records of components a stopped
run never reached; :mod:`.certificate` holds the format this fills in.
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from precision_convert.conversion.io.finite import SourceRead
from precision_convert.conversion.io.header import COPIED_METADATA_LIMIT, copied_metadata
from precision_convert.conversion.io.source import (
    ModelSource,
    PipelineSource,
    Source,
)
from precision_convert.core._version import __version__
from precision_convert.core.errors import CannotValidateError
from precision_convert.validation.certify.certificate import (
    FAIL,
    PASS,
    SELF_BASELINE,
    SMOKE_PASS,
    SOURCE_BASELINE,
    Certificate,
    ComponentRecord,
    in_series_order,
    metric_failures,
)
from precision_convert.validation.certify.components import (
    Component,
    ComponentResult,
)
from precision_convert.validation.certify.consistency import not_covered
from precision_convert.validation.certify.load_paths import failure_lines
from precision_convert.validation.certify.load_ways import stored_dtypes
from precision_convert.validation.certify.reference import (
    SourceInfo,
    models_of,
    without_local_paths,
)
from precision_convert.validation.certify.verify import hash_files


@dataclass(frozen=True)
class _Run:
    """What one validation compares, where and with what: set up, and checked, before
    anything runs."""

    root: Path
    opened: Source
    source: SourceInfo
    read: SourceRead  # the baseline's weight files: their digests, their non-finite tensors
    reference: Source  # the baseline's files, opened (the converted ones for a smoke check)
    device: torch.device
    memory: int  # bytes: past them, a model is validated block by block
    max_memory: str | int | None  # as the user gave it, for the certificate
    supplied: Mapping[str, torch.Tensor] | None
    components: list[Component]


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
    # A coverage shortfall's own lines (among the errors) name the modules that never ran.
    failures = [e for r in results for e in r.errors]
    failures += metric_failures(m for m in metrics if m.metric != "coverage")
    failures += failure_lines(paths)  # the plain default load decides too
    if cannot is not None:
        failures = [*_cannot_validate_lines(cannot), *failures]
    broken = run.read.broken_line()
    if broken is not None:  # allowed to go on (--allow-nonfinite-source), never to pass
        failures = [f"{broken}: the baseline is not a reference there", *failures]
    records = {c.record.target for c in components if c.record.target is not None}
    compute = {c.record.compute_dtype for c in components if c.record.compute_dtype is not None}
    notes = [r.record.inputs["skipped"] for r in results if "skipped" in r.record.inputs]
    notes += [note for r in results for note in r.notes]
    for r in results:  # probes the fp32 baseline could not answer: named, not dropped
        if unjudged := r.record.inputs.get("unjudged"):
            notes.append(
                f"{r.record.name or 'model'}: {len(unjudged)} probe(s) not judged, the fp32 "
                f"baseline's own output is not finite there (counted against coverage): "
                f"{', '.join(unjudged)}"
            )
    for r in results:  # probes a time budget left out: named, not dropped
        if left := (r.record.inputs.get("budget") or {}).get("left_out"):
            notes.append(
                f"{r.record.name or 'model'}: {len(left)} probe(s) not run within --budget "
                f"(not covered by the verdict): {', '.join(left)}"
            )
    for r in results:  # a tokenizer that could not be used: its token probes are seeded ids
        tokenizer = r.record.inputs.get("tokenizer") or {}
        if tokenizer.get("usable") is False:
            notes.append(
                f"{r.record.name}: {tokenizer['note']}" if r.record.name else tokenizer["note"]
            )
    masks = [
        f"{c}/{t.describe()}" if c else t.describe()
        for c, found in run.read.nonfinite.items()
        for t in found
        if t.by_design
    ]
    if masks:
        notes.append(f"attention masks stored as ±inf by design: {', '.join(masks)}")
    if dropped := _dropped_metadata(run.reference):
        notes.append(
            f"source metadata not copied (entries over {COPIED_METADATA_LIMIT // 1024} KiB): "
            + ", ".join(dropped)
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
            "files": run.read.files,
            "card": source_card_data(source.path),
            # What the baseline's weights were before the upcast: a bf16-stored source's
            # baseline holds bf16 values, not an fp32 checkpoint's.
            "stored_dtypes": stored_dtypes_of(run.reference),
            "nonfinite": _nonfinite(run.read),
            # A --variant output: its files are added to the source repo under this variant.
            "variant": next((c.converted.variant for c in components if c.converted.variant), None),
        },
        baseline={"dtype": "float32", "kind": source.kind},
        device=_device_record(run.device, run.max_memory, {r.record.mode for r in results}),
        versions=_versions(),
        components=[r.record for r in results],
        metrics=in_series_order(metrics),  # as stored: the certificate read back is equal
        failures=failures,
        files=hash_files(root),
        notes=notes,
        tool={"name": "precision-convert", "version": __version__},
        load_paths=paths,
        not_covered=not_covered(paths, [r.record for r in results]),
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


def _dropped_metadata(reference: Source) -> list[str]:
    """The baseline's metadata entries a conversion does not copy (too large), each as
    ``file: 'key' (bytes)`` with a long key cut: the output's files no longer hold them."""
    found = []
    for component, model in models_of(reference).items():
        where = f"{component}/" if component else ""
        held = [(f.path.name, f.metadata) for f in model.files]
        if model.index_name is not None:
            held.append((model.index_name, model.index_metadata))
        for name, metadata in held:
            for key, size in copied_metadata(metadata)[1].items():
                shown = key if len(key) <= 40 else key[:40] + "…"
                found.append(f"{where}{name}: {shown!r} ({size:,} bytes)")
    return found


def _nonfinite(read: SourceRead) -> dict[str, list[dict[str, object]]]:
    """The baseline's tensors holding NaN or ±inf, per component, each with its counts and
    whether it is a mask stored so by design (reported, never refused)."""
    return {c: [t.to_json() for t in found] for c, found in read.nonfinite.items()}


def stored_dtypes_of(reference: Source) -> dict[str, dict[str, int]]:
    """Floating elements per stored dtype of the baseline's weight files, per component (""
    for a single model), from the headers already read: no pass over the data."""
    return {name: stored_dtypes([model]) for name, model in models_of(reference).items()}


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
