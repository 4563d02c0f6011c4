"""A model from ``pc.load`` keeps its dtype plan when its user saves it again.

Fine-tune, ``save_pretrained``, load: the ordinary path after a conversion. The library's save
writes every tensor in the dtype it holds (the fp32 islands stay fp32, the rest stays in the
compute dtype), but drops what makes those files load safely:

- transformers writes ``config.json``'s ``dtype`` as the dtype of the model's first
  parameter. For an fp16 plan with a range island the converter wrote ``float32`` there, so a
  plain ``from_pretrained`` (or ``dtype="auto"``) loads it in fp32; after a re-save it reads
  ``float16``, flattens the island and overflows to NaN.
- no library writes the ``precision_convert`` record into the shards' metadata, and diffusers
  drops it from its config (a key its classes do not expect).

So :func:`keep_plan_on_save` gives each model ``pc.load`` builds a ``save_pretrained`` of its
own: the library's, then the plan written back into what it saved — ``config.json``'s dtype as
the loaded directory had it (what a plain load of these weights was certified with), the record
in ``config.json`` and in every safetensors shard's metadata. A diffusers pipeline saves its
components through theirs, so a whole pipeline keeps its plans too. When the weights no longer
hold the plan (an island cast down to fp16 after loading), the record is taken out of what was
saved instead, so the files load as a model that was never converted, and a warning says why.

The saver is an attribute of its model and refers to it, as accelerate's hooks do (a weak
reference would not survive ``pc.load(out).save_pretrained(new)``, where nothing else holds
the model): ``copy.deepcopy`` and pickling carry it over to the copy, and a model freed by
``del`` is reclaimed by Python's cycle collector (``gc.collect()``) rather than at once.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precision_convert.conversion.io.header import read_header
from precision_convert.conversion.io.source import ModelSource, open_source
from precision_convert.conversion.plan import DIFFUSERS_RECORD_KEY, RECORD_KEY, PlanRecord
from precision_convert.conversion.runtime.record import record_mismatch
from precision_convert.core.quiet import PrecisionConvertWarning

__all__ = ["SavedPlan", "keep_plan_on_save", "write_plan"]

#: Config keys transformers reads the load dtype from (``torch_dtype`` before v4.56).
DTYPE_KEYS = ("dtype", "torch_dtype")
#: Bytes copied per read when a shard is rewritten with its new header.
_COPY_CHUNK = 16 << 20
#: safetensors pads its header with spaces so tensor data starts 8-byte aligned.
_ALIGN = 8


@dataclass(frozen=True)
class SavedPlan:
    """What a re-save writes back: the record, and the dtype the loaded ``config.json`` gave a
    plain load (transformers only; None: leave the library's)."""

    record: PlanRecord
    dtype: str | None

    @classmethod
    def of(cls, source: ModelSource, record: PlanRecord) -> SavedPlan:
        found = next((source.config[k] for k in DTYPE_KEYS if k in source.config), None)
        plain = found if source.library == "transformers" and isinstance(found, str) else None
        return cls(record, plain)


def keep_plan_on_save(model: Any, plan: SavedPlan) -> None:
    """Give ``model`` a ``save_pretrained`` that writes ``plan`` back after the library's own
    (models without one, such as OpenCLIP's, are left alone)."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = PlanKeepingSave(model, plan)


class PlanKeepingSave:
    """``model.save_pretrained``: the class's own, then :func:`write_plan` on its output."""

    def __init__(self, model: Any, plan: SavedPlan) -> None:
        self._model = model
        self._plan = plan

    def __call__(self, save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        result = type(self._model).save_pretrained(self._model, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):  # other ranks write nothing
            write_plan(Path(save_directory), self._plan, kwargs.get("variant"))
        return result

    @property
    def __signature__(self) -> inspect.Signature:
        # diffusers reads it to decide which keywords (variant, max_shard_size...) to pass.
        return inspect.signature(type(self._model).save_pretrained.__get__(self._model))


def write_plan(directory: Path, plan: SavedPlan, variant: str | None = None) -> None:
    """Write ``plan`` into the model a library just saved in ``directory``.

    The saved weights are checked against the record first, as ``pc.load`` will check them.
    When they no longer hold it (an island cast down), the record is taken out of the saved
    config instead (transformers copies it from the loaded one), so the files load as a model
    that was never converted, and a ``UserWarning`` says why.
    """
    saved = open_source(directory, variant)
    if not isinstance(saved, ModelSource):
        return
    mismatch = record_mismatch(plan.record, list(saved.tensors()))
    config_path = directory / saved.config_name
    config = json.loads(config_path.read_text("utf-8"))
    if mismatch is not None:
        warnings.warn(
            f"{directory} saved without its {RECORD_KEY} record: {mismatch}, so it loads as "
            "a model that was never converted",
            PrecisionConvertWarning,
            stacklevel=3,
        )
        if any([config.pop(key, None) for key in (RECORD_KEY, DIFFUSERS_RECORD_KEY)]):
            _replace_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
        return
    record = plan.record.to_dict()
    config[DIFFUSERS_RECORD_KEY if saved.library == "diffusers" else RECORD_KEY] = record
    for key in DTYPE_KEYS:
        if key in config and plan.dtype is not None:
            config[key] = plan.dtype
    _replace_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    metadata = {RECORD_KEY: json.dumps(record, separators=(",", ":"))}
    for weight_file in saved.files:
        if weight_file.path.suffix == ".safetensors":
            add_metadata(weight_file.path, metadata)


def add_metadata(path: Path, extra: dict[str, str]) -> None:
    """Rewrite a safetensors file with ``extra`` added to its ``__metadata__``.

    The header grows, so the tensor data moves: it is streamed into a new file beside the old
    one (never held in memory), which then replaces it.
    """
    header = read_header(path)
    tensors = {
        e.name: {
            "dtype": e.dtype.code,
            "shape": list(e.shape),
            "data_offsets": [e.begin - header.data_start, e.end - header.data_start],
        }
        for e in header.tensors
    }
    metadata = {**header.metadata, **extra}
    raw = json.dumps({"__metadata__": metadata, **tensors}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    staged = path.with_name(f".{path.name}.precision-convert")
    try:
        with path.open("rb") as old, staged.open("wb") as new:
            new.write(len(raw).to_bytes(8, "little"))
            new.write(raw)
            old.seek(header.data_start)
            shutil.copyfileobj(old, new, _COPY_CHUNK)
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def _replace_text(path: Path, text: str) -> None:
    staged = path.with_name(f".{path.name}.precision-convert")
    try:
        staged.write_text(text, encoding="utf-8")
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)
