"""Block-by-block validation for models whose fp32 copy does not fit in memory.

Both models are built as meta-device skeletons (no weights) and cut into blocks: the largest
subtrees whose fp32 weights fit a fraction of the budget (a decoder layer, a UNet down block).
A block's weights are read from the safetensors files just before its forward and dropped
right after, so only one block is ever resident, on the GPU when there is one.

1. The baseline (source weights upcast to fp32) runs once; every block's inputs and outputs
   are kept on the CPU (spilled to disk past a budget).
2. The candidate (converted weights in their stored dtypes, with the loader's boundary hooks)
   runs once. Each block, while resident, runs twice: on its own upstream activations (the
   free-running pass whose final outputs are compared end to end), and on the baseline's
   inputs to that block, cast to the dtypes the candidate feeds it (teacher forcing), whose
   output is compared with the baseline block's output. A broken block is named, not just
   detected somewhere downstream.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from precision_convert.convert.source import ModelSource, open_source
from precision_convert.convert.tensors import FileTensor, LazyTensor
from precision_convert.errors import CannotValidateError
from precision_convert.nested import map_tensors, tensors_in
from precision_convert.validate.execute import (
    METADATA_FUNCTIONS,
    Coverage,
    Outputs,
    flatten,
    function_name,
    run_probes,
)
from precision_convert.validate.execute import resolve as resolve_inputs
from precision_convert.validate.inputs import (
    ModelInputs,
    input_candidates,
    inputs_from_tensors,
    select_inputs,
)
from precision_convert.validate.memory import release_freed_memory
from precision_convert.validate.metrics import Measurement, compare, kind_of, measure
from precision_convert.validate.runner import (
    RUN_ERRORS,
    SEED,
    Component,
    ComponentResult,
    check_baseline,
    compare_outputs,
    component_record,
    recipe_validation,
    thresholds_for,
)

#: Share of the budget one block's fp32 weights may take: the rest holds the read buffer, the
#: block's activations, the kept baseline activations and allocator slack.
BLOCK_SHARE = 0.25
#: Share of the budget the kept baseline activations may take in memory before going to disk.
ACTIVATION_SHARE = 0.25


# --------------------------------------------------------------------------- skeletons


def build_skeleton(source: ModelSource) -> nn.Module:
    """The model's module tree with parameters on the meta device (buffers real: the
    non-persistent ones, such as rotary frequencies, are computed at construction)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        if source.library == "diffusers":
            import diffusers

            cls = getattr(diffusers, source.class_name or "", None)
            if not isinstance(cls, type):
                raise CannotValidateError(f"diffusers has no class {source.class_name!r}")
            model = cls.from_config(cls.load_config(source.root))
        elif source.library == "transformers":
            import transformers

            if source.config.get("auto_map"):
                raise CannotValidateError(
                    "block-wise validation cannot build remote code "
                    "(auto_map); validate on a machine where it fits"
                )
            config = transformers.AutoConfig.from_pretrained(source.root)
            name = (source.config.get("architectures") or [None])[0]
            cls = getattr(transformers, name, None) if name else None
            model = (
                cls(config) if isinstance(cls, type) else transformers.AutoModel.from_config(config)
            )
        else:
            import open_clip

            # The class itself: create_model() moves the model to a device, which meta cannot.
            config = dict(source.config["model_cfg"])
            hf_text = config.get("text_cfg", {}).get("hf_model_name")
            model = (open_clip.model.CustomTextCLIP if hf_text else open_clip.model.CLIP)(**config)
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    return model.eval()


Holder = tuple[nn.Module, str, str]  # (module, attribute, dotted name of the tensor)


def _owners(model: nn.Module) -> dict[str, list[Holder]]:
    """State-dict key -> every (module, attribute, name) holding that tensor (ties share a key)."""
    by_id: dict[int, str] = {}
    found: dict[str, list[Holder]] = {}
    for prefix, module in model.named_modules():
        tensors = list(module._parameters.items()) + [
            (n, b)
            for n, b in module._buffers.items()
            if n not in module._non_persistent_buffers_set
        ]
        for local, tensor in tensors:
            if tensor is None:
                continue
            name = f"{prefix}.{local}" if prefix else local
            found.setdefault(by_id.setdefault(id(tensor), name), []).append((module, local, name))
    return found


def _weight_map(model: nn.Module, source: ModelSource) -> dict[str, LazyTensor]:
    """State-dict key -> the file tensor that fills it.

    Checkpoint names go through the same mapping the loader uses (transformers renames legacy
    keys); a tied tensor stored under one of its names fills every holder.
    """
    from precision_convert.convert.loader import transformers_key_map

    if source.library == "transformers":
        key_of = transformers_key_map(model)
    else:
        state = set(model.state_dict())
        key_of = lambda name: name if name in state else None  # noqa: E731
    by_key = {key: t for t in source.tensors() if (key := key_of(t.name)) is not None}
    found: dict[str, LazyTensor] = {}
    for key, holders in _owners(model).items():
        hit = next((by_key[name] for _, _, name in holders if name in by_key), None)
        if hit is None:
            raise CannotValidateError(
                f"block-wise validation: no weight for {key!r} in {source.root}; validate "
                "where the model fits in memory"
            )
        found[key] = hit
    return found


def partition(model: nn.Module, limit: int, bytes_per_element: int = 4) -> list[str]:
    """Blocks: the largest subtrees whose weights fit ``limit`` bytes, in module order.

    A module with no children is a block whatever its size (it cannot be split).
    """
    blocks: list[str] = []

    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters()) * bytes_per_element

    def visit(name: str, module: nn.Module) -> None:
        children = [(n, c) for n, c in module.named_children() if size(c) > 0]
        # A ModuleList/ModuleDict has no forward: hooks on it would never fire.
        container = isinstance(module, nn.ModuleList | nn.ModuleDict)
        if name and not container and (size(module) <= limit or not children):
            blocks.append(name)
            return
        for child, sub in children:
            visit(f"{name}.{child}" if name else child, sub)

    visit("", model)
    return blocks


# --------------------------------------------------------------------------- streaming


def _read(tensor: LazyTensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One file tensor in ``dtype``, with no more than one copy of it in memory.

    When the file already holds ``dtype`` (the candidate always; an fp32 source's baseline)
    its bytes are read straight into the result. Otherwise chunks are converted into a single
    preallocated result: the peak is the result plus one chunk.
    """
    out = torch.empty(math.prod(tensor.shape), dtype=dtype)
    if isinstance(tensor, FileTensor) and tensor.dtype.torch == dtype and out.numel():
        with tensor.path.open("rb", buffering=0) as f:
            f.seek(tensor.begin)
            view = memoryview(out.view(torch.uint8).numpy()).cast("B")
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CannotValidateError(f"{tensor.path}: truncated at {tensor.name!r}")
                got += n
    else:
        start = 0
        for chunk in tensor.chunks():
            out[start : start + chunk.numel()] = chunk
            start += chunk.numel()
    return out.reshape(tensor.shape).to(device)


@dataclass
class _Streamer:
    """Materializes one block's tensors before its forward and puts the meta ones back after."""

    model: nn.Module
    weights: Mapping[str, LazyTensor]
    device: torch.device
    upcast: bool  # baseline: every floating tensor to fp32; candidate: stored dtypes
    coverage: Coverage | None = None  # told which tensor each loaded weight is
    keys_by_block: dict[str, list[str]] = field(default_factory=dict)
    owners: dict[str, list[Holder]] = field(default_factory=dict)
    saved: dict[str, list[tuple[nn.Module, str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.owners = _owners(self.model)

    def assign(self, blocks: list[str]) -> list[str]:
        """Give each tensor key to every block holding it (tied weights live in several);
        return the keys no block holds (they stay resident)."""
        rest = []
        for key, holders in self.owners.items():
            found = {b for b in blocks for _, _, name in holders if name.startswith(b + ".")}
            for block in found:
                self.keys_by_block.setdefault(block, []).append(key)
            if not found:
                rest.append(key)
        return rest

    def tensor(self, key: str) -> torch.Tensor:
        stored = self.weights[key]
        dtype = stored.dtype.torch
        if self.upcast and stored.dtype.is_float:
            dtype = torch.float32
        return _read(stored, dtype, self.device)

    def load_keys(self, tag: str, keys: list[str]) -> None:
        """Materialize ``keys`` in every module holding them; :meth:`unload` puts back what was
        there (the placeholders)."""
        saved = []
        for key in keys:
            value = self.tensor(key)
            param = nn.Parameter(value, requires_grad=False)  # one object: ties stay tied
            if self.coverage is not None:
                self.coverage.alias(param, key)
            for module, local, _ in self.owners[key]:
                table = module._parameters if local in module._parameters else module._buffers
                saved.append((table, local, table[local]))
                table[local] = param if table is module._parameters else value
        self.saved[tag] = saved

    def unload(self, tag: str) -> None:
        for table, local, old in self.saved.pop(tag, []):
            table[local] = old
        release_freed_memory()


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move the real buffers (``model.to`` would trip over the meta parameters)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)


Placeholders = dict[int, tuple[str, torch.Tensor]]


def install_placeholders(
    model: nn.Module, weights: Mapping[str, LazyTensor], device: torch.device, upcast: bool
) -> Placeholders:
    """Replace every weight by a placeholder: right shape, dtype and device, no memory.

    Model code reads weights outside their module's forward (``self.device``, T5's
    ``relative_attention_bias.weight.device``), which meta tensors would answer with "meta".
    A placeholder is one NaN expanded to the full shape: its metadata is right, :class:`LoadOnUse`
    swaps in the real tensor wherever its values are used outside a streamed block, and any use
    that still slips through turns the output NaN, which is caught, never silent.

    Returns:
        id of each placeholder -> (key of the tensor it stands for, the placeholder).
    """
    found: Placeholders = {}
    for key, holders in _owners(model).items():
        stored = weights[key].dtype
        dtype = torch.float32 if upcast and stored.is_float else stored.torch
        shape = weights[key].shape
        fill = math.nan if stored.is_float else 0
        placeholder = torch.full((1,) * len(shape), fill, dtype=dtype, device=device).expand(shape)
        is_param = any(local in module._parameters for module, local, _ in holders)
        stand_in = nn.Parameter(placeholder, requires_grad=False) if is_param else placeholder
        for module, local, _ in holders:
            if local in module._parameters:
                module._parameters[local] = stand_in
            else:
                module._buffers[local] = stand_in
        # Keyed by id, so the object is held too: a freed object's id can be reused.
        found[id(stand_in)] = (key, stand_in)
    return found


class LoadOnUse(TorchFunctionMode):
    """Weights used outside a streamed block — a parent reading ``child.weight`` (Whisper's
    positions), a module no hook covers — are read for that one operation and dropped."""

    def __init__(self, streamer: _Streamer, placeholders: Placeholders) -> None:
        super().__init__()
        self.streamer = streamer
        self.placeholders = placeholders

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        # A placeholder answers metadata questions itself; only its values need the file.
        if function_name(func) not in METADATA_FUNCTIONS:
            loaded: dict[str, torch.Tensor] = {}

            def real(value: Any) -> Any:
                is_tensor = isinstance(value, torch.Tensor)
                entry = self.placeholders.get(id(value)) if is_tensor else None
                if entry is None or entry[1] is not value:
                    return value
                key = entry[0]
                if key not in loaded:
                    loaded[key] = self.streamer.tensor(key)
                return loaded[key]

            args, kwargs = tree_map(real, (args, kwargs))
        return func(*args, **kwargs)


def build_streamed(source: ModelSource, *, upcast: bool) -> nn.Module:
    """The whole model on the CPU, filled from its files one tensor at a time.

    Peak memory is the model plus one tensor. ``from_pretrained(dtype=float32)`` of a bf16
    checkpoint instead keeps the file's mapped pages (0.5x) next to the fp32 weights (1x).

    Raises:
        CannotValidateError: the weights do not map one-to-one onto the model's tensors (a
            library that fuses them on load); build with the library instead.
    """
    model = build_skeleton(source)
    streamer = _Streamer(model, _weight_map(model, source), torch.device("cpu"), upcast=upcast)
    streamer.load_keys("", list(streamer.owners))
    return model


# --------------------------------------------------------------------------- activations


class ActivationStore:
    """Baseline block activations: in memory up to a byte budget, then on disk."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.memory: dict[tuple[str, int], Any] = {}
        self.disk: dict[tuple[str, int], Path] = {}
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def put(self, key: tuple[str, int], value: Any) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors_in(value))
        if self.used + size <= self.limit:
            self.memory[key] = value
            self.used += size
            return
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="precision-convert-acts-")
        path = Path(self._dir.name) / f"{len(self.disk)}.pt"
        torch.save(value, path)
        self.disk[key] = path

    def get(self, key: tuple[str, int]) -> Any:
        if key in self.memory:
            return self.memory[key]
        return torch.load(self.disk[key], weights_only=False)

    def clear(self) -> None:
        self.memory.clear()
        self.used = 0
        for path in self.disk.values():
            path.unlink(missing_ok=True)
        self.disk.clear()

    def close(self) -> None:
        self.clear()
        if self._dir is not None:
            self._dir.cleanup()


def _to_cpu(value: Any) -> Any:
    return map_tensors(value, lambda t: t.detach().to("cpu"))


def _like(baseline: Any, live: Any, device: torch.device) -> Any:
    """The baseline's block inputs, each floating tensor in the dtype the candidate fed there."""
    if isinstance(baseline, torch.Tensor):
        dtype = (
            live.dtype if isinstance(live, torch.Tensor) and baseline.is_floating_point() else None
        )
        return baseline.to(device=device, dtype=dtype or baseline.dtype)
    if isinstance(baseline, Mapping) and isinstance(live, Mapping):
        return {k: _like(v, live.get(k), device) for k, v in baseline.items()}
    if (
        isinstance(baseline, list | tuple)
        and isinstance(live, list | tuple)
        and len(live) == len(baseline)
    ):
        items = [_like(b, v, device) for b, v in zip(baseline, live, strict=True)]
        return type(baseline)(*items) if hasattr(baseline, "_fields") else type(baseline)(items)
    return map_tensors(baseline, lambda t: t.to(device))


# --------------------------------------------------------------------------- the two passes


@dataclass
class _Pass:
    """Hooks for one streamed pass over a skeleton: load/unload, plus capture or compare."""

    streamer: _Streamer
    placeholders: Placeholders
    blocks: list[str]
    store: ActivationStore
    teacher: Callable[[str, int, nn.Module, tuple[Any, ...], dict[str, Any]], None] | None = None
    calls: dict[str, int] = field(default_factory=dict)
    inputs: dict[tuple[str, int], tuple[tuple[Any, ...], dict[str, Any]]] = field(
        default_factory=dict
    )
    replaying: bool = False

    @contextmanager
    def installed(self) -> Iterator[_Pass]:
        handles = []
        for name in self.blocks:
            module = self.streamer.model.get_submodule(name)
            # prepend: weights must be in place before the loader's casting hooks read dtypes.
            handles.append(
                module.register_forward_pre_hook(self._pre(name), with_kwargs=True, prepend=True)
            )
            handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        try:
            with LoadOnUse(self.streamer, self.placeholders):
                yield self
        finally:
            for handle in handles:
                handle.remove()
            for name in list(self.streamer.saved):
                self.streamer.unload(name)

    def reset(self) -> None:
        """Forget a failed attempt (another candidate input is about to be tried)."""
        for tag in [t for t in self.streamer.saved if t]:  # blocks an exception left loaded
            self.streamer.unload(tag)
        self.calls.clear()
        self.inputs.clear()
        self.store.clear()

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.replaying:
                return
            index = self.calls.get(name, 0)
            self.calls[name] = index + 1
            self.streamer.load_keys(name, self.streamer.keys_by_block.get(name, []))
            if self.teacher is None:
                self.inputs[(name, index)] = (_to_cpu(args), _to_cpu(kwargs))

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            if self.replaying:
                return
            index = self.calls[name] - 1
            if self.teacher is None:
                self.store.put((name, index), (*self.inputs.pop((name, index)), _to_cpu(output)))
            else:
                self.replaying = True
                try:
                    self.teacher(name, index, module, args, kwargs)
                finally:
                    self.replaying = False
            self.streamer.unload(name)

        return hook


def validate_blockwise(
    component: Component,
    device: torch.device,
    budget: int,
    supplied: Mapping[str, torch.Tensor] | None,
) -> ComponentResult:
    """Compare ``component`` with its baseline holding one block's weights at a time."""
    base_source = open_source(component.baseline_dir)
    if not isinstance(base_source, ModelSource):
        raise CannotValidateError("block-wise validation takes one model, not a pipeline")
    baseline = build_skeleton(base_source)
    limit = max(1, int(budget * BLOCK_SHARE))
    blocks = partition(baseline, limit)
    store = ActivationStore(int(budget * ACTIVATION_SHARE))
    try:
        base_weights = _weight_map(baseline, base_source)
        base_placeholders = install_placeholders(baseline, base_weights, device, upcast=True)
        coverage = Coverage()
        base_streamer = _Streamer(baseline, base_weights, device, upcast=True, coverage=coverage)
        resident = base_streamer.assign(blocks)
        base_streamer.load_keys("", resident)
        _buffers_to(baseline, device)
        base_pass = _Pass(base_streamer, base_placeholders, blocks, store)

        def run(model: nn.Module, inputs: ModelInputs) -> Outputs:
            base_pass.reset()
            with coverage.track(model):
                return run_probes(model, inputs, device, torch.float32)

        if supplied is not None:
            candidates = iter([inputs_from_tensors(baseline, supplied, seed=SEED)])
        else:
            candidates = input_candidates(baseline, seed=SEED)
        with base_pass.installed():
            chosen, base_out = select_inputs(baseline, candidates, run)
        check_baseline(
            base_out,
            component,
            " (block-wise: the model reads a weight outside the "
            "module that owns it; validate where it fits in memory)",
        )
        frozen = resolve_inputs(chosen, base_out)

        record, thresholds = component_record(
            component, chosen.task, frozen, "blockwise", blocks=len(blocks)
        )
        block_thresholds = thresholds_for("block", recipe_validation(record.recipe))
        metrics = measure(
            component.name, "forward", "*", {"coverage": coverage.fraction}, thresholds
        )
        try:
            cand_out, block_metrics = _candidate_pass(
                component, blocks, store, frozen, device, block_thresholds
            )
        except RUN_ERRORS as exc:
            text = str(exc).strip().splitlines()
            return ComponentResult(
                record,
                metrics,
                [
                    f"{component.name or 'model'}: the converted model failed to run: "
                    f"{type(exc).__name__}: {text[0] if text else ''}"
                ],
            )
        metrics += block_metrics
        metrics += compare_outputs(component.name, frozen, base_out, cand_out, thresholds)
        return ComponentResult(record, metrics, [])
    finally:
        store.close()


def _candidate_pass(
    component: Component,
    blocks: list[str],
    store: ActivationStore,
    inputs: ModelInputs,
    device: torch.device,
    thresholds: Mapping[str, float],
) -> tuple[Outputs, list[Measurement]]:
    from precision_convert.convert.boundaries import find_boundaries, install

    candidate = build_skeleton(component.converted)
    weights = _weight_map(candidate, component.converted)
    placeholders = install_placeholders(candidate, weights, device, upcast=False)
    islands = dict(component.record.get("islands", {}))
    names = {n for n, _ in candidate.named_modules()} | set(_owners(candidate))
    install(
        candidate,
        find_boundaries(
            candidate,
            compute=component.compute_dtype,
            reasons={k: v for k, v in islands.items() if k in names},
        ),
    )
    streamer = _Streamer(candidate, weights, device, upcast=False)
    streamer.load_keys("", streamer.assign(blocks))
    _buffers_to(candidate, device)
    metrics: list[Measurement] = []

    def teacher(
        name: str, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        base_args, base_kwargs, base_output = store.get((name, index))
        output = module(*_like(base_args, args, device), **_like(base_kwargs, kwargs, device))
        got, want = flatten(output), flatten(base_output)
        label = f"block:{name}" + (f"#{index + 1}" if index else "")
        for key, base in want.items():
            cand = got.get(key)
            if cand is None or cand.shape != base.shape:
                metrics.append(
                    Measurement(component.name, label, key, "nonfinite", None, 0.0, "max", False)
                )
                continue
            metrics.extend(
                measure(
                    component.name,
                    label,
                    key,
                    compare(base, cand, kind_of(key, images=False)),
                    thresholds,
                )
            )

    cand_pass = _Pass(streamer, placeholders, blocks, store, teacher)
    with cand_pass.installed():
        outputs = run_probes(candidate, inputs, device, component.compute_dtype)
    return outputs, metrics
