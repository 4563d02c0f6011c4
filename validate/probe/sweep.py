"""Coverage sweeps: after a layout is chosen, the probes that vary what changes activations.

A model accepted by one layout (:func:`~.inputs.input_candidates`) has still seen a sliver of
its input space: 2×12 random ids, one timestep. Overflow hides elsewhere — one rare token's
embedding, positions past the first few dozen, the first denoising step at t=999. A sweep
keeps the chosen probe first (its outputs are reused) and adds, per family:

- token models: the whole vocabulary in chunks (every id at least once from ``standard`` up),
  the special tokens (bos/eos/pad/unk/cls/sep/mask, added tokens, the chat template), real
  text, sequence lengths doubling up to the level's longest context, short rows with
  ``position_ids`` offsets reaching the rest of the position table (:mod:`.positions`),
  padded batches with their attention mask, right-padded and (decoder-only models)
  left-padded as ``generate`` pads them; encoder-decoders feed the decoder the same ids
  shifted right. Special tokens, text and padded batches go through the model's own
  tokenizer when it ships a usable one (each probe records ``ids_from``), else they are made
  of seeded ids;
- diffusion denoisers: timesteps across the schedule, including its first step (t=999 on the
  usual scale, sigma 1.0 for models taking t in [0, 1]), and realistic conditioning magnitudes;
- autoencoders: larger images; vision and speech encoders: normalized-image contrast and
  longer audio.

How much is swept is a coverage budget (:data:`BUDGETS`): ``quick``, ``standard`` (default) or
``thorough``. Every probe records how it was made (``Probe.sweep``) so the certificate can be
replayed with :func:`replay`.

Example:
    >>> chosen, outputs = select_inputs(model, input_candidates(model), run_probes)
    >>> inputs = sweep(model, chosen, "standard", tokenizer)
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from precision_convert.errors import CannotValidateError, InputError
from precision_convert.validation.probe.inputs import (
    BATCH,
    FromOutput,
    ModelInputs,
    Probe,
    _get,
    _image,
    _is_open_clip,
    _library,
    _scales_timestep,
    _signature,
    input_candidates,
    tensor_digest,
)
from precision_convert.validation.probe.positions import (
    OFFSET_POSITIONS,
    position_probes,
    token_limits,
)
from precision_convert.validation.probe.tokenizers import (
    ProbeTokenizer,
    pad_rows,
    probe_tokenizer,
)
from precision_convert.validation.probe.userdata import (
    CalibrationData,
    addressed,
    decoder_start,
    to_tensor,
)

# --------------------------------------------------------------------------- budgets

LEVELS = ("quick", "standard", "thorough")
DEFAULT_LEVEL = "standard"


@dataclass(frozen=True)
class Budget:
    """How much one coverage level sweeps. See :data:`BUDGETS` for why each value."""

    level: str
    #: Longest sequence swept; the model's position limit when that is smaller. None: the
    #: whole position range, however long.
    max_length: int | None
    #: Lengths doubling from :data:`FIRST_LENGTH` to the longest (else only the longest).
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
    #: Latents a side of a pipeline's end-to-end call (at most; the pipeline's own size when
    #: smaller). The call decodes full images, or video frames, in every load path checked.
    pipeline_latent_side: int = 32


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
    ),
}

#: First length of the doubling ladder: past the 12-token layout probe, where learned
#: position tables start to matter.
FIRST_LENGTH = 32
#: Row length of vocabulary chunks: long enough that ids meet attention, short enough that
#: attention cost stays linear-ish.
VOCAB_ROW = 512
#: Position limit assumed for models that have none (relative positions, e.g. T5): what such
#: encoders are fed in practice (SD3/Flux use 256-512 T5 tokens).
UNKNOWN_POSITION_LIMIT = 512
#: Length of the padded batches: enough for four visibly different row lengths.
PADDED_LENGTH = 64
#: Row tokens per special token in the special-token probe: the token, a word, a space.
SPECIAL_SPACING = 4
#: Training schedule length assumed when no scheduler says otherwise (DDPM/flow-matching).
TRAIN_TIMESTEPS = 1000
#: Magnitude of the outlier channels in the realistic conditioning probe: CLIP text encoders'
#: hidden states carry a few channels near +-30, the rest near unit scale.
CONDITIONING_OUTLIER = 30.0

#: Config keys naming special token ids.
_SPECIAL_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "unk_token_id",
    "cls_token_id",
    "sep_token_id",
    "mask_token_id",
    "decoder_start_token_id",
)

#: Real text fed through the model's own tokenizer: prose, numbers, code, punctuation runs and
#: non-Latin scripts, so frequent and rare tokens (and byte fallbacks) are both exercised.
TEXTS: tuple[str, ...] = (
    "A red fox jumps over the sleeping dog near the river bank.",
    "Precision matters: 65504 is the largest finite half-precision number!",
    "def forward(self, x):\n    return torch.nn.functional.gelu(self.proj(x)) * 0.5",
    "In 1969, 3 astronauts flew 384,400 km; the mission cost $25.4 billion (≈ 2.8e11 in 2024).",
    "Les modèles de langage traitent le texte comme une suite de jetons. 東京は日本の首都です。",
    "!!! ??? ... ---- #### $$$$ %%%% &&&& **** (((( )))) [[[[ ]]]] {{{{ }}}} <<<< >>>> ~~~~",
    "The quick brown fox " * 12,
)


def budget_for(level: str) -> Budget:
    """The budget of a coverage level; an unknown level is an :class:`InputError`."""
    try:
        return BUDGETS[level]
    except KeyError:
        raise InputError(
            f"unknown coverage level {level!r}; choose one of {', '.join(LEVELS)}"
        ) from None


def usable(tokenizer: Any | None) -> ProbeTokenizer | None:
    """``tokenizer`` as a :class:`ProbeTokenizer` when it can be used, else None (its note, if
    any, is on the layout's candidates already)."""
    tok = probe_tokenizer(tokenizer)
    return tok if tok is not None and tok.usable else None


def generator(seed: int, name: str) -> torch.Generator:
    """A generator per probe and tensor name: adding a probe never changes another."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


# --------------------------------------------------------------------------- public API


def sweep(
    model: Any,
    chosen: ModelInputs,
    level: str = DEFAULT_LEVEL,
    tokenizer: Any | None = None,
    *,
    data: CalibrationData | None = None,
    component: str = "",
    train_timesteps: int | None = None,
    memory: int | None = None,
) -> ModelInputs:
    """``chosen`` plus the probes ``level`` sweeps for this model, plus user data.

    The chosen probes stay first and unchanged, so their outputs can be reused. Inputs the
    user supplied (``origin == "file"``) replace the built ones: nothing is swept, but
    ``data`` (``--calibration-data``) still adds its probes.

    Args:
        model: the (fp32) model the inputs are for.
        chosen: the layout :func:`~.execute.select_inputs` kept.
        level: ``quick``, ``standard`` or ``thorough`` (see :data:`BUDGETS`).
        tokenizer: the model's own tokenizer (a library one or a :class:`ProbeTokenizer`), for
            real text, special tokens and padding (None or unusable: seeded ids only).
        data: user calibration data, whose probes are appended.
        component: the pipeline component this model is ("" for a single model); user data
            keys ``<component>/<argument>`` address it.
        train_timesteps: the training schedule's length (a pipeline's scheduler config);
            default 1000.
        memory: the memory budget of a block-wise validation (a model that does not fit):
            probes are sized to it and few, since each is a pass over every block (see
            :func:`fit_budget`); the certificate notes how much of the vocabulary was reached.
    """
    budget = (
        fit_budget(budget_for(level), model, memory)
        if memory
        else fit_model(budget_for(level), model)
    )
    # A tokenizer the layout found unusable (its note is there already) is not used here.
    tok = usable(tokenizer) if (chosen.tokenizer or {}).get("usable", True) else None
    probes: list[Probe] = []
    notes: list[str] = []
    if chosen.origin != "file":
        made, made_notes = _built(model, chosen, budget, tok, train_timesteps)
        probes += made
        notes += made_notes
    if data is not None:
        probes += user_probes(
            model, chosen, data, tokenizer=tok, budget=budget, component=component
        )
    first = chosen.probes[0] if chosen.probes else None
    spec = (
        token_spec(model, first, tok, chosen.task)
        if first is not None and first.method == "forward" and chosen.task != "pipeline"
        else None
    )
    taken = {p.name for p in chosen.probes}
    unique = []
    for probe in probes:
        if probe.name not in taken:
            taken.add(probe.name)
            unique.append(probe)
    return replace(
        chosen,
        probes=(*chosen.probes, *unique),
        notes=(*chosen.notes, *notes),
        coverage=budget.level,
        memory=memory,
        limits=token_limits(spec) if spec is not None else None,
    )


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
    hidden = _cfg(config, "hidden_size", "d_model", "n_embd", "width") or 1024
    wide = _cfg(config, "intermediate_size", "d_ff", "n_inner", "encoder_ffn_dim") or 4 * hidden
    vocab = _cfg(config, "vocab_size") or 0
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


def fit_model(budget: Budget, model: Any, *, logits: bool = True) -> Budget:
    """``budget`` with probes no bigger than the model's memory affords.

    A probe's activations grow with its tokens (a row of logits each), the model's weights do
    not: a 350 MB model with an 8k vocabulary fed 4096 tokens at once nearly doubles its
    footprint in logits alone, while a 7B model does not notice. Fewer tokens per probe means
    smaller batches and more, smaller vocabulary chunks; every id is still covered, and long
    sequences still run (at batch 1).
    """
    weights = sum(4 * p.numel() for p in model.parameters()) if hasattr(model, "parameters") else 0
    allowance = max(ACTIVATION_SHARE * weights, PROBE_ACTIVATIONS)
    affordable = allowance // bytes_per_token(model, logits=logits)
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


@dataclass(frozen=True)
class SweepSettings:
    """A coverage level and the user's calibration data: what every model of a run sweeps."""

    level: str = DEFAULT_LEVEL
    data: CalibrationData | None = None

    def apply(
        self,
        model: Any,
        chosen: ModelInputs,
        *,
        tokenizer: Any | None = None,
        component: str = "",
        directory: Path | None = None,
        memory: int | None = None,
    ) -> ModelInputs:
        """:func:`sweep` for ``model`` (``directory``: where it was loaded from, whose
        pipeline scheduler sets the timestep range; ``memory``: see :func:`sweep`)."""
        return sweep(
            model,
            chosen,
            self.level,
            tokenizer,
            data=self.data,
            component=component,
            train_timesteps=train_timesteps_of(directory) if directory is not None else None,
            memory=memory,
        )


def train_timesteps_of(directory: Path) -> int | None:
    """``num_train_timesteps`` of the scheduler next to a pipeline component, if any."""
    import json

    for candidate in (directory.parent / "scheduler", directory / "scheduler"):
        config = candidate / "scheduler_config.json"
        if config.is_file():
            try:
                value = json.loads(config.read_text("utf-8")).get("num_train_timesteps")
            except (OSError, ValueError, AttributeError):
                return None
            return int(value) if isinstance(value, int | float) and value > 1 else None
    return None


def replay(
    model: Any,
    description: Mapping[str, Any],
    *,
    tokenizer: Any | None = None,
    data: CalibrationData | None = None,
    component: str = "",
    train_timesteps: int | None = None,
) -> ModelInputs:
    """Rebuild the probes a certificate's ``inputs`` record describes, and check them.

    The layout is rebuilt from the recorded seed and layout index, the sweep from the recorded
    coverage level; every rebuilt argument must match its recorded sha256.

    Raises:
        CannotValidateError: the record is not replayable here (inputs from a file, another
            model) or a rebuilt tensor differs from the record.
    """
    if description.get("origin") == "file":
        raise CannotValidateError("these probes came from --inputs: replay them from that file")
    seed = int(description.get("seed", 0))
    layout = int(description.get("layout", 0))
    found = list(input_candidates(model, seed=seed, tokenizer=tokenizer))
    if layout >= len(found):
        raise CannotValidateError(f"layout {layout} does not exist for {type(model).__name__}")
    inputs = found[layout]
    level = description.get("coverage")
    if level:
        inputs = sweep(
            model,
            inputs,
            str(level),
            tokenizer,
            data=data,
            component=component,
            train_timesteps=train_timesteps,
            memory=description.get("memory_budget"),
        )
    recorded: Mapping[str, Any] = description.get("probes", {})
    probes = {p.name: p for p in inputs.probes}
    missing = [name for name in recorded if name not in probes]
    if missing:
        raise CannotValidateError(f"cannot rebuild probes {', '.join(missing)}")
    kept = tuple(probes[name] for name in recorded)
    for probe in kept:
        _check_digests(probe.name, probe.kwargs, recorded[probe.name].get("args", {}))
    return replace(inputs, probes=kept)


def _check_digests(where: str, value: Any, record: Any) -> None:
    if isinstance(value, torch.Tensor):
        if not isinstance(record, Mapping) or record.get("sha256") != tensor_digest(value):
            raise CannotValidateError(f"replayed {where} differs from the recorded one")
    elif isinstance(value, Mapping) and isinstance(record, Mapping):
        for key, item in value.items():
            _check_digests(f"{where}/{key}", item, record.get(key))


# --------------------------------------------------------------------------- dispatch


def _built(
    model: Any,
    chosen: ModelInputs,
    budget: Budget,
    tokenizer: ProbeTokenizer | None,
    train_timesteps: int | None,
) -> tuple[list[Probe], list[str]]:
    """The probes the budget sweeps for this model's family (none for a whole pipeline)."""
    if chosen.task == "pipeline" or not chosen.probes:
        return [], []
    first = chosen.probes[0]
    if chosen.task == "vae" and first.method == "encode":
        return _image_sizes(chosen, budget), []
    if first.method != "forward":
        return [], []
    probes: list[Probe] = []
    notes: list[str] = []
    if chosen.task == "denoise" and "timestep" in first.kwargs:
        probes += _timesteps(model, chosen, budget, train_timesteps)
    spec = token_spec(model, first, tokenizer, chosen.task)
    if spec is not None:
        made, made_notes = _token_probes(spec, chosen, budget, tokenizer)
        probes += made
        notes += made_notes
        probes += position_probes(
            model,
            spec,
            chosen,
            budget,
            probes,
            tokens=lambda ids: with_tokens(spec, first.kwargs, ids),
            generator=lambda name: generator(chosen.seed, name),
            trimmed_tokens=fit_model(
                budget_for(budget.level), model, logits=False
            ).tokens_per_probe,
        )
    if chosen.task in ("vision", "clip") and not any(
        k in first.kwargs for k in ("input_ids", "text")
    ):
        probes += _contrast(chosen, budget)
    if chosen.task == "speech":
        probes += _longer_audio(chosen, budget)
    return probes, notes


# --------------------------------------------------------------------------- token models


@dataclass(frozen=True)
class TokenSpec:
    """How a model takes token ids: which argument, vocabulary, position limit, specials."""

    arg: str  # "input_ids", "decoder_input_ids" (speech seq2seq) or "text" (OpenCLIP)
    vocab: int
    limit: int
    fixed: int | None  # every row exactly this long, end-of-text last (OpenCLIP)
    pad: int
    pad_from: str  # why that id: the tokenizer's pad token, eos when it has none...
    specials: tuple[int, ...]
    mask: str | None  # the attention-mask argument that goes with ``arg``, when accepted
    batch: int  # the chosen probe's batch
    task: str
    decoder_start: int | None  # encoder-decoders: the decoder is fed the ids shifted right
    decoder_limit: int | None
    #: Decoder-only: ``generate`` left-pads its batches, so the sweep does too.
    causal: bool = False
    #: The forward takes ``position_ids``: left-padded rows get them as ``generate`` makes them.
    positions: bool = False


def _cfg(config: Any, *keys: str, prefer: Sequence[str] = ()) -> Any:
    subs = (*prefer, "text_config", "decoder", "encoder")
    for cfg in [config, *(_get(config, s) for s in subs)]:
        for key in keys:
            value = _get(cfg, key)
            if value is not None:
                return value
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


#: Class-name endings of decoder-only language models (``generate`` pads them on the left).
_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def _generates(model: Any) -> bool:
    """Whether users batch prompts for ``model.generate``, which pads them on the left: a
    causal LM head by name, or any transformers model that says it can generate (GPT-2's
    double-heads model, vision-language models) — the name alone misses those."""
    if type(model).__name__.endswith(_CAUSAL_HEADS):
        return True
    if _get(getattr(model, "config", None), "is_encoder_decoder"):
        return False  # its encoder takes the prompts, padded on the right
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


def token_spec(
    model: Any, probe: Probe, tokenizer: ProbeTokenizer | None, task: str
) -> TokenSpec | None:
    """The token argument of ``probe`` and what bounds it; None when it takes no ids."""
    kwargs = probe.kwargs
    params = _signature(model.forward)
    config = getattr(model, "config", None)
    decoder_start = decoder_limit = None
    fixed = None
    if isinstance(kwargs.get("input_ids"), torch.Tensor):
        arg = "input_ids"
        vocab = _cfg(config, "vocab_size")
        limit = _cfg(config, "max_position_embeddings", "n_positions", "max_text_len")
        mask = "attention_mask" if "attention_mask" in params else None
        if isinstance(kwargs.get("decoder_input_ids"), torch.Tensor):
            start = _cfg(config, "decoder_start_token_id", "bos_token_id", "pad_token_id")
            decoder_start = int(start) if isinstance(start, int) else 0
            dec = _cfg(config, "max_target_positions", "max_position_embeddings", "n_positions")
            decoder_limit = int(dec) if dec else None
    elif isinstance(kwargs.get("decoder_input_ids"), torch.Tensor):
        arg = "decoder_input_ids"
        vocab = _cfg(config, "vocab_size")
        limit = _cfg(config, "max_target_positions", "max_position_embeddings", "n_positions")
        mask = "decoder_attention_mask" if "decoder_attention_mask" in params else None
    elif isinstance(kwargs.get("text"), torch.Tensor) and _is_open_clip(model):
        arg = "text"
        vocab = int(getattr(model, "vocab_size", 49408))
        fixed = int(getattr(model, "context_length", kwargs["text"].shape[-1]))
        limit = fixed
        mask = None
    else:
        return None
    if not vocab:
        return None
    vocab = int(vocab)
    limit = int(limit) if limit else UNKNOWN_POSITION_LIMIT
    if str(_get(config, "model_type") or "") in OFFSET_POSITIONS:  # usable length = limit - 2
        limit -= 2
    specials: set[int] = set()
    for key in _SPECIAL_KEYS:
        for sub in (config, _get(config, "text_config"), _get(config, "decoder")):
            specials.update(_ids(_get(sub, key)))
    if tokenizer is not None:
        specials.update(token_id for _, token_id in tokenizer.special_tokens())
    if fixed is not None:  # OpenCLIP: start- and end-of-text are the two highest ids
        specials.update({vocab - 2, vocab - 1})
    pad, pad_from = _pad_id(config, tokenizer, vocab)
    template = kwargs[arg]
    return TokenSpec(
        arg=arg,
        vocab=vocab,
        limit=max(1, limit),
        fixed=fixed,
        pad=pad,
        pad_from=pad_from,
        specials=tuple(sorted(i for i in specials if 0 <= i < vocab)),
        mask=mask,
        batch=int(template.shape[0]) if template.dim() else 1,
        task=task,
        decoder_start=decoder_start,
        decoder_limit=decoder_limit,
        causal=arg == "input_ids" and decoder_start is None and _generates(model),
        positions="position_ids" in params,
    )


def _pad_id(config: Any, tokenizer: ProbeTokenizer | None, vocab: int) -> tuple[int, str]:
    """The id padded positions hold: the tokenizer's choice (its pad token, else eos...),
    else the config's pad or eos id, else 0. Padding is masked, so only its range matters."""
    if tokenizer is not None:
        pad, why = tokenizer.pad()
        if 0 <= pad < vocab:
            return pad, why
    for key, why in (("pad_token_id", "the config's pad_token_id"), ("eos_token_id", "eos")):
        found = _ids(_cfg(config, key))
        if found and 0 <= found[0] < vocab:
            return found[0], why
    return 0, "id 0: neither tokenizer nor config names a pad or eos token"


def with_tokens(
    spec: TokenSpec,
    template: Mapping[str, Any],
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> dict[str, Any]:
    """``template``'s keyword arguments with ``ids`` as the token argument.

    Arguments shaped like the old ids follow (mask, token types); encoder-decoders get the
    decoder fed the same ids shifted right; other per-sample tensors are repeated to the new
    batch — except images of contrastive models (CLIP), which compare any two batches.
    """
    rows = ids.shape[0]
    keep = {"pixel_values", "image"} if spec.task == "clip" else set()
    out: dict[str, Any] = {}
    for key, value in template.items():
        if (
            isinstance(value, torch.Tensor)
            and value.dim()
            and value.shape[0] == spec.batch
            and key not in keep
        ):
            value = value[torch.arange(rows) % spec.batch]
        out[key] = value
    out[spec.arg] = ids
    if spec.mask and (spec.mask in template or mask is not None):
        out[spec.mask] = mask if mask is not None else torch.ones_like(ids)
    if "token_type_ids" in template:
        out["token_type_ids"] = torch.zeros_like(ids)
    if spec.decoder_start is not None:
        dec = torch.cat([torch.full((rows, 1), spec.decoder_start, dtype=ids.dtype), ids], 1)
        dec = dec[:, : ids.shape[1]]
        if spec.decoder_limit:
            dec = dec[:, : spec.decoder_limit]
        out["decoder_input_ids"] = dec
        if "decoder_attention_mask" in template:
            out["decoder_attention_mask"] = torch.ones_like(dec)
    return out


def finish_rows(spec: TokenSpec, ids: torch.Tensor) -> torch.Tensor:
    """Rows as the model takes them: OpenCLIP rows end with end-of-text (its pooling takes
    the highest id's position)."""
    if spec.fixed is None:
        return ids
    end = torch.full((ids.shape[0], 1), spec.vocab - 1, dtype=ids.dtype)
    return torch.cat([ids[:, : spec.fixed - 1], end], 1)


def _row_length(spec: TokenSpec) -> int:
    return spec.fixed - 1 if spec.fixed is not None else min(spec.limit, VOCAB_ROW)


def _token_probes(
    spec: TokenSpec, chosen: ModelInputs, budget: Budget, tokenizer: ProbeTokenizer | None
) -> tuple[list[Probe], list[str]]:
    template = chosen.probes[0].kwargs
    seed = chosen.seed
    probes: list[Probe] = []
    notes: list[str] = []

    def add(
        label: str,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        how: dict[str, Any],
        *,
        left: bool = False,
    ) -> None:
        kwargs = with_tokens(spec, template, finish_rows(spec, ids), mask)
        if left and spec.positions and mask is not None:
            # As generate does: positions count real tokens only, so padding shifts nothing.
            kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        probes.append(
            Probe(
                f"forward:{label}",
                "forward",
                kwargs,
                sweep={"kind": how.pop("kind"), "argument": spec.arg, **how},
                max_output=budget.max_output,
                positions=padded_positions(mask),
            )
        )

    # The vocabulary: a seeded permutation cut into equal chunks, rows of VOCAB_ROW ids.
    row = _row_length(spec)
    order = torch.randperm(spec.vocab, generator=generator(seed, "vocabulary"))
    if budget.memory_bound and spec.specials:
        # Few passes: the special ids lead the vocabulary instead of a probe of their own.
        special = torch.zeros(spec.vocab, dtype=torch.bool)
        special[list(spec.specials)] = True
        order = torch.cat([order[special[order]], order[~special[order]]])
    if not budget.whole_vocabulary:
        chunks, size = 1, min(spec.vocab, budget.tokens_per_probe)
    elif budget.memory_bound:  # as far as memory-sized probes reach
        chunks = min(math.ceil(spec.vocab / budget.tokens_per_probe), budget.vocabulary_probes)
        size = min(budget.tokens_per_probe, math.ceil(spec.vocab / chunks))
    elif budget.tokens_fit:  # every id, in as many probes as memory-sized chunks take
        chunks = math.ceil(spec.vocab / budget.tokens_per_probe)
        size = math.ceil(spec.vocab / chunks)
    else:  # every id: chunks grow past tokens_per_probe rather than exceed the probe count
        per_probe = max(budget.tokens_per_probe, math.ceil(spec.vocab / budget.vocabulary_probes))
        chunks = math.ceil(spec.vocab / per_probe)
        size = math.ceil(spec.vocab / chunks)
    if budget.whole_vocabulary and chunks * size < spec.vocab:
        notes.append(
            f"block-wise memory budget: the vocabulary sweep reached {chunks * size} of "
            f"{spec.vocab} token ids; validate where the model fits, or on a larger budget, "
            "for every id"
        )
    for i in range(chunks):
        start, stop = i * size, min(spec.vocab, (i + 1) * size)
        part = order[start:stop]
        width = row if spec.fixed is not None else min(row, len(part))
        rows = math.ceil(len(part) / width)
        fill = rows * width - len(part)  # the last row is completed from the permutation's start
        part = torch.cat([part, order[torch.arange(fill) % spec.vocab]]) if fill else part
        add(
            f"vocab-{i + 1}of{chunks}",
            part.view(rows, width),
            None,
            {
                "kind": "vocabulary",
                "permutation_seed": seed,
                "specials_first": bool(budget.memory_bound and spec.specials),
                "permutation": [start, stop],
                "vocab_size": spec.vocab,
                "whole": chunks * size >= spec.vocab,
                "rows": rows,
                "length": width,
            },
        )

    # Special and added tokens: written in text and tokenized (and a chat-template
    # conversation), else their ids amid random ids and on their own. (Memory-bound sweeps
    # have the special ids lead the vocabulary instead.)
    made = (
        special_rows(spec, tokenizer, budget)
        if tokenizer is not None and not budget.memory_bound
        else None
    )
    if made is not None:
        ids, mask, how = made
        add("special", ids, mask, {"kind": "special", "ids_from": "tokenizer", **how})
    elif spec.specials and not budget.memory_bound:
        specials = torch.tensor(spec.specials, dtype=torch.long)
        length = min(spec.limit, max(16, 2 * len(specials) + 2))
        if spec.fixed is not None:
            length = spec.fixed - 1
        mixed = torch.randint(0, spec.vocab, (length,), generator=generator(seed, "special"))
        where = torch.linspace(0, length - 1, min(len(specials), length)).long()
        mixed[where] = specials[: len(where)]
        alone = specials[torch.arange(length) % len(specials)]
        add(
            "special",
            torch.stack([mixed, alone]),
            None,
            {
                "kind": "special",
                "ids_from": "seeded",
                "ids": list(spec.specials),
                "seed": seed,
                "length": length,
            },
        )

    # Real text through the model's own tokenizer, right-padded to the longest line (lines cut
    # where the probe's token budget is small: a memory bound, or a small model's wide logits).
    if tokenizer is not None:
        cap = max(8, budget.tokens_per_probe // len(TEXTS))
        ids, mask = text_rows(spec, tokenizer, TEXTS, limit=cap)
        how = {"kind": "text", "ids_from": "tokenizer", "lines": len(TEXTS), **_padding(spec)}
        add("text", ids, mask, how)

    # Padded batches: rows of different lengths, padding masked out. Right-padded, and for
    # decoder-only models also left-padded, as ``generate`` pads a batch of prompts.
    if spec.mask and spec.fixed is None and not budget.memory_bound:
        length = min(spec.limit, PADDED_LENGTH, max(8, budget.tokens_per_probe // 4))
        lengths = sorted(
            {length, max(1, 3 * length // 4), max(1, length // 2), max(1, length // 8)},
            reverse=True,
        )
        rows, ids_from = padded_rows(spec, tokenizer, lengths, seed)
        how = {
            "kind": "padding",
            "ids_from": ids_from,
            "lengths": [len(row) for row in rows],
            **_padding(spec),
            **({"seed": seed} if ids_from == "seeded" else {}),
        }
        for side in ("right", "left") if spec.causal else ("right",):
            ids, mask = pad_rows(rows, spec.pad, side=side, width=length)
            label = "padded" if side == "right" else "padded-left"
            add(label, ids, mask, {**how, "side": side}, left=side == "left")

    # Sequence lengths doubling up to the position limit (capped by the budget).
    if spec.fixed is None:
        top = spec.limit if budget.max_length is None else min(spec.limit, budget.max_length)
        lengths = []
        if budget.doubling:
            n = FIRST_LENGTH
            while n < top:
                lengths.append(n)
                n *= 2
        lengths.append(top)
        if budget.memory_bound and min(row, size) >= top:
            lengths = []  # the vocabulary rows already reach the top length: no extra pass
        for n in lengths:
            batch = 1 if budget.memory_bound else max(1, min(BATCH, budget.tokens_per_probe // n))
            ids = torch.randint(0, spec.vocab, (batch, n), generator=generator(seed, f"length-{n}"))
            add(f"length-{n}", ids, None, {"kind": "length", "length": n, "seed": seed})
    return probes, notes


def padded_positions(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The real positions of a padded batch (None when nothing is padded)."""
    if mask is None or bool(mask.all()):
        return None
    return mask.bool()


def _padding(spec: TokenSpec) -> dict[str, Any]:
    """How a probe's batch was padded, for its record."""
    return {"pad_id": spec.pad, "pad": spec.pad_from}


def text_rows(
    spec: TokenSpec, tokenizer: ProbeTokenizer, lines: Sequence[str], limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lines`` tokenized one by one (truncated to the limit), right-padded into a batch.

    Right padding keeps every padded position after a real token, so no row of a causal
    model attends to nothing.
    """
    longest = spec.fixed - 1 if spec.fixed is not None else spec.limit
    limit = longest if limit is None or spec.fixed is not None else min(longest, limit)
    encoded = [tokenizer.encode(line, limit) or [spec.pad] for line in lines]
    return pad_rows(encoded, spec.pad, width=limit if spec.fixed is not None else None)


def padded_rows(
    spec: TokenSpec, tokenizer: ProbeTokenizer | None, lengths: Sequence[int], seed: int
) -> tuple[list[list[int]], str]:
    """Rows of the given lengths and where their ids come from: prefixes of real text through
    the tokenizer, else seeded random ids."""
    if tokenizer is not None:
        stream = tokenizer.encode(" ".join(TEXTS), lengths[0])
        return [stream[:n] for n in lengths], "tokenizer"
    ids = torch.randint(
        0, spec.vocab, (len(lengths), lengths[0]), generator=generator(seed, "padded")
    )
    return [ids[r, :n].tolist() for r, n in enumerate(lengths)], "seeded"


def special_rows(
    spec: TokenSpec, tokenizer: ProbeTokenizer, budget: Budget
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None:
    """The tokenizer's special and added tokens written into text (each beside a word) and
    tokenized, after a chat-template conversation when the tokenizer has a template: rows of
    at most one probe's tokens, right-padded, and their record. None when the tokenizer has no
    special token inside the model's vocabulary."""
    tokens = [(text, i) for text, i in tokenizer.special_tokens() if 0 <= i < spec.vocab]
    if not tokens:
        return None
    width = _row_length(spec)
    if spec.fixed is None:  # a small token budget makes shorter rows, not a bigger probe
        width = min(width, max(16, budget.tokens_per_probe))
    most = max(1, budget.tokens_per_probe // width)
    rows: list[list[int]] = []
    chat = tokenizer.chat(TEXTS[:2], width)
    if chat is not None and max(chat) < spec.vocab:
        rows.append(chat)
    words = TEXTS[0].split()
    per_row = max(1, width // SPECIAL_SPACING)
    for start in range(0, len(tokens), per_row):
        if len(rows) >= most:
            break
        group = tokens[start : start + per_row]
        text = " ".join(f"{t} {words[k % len(words)]}" for k, (t, _) in enumerate(group, start))
        row = tokenizer.encode(text, width)
        if row and max(row) < spec.vocab:
            rows.append(row)
    if not rows:
        return None
    seen = {i for row in rows for i in row}
    ids, mask = pad_rows(rows, spec.pad, width=width if spec.fixed is not None else None)
    how = {
        "special_tokens": len(tokens),
        "reached": sum(i in seen for _, i in tokens),
        "chat_template": chat is not None,
        "rows": len(rows),
        **_padding(spec),
    }
    return ids, mask, how


# --------------------------------------------------------------------------- diffusion


def timestep_values(model: Any, budget: Budget, train_timesteps: int | None) -> list[Any]:
    """The timesteps ``budget`` sweeps, on the scale the model takes them.

    Most denoisers take the scheduler's integer timesteps (0..999): they are fed as int64,
    as DDPM/DDIM/PNDM schedulers hand them on, so a bf16 candidate sees 999 and not its bf16
    rounding (1000). Models that scale t in [0, 1] themselves (Flux) get sigma values that are
    exact in bf16 and fp16 — and stay exact once the model multiplies them by 1000.
    """
    steps = int(train_timesteps or TRAIN_TIMESTEPS)
    if _scales_timestep(model):
        exact = (1.0, 0.5, 0.25, 0.125, 0.0)
        wanted = {min(exact, key=lambda e: abs(e - f)) for f in budget.timesteps}
        return sorted(wanted, reverse=True)
    return sorted({round(f * (steps - 1)) for f in budget.timesteps}, reverse=True)


def _timesteps(
    model: Any, chosen: ModelInputs, budget: Budget, train_timesteps: int | None
) -> list[Probe]:
    first = chosen.probes[0]
    template = first.kwargs
    current = template["timestep"]
    batch = int(current.shape[0]) if isinstance(current, torch.Tensor) and current.dim() else 1
    scaled = _scales_timestep(model)
    probes = []
    values = timestep_values(model, budget, train_timesteps)
    chosen_value = float(current.flatten()[0]) if isinstance(current, torch.Tensor) else None
    for t in values:
        if chosen_value is not None and float(t) == chosen_value:
            continue  # the chosen probe already runs at this timestep
        value = torch.full((batch,), float(t)) if scaled else torch.full((batch,), int(t))
        probes.append(
            Probe(
                f"forward:t={t:g}",
                "forward",
                {**template, "timestep": value},
                sweep={"kind": "timestep", "timestep": t, "train_timesteps": train_timesteps},
                max_output=budget.max_output,
            )
        )
    if budget.conditioning:
        first_step = values[0]
        value = (
            torch.full((batch,), float(first_step))
            if scaled
            else torch.full((batch,), int(first_step))
        )
        kwargs = {**template, "timestep": value}
        changed = []
        for key in ("encoder_hidden_states", "pooled_projections", "encoder_hidden_states_image"):
            tensor = kwargs.get(key)
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                kwargs[key] = realistic_conditioning(tensor.shape, generator(chosen.seed, key))
                changed.append(key)
        if changed:
            probes.append(
                Probe(
                    "forward:conditioning",
                    "forward",
                    kwargs,
                    sweep={
                        "kind": "conditioning",
                        "timestep": first_step,
                        "arguments": changed,
                        "seed": chosen.seed,
                        "outlier": CONDITIONING_OUTLIER,
                    },
                    max_output=budget.max_output,
                )
            )
    return probes


def realistic_conditioning(shape: Sequence[int], g: torch.Generator) -> torch.Tensor:
    """Text-encoder-like states: unit-scale values plus two outlier channels near +-30."""
    values = torch.randn(*shape, generator=g)
    if len(shape) >= 2 and shape[-1] >= 4:
        channels = torch.randperm(shape[-1], generator=g)[:2]
        signs = torch.tensor([1.0, -1.0])
        values[..., channels] = CONDITIONING_OUTLIER * signs + 0.5 * values[..., channels]
    return values


# --------------------------------------------------------------------------- images, audio


def _image_sizes(chosen: ModelInputs, budget: Budget) -> list[Probe]:
    encode = chosen.probes[0]
    decode = next((p for p in chosen.probes if p.method == "decode"), None)
    name, image = next(
        ((k, v) for k, v in encode.kwargs.items() if isinstance(v, torch.Tensor)), (None, None)
    )
    if image is None or decode is None:
        return []
    probes: list[Probe] = []
    *lead, h, w = image.shape
    for scale in budget.image_scales:
        side = f"{h * scale}x{w * scale}"
        g = generator(chosen.seed, f"image-{side}")
        bigger = _image(g, *lead, h * scale, w * scale)
        how = {"kind": "image-size", "height": h * scale, "width": w * scale, "seed": chosen.seed}
        probes += _encode_decode(f"@{side}", {name: bigger}, decode, how, budget)
    return probes


def _encode_decode(
    label: str, kwargs: dict[str, Any], decode: Probe | None, how: dict[str, Any], budget: Budget
) -> list[Probe]:
    """An autoencoder probe pair: ``encode`` on ``kwargs``, then ``decode`` of its latents (the
    chosen layout's decode probe, re-pointed at this encode)."""
    probes = [Probe(f"encode{label}", "encode", kwargs, sweep=how, max_output=budget.max_output)]
    if decode is not None:
        z_name = next(k for k, v in decode.kwargs.items() if isinstance(v, FromOutput))
        probes.append(
            Probe(
                f"decode{label}",
                "decode",
                {**decode.kwargs, z_name: FromOutput(f"encode{label}")},
                images=True,
                sweep=how,
                max_output=budget.max_output,
            )
        )
    return probes


#: ImageNet-normalized pixels span about [-2.1, 2.6]; the built images span [-1, 1].
NORMALIZED_SPAN = 2.4


def _contrast(chosen: ModelInputs, budget: Budget) -> list[Probe]:
    """Vision inputs at the full range of normalized pixels (high-contrast images)."""
    if budget.level == "quick":
        return []
    template = chosen.probes[0].kwargs
    key = next(
        (k for k in ("pixel_values", "image") if isinstance(template.get(k), torch.Tensor)), None
    )
    if key is None:
        return []
    kwargs = {**template, key: (template[key] * NORMALIZED_SPAN).clamp(-2.1, 2.6)}
    how = {"kind": "contrast", "scale": NORMALIZED_SPAN, "clamp": [-2.1, 2.6]}
    return [Probe("forward:contrast", "forward", kwargs, sweep=how, max_output=budget.max_output)]


def _longer_audio(chosen: ModelInputs, budget: Budget) -> list[Probe]:
    """Raw-audio encoders on a clip four times longer (one sample): positions and conv edges."""
    if budget.level == "quick":
        return []
    template = chosen.probes[0].kwargs
    audio = template.get("input_values")
    if not isinstance(audio, torch.Tensor) or audio.dim() != 2:
        return []
    samples = int(audio.shape[1]) * 4
    g = generator(chosen.seed, "audio-4x")
    longer = 0.1 * torch.randn(1, samples, generator=g)
    kwargs = {k: v for k, v in template.items() if k != "attention_mask"}
    kwargs["input_values"] = longer
    how = {"kind": "audio-length", "samples": samples, "seed": chosen.seed}
    return [Probe("forward:audio-4x", "forward", kwargs, sweep=how, max_output=budget.max_output)]


# --------------------------------------------------------------------------- user data


def user_probes(
    model: Any,
    chosen: ModelInputs,
    data: CalibrationData,
    *,
    tokenizer: ProbeTokenizer | None,
    budget: Budget,
    component: str = "",
) -> list[Probe]:
    """The probes ``data`` adds for ``model`` (a pipeline's ``component`` when named).

    Raises:
        InputError: (naming the file) text without a tokenizer or for a model that takes no
            token ids; a JSONL line naming arguments the model does not take.
    """
    if data.texts:
        return _text_probes(model, chosen, data, tokenizer, budget, component)
    return _record_probes(model, chosen, data, budget, component)


def _text_probes(
    model: Any,
    chosen: ModelInputs,
    data: CalibrationData,
    tokenizer: ProbeTokenizer | None,
    budget: Budget,
    component: str,
) -> list[Probe]:
    name = type(model).__name__
    first = chosen.probes[0] if chosen.probes else None
    spec = token_spec(model, first, tokenizer, chosen.task) if first is not None else None
    if spec is None or tokenizer is None:
        if component:  # a pipeline component that takes no text: the data is for another
            return []
        why = (
            f"{name} takes no token ids"
            if spec is None
            else f"{name} ships no tokenizer to turn text into token ids"
        )
        raise InputError(
            f"--calibration-data holds text lines, but {why}; give JSONL of model inputs "
            '(one object per line, e.g. {"input_ids": [[1, 2, 3]]}) instead',
            data.path,
        )
    # Lines packed greedily into probes of at most tokens_per_probe (rows x longest row).
    limit = spec.fixed - 1 if spec.fixed is not None else spec.limit
    encoded = [tokenizer.encode(line, limit) or [spec.pad] for line in data.texts]
    if max(max(ids) for ids in encoded) >= spec.vocab:
        raise InputError(
            f"--calibration-data: the tokenizer's ids exceed {name}'s vocabulary", data.path
        )
    sizes = [len(ids) for ids in encoded]
    groups: list[list[int]] = []
    longest = 0
    for index, size in enumerate(sizes):
        if groups and (len(groups[-1]) + 1) * max(longest, size) <= budget.tokens_per_probe:
            groups[-1].append(index)
            longest = max(longest, size)
        else:
            groups.append([index])
            longest = size
    probes = []
    for number, group in enumerate(groups, 1):
        rows = [encoded[i] for i in group]
        ids, mask = pad_rows(rows, spec.pad, width=limit if spec.fixed is not None else None)
        kwargs = with_tokens(spec, first.kwargs, finish_rows(spec, ids), mask)
        lines = data.text_lines or tuple(range(1, len(data.texts) + 1))
        how = {
            "kind": "user-text",
            "file": data.path.name,  # the name only: the certificate is published
            "lines": [lines[group[0]], lines[group[-1]]],  # first and last file line
            "samples": len(group),
        }
        probes.append(
            Probe(
                f"forward:user-text-{number}",
                "forward",
                kwargs,
                sweep=how,
                max_output=budget.max_output,
                positions=padded_positions(mask),
            )
        )
    return probes


def _record_probes(
    model: Any, chosen: ModelInputs, data: CalibrationData, budget: Budget, component: str
) -> list[Probe]:
    first = chosen.probes[0] if chosen.probes else None
    autoencoder = first is not None and first.method == "encode"
    method = "encode" if autoencoder else "forward"
    target = getattr(model, method) if autoencoder else model.forward
    params = _signature(target)
    # transformers/diffusers forwards take **kwargs for attention plumbing, not inputs: their
    # named parameters are the inputs. Other code may read inputs from **kwargs.
    open_kwargs = _library(model) not in ("transformers", "diffusers") and any(
        p.kind == p.VAR_KEYWORD for p in inspect.signature(target).parameters.values()
    )
    name = type(model).__name__
    probes: list[Probe] = []
    for line, record in data.records:
        mine = addressed(record, component)
        if not mine:
            if not component:
                raise InputError(
                    f"--calibration-data: line {line} names no argument of {name}", data.path
                )
            continue
        unknown = sorted(set(mine) - set(params)) if not open_kwargs else []
        if component and len(unknown) == len(mine):
            continue  # a line for another component of the pipeline
        if unknown:
            raise InputError(
                f"--calibration-data: line {line} names {', '.join(unknown)}, which "
                f"{name}.{method} does not take (it takes {', '.join(params)})",
                data.path,
            )
        kwargs: dict[str, Any] = {k: to_tensor(v) for k, v in mine.items()}
        if first is not None:
            for key, value in first.kwargs.items():  # flags such as use_cache=False
                if key not in kwargs and not isinstance(value, torch.Tensor | FromOutput):
                    kwargs.setdefault(key, value)
            ids = kwargs.get("input_ids")
            if (
                "decoder_input_ids" in first.kwargs
                and "decoder_input_ids" not in kwargs
                and isinstance(ids, torch.Tensor)
                and ids.dim() == 2
            ):
                start = decoder_start(model)
                kwargs["decoder_input_ids"] = torch.cat(
                    [torch.full((ids.shape[0], 1), start, dtype=ids.dtype), ids[:, :-1]], 1
                )
        how = {"kind": "user-jsonl", "file": data.path.name, "line": line}
        label = f"user-{line}"
        if autoencoder:
            decode = next((p for p in chosen.probes if p.method == "decode"), None)
            probes += _encode_decode(f":{label}", kwargs, decode, how, budget)
        else:
            probes.append(
                Probe(
                    f"forward:{label}", "forward", kwargs, sweep=how, max_output=budget.max_output
                )
            )
    return probes
