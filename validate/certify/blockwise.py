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

import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precision_convert.conversion.io.source import ModelSource, open_source
from precision_convert.conversion.runtime.boundaries import find_boundaries, install
from precision_convert.conversion.runtime.builders import build_skeleton, key_map
from precision_convert.conversion.runtime.loader import model_reasons
from precision_convert.conversion.runtime.streaming import (
    LoadOnUse,
    Placeholders,
    Streamer,
    buffers_to,
    fp32_dtype,
    install_placeholders,
    stored_dtype,
)
from precision_convert.core.errors import CannotValidateError, WeightsDoNotMap, one_line
from precision_convert.core.nested import map_tensors, tensors_in
from precision_convert.validation.certify.components import (
    Component,
    ComponentResult,
    check_baseline,
    component_record,
)
from precision_convert.validation.certify.modules import judge_modules
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.sweep import SweepSettings
from precision_convert.validation.probe.inputs.tokenizers import tokenizer_for
from precision_convert.validation.probe.run.execute import (
    RUN_ERRORS,
    Coverage,
    Outputs,
    all_finite,
    flatten,
    run_probes,
)
from precision_convert.validation.probe.run.execute import resolve as resolve_inputs
from precision_convert.validation.probe.run.metrics import (
    Measurement,
    compare,
    intermediate_states,
    kind_of,
    measure,
)
from precision_convert.validation.probe.run.parity import (
    compare_outputs,
    recipe_validation,
    thresholds_for,
)
from precision_convert.validation.probe.run.session import sweep_model

#: Share of the budget one block's fp32 weights may take: the rest holds the read buffer, the
#: block's activations, the kept baseline activations and allocator slack.
BLOCK_SHARE = 0.25
#: Share of the budget the kept baseline activations may take in memory before going to disk.
ACTIVATION_SHARE = 0.25


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

    streamer: Streamer
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


def _streamed(
    source: ModelSource,
    device: torch.device,
    dtype_of: Callable[[Any], torch.dtype],
    on_load: Callable[[nn.Parameter, str], None] | None = None,
    *,
    trust_remote_code: bool = False,
) -> tuple[Streamer, Placeholders]:
    """``source``'s skeleton, from the builder ``pc.load`` uses, with every weight a
    placeholder and a streamer that loads them in ``dtype_of(stored)``."""
    model = build_skeleton(source, trust_remote_code=trust_remote_code)
    try:
        streamer = Streamer(model, source, key_map(model, source), device, dtype_of, on_load)
    except WeightsDoNotMap as exc:
        raise CannotValidateError(
            f"block-wise validation: {exc}; validate where the model fits in memory"
        ) from None
    return streamer, install_placeholders(streamer)


def validate_blockwise(
    component: Component,
    device: torch.device,
    budget: int,
    supplied: Mapping[str, torch.Tensor] | None,
    sweep_for: SweepSettings | None = None,
) -> ComponentResult:
    """Compare ``component`` with its baseline holding one block's weights at a time."""
    base_source = open_source(component.baseline_dir)
    if not isinstance(base_source, ModelSource):
        raise CannotValidateError("block-wise validation takes one model, not a pipeline")
    coverage = Coverage()
    base_streamer, base_placeholders = _streamed(
        base_source,
        device,
        fp32_dtype,
        coverage.alias,
        trust_remote_code=component.trust_remote_code,
    )
    baseline = base_streamer.model
    limit = max(1, int(budget * BLOCK_SHARE))
    blocks = partition(baseline, limit)
    store = ActivationStore(int(budget * ACTIVATION_SHARE))
    try:
        base_streamer.load_keys("", base_streamer.assign(blocks))
        buffers_to(baseline, device)
        base_pass = _Pass(base_streamer, base_placeholders, blocks, store)

        def run(model: nn.Module, inputs: ModelInputs) -> Outputs:
            base_pass.reset()
            with coverage.track(model):
                outputs = run_probes(model, inputs, device, torch.float32)
                if not all_finite(outputs):
                    coverage.unjudged()
                return outputs

        with base_pass.installed():
            # The sweep runs in the same pass: every probe's block activations are kept.
            task, swept, base_out = sweep_model(
                baseline,
                run,
                sweep_for or SweepSettings(),
                tokenizer=tokenizer_for(component.converted.root),
                component=component.name,
                directory=component.converted.root,
                supplied=supplied,
                memory=budget,  # probes sized so one forward fits next to one block
            )
        check_baseline(
            base_out,
            component,
            " (block-wise: the model reads a weight outside the "
            "module that owns it; validate where it fits in memory)",
        )
        frozen = resolve_inputs(swept, base_out)

        record, thresholds = component_record(
            component, task, swept, "blockwise", blocks=len(blocks)
        )
        block_thresholds = thresholds_for("block", recipe_validation(record.recipe))
        covered = judge_modules(component, coverage.usage, swept, record)
        metrics = measure(component.name, "forward", "*", {"coverage": covered.share}, thresholds)
        try:
            cand_out, block_metrics = _candidate_pass(
                component, blocks, store, frozen, device, block_thresholds
            )
        except RUN_ERRORS as exc:
            return ComponentResult(
                record,
                metrics,
                [
                    f"{component.name or 'model'}: the converted model failed to run: "
                    f"{one_line(exc)}"
                ],
            )
        metrics += block_metrics
        metrics += compare_outputs(component.name, frozen, base_out, cand_out, thresholds)
        return ComponentResult(record, metrics, covered.failures(component.name))
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
    streamer, placeholders = _streamed(
        component.converted, device, stored_dtype, trust_remote_code=component.trust_remote_code
    )
    candidate = streamer.model
    # The boundaries pc.load would install: same record, same key map, same reasons.
    reasons = model_reasons(
        dict(component.record.islands),
        list(component.converted.tensors()),
        streamer.key_of,
    )
    install(
        candidate,
        find_boundaries(candidate, compute=component.compute_dtype, reasons=reasons),
    )
    streamer.load_keys("", streamer.assign(blocks))
    buffers_to(candidate, device)
    metrics: list[Measurement] = []

    def teacher(
        name: str, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        base_args, base_kwargs, base_output = store.get((name, index))
        output = module(*_like(base_args, args, device), **_like(base_kwargs, kwargs, device))
        got, want = flatten(output), flatten(base_output)
        label = f"block:{name}" + (f"#{index + 1}" if index else "")
        inner = intermediate_states(want)
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
                    compare(base, cand, kind_of(key, images=False), intermediate=key in inner),
                    thresholds,
                )
            )

    cand_pass = _Pass(streamer, placeholders, blocks, store, teacher)
    with cand_pass.installed():
        outputs = run_probes(candidate, inputs, device, component.compute_dtype)
    return outputs, metrics
