"""Running probes on a model and flattening whatever it returns into named tensors.

Models return tensors, tuples, ``ModelOutput`` dicts, nested outputs (CLIP's
``text_model_output``) and plain objects (a VAE's ``latent_dist``). Metrics need one flat
``{"logits": t, "latent_dist.mean": t}`` view of all of them, on the CPU so that the model
that produced them can be freed before the next one is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from precision_convert.validate.inputs import FromOutput, ModelInputs, Probe, Seeded

#: Output fields that are caches or bookkeeping, not results: never compared.
_SKIP_OUTPUTS = frozenset({"past_key_values", "cache_params", "nsfw_content_detected"})

#: The fields that define a Gaussian latent distribution.
_DISTRIBUTION = ("mean", "logvar")

Outputs = dict[str, dict[str, torch.Tensor]]


def flatten(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every floating tensor in ``value``, keyed by its dotted path, detached onto the CPU."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out[prefix or "output"] = value.detach().to("cpu")
    elif type(value).__module__ == "numpy" and hasattr(value, "dtype"):  # pipelines' "np" output
        out.update(flatten(torch.as_tensor(value), prefix))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if key not in _SKIP_OUTPUTS:
                out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{i}" if prefix else str(i)))
    elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        # Plain result objects such as diffusers' DiagonalGaussianDistribution. A distribution
        # also caches views and transforms of its parameters (std, var): compare only what
        # defines it, so each number is judged once.
        fields = vars(value)
        keys = _DISTRIBUTION if all(k in fields for k in _DISTRIBUTION) else list(fields)
        for key in keys:
            item = fields[key]
            if not key.startswith("_") and isinstance(item, torch.Tensor):
                out.update(flatten(item, f"{prefix}.{key}" if prefix else key))
    return out


def latent_of(outputs: Mapping[str, torch.Tensor], name: str | None) -> torch.Tensor:
    """The output another probe consumes: ``name``, else a distribution's mean, else latents."""
    if name is not None:
        return outputs[name]
    for key in outputs:
        if key.endswith(".mean") or key == "latents" or key.endswith(".latents"):
            return outputs[key]
    return next(iter(outputs.values()))


def _prepare(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Move inputs to the device; floating ones to the model's compute dtype, as a caller would."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and dtype is not None:
            return value.to(device=device, dtype=dtype)
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _prepare(v, device, dtype) for k, v in value.items()}
    if isinstance(value, Seeded):
        return torch.Generator("cpu").manual_seed(value.seed)  # fresh for every run
    return value


def resolve(inputs: ModelInputs, outputs: Outputs) -> ModelInputs:
    """Replace every :class:`FromOutput` by the tensor it names in ``outputs`` (the baseline's)."""
    probes = []
    for probe in inputs.probes:
        kwargs = {
            k: latent_of(outputs[v.probe], v.output) if isinstance(v, FromOutput) else v
            for k, v in probe.kwargs.items()
        }
        probes.append(replace(probe, kwargs=kwargs))
    return replace(inputs, probes=tuple(probes))


def call_probe(
    model: Any,
    probe: Probe,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Run one probe (inputs already resolved) and return its flattened CPU outputs."""
    device = torch.device(device or "cpu")
    kwargs = {k: _prepare(v, device, dtype) for k, v in probe.kwargs.items()}
    with torch.no_grad():
        result = getattr(model, probe.method)(**kwargs)
    return flatten(result)


def run_probes(
    model: Any,
    inputs: ModelInputs,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Outputs:
    """Run every probe in order, feeding later probes from earlier outputs where asked."""
    outputs: Outputs = {}
    for probe in resolve_partial(inputs, outputs):
        outputs[probe.name] = call_probe(model, probe, device, dtype)
    return outputs


def resolve_partial(inputs: ModelInputs, outputs: Outputs) -> Any:
    """Yield probes one at a time, resolving references against outputs gathered so far."""
    for probe in inputs.probes:
        yield resolve(replace(inputs, probes=(probe,)), outputs).probes[0]


@dataclass
class Coverage:
    """Which parameters a run exercised: those of every module whose forward was called.

    A model fed only part of what it takes (a vision-language model given text alone) still
    produces outputs; this is what shows that half of it was never compared.
    """

    called: set[int] = field(default_factory=set)
    fraction: float = 0.0

    @contextmanager
    def track(self, model: torch.nn.Module) -> Iterator[Coverage]:
        self.called.clear()
        modules = list(model.modules())
        handles = [m.register_forward_pre_hook(self._seen) for m in modules]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
        # A tied parameter counts once, as exercised when any module holding it ran.
        params: dict[int, tuple[int, bool]] = {}
        for module in modules:
            ran = id(module) in self.called
            for param in module.parameters(recurse=False):
                size, before = params.get(id(param), (param.numel(), False))
                params[id(param)] = (size, before or ran)
        total = sum(size for size, _ in params.values())
        used = sum(size for size, ran in params.values() if ran)
        self.fraction = used / total if total else 1.0

    def _seen(self, module: torch.nn.Module, args: Any) -> None:
        self.called.add(id(module))
