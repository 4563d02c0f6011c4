"""What a model is fed: :class:`Probe` calls grouped in :class:`ModelInputs`, and how they are
recorded (shapes, dtypes, digests) so a certificate's probes can be replayed and checked.

Also the small readers every input builder shares: a seeded generator per name, a config's
values (searching its sub-configs), a forward's parameters, and the library a model comes from.
"""

from __future__ import annotations

import hashlib
import inspect
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

#: Sub-configs :func:`config_value` searches: where a token model's sizes sit.
_TOKEN_SUBCONFIGS = ("text_config", "decoder", "encoder")


@dataclass(frozen=True)
class FromOutput:
    """A probe argument taken from an earlier probe's baseline output.

    The value is resolved once, on the baseline, and then fed unchanged to the candidate:
    both models decode the same latents.
    """

    probe: str
    output: str | None = None  # None: the probe's latent (``*.mean`` or ``latents``), else first


@dataclass(frozen=True)
class Seeded:
    """A random generator argument, created fresh from ``seed`` for every run.

    Generators are stateful: baseline and candidate must each start from the same state.
    """

    seed: int


@dataclass(frozen=True)
class Probe:
    """One call on the model: ``getattr(model, method)(**kwargs)``."""

    name: str
    method: str
    kwargs: Mapping[str, Any]
    #: Outputs are decoded images or frames: PSNR and constant-frame checks apply.
    images: bool = False
    #: How a sweep made this probe (kind, seed, ids, lengths, timesteps): the certificate's
    #: recipe for replaying it. Empty for the layout probe every model starts from.
    sweep: Mapping[str, Any] = field(default_factory=dict)
    #: Outputs with more elements than this are kept as a strided sample of their rows plus
    #: every row's RMS (:func:`~.execute.summarize`); None keeps them whole.
    max_output: int | None = None
    #: (batch, length) bool of the real token positions of a padded batch: outputs shaped
    #: (batch, length, ...) are compared there only — no caller reads a padded position.
    positions: torch.Tensor | None = None
    #: Judged for NaN/Inf only: the candidate's own free generation, which may legitimately
    #: pick other tokens than fp32's (its teacher-forced twin is judged on every metric).
    finite_only: bool = False
    #: Keyword arguments of a one-row call every row continues from (the BOS that after-BOS
    #: rows share): run once, its cache repeated to the batch, not recomputed in every row.
    #: Only the rows' own positions are in the outputs.
    prefix: Mapping[str, Any] | None = None

    def on_hidden_states(self, logits_kept: int) -> Probe:
        """This probe judged on every layer's hidden states at every position, with the logits
        of the last ``logits_kept`` positions only (0: none), through ``logits_to_keep``. A
        128k vocabulary's logits cost 0.5 MB a position, so a row of logits per position would
        make a long row cost as much as the vocabulary sweep, whose probes judge the head's own
        range; an overflow anywhere in a row shows in the hidden states where it happens."""
        keep = logits_kept or torch.zeros(0, dtype=torch.long)  # 0 itself would keep them all
        logits = {0: "none", 1: "the last position's"}.get(
            logits_kept, f"the last {logits_kept} positions'"
        )
        sweep = {**self.sweep, "logits": f"{logits}; hidden states of every layer"}
        kwargs = {**self.kwargs, "logits_to_keep": keep, "output_hidden_states": True}
        return replace(self, kwargs=kwargs, sweep=sweep)


@dataclass(frozen=True)
class ModelInputs:
    """The probes a model is validated on, the task they exercise and how they were made."""

    task: str
    probes: tuple[Probe, ...]
    seed: int
    origin: str = "builder"  # "builder", "tokenizer" (real sentences) or "file" (--inputs)
    notes: tuple[str, ...] = field(default=())
    #: Index of this layout among :func:`input_candidates` (what a replay rebuilds first).
    layout: int = 0
    #: The coverage level whose sweep added probes (None: no sweep ran).
    coverage: str | None = None
    #: Bytes the sweep's probes were fitted to (block-wise validation), None when unbounded.
    memory: int | None = None
    #: The tokenizer the token probes went through, as :meth:`ProbeTokenizer.describe` says.
    tokenizer: Mapping[str, Any] | None = None
    #: What bounds a token model's inputs (vocabulary, position limit), set by the sweep:
    #: what :func:`~.positions.reach` measures the probes against.
    limits: Mapping[str, Any] | None = None
    #: The sizes the model declares and those run (:func:`~.sizes.declared_size_probes`):
    #: image side, latent side and frames, each ``declared``, ``run`` and why ``not_run``.
    sizes: Mapping[str, Any] | None = None
    #: Sweep probes the fp32 model answered with NaN or ±inf: with nothing to compare with,
    #: they are not run on the candidate, and count against coverage instead of vanishing.
    unjudged: tuple[str, ...] = ()
    #: What a time budget (``--budget``) left out: ``seconds`` given, the ``estimate`` of the
    #: probes kept and the ``minimum`` certificate's, and the probes ``left_out`` by kind
    #: (:func:`~precision_convert.validation.probe.run.time_budget.fit_to_budget`). None:
    #: no budget was given.
    budget: Mapping[str, Any] | None = None
    #: The arguments of ``forward`` that take an input (set by the sweep): what the
    #: certificate's ``inputs.arguments`` measures the probes against.
    forward_arguments: tuple[str, ...] = ()

    @property
    def judged_share(self) -> float:
        """The share of the probes made that the fp32 baseline could answer."""
        made = len(self.probes) + len(self.unjudged)
        return len(self.probes) / made if made else 1.0

    def describe(self) -> dict[str, Any]:
        """Every probe precisely enough to replay it, as the certificate records it.

        Per probe: its method, how the sweep made it (seeds, ids, lengths, timesteps), and per
        argument its shape, dtype and sha256 (small tensors — timesteps, short id rows — also
        inline). :func:`~.sweep.replay` rebuilds the probes from this and checks the digests.
        """
        return {
            "task": self.task,
            "seed": self.seed,
            "origin": self.origin,
            "layout": self.layout,
            **({"coverage": self.coverage} if self.coverage else {}),
            **({"memory_budget": self.memory} if self.memory else {}),
            **({"tokenizer": dict(self.tokenizer)} if self.tokenizer else {}),
            "probes": {p.name: _describe_probe(p) for p in self.probes},
            **({"sizes": dict(self.sizes)} if self.sizes else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
            **({"unjudged": list(self.unjudged)} if self.unjudged else {}),
            **({"budget": dict(self.budget)} if self.budget else {}),
        }


def _describe_probe(probe: Probe) -> dict[str, Any]:
    record: dict[str, Any] = {"method": probe.method}
    if probe.sweep:
        record["sweep"] = _describe(dict(probe.sweep), INLINE_INTEGERS)
    if probe.max_output is not None:
        record["max_output_elements"] = probe.max_output
    if probe.positions is not None:
        record["compared_positions"] = "real tokens only (padding excluded)"
    if probe.finite_only:
        record["judged"] = "NaN/Inf only"
    if probe.prefix is not None:
        record["prefix"] = _describe(probe.prefix, INLINE_INTEGERS)
    # A swept probe's record says how its ids were made (ids, seeds, rows): its long id rows
    # are left to the digest, which a replay checks, so a 128k-vocabulary sweep stays small.
    record["args"] = _describe(probe.kwargs, INLINE_FLOATS if probe.sweep else INLINE_INTEGERS)
    return record


#: Tensors up to this many elements are recorded inline too: timesteps, labels, and the id rows
#: of a probe no sweep describes (the layout's own, a user's).
INLINE_FLOATS = 16
INLINE_INTEGERS = 256


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (C order, its own dtype): replays are checked against it."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _describe(value: Any, inline_integers: int) -> Any:
    if isinstance(value, torch.Tensor):
        record: dict[str, Any] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "sha256": tensor_digest(value),
        }
        inline = INLINE_FLOATS if value.is_floating_point() else inline_integers
        if value.numel() <= inline:
            record["values"] = value.tolist()
        return record
    if isinstance(value, FromOutput):
        return {"from_probe": value.probe, "output": value.output}
    if isinstance(value, Seeded):
        return {"generator_seed": value.seed}
    if isinstance(value, Mapping):
        return {k: _describe(v, inline_integers) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_describe(v, inline_integers) for v in value]
    return value


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A generator per seed and tensor (or probe) name: adding one never changes another."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def config_get(config: Any, key: str) -> Any:
    """``key`` of a config object or dict (None when unset, or when there is no config)."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def config_value(config: Any, *keys: str, prefer: Sequence[str] = ()) -> Any:
    """The first of ``keys`` set in ``config``, then in its ``prefer``, text, decoder and
    encoder sub-configs: what sizes a token model's probes and activations."""
    for sub in [config, *(config_get(config, s) for s in (*prefer, *_TOKEN_SUBCONFIGS))]:
        for key in keys:
            value = config_get(sub, key)
            if value is not None:
                return value
    return None


def parameters_of(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """``fn``'s named parameters (``*args`` and ``**kwargs`` left out): what inputs it takes."""
    return {
        n: p
        for n, p in inspect.signature(fn).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def cache_argument(model: Any) -> str | None:
    """The name ``model``'s forward takes a key/value cache by (transformers 5 renamed
    ``past_key_values`` to ``cache``), None when it takes none."""
    parameters = parameters_of(model.forward)
    return next((n for n in ("cache", "past_key_values") if n in parameters), None)


# --------------------------------------------------------------------------- family detection


def library_of(model: Any) -> str:
    """The library whose base the class inherits (``transformers``, ``diffusers``,
    ``open_clip``, else ``torch``), wherever the class is defined: remote or user code
    subclasses a library's model, and diffusers defines transformers models too (the Stable
    Diffusion safety checker is a transformers PreTrainedModel)."""
    roots = [base.__module__.split(".")[0] for base in type(model).__mro__]
    if "transformers" in roots:
        return "transformers"
    return next((root for root in roots if root in ("diffusers", "open_clip")), "torch")


def is_open_clip(model: Any) -> bool:
    """Whether ``model`` is an OpenCLIP model (image and text towers, ``forward(image, text)``)."""
    return (
        callable(getattr(model, "encode_image", None))
        and callable(getattr(model, "encode_text", None))
        and "image" in parameters_of(model.forward)
    )


def linear_head(model: Any) -> nn.Linear | None:
    """The model's output embedding where it is a plain linear head: one a summarized probe
    computes for the rows it keeps only (:mod:`~..run.head`), so a token costs no row of
    logits there."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if type(head) is not nn.Linear or head.weight.dim() != 2:
        return None
    return head
