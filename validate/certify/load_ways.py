"""The ways users load a converted checkpoint, and what each loaded: the calls and builders.

Each :class:`Way` is one call as users write it (``pc.load``, the library's plain
``from_pretrained``, ``dtype="auto"``, the explicit compute dtype, each under another
attention implementation, and the re-saved files loaded again) with the builder that makes
it here; :mod:`.load_paths` runs and judges them. The dtype counts say what a load holds, and
whether two loads hold the very same tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from precision_convert.conversion.io.source import ModelSource, PipelineSource
from precision_convert.conversion.runtime.builders import (
    _diffusers_dtype_keyword,
    model_class,
    variant_keyword,
)
from precision_convert.conversion.runtime.loader import load, read_record
from precision_convert.core.dtypes import from_torch
from precision_convert.validation.certify.components import Component
from precision_convert.validation.probe.run.attention import switch

__all__ = ["AUTO", "COMPUTE", "DECIDING", "PC_LOAD", "PLAIN", "RESAVED"]

PC_LOAD = "pc.load"
PLAIN = "plain"
AUTO = "auto"
COMPUTE = "compute"
#: The ways whose verdict is the certificate's.
DECIDING = frozenset({PC_LOAD, PLAIN})
#: The re-save ways: ``pc.load(dir).save_pretrained(new)``, then ``new`` loaded each of these
#: ways. Shown, never deciding.
RESAVED = {PLAIN: "resave:plain", AUTO: "resave:auto", PC_LOAD: "resave:pc.load"}


@dataclass(frozen=True)
class Way:
    """One way of loading: how to call it, and whether it can be checked here."""

    key: str
    call: str
    build: Callable[[], Any] | None  # None: not checked (``why_not`` says why)
    why_not: str | None = None
    input_dtype: torch.dtype | None = None  # None: the loaded model's own dtype
    attention: str | None = None  # None: the model's default attention implementation

    @property
    def decides(self) -> bool:
        return self.key in DECIDING


# --------------------------------------------------------------------------- the ways


def _dtype_name(dtype: torch.dtype) -> str:
    return from_torch(dtype).torch_name


def _literal(dtype: torch.dtype) -> str:
    return f"torch.{_dtype_name(dtype)}"


def model_ways(component: Component) -> list[Way]:
    """The library's own ways of loading one model (or one pipeline component)."""
    source = component.converted
    compute = component.compute_dtype
    repo = f'"<repo>", subfolder="{component.name}"' if component.name else '"<repo>"'
    repo += _variant_argument(source.variant)
    if source.library == "open_clip":
        return _open_clip_ways(source.root, compute)
    # A model with its own code is loaded the way its users must: through the Auto class,
    # with trust_remote_code=True (only when the user allowed it here too).
    trusted = component.trust_remote_code and bool(source.config.get("auto_map"))
    cls_name = "AutoModel" if trusted else source.class_name or "AutoModel"
    call = f"{cls_name}.from_pretrained({repo}"
    if trusted:
        call += ", trust_remote_code=True"

    def load(**kwargs: Any) -> Callable[[], Any]:
        return _from_pretrained(source, trusted, **kwargs)

    if source.library == "transformers":
        keyword = "dtype"
        auto = Way(AUTO, f'{call}, dtype="auto")', load(dtype="auto"))
    else:
        keyword = _diffusers_dtype_keyword()
        auto = Way(AUTO, f'{call}, {keyword}="auto")', None, "diffusers has no 'auto' dtype")
    return [
        Way(PLAIN, f"{call})", load()),
        auto,
        Way(
            COMPUTE,
            f"{call}, {keyword}={_literal(compute)})",
            load(**{keyword: compute}),
            input_dtype=compute,
        ),
    ]


def attention_ways(component: Component, implementation: str) -> list[Way]:
    """The deciding ways again with another attention implementation: ``pc.load`` switched
    after loading (``set_attn_implementation``), and the library's ``from_pretrained`` asked
    for it (``attn_implementation=``). A user picks one as easily as the default."""
    source = component.converted
    plain = next(w for w in model_ways(component) if w.key == PLAIN)
    trusted = component.trust_remote_code and bool(source.config.get("auto_map"))

    def switched() -> Any:
        model = load(source.root, trust_remote_code=component.trust_remote_code)
        return switch(model, implementation)

    pc_call = pc_load_call(component.name, source.variant)
    return [
        Way(
            PC_LOAD,
            f'model = {pc_call}; model.set_attn_implementation("{implementation}")',
            switched,
            attention=implementation,
        ),
        Way(
            PLAIN,
            f'{plain.call.removesuffix(")")}, attn_implementation="{implementation}")',
            _from_pretrained(source, trusted, attn_implementation=implementation),
            attention=implementation,
        ),
    ]


def _variant_argument(variant: str | None) -> str:
    return f', variant="{variant}"' if variant else ""


def _from_pretrained(source: ModelSource, trusted: bool, **kwargs: Any) -> Callable[[], Any]:
    def build() -> Any:
        # The class a user would name; remote code only where the user allowed it.
        if trusted:
            kwargs["trust_remote_code"] = True
        return model_class(source, trust_remote_code=trusted).from_pretrained(
            source.root, **variant_keyword(source), **kwargs
        )

    return build


def _open_clip_ways(root: Path, compute: torch.dtype) -> list[Way]:
    precision = from_torch(compute).short  # open_clip's names are the table's short ones

    def create(**kwargs: Any) -> Callable[[], Any]:
        def build() -> Any:
            import open_clip

            return open_clip.create_model(f"local-dir:{root}", **kwargs)

        return build

    call = 'open_clip.create_model("local-dir:<dir>"'
    return [
        Way(PLAIN, f"{call})", create()),
        Way(AUTO, f'{call}, precision="auto")', None, "open_clip has no 'auto' precision"),
        Way(
            COMPUTE,
            f'{call}, precision="{precision}")',
            create(precision=precision),
            input_dtype=compute,
        ),
    ]


def pipeline_ways(opened: PipelineSource) -> list[Way]:
    """diffusers' own ways of loading the whole pipeline."""
    variant = pipeline_variant(opened)
    compute = pipeline_compute(opened.components.values())

    def load(**kwargs: Any) -> Callable[[], Any]:
        def build() -> Any:
            import diffusers

            return diffusers.DiffusionPipeline.from_pretrained(
                opened.root, **({"variant": variant} if variant else {}), **kwargs
            )

        return build

    keyword = _diffusers_dtype_keyword()
    call = f'DiffusionPipeline.from_pretrained("<repo>"{_variant_argument(variant)}'
    ways = [
        Way(PLAIN, f"{call})", load()),
        Way(AUTO, f'{call}, {keyword}="auto")', None, "diffusers has no 'auto' dtype"),
    ]
    if compute is not None:
        ways.append(
            Way(COMPUTE, f"{call}, {keyword}={_literal(compute)})", load(**{keyword: compute}))
        )
    return ways


def pc_load_call(component: str, variant: str | None) -> str:
    """How a user loads ``component`` with precision-convert."""
    where = f"<repo>/{component}" if component and component != "pipeline" else "<repo>"
    return f'precision_convert.load("{where}"{_variant_argument(variant)})'


def pipeline_variant(opened: PipelineSource) -> str | None:
    """The variant a pipeline's components were read under (one for all of them)."""
    return next((m.variant for m in opened.components.values() if m.variant), None)


def pipeline_compute(models: Iterable[ModelSource]) -> torch.dtype | None:
    """The compute dtype the pipeline's components share (the most common one)."""
    counts: dict[torch.dtype, int] = {}
    for model in models:
        record = read_record(model)
        found = record.compute if record else None
        if found is not None:
            counts[found.torch] = counts.get(found.torch, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


def _resave_ways(
    loaded: Component | PipelineSource, saved: ModelSource | PipelineSource | None
) -> list[Way]:
    """The ways of loading the re-saved files ``saved`` (None: not saved, the calls only),
    named as users write them, the saved directory as ``<dir>``."""
    if isinstance(loaded, PipelineSource):
        variant = pipeline_variant(loaded)
        found = pipeline_ways(saved if isinstance(saved, PipelineSource) else loaded)
    else:
        variant = loaded.converted.variant
        model = saved if isinstance(saved, ModelSource) else loaded.converted
        found = model_ways(replace(loaded, converted=model))
    # The compute-dtype way is left out: it ignores the files' dtypes, a re-save changes nothing.
    library = [w for w in found if w.key != COMPUTE]
    round_trip = f'{pc_load_call("", variant)}.save_pretrained("<dir>"); '
    ways = [
        Way(
            RESAVED[w.key],
            round_trip
            + w.call.replace('"<repo>"', '"<dir>"').replace(_variant_argument(variant), ""),
            w.build if saved is not None else None,
            w.why_not,
        )
        for w in library
    ]
    reload = (lambda: load(saved.root)) if saved is not None else None
    ways.append(Way(RESAVED[PC_LOAD], round_trip + 'precision_convert.load("<dir>")', reload))
    return ways


# --------------------------------------------------------------------------- what was loaded


def parameter_dtypes(model: Any) -> dict[str, int]:
    """Floating elements per dtype of what a model (every module of a pipeline) holds of its
    checkpoint: parameters and persistent buffers, tied tensors once, as :func:`stored_dtypes`
    counts the files."""
    counts: dict[str, int] = {}
    seen: set[tuple[int, torch.dtype]] = set()
    for module in _modules(model):
        for tensor in module.state_dict().values():
            key = (tensor.data_ptr(), tensor.dtype)
            if not tensor.is_floating_point() or key in seen:
                continue
            seen.add(key)
            name = _dtype_name(tensor.dtype)
            counts[name] = counts.get(name, 0) + tensor.numel()
    return dict(sorted(counts.items()))


def stored_dtypes(models: Iterable[ModelSource]) -> dict[str, int]:
    """Floating elements per stored dtype: what ``pc.load`` holds (it keeps them exactly)."""
    counts: dict[str, int] = {}
    for model in models:
        for t in model.tensors():
            if t.dtype.is_float:
                name = _dtype_name(t.dtype.torch)
                counts[name] = counts.get(name, 0) + math.prod(t.shape)
    return dict(sorted(counts.items()))


def _modules(model: Any) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    components = getattr(model, "components", None)
    if isinstance(components, dict):
        return [m for m in components.values() if isinstance(m, torch.nn.Module)]
    return []


def _signature(model: Any) -> tuple[Any, ...]:
    """What two loads must share to be the same load: classes, tensor names and dtypes."""
    parts: list[Any] = [type(model).__name__]
    for module in _modules(model):
        parts.append(type(module).__name__)
        parts.extend((n, t.dtype) for n, t in module.state_dict().items())
    return tuple(parts)


def _input_dtype(model: Any) -> torch.dtype | None:
    """The dtype a user casts floating inputs to: the model's ``dtype``, else the dtype most
    of its parameters are in; None for a pipeline (it makes its own inputs)."""
    if not isinstance(model, torch.nn.Module):
        return None
    declared = getattr(model, "dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None
