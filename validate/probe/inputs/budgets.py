"""Coverage budgets: how much a sweep probes at each level, and what memory lets one probe hold.

A level (:data:`BUDGETS`: ``quick``, ``standard`` by default, ``thorough``) fixes the longest
sequence, the vocabulary's probes, the timesteps, the image sizes, and the repeated ids and
greedy continuations of the context probes (:mod:`.contexts`). The model then bounds
each probe's tokens: :func:`fit_model` to what its memory affords, :func:`fit_budget` to a
block-wise validation's memory budget, where every probe is a pass over every block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from precision_convert.core.errors import InputError
from precision_convert.core.units import parse_duration
from precision_convert.validation.probe.inputs.model_inputs import config_value, linear_head

LEVELS = ("quick", "standard", "thorough")
DEFAULT_LEVEL = "standard"
#: The context search's share of the certificate's floor at ``standard``: at most a quarter.
CONTEXT_SEARCH_SHARE = 0.25
#: The longest sequence any probe runs, whatever the level or the config says: a config may
#: declare 2^31 positions, and a forward of more than a million tokens fits no accelerator
#: today. Positions past it are recorded as untested (:func:`~.positions.reach`).
LONGEST_SEQUENCE = 1 << 20


@dataclass(frozen=True)
class Budget:
    """How much one coverage level sweeps. See :data:`BUDGETS` for why each value."""

    level: str
    #: Longest sequence swept; the model's position limit when that is smaller. None: the
    #: whole position range, up to :data:`LONGEST_SEQUENCE`.
    max_length: int | None
    #: Lengths doubling from :data:`~.token_probes.FIRST_LENGTH` to the longest (else only
    #: the longest).
    doubling: bool
    #: Tokens (batch x length) in one probe: bounds one forward's activation memory.
    tokens_per_probe: int
    #: Every vocabulary id at least once; otherwise one probe's worth of sampled ids.
    whole_vocabulary: bool
    #: Most probes the vocabulary takes: a big vocabulary gets bigger chunks, not more probes.
    vocabulary_probes: int
    #: Denoising timesteps as fractions of the schedule (1.0: its first step, t=999 of 1000).
    timesteps: tuple[float, ...]
    #: Autoencoder image sides, as multiples of the built one (which always runs).
    image_scales: tuple[int, ...]
    #: Conditioning at realistic magnitudes (text-encoder outliers) at the first step.
    conditioning: bool
    #: Elements of one output kept whole per sweep probe (1M: 4 MB in fp32); beyond, a strided
    #: sample of rows plus every row's RMS (NaN/Inf anywhere still shows), so the logits of a
    #: vocabulary sweep over 128k ids do not hold tens of GB, and comparing them stays fast.
    max_output: int
    #: Vocabulary probes when memory bounds each probe (block-wise validation, where every
    #: probe is one more pass streaming every block from disk): the vocabulary is then covered
    #: as far as this many memory-sized probes reach, and the certificate says how far.
    blockwise_vocabulary_probes: int = 2
    #: Set by :func:`fit_budget`: ``tokens_per_probe`` is a memory limit, not a target.
    memory_bound: bool = False
    #: Set by :func:`fit_model`: ``tokens_per_probe`` is what the model's memory affords, so
    #: the whole vocabulary takes more probes rather than chunks past it.
    tokens_fit: bool = False
    #: Latents a side of a pipeline's small end-to-end call (at most; the pipeline's own size
    #: when smaller). The call decodes full images, or video frames, in every load path
    #: checked; a second call runs at the pipeline's default sizes (:mod:`.pipelines`).
    pipeline_latent_side: int = 32
    #: Bytes the largest fp32 activation of one declared-size probe (:mod:`.sizes`: a VAE at
    #: its sample_size, a denoiser at its declared latents, a pipeline's call at its default
    #: side) may take: 2 GiB holds SDXL's VAE at 1024 px (512 MiB at its first level) and a
    #: UNet at 128x128 latents; a bigger forward is recorded as not run.
    declared_activation_bytes: int = 2 << 30
    #: Whether declared image and latent sides run at all (declared frame counts run at every
    #: level, where one forward fits ``declared_activation_bytes``).
    declared_sides: bool = True
    #: Share of the certificate's floor (comparing by hand: the fp32 sweep and the candidate's
    #: sweep of the same probes, estimated as twice the fp32 sweep's time) the search for the
    #: worst context (:mod:`~.run.contexts`) may take, and its most steps per bounded module.
    #: The seeds are always tried: a search cut short still judges where the factors peaked.
    context_search: float = CONTEXT_SEARCH_SHARE
    context_steps: int = 50
    #: Seeded ids each repeated along a row at every doubling distance (:mod:`.contexts`).
    repeat_ids: int = 4
    #: Prompts x new tokens of fp32's greedy continuation the candidate is teacher-forced on,
    #: for models that generate (:mod:`.contexts`); (0, 0): none.
    generation: tuple[int, int] = (4, 256)


BUDGETS: dict[str, Budget] = {
    # Seconds on a CPU for a small model: one probe of sampled ids (no whole vocabulary), the
    # special tokens, text, one long sequence (256), the first denoising step. Catches gross
    # overflow; misses a single rare token.
    "quick": Budget(
        level="quick",
        max_length=256,
        doubling=False,
        tokens_per_probe=1024,
        whole_vocabulary=False,
        vocabulary_probes=1,
        timesteps=(1.0,),
        image_scales=(),
        conditioning=False,
        max_output=1 << 20,
        blockwise_vocabulary_probes=1,
        # 64-pixel images: a video pipeline's 5-frame decode in low precision takes minutes
        # on a CPU at 256 pixels (the zoo's 7 MB CogVideoX: 285 s), seconds at 64.
        pipeline_latent_side=8,
        # A 1024 px fp16 pass of even an 8-channel VAE takes most of a minute on a CPU, and a
        # certificate makes a dozen: the sides are the default level's; quick says so.
        declared_sides=False,
        # No search for contexts: bounds are still recorded.
        context_search=0.0,
        context_steps=0,
        # One id at each distance, and two continuations of 64 tokens: past where a loop's
        # start token leaves T5's exact relative-position buckets (distance 59 is bucket 26).
        repeat_ids=1,
        generation=(2, 64),
    ),
    # The default. Every vocabulary id once (a 32k vocabulary is 8 probes of 4096 tokens;
    # 128k+ ones are capped at 32 probes of bigger chunks: tens of seconds on one GPU for an
    # 8B model, about a minute on CPU for a 100M one), lengths doubling to 2048 (real text
    # sits there; longer contexts are `thorough`), timestep quartiles with the first step, 2x
    # VAE images. About 10-40 forwards for a tiny model.
    "standard": Budget(
        level="standard",
        max_length=2048,
        doubling=True,
        tokens_per_probe=4096,
        whole_vocabulary=True,
        vocabulary_probes=32,
        timesteps=(1.0, 0.75, 0.25, 0.0),
        image_scales=(2,),
        conditioning=True,
        max_output=1 << 20,
        # Four ids at each distance (two probes of 16 rows), four prompts continued 256
        # tokens: past where a loop's start token falls out of a relative-position bucket.
        repeat_ids=4,
        generation=(4, 256),
    ),
    # Release-grade: the full position range (a 128k-context model gets a 128k-token probe:
    # use a GPU), every timestep decile, VAE images at 2x and 4x, bigger probes.
    "thorough": Budget(
        level="thorough",
        max_length=None,
        doubling=True,
        tokens_per_probe=16384,
        whole_vocabulary=True,
        vocabulary_probes=128,
        timesteps=(1.0, 0.9, 0.8, 0.7, 0.6, 0.4, 0.3, 0.2, 0.1, 0.0),
        image_scales=(2, 4),
        conditioning=True,
        max_output=1 << 22,
        blockwise_vocabulary_probes=16,
        declared_activation_bytes=8 << 30,
        # As long again as the floor: release-grade conversions can afford the search.
        context_search=1.0,
        context_steps=200,
        repeat_ids=16,
        generation=(8, 512),
    ),
}


def budget_for(level: str) -> Budget:
    """The budget of a coverage level; an unknown level is an :class:`InputError`."""
    try:
        return BUDGETS[level]
    except KeyError:
        raise InputError(
            f"unknown coverage level {level!r}; choose one of {', '.join(LEVELS)}"
        ) from None


#: Share of the memory budget one probe's activations may take, and the share one kept
#: output's comparison may take. Small: next to them sit the resident block (a quarter), the
#: block activations kept for teacher forcing (another quarter, then disk) and allocator slack;
#: measured on an 8-layer Llama at a 16 MB budget, these keep the whole run inside it.
PROBE_MEMORY_SHARE = 0.05
OUTPUT_MEMORY_SHARE = 0.1
#: Bytes per output element while comparing it: baseline and candidate in float64, their
#: difference, and the log-softmax/KL temporaries of logits.
COMPARE_BYTES = 72


def bytes_per_token(model: Any, *, logits: bool = True) -> int:
    """Rough fp32 activation bytes one token costs in a forward: the hidden stream and its
    copies, the MLP's widened activations, and (LM heads, unless ``logits`` is off: a head
    trimmed to the last position) a row of logits."""
    config = getattr(model, "config", None)
    hidden = config_value(config, "hidden_size", "d_model", "n_embd", "width") or 1024
    wide = (
        config_value(config, "intermediate_size", "d_ff", "n_inner", "encoder_ffn_dim")
        or 4 * hidden
    )
    vocab = config_value(config, "vocab_size") or 0
    return 4 * (8 * int(hidden) + 3 * int(wide) + (2 * int(vocab) if logits else 0))


#: Activations one whole-model probe may take whatever the model's size (fp32): a few hundred
#: tokens of a 32k-vocabulary model's logits. The certificate's memory is the fp32 model plus
#: a bounded overhead; tying a small model's probes to a share of its weights instead cut a
#: 55M model's vocabulary into 800 probes of 38 tokens, each paying a forward's fixed costs.
PROBE_ACTIVATIONS = 256 * 2**20
#: A larger model's probe may take this share of the fp32 model (baseline and candidate are
#: resident one at a time, and kept outputs wait on disk, so peak memory stays near the
#: model's own size).
ACTIVATION_SHARE = 0.05


def activation_allowance(model: Any) -> int:
    """Bytes one whole-model probe's activations may take (fp32): :data:`PROBE_ACTIVATIONS`,
    or :data:`ACTIVATION_SHARE` of a larger model."""
    weights = sum(4 * p.numel() for p in model.parameters()) if hasattr(model, "parameters") else 0
    return int(max(ACTIVATION_SHARE * weights, PROBE_ACTIVATIONS))


def fit_model(budget: Budget, model: Any, *, logits: bool | None = None) -> Budget:
    """``budget`` with probes no bigger than the model's memory affords.

    A probe's activations grow with its tokens (a row of logits each), the model's weights do
    not: a 350 MB model with an 8k vocabulary fed 4096 tokens at once nearly doubles its
    footprint in logits alone, while a 7B model does not notice. Fewer tokens per probe means
    smaller batches and more, smaller vocabulary chunks; every id is still covered, and long
    sequences still run (at batch 1). ``logits``: whether each token costs a row of logits
    (None: unless the model says it has no output embeddings, as an encoder without a head
    does, or its head is a plain linear one, which a summarized probe computes for the kept
    rows only; counting logits there cut a tiny T5 encoder's 32k vocabulary into 32 probes,
    and the zoo's Llama-3.2's 128k vocabulary into 494).
    """
    if logits is None:
        head = getattr(model, "get_output_embeddings", None)
        logits = (not callable(head) or head() is not None) and linear_head(model) is None
    affordable = activation_allowance(model) // bytes_per_token(model, logits=logits)
    tokens = max(16, min(budget.tokens_per_probe, int(affordable)))
    if tokens == budget.tokens_per_probe:
        return budget
    return replace(budget, tokens_per_probe=tokens, tokens_fit=True)


def fit_budget(budget: Budget, model: Any, memory: int) -> Budget:
    """``budget`` for block-wise validation within ``memory`` bytes.

    Each probe there is a pass streaming every block from disk, so passes are few and as big
    as memory allows: probes of as many tokens as fit (up to 4x the level's count), the
    vocabulary in at most ``blockwise_vocabulary_probes`` of them, only the longest length,
    and kept outputs small enough to compare within the budget.
    """
    fitting = int(memory * PROBE_MEMORY_SHARE) // bytes_per_token(model)
    tokens = max(16, min(fitting, 4 * budget.tokens_per_probe))
    outputs = max(1024, int(memory * OUTPUT_MEMORY_SHARE) // COMPARE_BYTES)
    return replace(
        budget,
        tokens_per_probe=tokens,
        vocabulary_probes=budget.blockwise_vocabulary_probes,
        doubling=False,
        max_output=min(budget.max_output, outputs),
        memory_bound=True,
    )


#: The order a time budget (``--budget``) keeps probe kinds in, most telling first: what each
#: kind has caught in this project's tests. Declared sizes and range come first: position 0
#: (every id alone, where a causal model's token attends only to itself: the overflows of
#: rare ids), the special tokens (BOS/EOS rows that spike), the sizes a model declares and
#: the growth toward them (an SD VAE overflows only at 1024 px; CogVideoX at its 13th latent
#: frame; wav2vec2 on a 1 s clip padded to 30 s), a denoiser's first step; then the
#: vocabulary's chunks, the lengths and positions, the repeated ids and generated contexts,
#: padding, and the rest. The layout's own probe
#: always runs first; a kind not listed here comes last.
CAUGHT_FIRST = (
    "first-position",
    "special",
    "declared-size",
    "size-growth",
    "padded-audio",
    "timestep",
    "vocabulary",
    "length",
    "positions",
    "repeats",
    "generation",
    "padding",
    "user-text",
    "user-jsonl",
    "text",
    "conditioning",
    "image-size",
    "contrast",
)


def caught_rank(kind: str) -> int:
    """Where a probe kind stands in :data:`CAUGHT_FIRST` (an unknown kind last)."""
    return CAUGHT_FIRST.index(kind) if kind in CAUGHT_FIRST else len(CAUGHT_FIRST)


def budget_seconds(budget: str | float | None) -> float | None:
    """A time budget (``--budget``, the manifest's ``budget``, ``budget=``) in seconds: a
    duration such as ``10m`` or ``1h30m``, or a number of seconds; None: no budget.

    Raises:
        InputError: not a duration, or not more than zero.
    """
    if budget is None:
        return None
    if isinstance(budget, int | float) and not isinstance(budget, bool):
        if budget > 0:
            return float(budget)
        raise InputError(f"--budget {budget!r} is no time at all: give a duration such as 10m")
    try:
        return parse_duration(str(budget))
    except ValueError as exc:
        raise InputError(f"--budget {exc}") from None
