"""Context probes: the inputs an overflow may need that the vocabulary and length sweeps leave
out, made cheaply.

A token's activations depend on where it sits and what it follows. The vocabulary sweep puts
every id somewhere in a 512-token row, almost never at position 0, where a causal model's
token attends to nothing but itself; the length ladder feeds random ids, which never repeat
and never loop as a model's own generation does. Three families of probes reach these
contexts at a cost linear in the vocabulary and the tokens generated:

- **the first position** (``first-position``): every id alone in a one-token row (rows of
  one token are cheap: thousands go in one forward), and, where the family starts its prompts
  with a BOS token, every id right after it; where the head can keep no logits, these rows
  are judged on every layer's hidden states instead. A family with no BOS (Qwen2) has
  position 0 holding the id itself, which the one-token rows are.
- **repeated ids** (``repeats``): a few seeded ids, each placed every ``d`` tokens along a row
  of seeded ids, for ``d`` doubling from 1 (the id repeated throughout) to half the row: what
  attention reading back to an earlier copy of a token sees. Where the head can keep fewer
  logits, these rows are judged on every layer's hidden states and the last position's logits.
- **generation** (``generation``): for models that generate (decoder-only and
  encoder-decoder), fp32's greedy continuation of a few prompts, made here on the fp32 model.
  The candidate is teacher-forced on it (``generation-forced``: the prompt and continuation as
  one forward, judged per position with the usual logits thresholds), and its own free
  generation (``generation-free``) is judged for NaN/Inf only: a lower precision may
  legitimately pick other tokens there.

How much each family runs is the coverage level's (:data:`~.budgets.BUDGETS`:
``repeat_ids``, ``generation``). Calibration runs the same probes as validation, so the peaks
that make fp16-safe's range islands are recorded on these contexts too. :func:`triggers` says,
per kind of trigger (``ids``, ``positions``, ``pairs``, ``generation``, ``bound``), what the
probes searched and what they did not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from precision_convert.core.errors import one_line
from precision_convert.validation.probe.inputs.budgets import Budget
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    cache_argument,
    parameters_of,
    seeded_generator,
)
from precision_convert.validation.probe.inputs.token_probes import (
    TEXTS,
    TokenSpec,
    finish_rows,
    with_tokens,
)
from precision_convert.validation.probe.inputs.tokenizers import ProbeTokenizer

#: Tokens of a repeated-ids row: long enough for distances up to 128, short enough that each
#: row costs little.
REPEAT_ROW = 256
#: Tokens of a generation prompt made of seeded ids (a tokenizer's prompts are real text cut
#: to the shortest of them).
PROMPT_LENGTH = 16
#: What a model's generate raises when it cannot run on the prompts (then no generation probe,
#: with a note): the run layer's own list, which this layer cannot import.
_GENERATE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError)


def context_probes(
    model: Any,
    spec: TokenSpec,
    chosen: ModelInputs,
    budget: Budget,
    tokenizer: ProbeTokenizer | None,
    *,
    trimmed_tokens: int,
    sampled: torch.Tensor | None = None,
) -> tuple[list[Probe], list[str]]:
    """The first-position, repeated-ids and generation probes of a token model, and notes on
    what could not run.

    ``sampled``: the ids a level without the whole vocabulary samples (its one vocabulary
    probe's); those are the ids fed at position 0 then. ``trimmed_tokens``: tokens a probe
    may hold when its head keeps no logits. Fixed-length text (OpenCLIP) gets none:
    it is always fed whole, end-of-text last; nor does a model fed images or audio beside its
    ids (thousands of one-token rows would each carry a copy of them).
    """
    template = chosen.probes[0].kwargs
    media = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in template.values())
    if spec.fixed is not None or media:
        return [], []
    probes = first_position_probes(
        model, spec, template, budget, tokenizer, trimmed_tokens=trimmed_tokens, sampled=sampled
    )
    probes += repeat_probes(
        model, spec, template, budget, chosen.seed, trimmed_tokens=trimmed_tokens
    )
    made, notes = generation_probes(model, spec, template, budget, tokenizer, chosen.seed)
    return probes + made, notes


def _probe(
    spec: TokenSpec,
    template: Mapping[str, Any],
    budget: Budget,
    name: str,
    ids: torch.Tensor,
    how: Mapping[str, Any],
) -> Probe:
    """A forward probe of ``ids`` in the model's token argument, recorded as ``how`` says."""
    kwargs = with_tokens(spec, template, finish_rows(spec, ids))
    return Probe(
        f"forward:{name}",
        "forward",
        kwargs,
        sweep={"argument": spec.arg, **how},
        max_output=budget.max_output,
    )


def first_position_probes(
    model: Any,
    spec: TokenSpec,
    template: Mapping[str, Any],
    budget: Budget,
    tokenizer: ProbeTokenizer | None,
    *,
    trimmed_tokens: int,
    sampled: torch.Tensor | None = None,
) -> list[Probe]:
    """Every id (``sampled`` ones below ``whole_vocabulary``) at position 0: one-token rows,
    then, where the family has a BOS token, two-token rows ``[bos, id]``."""
    ids = (
        torch.arange(spec.vocab)
        if budget.whole_vocabulary or sampled is None
        else sampled.reshape(-1).unique()
    )
    bos = bos_of(model, tokenizer, spec.vocab)
    parameters = parameters_of(model.forward)
    trimmed = "logits_to_keep" in parameters
    # A causal LM's rows after BOS all attend to the same BOS: its cache is computed once.
    shared = trimmed and cache_argument(model) is not None and spec.decoder_start is None
    probes = []
    for lead in (None, bos) if bos is not None else (None,):
        width = 1 if lead is None or shared else 2
        per_probe = max(1, (trimmed_tokens if trimmed else budget.tokens_per_probe) // width)
        chunks = math.ceil(len(ids) / per_probe)
        for i in range(chunks):
            part = ids[i * per_probe : (i + 1) * per_probe].unsqueeze(1)
            if lead is not None and not shared:
                part = torch.cat([torch.full_like(part, lead), part], 1)
            label = "first-position" if lead is None else "first-position-bos"
            how: dict[str, Any] = {
                "kind": "first-position",
                "ids_from": "every id" if len(ids) == spec.vocab else "the sampled vocabulary",
                "rows": [i * per_probe, i * per_probe + len(part)],
                "bos": lead,
            }
            probe = _probe(spec, template, budget, f"{label}-{i + 1}of{chunks}", part, how)
            probe = probe.on_hidden_states(0) if trimmed else probe
            if lead is not None and shared:
                probe = _after_prefix(spec, template, probe, lead)
            probes.append(probe)
    return probes


def _after_prefix(spec: TokenSpec, template: Mapping[str, Any], probe: Probe, lead: int) -> Probe:
    """``probe``'s one-token rows continuing the cache of ``[lead]``: the mask covers the
    prefix too, and the prefix call keeps no logits (only its cache is read)."""
    rows = probe.kwargs[spec.arg]
    kwargs = dict(probe.kwargs)
    if spec.mask and spec.mask in kwargs:
        kwargs[spec.mask] = torch.ones(rows.shape[0], 1 + rows.shape[1], dtype=rows.dtype)
    prefix = with_tokens(spec, template, torch.tensor([[lead]], dtype=rows.dtype))
    prefix["use_cache"] = True
    prefix["logits_to_keep"] = torch.zeros(0, dtype=torch.long)
    sweep = {**probe.sweep, "prefix": "BOS run once; its cache continued by every row"}
    return replace(probe, kwargs=kwargs, prefix=prefix, sweep=sweep)


def bos_of(model: Any, tokenizer: ProbeTokenizer | None, vocab: int) -> int | None:
    """The id the family starts prompts with: the first id the tokenizer puts before text,
    when it is its BOS token; without a tokenizer, the config's ``bos_token_id``. None for a
    family with no BOS (Qwen2's tokenizer adds none, whatever its config names)."""
    if tokenizer is not None and tokenizer.tokenizer is not None:
        bos = getattr(tokenizer.tokenizer, "bos_token_id", None)
        first = tokenizer.encode(TEXTS[0], 4)
        found = first[0] if first and isinstance(bos, int) and first[0] == bos else None
    else:
        found = getattr(getattr(model, "config", None), "bos_token_id", None)
    return found if isinstance(found, int) and 0 <= found < vocab else None


def repeat_distances(length: int) -> list[int]:
    """Distances 1, 2, 4, ... up to half of a ``length``-token row."""
    distances, d = [], 1
    while d <= max(1, length // 2):
        distances.append(d)
        d *= 2
    return distances


def repeat_probes(
    model: Any,
    spec: TokenSpec,
    template: Mapping[str, Any],
    budget: Budget,
    seed: int,
    *,
    trimmed_tokens: int,
) -> list[Probe]:
    """``budget.repeat_ids`` seeded ids, each every ``d`` tokens of a row of seeded ids, for
    each distance ``d`` of :func:`repeat_distances`: rows packed into probes of the level's
    tokens. Where the head can keep fewer logits, the rows are judged on every layer's hidden
    states and the last position's logits, and packed ``trimmed_tokens`` a probe."""
    if budget.repeat_ids <= 0:
        return []
    length = min(REPEAT_ROW, spec.limit)
    distances = repeat_distances(length)
    g = seeded_generator(seed, "repeats")
    chosen = torch.randperm(spec.vocab, generator=g)[: budget.repeat_ids]
    rows = []
    for token in chosen.tolist():
        for d in distances:
            row = torch.randint(0, spec.vocab, (length,), generator=g)
            row[::d] = token
            rows.append(row)
    trimmed = "logits_to_keep" in parameters_of(model.forward)
    per_probe = max(1, (trimmed_tokens if trimmed else budget.tokens_per_probe) // length)
    chunks = math.ceil(len(rows) / per_probe)
    probes = []
    for i in range(chunks):
        how = {
            "kind": "repeats",
            "ids": chosen.tolist(),
            "distances": distances,
            "length": length,
            "rows": [i * per_probe, min(len(rows), (i + 1) * per_probe)],
            "seed": seed,
        }
        part = torch.stack(rows[i * per_probe : (i + 1) * per_probe])
        probe = _probe(spec, template, budget, f"repeats-{i + 1}of{chunks}", part, how)
        probes.append(probe.on_hidden_states(1) if trimmed else probe)
    return probes


def generates(model: Any, spec: TokenSpec) -> bool:
    """Whether users generate with ``model``: a decoder-only LM (``spec.causal``) or an
    encoder-decoder whose class says it can generate."""
    if spec.causal:
        return True
    can = getattr(model, "can_generate", None)
    return spec.decoder_start is not None and callable(can) and bool(can())


def generation_probes(
    model: Any,
    spec: TokenSpec,
    template: Mapping[str, Any],
    budget: Budget,
    tokenizer: ProbeTokenizer | None,
    seed: int,
) -> tuple[list[Probe], list[str]]:
    """fp32's greedy continuation of ``budget.generation`` prompts, run here on ``model``
    (fp32), as a teacher-forced forward, and the free generation judged for NaN/Inf only."""
    prompts, new_tokens = budget.generation
    if not prompts or not new_tokens or budget.memory_bound or not generates(model, spec):
        return [], []
    ids, ids_from = _prompts(spec, tokenizer, prompts, seed)
    room = (spec.decoder_limit or spec.limit) - 1 if spec.decoder_start is not None else spec.limit
    new_tokens = min(new_tokens, room - (0 if spec.decoder_start is not None else ids.shape[1]))
    if new_tokens < 1:
        return [], []
    settings: dict[str, Any] = {
        "max_new_tokens": new_tokens,
        # Every continuation runs its full length: end-of-sequence is not taken (the next
        # likeliest token is), so rows stay aligned and long loops are reached.
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "num_beams": 1,
        "pad_token_id": spec.pad,
    }
    prompt = _prompt_kwargs(spec, template, ids)
    try:
        sequences = _greedy(model, {**prompt, **settings})
    except _GENERATE_ERRORS as exc:
        return [], [f"generation probes not run: the fp32 model's generate fails ({one_line(exc)})"]
    how = {
        "kind": "generation",
        "prompts": prompts,
        "prompt_length": int(ids.shape[1]),
        "new_tokens": new_tokens,
        "ids_from": ids_from,
        "seed": seed,
        "greedy": "fp32, end-of-sequence suppressed until the last token",
    }
    forced = with_tokens(spec, template, ids if spec.decoder_start is not None else sequences)
    if spec.decoder_start is not None:
        forced["decoder_input_ids"] = sequences
        if "decoder_attention_mask" in forced:
            forced["decoder_attention_mask"] = torch.ones_like(sequences)
    free = {**prompt, **settings}
    name = f"generation-{prompts}x{new_tokens}"
    return [
        Probe(
            f"forward:{name}-forced",
            "forward",
            forced,
            sweep={**how, "judged": "teacher-forced on fp32's continuation, every position"},
            max_output=budget.max_output,
        ),
        Probe(
            f"generate:{name}-free",
            "generate",
            free,
            sweep={**how, "judged": "its own greedy generation: NaN/Inf only"},
            max_output=budget.max_output,
            finite_only=True,
        ),
    ], []


def _prompt_kwargs(
    spec: TokenSpec, template: Mapping[str, Any], ids: torch.Tensor
) -> dict[str, Any]:
    """``generate``'s arguments for prompts ``ids``: an encoder-decoder's decoder starts from
    its start token alone (the decoder ids a forward takes would be a decoder prompt), and the
    generation runs as a user's does, on its KV cache. The forwards' ``use_cache=False`` would
    rerun the whole sequence at every step: 8x the time of a 256-token generation at 55M, and
    a heap grown by gigabytes from ever longer activations."""
    kwargs = with_tokens(spec, template, ids)
    for key in ("decoder_input_ids", "decoder_attention_mask"):
        kwargs.pop(key, None)
    kwargs["use_cache"] = True
    return kwargs


def _prompts(
    spec: TokenSpec, tokenizer: ProbeTokenizer | None, count: int, seed: int
) -> tuple[torch.Tensor, str]:
    """``count`` prompts of one length: real text through the tokenizer (cut to the shortest
    line), else seeded ids."""
    if tokenizer is not None and tokenizer.tokenizer is not None:
        lines = [tokenizer.encode(TEXTS[i % len(TEXTS)], PROMPT_LENGTH) for i in range(count)]
        shortest = min(len(line) for line in lines)
        if shortest >= 2 and all(max(line) < spec.vocab for line in lines):
            return torch.tensor([line[:shortest] for line in lines]), "tokenizer"
    g = seeded_generator(seed, "generation")
    return torch.randint(0, spec.vocab, (count, PROMPT_LENGTH), generator=g), "seeded"


def _greedy(model: Any, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """The sequences ``model.generate`` returns for ``kwargs`` (on the model's device, back on
    the CPU): prompt and continuation for decoder-only models, the decoder's start token and
    continuation for encoder-decoders."""
    device = next(model.parameters()).device
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.no_grad():
        out = model.generate(**moved)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    return sequences.to("cpu")


# --------------------------------------------------------------------------- triggers

#: Every kind of trigger a certificate states, in order.
TRIGGER_KINDS = ("ids", "positions", "pairs", "generation", "bound")
#: Why a kind is not searched, when nothing here searches it at all.
_NOT_SEARCHED = {
    "pairs": "not searched: token pairs are not enumerated (only those the probes hold by chance)",
    "bound": "not searched: no fp32 session recorded factor peaks here (block-wise, or a "
    "model without gated MLPs or attention values)",
}


def triggers(inputs: ModelInputs, reached: Mapping[str, Any]) -> dict[str, Any]:
    """Per kind of trigger (:data:`TRIGGER_KINDS`), whether the probes of ``inputs`` searched
    it and how far (``reached``: :func:`~.positions.reach` of the same inputs), or why not.

    ``ids``: token ids fed; ``positions``: the position table reached, every id at position 0
    and repeated ids at a spread of distances; ``generation``: fp32's greedy continuations the
    candidate was teacher-forced on; ``pairs`` and ``bound``: not searched here (the fp32
    session's bounds and context search fill them in: :func:`with_bounds`).
    """
    out: dict[str, Any] = {}
    kinds = {str(p.sweep.get("kind", "")): p for p in inputs.probes}
    if "vocabulary" not in reached:
        why = "not searched: the model takes no token ids"
        for kind in TRIGGER_KINDS:
            out[kind] = {"searched": False, "why": _NOT_SEARCHED.get(kind, why)}
        return out
    vocab = reached["vocabulary"]
    out["ids"] = {"searched": True, "reached": vocab["reached"], "of": vocab["size"]}
    first = _first_position(inputs.probes, int(vocab["size"]))
    repeats = kinds.get("repeats")
    positions = reached["positions"]
    out["positions"] = {
        "searched": True,
        "reached": positions["reached"],
        "of": positions["limit"],
        "first_position": first,
        "repeats": (
            {
                "ids": len(repeats.sweep["ids"]),
                "distances": list(repeats.sweep["distances"]),
                "length": repeats.sweep["length"],
            }
            if repeats is not None
            else "not run"
        ),
    }
    out["pairs"] = {"searched": False, "why": _NOT_SEARCHED["pairs"]}
    generation = kinds.get("generation")
    if generation is not None:
        out["generation"] = {
            "searched": True,
            "prompts": generation.sweep["prompts"],
            "new_tokens": generation.sweep["new_tokens"],
            "judged": "teacher-forced on fp32's greedy continuation; free generation NaN/Inf",
        }
    else:
        why = next(
            (n for n in inputs.notes if n.startswith("generation probes not run")),
            "not searched: the model does not generate, or the level runs no generation",
        )
        out["generation"] = {"searched": False, "why": why}
    out["bound"] = {"searched": False, "why": _NOT_SEARCHED["bound"]}
    return out


def with_bounds(found: dict[str, Any], calibration: Mapping[str, Any] | None) -> dict[str, Any]:
    """``found`` (:func:`triggers`) with ``bound`` and ``pairs`` as the fp32 session left them
    (its certificate ``calibration`` record): ``bound`` searched where factor peaks gave
    bounds, ``pairs`` where the worst-context search ran (a pair is a context of two ids; the
    search looks for any context that drives a bound's channel up)."""
    if not found or not calibration:
        return found
    out = dict(found)
    bounds = calibration.get("bounds") or []
    if bounds:
        top = max(bounds, key=lambda b: float(b["bound"]))
        out["bound"] = {
            "searched": True,
            "modules": len(bounds),
            "highest": {k: top[k] for k in ("module", "side", "bound", "observed_peak")},
            "conditional_on": "the per-channel factor peaks the probes observed",
        }
    search = calibration.get("context_search") or {}
    if search.get("searched"):
        out["pairs"] = {
            "searched": True,
            "how": "gradient-guided search for the worst context of each bound near the limit "
            "and of each sound bound not proven below it",
            "modules": len(search["searched"]),
            "seconds": search.get("seconds"),
            "highest_peak": search.get("highest_peak"),
        }
    elif search.get("not_searched"):
        out["pairs"] = {"searched": False, "why": f"not searched: {search['not_searched']}"}
    elif search and not search.get("near_limit") and not search.get("sound_targets"):
        out["pairs"] = {
            "searched": False,
            "why": "not searched: no bound (conditional on the factor peaks seen) came near "
            "fp16's limit, and every sound bound was proven below it",
        }
    return out


def _first_position(probes: Sequence[Probe], vocab: int) -> dict[str, Any] | str:
    """How many ids the first-position probes fed at position 0, alone and after BOS."""
    alone = torch.zeros(vocab, dtype=torch.bool)
    after = torch.zeros(vocab, dtype=torch.bool)
    bos = None
    for probe in probes:
        if probe.sweep.get("kind") != "first-position":
            continue
        ids = probe.kwargs[str(probe.sweep["argument"])]
        lead = probe.sweep.get("bos")
        (after if lead is not None else alone)[ids[:, -1]] = True
        bos = lead if lead is not None else bos
    if not bool(alone.any()):
        return "not run"
    return {
        "ids": int(alone.sum()),
        "after_bos": int(after.sum()) if bos is not None else "the family has no BOS token",
        "of": vocab,
    }
