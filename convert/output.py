"""Writing one model directory for a plan: weights through the streaming writer, the config
with its ``precision_convert`` record (``_precision_convert`` in diffusers configs), every
other file copied unchanged.

The converter writes its output with this, and calibration's search writes each candidate
with it too, so a candidate checked against fp32 is byte for byte what the user would get.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from precision_convert.conversion.io.context import IOContext
from precision_convert.conversion.io.finite import SourceWatch
from precision_convert.conversion.io.header import copied_metadata
from precision_convert.conversion.io.source import ModelSource, variant_name
from precision_convert.conversion.io.writer import write_file
from precision_convert.conversion.plan import DIFFUSERS_RECORD_KEY, RECORD_KEY, ModelPlan
from precision_convert.core._version import __version__
from precision_convert.core.dtypes import FP32, DType
from precision_convert.core.progress import ledger_span

#: Progress callback: (what is being written, source bytes just consumed).
ProgressHook = Callable[[str, int], None]
#: Never copied from a source: Hub download bookkeeping and version control.
NEVER_COPY = frozenset({".cache", ".git", ".huggingface"})
#: A pipeline's index: a model directory next to it is one of the pipeline's components.
PIPELINE_INDEX = "model_index.json"


def copy_entry(entry: Path, dest: Path) -> list[str]:
    """Copy a file or folder unchanged; returns the copied files relative to ``dest``'s folder."""
    if entry.is_dir():
        shutil.copytree(entry, dest, ignore=shutil.ignore_patterns(*NEVER_COPY))
        return [str(p.relative_to(dest.parent)) for p in dest.rglob("*") if p.is_file()]
    shutil.copy2(entry, dest)
    return [dest.name]


@ledger_span("write")
def write_model(
    model: ModelSource,
    plan: ModelPlan,
    out_dir: Path,
    on_progress: ProgressHook | None = None,
    *,
    io: IOContext | None = None,
    variant: str | None = None,
    watch: SourceWatch | None = None,
) -> list[str]:
    """Write ``model`` under ``plan`` into the existing directory ``out_dir``; returns the
    files written, relative to it.

    ``io`` is the run's I/O context (its buffers are reused from shard to shard); without one,
    the call opens its own and closes it before returning.

    ``variant`` names the weight files as the Hub's variant of the source (``model.fp16.
    safetensors``…) and keeps the source's config unchanged, so the files can be added to the
    source repo beside its own: the dtype map travels in every shard's metadata only.

    ``watch`` is the run's read of its source (:class:`SourceWatch`): each weight file is
    hashed and checked as it is read here, not read once more for that.
    """
    if io is None:
        with IOContext() as own:
            return write_model(
                model, plan, out_dir, on_progress, io=own, variant=variant, watch=watch
            )
    block = plan.record(__version__).to_dict()
    stored = {t.name: t.stored for t in plan.tensors}
    written: list[str] = []
    for entry in sorted(model.root.iterdir()):
        if entry.name in NEVER_COPY or model.is_weight_file(entry.name):
            continue
        if entry.name == model.config_name and variant is None:
            continue
        written += copy_entry(entry, out_dir / entry.name)
    if variant is None:
        _write_config(model, plan, block, out_dir / model.config_name)
        written.append(model.config_name)

    weight_map: dict[str, str] = {}
    total = 0
    for weight_file in model.files:
        tensors = weight_file.tensors if watch is None else watch.watched(weight_file)
        items = [(t, stored[t.name]) for t in tensors]
        metadata = {
            **copied_metadata(weight_file.metadata)[0],  # the source shard's own entries
            "format": "pt",
            RECORD_KEY: json.dumps(block, separators=(",", ":")),
        }

        name = variant_name(weight_file.output_name, variant)

        def progress(n: int, label: str = name) -> None:
            if on_progress is not None:
                on_progress(label, n)

        total += write_file(out_dir / name, items, metadata, progress, io=io)
        weight_map.update({t.name: name for t, _ in items})
        written.append(name)
    if model.index_name is not None:
        index = {
            "metadata": {**copied_metadata(model.index_metadata)[0], "total_size": total},
            "weight_map": weight_map,
        }
        index_name = variant_name(model.index_name, variant)
        (out_dir / index_name).write_text(json.dumps(index, indent=2) + "\n")
        written.append(index_name)
    return written


def _write_config(model: ModelSource, plan: ModelPlan, block: dict[str, Any], path: Path) -> None:
    config = dict(model.config)
    # The real compute dtype, whatever the dtype key below says; under the name diffusers
    # passes over silently in a diffusers model's config.
    config[DIFFUSERS_RECORD_KEY if model.library == "diffusers" else RECORD_KEY] = block
    if model.library == "transformers":
        dtype = plain_load_dtype(model, plan)
        config["dtype"] = dtype.torch_name
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype.torch_name
    for key, value in plan.config_flags.items():
        config[key] = value
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def plain_load_dtype(model: ModelSource, plan: ModelPlan) -> DType:
    """The dtype for config.json's ``dtype``: what transformers' plain ``from_pretrained(dir)``
    (and ``dtype="auto"``) loads every tensor in, flattening the plan's islands.

    The compute dtype, so the plain load keeps the memory saving, except where that load
    would not be finite or would not run:

    - an fp16 plan with islands whose fp32 *output* must flow on (reasons ``range``,
      ``search``, ``user``) that the class does not keep fp32 itself
      (``_keep_in_fp32_modules``): flattened to fp16 they overflow, so float32 (the plain load
      is then fp32 throughout: finite, without the memory saving);
    - a bf16 plan with islands calibration measured on the model (a layer that loses most of
      its mantissa in bf16, or whose bf16 kernel is wrong on the machine it ran on): flattened
      to bf16 they lose it again, so float32;
    - a component of a diffusers pipeline: ``DiffusionPipeline.from_pretrained(dir)`` loads
      its diffusers models in float32 whatever the files hold, and a text encoder loaded in
      fp16/bf16 hands the denoiser half-precision latents ("mat1 and mat2 must have the same
      dtype" at its fp32 time embedding), so float32.

    ``precision_convert.load`` reads the compute dtype from the record, never from this key.
    """
    if (model.root.parent / PIPELINE_INDEX).is_file():
        return FP32
    if not plan.target.range_limited:
        return FP32 if any(i.measured for i in plan.islands) else plan.compute
    kept = _kept_fp32_by_class(model)
    flowing = [i.name for i in plan.islands if i.reason != "precision"]
    if any(not _covered(name, kept) for name in flowing):
        return FP32
    return plan.compute


def _kept_fp32_by_class(model: ModelSource) -> frozenset[str]:
    """Module names transformers keeps in fp32 when it loads this class in fp16 (none known
    for remote code or a class this transformers lacks: then every island counts)."""
    architecture = (model.config.get("architectures") or [None])[0]
    if not isinstance(architecture, str) or model.config.get("auto_map"):
        return frozenset()
    try:
        import transformers

        cls = getattr(transformers, architecture, None)
    except (ImportError, RuntimeError):
        return frozenset()
    names: set[str] = set()
    for attribute in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names.update(str(n) for n in getattr(cls, attribute, None) or ())
    # Plain names only: a pattern's reach is the library's to judge, so it is not counted.
    return frozenset(n for n in names if n and not any(c in n for c in "*?[]()^$\\|+"))


def _covered(module: str, kept: frozenset[str]) -> bool:
    """Whether ``module`` is one transformers keeps fp32: a kept name matches whole
    dot-separated components of it (transformers' own match is looser, never stricter)."""
    dotted = f".{module}."
    return any(f".{name}." in dotted for name in kept)
