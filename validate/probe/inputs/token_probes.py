"""Token-family sweep probes: what a model taking token ids is fed beyond its layout probe.

The whole vocabulary in chunks (every id at least once from ``standard`` up), the special
tokens (bos/eos/pad/unk/cls/sep/mask, added tokens, the chat template), real text, sequence
lengths doubling up to the level's longest context, and padded batches with their attention
mask, right-padded and (decoder-only models) left-padded as ``generate`` pads them;
encoder-decoders feed the decoder the same ids shifted right. Special tokens, text and padded
batches go through the model's own tokenizer when it ships a usable one (each probe records
``ids_from``), else they are made of seeded ids. :func:`token_spec` says how a model takes ids;
the rows past the longest probe, up to the position limit, are :mod:`.positions`' job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from precision_convert.validation.probe.inputs.budgets import LONGEST_SEQUENCE, Budget
from precision_convert.validation.probe.inputs.layouts import BATCH
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    config_get,
    config_value,
    is_open_clip,
    parameters_of,
    seeded_generator,
)
from precision_convert.validation.probe.inputs.positions import OFFSET_POSITIONS
from precision_convert.validation.probe.inputs.tokenizers import ProbeTokenizer, pad_rows

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
    #: Elements a token's hidden states take over every layer (``output_hidden_states``) when
    #: the forward can keep only the last positions' logits (``logits_to_keep``); else None.
    hidden_elements: int | None = None
    #: The image a vision-language layout placed in its prompt (``pixel_values``...): left out
    #: of the token probes, whose rows hold no image tokens for it (the layout judges it).
    image_inputs: tuple[str, ...] = ()


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
    if config_get(getattr(model, "config", None), "is_encoder_decoder"):
        return False  # its encoder takes the prompts, padded on the right
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


def token_spec(
    model: Any, probe: Probe, tokenizer: ProbeTokenizer | None, task: str
) -> TokenSpec | None:
    """The token argument of ``probe`` and what bounds it; None when it takes no ids."""
    kwargs = probe.kwargs
    params = parameters_of(model.forward)
    config = getattr(model, "config", None)
    decoder_start = decoder_limit = None
    fixed = None
    if isinstance(kwargs.get("input_ids"), torch.Tensor):
        arg = "input_ids"
        vocab = config_value(config, "vocab_size")
        limit = config_value(config, "max_position_embeddings", "n_positions", "max_text_len")
        mask = "attention_mask" if "attention_mask" in params else None
        if isinstance(kwargs.get("decoder_input_ids"), torch.Tensor):
            start = config_value(config, "decoder_start_token_id", "bos_token_id", "pad_token_id")
            decoder_start = int(start) if isinstance(start, int) else 0
            dec = config_value(
                config, "max_target_positions", "max_position_embeddings", "n_positions"
            )
            decoder_limit = int(dec) if dec else None
    elif isinstance(kwargs.get("decoder_input_ids"), torch.Tensor):
        arg = "decoder_input_ids"
        vocab = config_value(config, "vocab_size")
        limit = config_value(
            config, "max_target_positions", "max_position_embeddings", "n_positions"
        )
        mask = "decoder_attention_mask" if "decoder_attention_mask" in params else None
    elif isinstance(kwargs.get("text"), torch.Tensor) and is_open_clip(model):
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
    if str(config_get(config, "model_type") or "") in OFFSET_POSITIONS:  # usable length = limit - 2
        limit -= 2
    specials: set[int] = set()
    for key in _SPECIAL_KEYS:
        for sub in (config, config_get(config, "text_config"), config_get(config, "decoder")):
            specials.update(_ids(config_get(sub, key)))
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
        hidden_elements=_hidden_elements(config) if "logits_to_keep" in params else None,
        image_inputs=_image_inputs(config, kwargs, template),
    )


def _image_inputs(config: Any, kwargs: Mapping[str, Any], ids: torch.Tensor) -> tuple[str, ...]:
    """The image arguments of a prompt holding the image token its config names."""
    token = config_value(config, "image_token_index", "image_token_id")
    if not isinstance(token, int) or not bool((ids == token).any()):
        return ()
    return tuple(k for k in ("pixel_values", "image_sizes") if k in kwargs)


def _hidden_elements(config: Any) -> int | None:
    """Elements of one token's hidden states over every layer and the embedding."""
    hidden = config_value(config, "hidden_size", "n_embd", "d_model")
    layers = config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    if not isinstance(hidden, int) or not isinstance(layers, int):
        return None
    return hidden * (layers + 1)


def _pad_id(config: Any, tokenizer: ProbeTokenizer | None, vocab: int) -> tuple[int, str]:
    """The id padded positions hold: the tokenizer's choice (its pad token, else eos...),
    else the config's pad or eos id, else 0. Padding is masked, so only its range matters."""
    if tokenizer is not None:
        pad, why = tokenizer.pad()
        if 0 <= pad < vocab:
            return pad, why
    for key, why in (("pad_token_id", "the config's pad_token_id"), ("eos_token_id", "eos")):
        found = _ids(config_value(config, key))
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
        if key in spec.image_inputs:
            continue
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


@dataclass(frozen=True)
class _TokenProbes:
    """What every token probe of one sweep shares: the model's token argument, the chosen
    probe's keyword arguments as template, the budget and the layout's seed."""

    spec: TokenSpec
    template: Mapping[str, Any]
    budget: Budget
    seed: int

    def probe(
        self,
        label: str,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        how: Mapping[str, Any],
        *,
        left: bool = False,
    ) -> Probe:
        """A forward probe of ``ids`` (``mask``: their padding), recorded as ``how`` says."""
        spec = self.spec
        kwargs = with_tokens(spec, self.template, finish_rows(spec, ids), mask)
        if left and spec.positions and mask is not None:
            # As generate does: positions count real tokens only, so padding shifts nothing.
            kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        record = {k: v for k, v in how.items() if k != "kind"}
        return Probe(
            f"forward:{label}",
            "forward",
            kwargs,
            sweep={"kind": how["kind"], "argument": spec.arg, **record},
            max_output=self.budget.max_output,
            positions=padded_positions(mask),
        )


def token_probes(
    spec: TokenSpec, chosen: ModelInputs, budget: Budget, tokenizer: ProbeTokenizer | None
) -> tuple[list[Probe], list[str]]:
    """The token family's sweep probes, and notes on what the budget left out: the whole
    vocabulary in chunks, the special tokens, real text, padded batches and lengths doubling
    up to the position limit."""
    made = _TokenProbes(spec, chosen.probes[0].kwargs, budget, chosen.seed)
    chunks, size = _vocabulary_chunks(spec, budget)
    probes = _vocabulary_probes(made, chunks, size)
    special = _special_probe(made, tokenizer)
    if special is not None:
        probes.append(special)
    if tokenizer is not None:
        probes.append(_text_probe(made, tokenizer))
    probes += _padded_probes(made, tokenizer)
    probes += _length_probes(made, size)
    notes = []
    if budget.whole_vocabulary and chunks * size < spec.vocab:
        notes.append(
            f"block-wise memory budget: the vocabulary sweep reached {chunks * size} of "
            f"{spec.vocab} token ids; validate where the model fits, or on a larger budget, "
            "for every id"
        )
    return probes, notes


def _vocabulary_chunks(spec: TokenSpec, budget: Budget) -> tuple[int, int]:
    """How many vocabulary probes the budget takes, and how many ids each holds."""
    if not budget.whole_vocabulary:
        return 1, min(spec.vocab, budget.tokens_per_probe)
    if budget.memory_bound:  # as far as memory-sized probes reach
        chunks = min(math.ceil(spec.vocab / budget.tokens_per_probe), budget.vocabulary_probes)
        return chunks, min(budget.tokens_per_probe, math.ceil(spec.vocab / chunks))
    if budget.tokens_fit:  # every id, in as many probes as memory-sized chunks take
        chunks = math.ceil(spec.vocab / budget.tokens_per_probe)
        return chunks, math.ceil(spec.vocab / chunks)
    # Every id: chunks grow past tokens_per_probe rather than exceed the probe count.
    per_probe = max(budget.tokens_per_probe, math.ceil(spec.vocab / budget.vocabulary_probes))
    chunks = math.ceil(spec.vocab / per_probe)
    return chunks, math.ceil(spec.vocab / chunks)


def _vocabulary_probes(made: _TokenProbes, chunks: int, size: int) -> list[Probe]:
    """The vocabulary: a seeded permutation cut into ``chunks`` of ``size`` ids, in rows of
    :data:`VOCAB_ROW` ids (memory-bound sweeps put the special ids first)."""
    spec, budget = made.spec, made.budget
    order = torch.randperm(spec.vocab, generator=seeded_generator(made.seed, "vocabulary"))
    if budget.memory_bound and spec.specials:
        # Few passes: the special ids lead the vocabulary instead of a probe of their own.
        special = torch.zeros(spec.vocab, dtype=torch.bool)
        special[list(spec.specials)] = True
        order = torch.cat([order[special[order]], order[~special[order]]])
    row = _row_length(spec)
    probes = []
    for i in range(chunks):
        start, stop = i * size, min(spec.vocab, (i + 1) * size)
        part = order[start:stop]
        width = row if spec.fixed is not None else min(row, len(part))
        rows = math.ceil(len(part) / width)
        fill = rows * width - len(part)  # the last row is completed from the permutation's start
        part = torch.cat([part, order[torch.arange(fill) % spec.vocab]]) if fill else part
        how = {
            "kind": "vocabulary",
            "permutation_seed": made.seed,
            "specials_first": bool(budget.memory_bound and spec.specials),
            "permutation": [start, stop],
            "vocab_size": spec.vocab,
            "whole": chunks * size >= spec.vocab,
            "rows": rows,
            "length": width,
        }
        probes.append(made.probe(f"vocab-{i + 1}of{chunks}", part.view(rows, width), None, how))
    return probes


def _special_probe(made: _TokenProbes, tokenizer: ProbeTokenizer | None) -> Probe | None:
    """Special and added tokens written in text and tokenized (and a chat-template
    conversation), else their ids amid random ids and on their own. None for memory-bound
    sweeps, whose vocabulary probes lead with the special ids instead."""
    spec, budget = made.spec, made.budget
    if budget.memory_bound:
        return None
    made_rows = special_rows(spec, tokenizer, budget) if tokenizer is not None else None
    if made_rows is not None:
        ids, mask, how = made_rows
        return made.probe("special", ids, mask, {"kind": "special", "ids_from": "tokenizer", **how})
    if not spec.specials:
        return None
    specials = torch.tensor(spec.specials, dtype=torch.long)
    length = min(spec.limit, max(16, 2 * len(specials) + 2))
    if spec.fixed is not None:
        length = spec.fixed - 1
    g = seeded_generator(made.seed, "special")
    mixed = torch.randint(0, spec.vocab, (length,), generator=g)
    where = torch.linspace(0, length - 1, min(len(specials), length)).long()
    mixed[where] = specials[: len(where)]
    alone = specials[torch.arange(length) % len(specials)]
    how = {
        "kind": "special",
        "ids_from": "seeded",
        "ids": list(spec.specials),
        "seed": made.seed,
        "length": length,
    }
    return made.probe("special", torch.stack([mixed, alone]), None, how)


def _text_probe(made: _TokenProbes, tokenizer: ProbeTokenizer) -> Probe:
    """Real text through the model's own tokenizer, right-padded to the longest line (lines
    cut where the probe's token budget is small: a memory bound, or a small model's wide
    logits)."""
    cap = max(8, made.budget.tokens_per_probe // len(TEXTS))
    ids, mask = text_rows(made.spec, tokenizer, TEXTS, limit=cap)
    how = {"kind": "text", "ids_from": "tokenizer", "lines": len(TEXTS), **_padding(made.spec)}
    return made.probe("text", ids, mask, how)


def _padded_probes(made: _TokenProbes, tokenizer: ProbeTokenizer | None) -> list[Probe]:
    """Padded batches: rows of different lengths, padding masked out. Right-padded, and for
    decoder-only models also left-padded, as ``generate`` pads a batch of prompts."""
    spec, budget = made.spec, made.budget
    if not spec.mask or spec.fixed is not None or budget.memory_bound:
        return []
    length = min(spec.limit, PADDED_LENGTH, max(8, budget.tokens_per_probe // 4))
    lengths = sorted(
        {length, max(1, 3 * length // 4), max(1, length // 2), max(1, length // 8)},
        reverse=True,
    )
    rows, ids_from = padded_rows(spec, tokenizer, lengths, made.seed)
    how = {
        "kind": "padding",
        "ids_from": ids_from,
        "lengths": [len(row) for row in rows],
        **_padding(spec),
        **({"seed": made.seed} if ids_from == "seeded" else {}),
    }
    probes = []
    for side in ("right", "left") if spec.causal else ("right",):
        ids, mask = pad_rows(rows, spec.pad, side=side, width=length)
        label = "padded" if side == "right" else "padded-left"
        probes.append(made.probe(label, ids, mask, {**how, "side": side}, left=side == "left"))
    return probes


def _length_probes(made: _TokenProbes, vocabulary_size: int) -> list[Probe]:
    """Sequence lengths doubling up to the position limit (capped by the budget); none where
    memory-bound vocabulary rows of ``vocabulary_size`` ids already reach the longest."""
    spec, budget = made.spec, made.budget
    if spec.fixed is not None:
        return []
    top = min(spec.limit, budget.max_length or LONGEST_SEQUENCE)
    lengths = []
    if budget.doubling:
        n = FIRST_LENGTH
        while n < top:
            lengths.append(n)
            n *= 2
    lengths.append(top)
    if budget.memory_bound and min(_row_length(spec), vocabulary_size) >= top:
        return []  # the vocabulary rows already reach the top length: no extra pass
    probes = []
    for n in lengths:
        batch = 1 if budget.memory_bound else max(1, min(BATCH, budget.tokens_per_probe // n))
        g = seeded_generator(made.seed, f"length-{n}")
        ids = torch.randint(0, spec.vocab, (batch, n), generator=g)
        how: dict[str, Any] = {"kind": "length", "length": n, "seed": made.seed}
        kept = _logits_kept(spec, budget, n)
        probe = made.probe(f"length-{n}", ids, None, how)
        probes.append(probe if kept is None else probe.on_hidden_states(kept))
    return probes


def _logits_kept(spec: TokenSpec, budget: Budget, length: int) -> int | None:
    """How many positions' logits a ``length``-token row keeps (None: all of them).

    A row longer than the tokens memory affords a probe still runs (it is the context length
    reached), but a big vocabulary's logits at every position would dominate its memory (a
    2048-token row over 128k ids: 1 GB in fp32). Where the head can keep the last positions
    only and every layer's hidden states at every position take less than the logits dropped,
    the row keeps as many positions' logits as a probe affords and is judged on every
    position's hidden states: a NaN or an error at any position shows there, and the head's
    own numbers on the last positions.
    """
    affordable = budget.tokens_per_probe
    if spec.hidden_elements is None or budget.memory_bound or length <= affordable:
        return None
    dropped = (length - affordable) * spec.vocab
    return affordable if dropped > length * spec.hidden_elements else None


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
        0, spec.vocab, (len(lengths), lengths[0]), generator=seeded_generator(seed, "padded")
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
