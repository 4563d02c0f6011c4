"""Running probes on a model and flattening whatever it returns into named tensors.

Models return tensors, tuples, ``ModelOutput`` dicts, nested outputs (CLIP's
``text_model_output``) and plain objects (a VAE's ``latent_dist``). Metrics need one flat
``{"logits": t, "latent_dist.mean": t}`` view of all of them, on the CPU so that the model
that produced them can be freed before the next one is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from precision_convert.conversion.runtime.streaming import METADATA_FUNCTIONS, function_name
from precision_convert.errors import CannotValidateError
from precision_convert.validation.probe.inputs import (
    FromOutput,
    ModelInputs,
    Probe,
    Seeded,
    input_candidates,
)

#: Output fields that are caches or bookkeeping, not results: never compared.
_SKIP_OUTPUTS = frozenset({"past_key_values", "cache_params", "nsfw_content_detected"})

#: The fields that define a Gaussian latent distribution.
_DISTRIBUTION = ("mean", "logvar")

Outputs = dict[str, dict[str, torch.Tensor]]
#: Errors a model raises when it cannot run on what it was given (dtype clashes included).
RUN_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError)


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
    # forward goes through __call__: the model's own hooks (the loader's input casts) must run.
    method = model if probe.method == "forward" else getattr(model, probe.method)
    with torch.no_grad():
        result = method(**kwargs)
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


def build_inputs(model: Any, *, seed: int = 0, tokenizer: Any | None = None) -> ModelInputs:
    """The seeded inputs ``model`` accepts (tries the candidates on it when there are several).

    Reusable outside validation (activation analysis): give it any transformers, diffusers or
    OpenCLIP model, get inputs that exercise it.

    Raises:
        CannotValidateError: no candidate runs; the message carries the model's last error.
    """
    inputs, _ = select_inputs(
        model, input_candidates(model, seed=seed, tokenizer=tokenizer), run_probes
    )
    return inputs


def select_inputs(
    model: Any,
    candidates: Iterator[ModelInputs],
    run: Callable[[Any, ModelInputs], dict[str, dict[str, torch.Tensor]]],
) -> tuple[ModelInputs, dict[str, dict[str, torch.Tensor]]]:
    """Run candidates until one works; return it with its outputs (so nothing runs twice)."""
    errors: list[str] = []
    for candidate in candidates:
        try:
            return candidate, run(model, candidate)
        except RUN_ERRORS as e:
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    detail = errors[-1] if errors else "no candidate inputs"
    raise CannotValidateError(
        f"cannot validate {type(model).__name__}: the model rejected every built input "
        f"({len(errors)} tried; last: {detail}); pass --inputs"
    )


class Coverage(TorchFunctionMode):
    """Which share of a model's parameters a run computed with.

    A model fed only part of what it takes (a vision-language model given text alone) still
    produces outputs; this is what shows that half of it was never compared. Use is seen at
    the level of torch operations, so weights a module uses without being called
    (``nn.MultiheadAttention``'s ``out_proj``) count, and metadata reads (``self.dtype``) do not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}  # id of a tensor -> the parameter it is
        self.sizes: dict[str, int] = {}
        self.used: set[str] = set()
        self.fraction = 0.0

    @contextmanager
    def track(self, model: torch.nn.Module) -> Iterator[Coverage]:
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.sizes = {name: p.numel() for name, p in model.named_parameters()}
        self.used = set()
        try:
            with self:
                yield self
        finally:
            total = sum(self.sizes.values())
            used = sum(self.sizes[name] for name in self.used)
            self.fraction = used / total if total else 1.0

    def alias(self, tensor: torch.Tensor, name: str) -> None:
        """``tensor`` now stands for parameter ``name`` (block-wise runs load weights anew)."""
        if name in self.sizes:
            self.names[id(tensor)] = name

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if function_name(func) not in METADATA_FUNCTIONS:
            for leaf in tree_leaves((args, kwargs)):
                name = self.names.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if name is not None:
                    self.used.add(name)
        return func(*args, **kwargs)
