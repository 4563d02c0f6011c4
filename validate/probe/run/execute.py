"""Running probes on a model and flattening whatever it returns into named tensors.

Models return tensors, tuples, ``ModelOutput`` dicts, nested outputs (CLIP's
``text_model_output``) and plain objects (a VAE's ``latent_dist``). Metrics need one flat
``{"logits": t, "latent_dist.mean": t}`` view of all of them, on the CPU so that the model
that produced them can be freed before the next one is loaded.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from precision_convert.conversion.analysis.activations import unrecorded
from precision_convert.conversion.runtime.memory import release_freed_memory
from precision_convert.conversion.runtime.streaming import METADATA_FUNCTIONS, function_name
from precision_convert.core.dtypes import from_torch
from precision_convert.core.errors import CannotValidateError, InputError, one_line
from precision_convert.core.progress import forward_ran, ledger_span, record_forwards, report
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.model_inputs import (
    FromOutput,
    ModelInputs,
    Probe,
    Seeded,
    cache_argument,
)
from precision_convert.validation.probe.inputs.sweep import sweep
from precision_convert.validation.probe.run.continuations import (
    STEP_PEAKS,
    continued_cache,
    step_peaks,
)
from precision_convert.validation.probe.run.head import head_outputs, sampled_head
from precision_convert.validation.probe.run.modules import ModuleUsage, module_usage

#: Output fields that are caches or bookkeeping, not results: never compared.
_SKIP_OUTPUTS = frozenset({"past_key_values", "cache_params", "nsfw_content_detected"})

#: The fields that define a Gaussian latent distribution.
_DISTRIBUTION = ("mean", "logvar")

#: Each probe's flattened outputs, by probe name (in memory, or :class:`SpilledOutputs`).
Outputs = MutableMapping[str, dict[str, torch.Tensor]]
#: Where :func:`run_probes` keeps outputs inside a :func:`spilled_outputs` block.
_SPILL: ContextVar[Path | None] = ContextVar("precision_convert_spill", default=None)
#: Errors a model raises when it cannot run on what it was given (dtype clashes included;
#: OverflowError: a pipeline padding prompts to a tokenizer's unset model_max_length, 1e30).
RUN_ERRORS = (
    RuntimeError,
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,
    OverflowError,
)


def flatten(value: Any, prefix: str = "", *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every floating tensor in ``value``, keyed by its dotted path, detached (onto the CPU
    unless ``cpu`` is false)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out[prefix or "output"] = value.detach().to("cpu") if cpu else value.detach()
    elif type(value).__module__ == "numpy" and hasattr(value, "dtype"):  # pipelines' "np" output
        out.update(flatten(torch.as_tensor(value), prefix, cpu=cpu))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if key not in _SKIP_OUTPUTS:
                out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key), cpu=cpu))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{i}" if prefix else str(i), cpu=cpu))
    elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        # Plain result objects such as diffusers' DiagonalGaussianDistribution. A distribution
        # also caches views and transforms of its parameters (std, var): compare only what
        # defines it, so each number is judged once.
        fields = vars(value)
        keys = _DISTRIBUTION if all(k in fields for k in _DISTRIBUTION) else list(fields)
        for key in keys:
            item = fields[key]
            if not key.startswith("_") and isinstance(item, torch.Tensor):
                out.update(flatten(item, f"{prefix}.{key}" if prefix else key, cpu=cpu))
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
    *,
    sample_head: bool = True,
) -> dict[str, torch.Tensor]:
    """Run one probe (inputs already resolved) and return its flattened CPU outputs.

    A summarized probe's output head computes the rows it keeps only (:mod:`.head`) unless
    ``sample_head`` is false."""
    device = torch.device(device or "cpu")
    kwargs = {k: _prepare(v, device, dtype) for k, v in probe.kwargs.items()}
    # forward goes through __call__: the model's own hooks (the loader's input casts) must run.
    method = model if probe.method == "forward" else getattr(model, probe.method)
    limit = probe.max_output if probe.method == "forward" and sample_head else None
    # A free generation's activations are its teacher-forced twin's: no hook records them twice.
    with (
        torch.no_grad(),
        unrecorded() if probe.finite_only else contextlib.nullcontext(),
    ):
        if probe.prefix is not None:
            prefix = _prepare(probe.prefix, device, None)
            kwargs[cache_argument(model) or "cache"] = continued_cache(model, prefix, kwargs)
        if probe.method == "generate":
            with step_peaks(model) as peaks:
                method(**kwargs)
            result = {STEP_PEAKS: torch.stack(peaks, 1)} if peaks else {}
            head = None
        else:
            with sampled_head(model, limit) as head:
                result = method(**kwargs)
    if probe.max_output is None and probe.positions is None:
        return flatten(result)
    kept = flatten(result, cpu=False)
    summarized = head_outputs(kept, head, probe.positions) if head is not None else {}
    if head is not None and head.returned is not None and not summarized:
        # The model reshaped its head's rows past recognition: run it with the head whole.
        return call_probe(model, probe, device, dtype, sample_head=False)
    if probe.positions is not None:
        kept = padding_excluded(kept, probe.positions)
    if probe.max_output is not None:
        # Summarized where the outputs are (a GPU's logits never travel whole to the CPU).
        kept = summarize(kept, probe.max_output)
    kept.update(summarized)
    return {name: tensor.to("cpu") for name, tensor in kept.items()}


def padding_excluded(
    outputs: Mapping[str, torch.Tensor], positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Outputs shaped (batch, length, ...) like ``positions`` zeroed where it is False.

    Padded positions compute garbage that no caller reads (and that can differ wildly between
    precisions); a NaN there that leaks into real positions still shows at those.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in outputs.items():
        if tensor.dim() >= 2 and tuple(tensor.shape[:2]) == tuple(positions.shape):
            keep = positions.to(tensor.device).reshape(*positions.shape, *[1] * (tensor.dim() - 2))
            tensor = tensor.masked_fill(~keep, 0)
        out[name] = tensor
    return out


def summarize(outputs: Mapping[str, torch.Tensor], limit: int) -> dict[str, torch.Tensor]:
    """Outputs over ``limit`` elements as a strided sample of their rows plus each row's RMS.

    A sweep over a whole vocabulary would otherwise keep logits of every token (tens of GB
    for a 128k vocabulary). The sample keeps the full per-row metrics (top-1, KL) on evenly
    spread rows; ``<name>.rms`` (per row, over the last dimension, accumulated in float32 so an
    fp16 candidate's squares cannot overflow) keeps NaN/Inf and magnitude errors of every row
    visible. Baseline and candidate run the same probe, so both are summarized alike.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in outputs.items():
        if tensor.numel() <= limit or tensor.dim() < 2:
            out[name] = tensor
            continue
        width = tensor.shape[-1]
        rows = tensor.reshape(-1, width)
        stride = max(1, -(-tensor.numel() // limit))
        out[name] = rows[::stride].clone()
        norm = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32)
        out[f"{name}.rms"] = (norm / math.sqrt(width)).reshape(tensor.shape[:-1])
    return out


def run_probes(
    model: Any,
    inputs: ModelInputs,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    stop: Callable[[str, dict[str, torch.Tensor]], bool] | None = None,
    around: Callable[[str], AbstractContextManager[None]] | None = None,
) -> Outputs:
    """Run every probe in order, feeding later probes from earlier outputs where asked.

    ``stop(name, outputs)`` hears each probe's outputs as they come; when it returns true the
    run ends there (a candidate that already failed needs no more forwards), and the outputs
    hold the probes run so far. ``around(name)`` wraps each probe's call (hooks a probe needs).
    """
    spill = _SPILL.get()
    outputs: Outputs = SpilledOutputs(spill) if spill is not None else {}
    precision = from_torch(dtype).short if dtype is not None else "stored dtypes"
    what = f"{type(model).__name__} {precision} probes"
    start = time.perf_counter()
    ran, forwarding = 0, 0.0
    by_kind: dict[str, tuple[int, float]] = {}
    with _no_denoising_bar(model):
        for probe in resolve_partial(inputs, outputs):
            report(what, ran, len(inputs.probes))
            # What earlier probes freed goes back first: glibc keeps freed heap pages, and a
            # sweep's probes of every shape leave the heap 1 GiB above what is live (265M model).
            release_freed_memory()
            began = time.perf_counter()
            with around(probe.name) if around is not None else contextlib.nullcontext():
                result = call_probe(model, probe, device, dtype)
            took = time.perf_counter() - began
            forwarding += took
            kind = str(probe.sweep.get("kind", "layout"))
            done, seconds = by_kind.get(kind, (0, 0.0))
            by_kind[kind] = (done + 1, seconds + took)
            outputs[probe.name] = result
            ran += 1
            forward_ran(precision, took, bool(probe.sweep), str(probe.sweep.get("kind", "")))
            if stop is not None and stop(probe.name, result):
                break
    report(what, ran, ran)
    record_forwards(what, ran, time.perf_counter() - start, forwarding, by_kind)
    return outputs


@contextmanager
def _no_denoising_bar(model: Any) -> Iterator[None]:
    """A diffusers pipeline's own bar over its denoising steps off while probes run it (the
    probes report their own progress); the pipeline's setting is put back afterwards."""
    if not callable(getattr(model, "set_progress_bar_config", None)):
        yield
        return
    before = dict(getattr(model, "_progress_bar_config", None) or {})
    model.set_progress_bar_config(**before, disable=True)
    try:
        yield
    finally:
        model.set_progress_bar_config(**before)


class SpilledOutputs(MutableMapping[str, dict[str, torch.Tensor]]):
    """Probe outputs on disk, one safetensors file per probe, read back when asked for.

    Validation keeps every probe's baseline outputs until the candidate has run and been
    compared. A coverage sweep's kept logits (1M elements a probe, dozens of probes) are small
    next to a large model but not next to a mid-size one, where they pushed peak memory to
    1.7x the fp32 model; on disk, one probe's outputs are resident at a time.
    """

    def __init__(self, directory: Path) -> None:
        try:
            self._directory = Path(tempfile.mkdtemp(prefix="outputs-", dir=directory))
        except OSError as exc:
            raise _no_room(directory, exc.strerror or str(exc)) from None
        self._files: dict[str, Path] = {}

    def __setitem__(self, probe: str, outputs: dict[str, torch.Tensor]) -> None:
        path = self._files.get(probe) or self._directory / f"{len(self._files)}.pt"
        # torch.save writes each storage straight from memory; safetensors' save_file needed a
        # clone of every output and copied each again into Python bytes: three copies of a
        # probe's outputs at once.
        try:
            with ledger_span("spill"):
                torch.save({name: _own_storage(t.detach()) for name, t in outputs.items()}, path)
        except (OSError, RuntimeError) as exc:
            # A full TMPDIR: torch reports it as a RuntimeError ("unexpected pos …"), which
            # would otherwise pass for the model rejecting its inputs.
            path.unlink(missing_ok=True)
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "write failed"
            raise _no_room(self._directory.parent, why) from None
        self._files[probe] = path

    def __getitem__(self, probe: str) -> dict[str, torch.Tensor]:
        return torch.load(self._files[probe], weights_only=True, mmap=True)

    def __delitem__(self, probe: str) -> None:
        self._files.pop(probe).unlink()

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._files))

    def __len__(self) -> int:
        return len(self._files)


def _no_room(directory: Path, why: str) -> CannotValidateError:
    """Validation cannot keep its probe outputs in the temporary folder: said as such (what is
    left free there included), never blamed on the model; the output gets a failing
    certificate that says so, as for any validation that cannot run."""
    with contextlib.suppress(OSError):
        why += f"; {shutil.disk_usage(directory).free / 2**20:.0f} MiB free there"
    return CannotValidateError(
        f"cannot validate: the probe outputs cannot be written to the temporary folder "
        f"{directory} ({why}): free space there, or set TMPDIR to a folder with room, then "
        "run validate again"
    )


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` holding a storage of its own size: torch.save writes a view's whole storage
    (a slice of the logits would write all of them)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() == tensor.nbytes and tensor.storage_offset() == 0:
        return tensor
    return tensor.clone()


@contextmanager
def spilled_outputs(directory: Path) -> Iterator[None]:
    """Inside, :func:`run_probes` keeps its outputs in ``directory`` (see
    :class:`SpilledOutputs`); the caller owns the directory and removes it."""
    token = _SPILL.set(directory)
    try:
        yield
    finally:
        _SPILL.reset(token)


@contextmanager
def outputs_on_disk() -> Iterator[None]:
    """Inside, probe outputs are kept in a temporary directory of their own, removed on exit
    (:func:`spilled_outputs`): a sweep's kept outputs are not small next to a mid-size model."""
    try:
        folder = tempfile.TemporaryDirectory(prefix="precision-convert-outputs-")
    except OSError as exc:
        raise _no_room(Path(tempfile.gettempdir()), exc.strerror or str(exc)) from None
    with folder as spill, spilled_outputs(Path(spill)):
        yield


def resolve_partial(inputs: ModelInputs, outputs: Outputs) -> Any:
    """Yield probes one at a time, resolving references against outputs gathered so far."""
    for probe in inputs.probes:
        yield resolve(replace(inputs, probes=(probe,)), outputs).probes[0]


def build_inputs(
    model: Any,
    *,
    seed: int = 0,
    tokenizer: Any | None = None,
    coverage: str | None = None,
) -> ModelInputs:
    """The seeded inputs ``model`` accepts (tries the candidates on it when there are several).

    Reusable outside validation (activation analysis): give it any transformers, diffusers or
    OpenCLIP model, get inputs that exercise it. With ``coverage`` (``quick``, ``standard``,
    ``thorough``) the chosen layout is followed by that level's sweep (:mod:`.sweep`).

    Raises:
        CannotValidateError: no candidate runs; the message carries the model's last error.
    """
    inputs, _ = select_inputs(
        model, input_candidates(model, seed=seed, tokenizer=tokenizer), run_probes
    )
    if coverage is None:
        return inputs
    return sweep(model, inputs, coverage, tokenizer)


def run_sweep(
    model: Any,
    chosen: ModelInputs,
    full: ModelInputs,
    run: Callable[[Any, ModelInputs], Outputs],
    outputs: Outputs | None = None,
) -> tuple[ModelInputs, Outputs]:
    """Run ``full`` (``chosen``'s probes first, then a sweep) with ``run`` in one call.

    One call, so whatever ``run`` records (parameter coverage, block activations, calibration
    statistics) spans every probe. A sweep probe the model rejects, or on which the fp32 model
    itself is not finite (nothing to compare against), is dropped with a note (and, for the
    latter, recorded in ``unjudged``: it counts against coverage), and the kept
    probes run again; the chosen probes are never dropped (a non-finite baseline there is the
    caller's to report). ``outputs``: the chosen probes' outputs from the last ``run``, reused
    when the sweep adds nothing.
    """
    chosen_names = {p.name for p in chosen.probes}
    if all(p.name in chosen_names for p in full.probes):
        return full, outputs if outputs is not None else run(model, full)
    try:
        found: Outputs | None = run(model, full)
    except RUN_ERRORS:
        found = None
    if found is not None and not _nonfinite(found, chosen_names):
        return full, found
    kept: list[Probe] = []
    notes: list[str] = []
    unjudged: list[str] = []
    for group in _groups(full, chosen_names):
        trial = replace(full, probes=(*chosen.probes, *group))
        try:
            tried = run(model, trial)
        except RUN_ERRORS as exc:
            why = one_line(exc)
            _refuse_user_data(group[0], why)
            notes.append(f"probe {group[0].name} skipped: the fp32 model rejects it ({why})")
            continue
        if _nonfinite(tried, chosen_names):
            notes.append(
                f"probe {group[0].name} not judged: the fp32 model's own output is not finite "
                "there (it counts against coverage)"
            )
            unjudged += [p.name for p in group]
            continue
        kept.extend(group)
    inputs = replace(
        full,
        probes=(*chosen.probes, *kept),
        notes=(*full.notes, *notes),
        unjudged=(*full.unjudged, *unjudged),
    )
    return inputs, run(model, inputs)


def _refuse_user_data(probe: Probe, why: str) -> None:
    """User data the model cannot take is the user's to fix: say which line, do not skip it."""
    kind = str(probe.sweep.get("kind", ""))
    if kind.startswith("user"):
        where = probe.sweep.get("line") or probe.sweep.get("lines")
        raise InputError(
            f"--calibration-data: the model rejects the sample(s) at line {where} ({why})",
            probe.sweep.get("file"),
        )


def _nonfinite(outputs: Outputs, skip: set[str]) -> list[str]:
    return [
        probe
        for probe, tensors in outputs.items()
        if probe not in skip and any(not torch.isfinite(t).all() for t in tensors.values())
    ]


def _groups(inputs: ModelInputs, chosen: set[str]) -> list[list[Probe]]:
    """Sweep probes in order, each with the sweep probes it reads outputs from."""
    groups: list[list[Probe]] = []
    home: dict[str, int] = {}
    for probe in inputs.probes:
        if probe.name in chosen:
            continue
        refs = {v.probe for v in probe.kwargs.values() if isinstance(v, FromOutput)}
        owner = next((home[r] for r in refs if r in home), None)
        if owner is None:
            groups.append([probe])
            owner = len(groups) - 1
        else:
            groups[owner].append(probe)
        home[probe.name] = owner
    return groups


def select_inputs(
    model: Any,
    candidates: Iterator[ModelInputs],
    run: Callable[[Any, ModelInputs], Outputs],
) -> tuple[ModelInputs, Outputs]:
    """Run candidates until one works; return it with its outputs (so nothing runs twice)."""
    errors: list[str] = []
    for candidate in candidates:
        try:
            return candidate, run(model, candidate)
        except RUN_ERRORS as e:
            errors.append(one_line(e))
    detail = errors[-1] if errors else "no candidate inputs"
    raise CannotValidateError(
        f"cannot validate {type(model).__name__}: the model rejected every built input "
        f"({len(errors)} tried; last: {detail}); pass --inputs"
    )


class Coverage(TorchFunctionMode):
    """Which parameters, and so which modules, a model's judged probes computed with.

    A model fed only part of what it takes (a vision-language model given text alone) still
    produces outputs; this is what shows that part of it was never compared. Use is seen at
    the level of torch operations, so weights a module uses without being called
    (``nn.MultiheadAttention``'s ``out_proj``) count, and metadata reads (``self.dtype``) do not.
    No forward runs for it: it watches the probes' own.

    Each :meth:`track` is one run; what a run read joins :attr:`usage` when it returns, unless
    it raised (a layout the model refused may have run half of it) or :meth:`unjudged` was
    called (its fp32 outputs are not finite: nothing was compared there).
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}  # id of a tensor -> the parameter it is
        self.sizes: dict[str, int] = {}
        self.used: set[str] = set()
        self.judged: set[str] = set()  # every judged run's, together
        self.usage = ModuleUsage()
        self._judged_run = True

    @contextmanager
    def track(self, model: torch.nn.Module) -> Iterator[Coverage]:
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.sizes = {name: p.numel() for name, p in model.named_parameters()}
        self.used = set()
        self._judged_run = True
        with self:
            yield self
        if self._judged_run:
            self.judged |= self.used
            self.usage = module_usage(model, self.judged)

    def unjudged(self) -> None:
        """The run being tracked judges nothing: what it read does not count."""
        self._judged_run = False

    def alias(self, tensor: torch.Tensor, name: str) -> None:
        """``tensor`` now stands for parameter ``name`` (block-wise runs load weights anew)."""
        if name in self.sizes:
            self.names[id(tensor)] = name

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        # Once every parameter is seen there is nothing left to learn: skip the argument walk,
        # which otherwise costs a pytree flatten per torch operation of every probe.
        if len(self.used) < len(self.sizes) and function_name(func) not in METADATA_FUNCTIONS:
            for leaf in tree_leaves((args, kwargs)):
                name = self.names.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if name is not None:
                    self.used.add(name)
        return func(*args, **kwargs)


def all_finite(outputs: Outputs) -> bool:
    """Whether every output of every probe is finite (a probe judged on them all)."""
    return not _nonfinite(outputs, set())
