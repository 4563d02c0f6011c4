"""Position probes, and what every probe family reached and did not.

The context ladder of a sweep runs sequences up to the coverage level's longest length (2048
at ``standard``): attention over a long context costs quadratically, and real text sits
there. A model's position table goes further (a GPT-2 with ``n_positions=4096``, a Llama with
128k rope positions), and an overflow can hide in its far rows. Reaching them needs no long
context: a short row fed ``position_ids`` starting at ``p`` computes the embedding of
positions ``p..p+W-1`` (a learned table's rows, rope angles) exactly as a long sequence would
there. Rows of :data:`POSITION_ROW` tokens tile the table from where the ladder stopped up to
the position limit, a cost linear in the positions, at ``standard`` and ``thorough``. Causal
LMs that take ``logits_to_keep`` keep the last position's logits and return their hidden
states instead, so a 128k vocabulary does not make every position cost a row of logits.

:func:`reach` summarizes, from the probes that ran, what they reached: vocabulary ids,
positions and the longest context of a token model (every range left untested named), the
timesteps of a denoiser, and how many probes of each kind ran.

Example:
    >>> probes = position_probes(model, spec, chosen, budget, built, tokens=..., generator=...,
    ...                          trimmed_tokens=4096)
    >>> reach(inputs)["positions"]
    {'limit': 4096, 'reached': 4096, 'untested': []}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from precision_convert.core import interrupts
from precision_convert.validation.probe.inputs.budgets import Budget
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    config_get,
    parameters_of,
)

#: Tokens per row of a position probe: long enough that attention mixes positions, short
#: enough that its cost stays linear in the positions reached.
POSITION_ROW = 256
#: Most position probes per coverage level (each one forward of a probe's tokens); a table too
#: long for them gets evenly spread rows, and the gaps are recorded as untested. ``quick``
#: reaches what its one long sequence reaches.
POSITION_PROBES: Mapping[str, int] = {"quick": 0, "standard": 64, "thorough": 1024}
#: Most untested ranges a record lists (the rest are counted).
LISTED_RANGES = 8
#: Model types whose learned positions start after the padding index: position p is table row
#: ``pad_token_id + 1 + p``.
OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer", "luke"})


def position_probes(
    model: Any,
    spec: Any,
    chosen: ModelInputs,
    budget: Budget,
    built: Sequence[Probe],
    *,
    tokens: Callable[[torch.Tensor], dict[str, Any]],
    generator: Callable[[str], torch.Generator],
    trimmed_tokens: int,
) -> list[Probe]:
    """Rows with ``position_ids`` offsets covering the positions past the longest row of
    ``chosen`` and ``built`` (the other sweep probes) up to ``spec.limit`` (``spec`` a
    :class:`~.token_probes.TokenSpec`: that module imports this one, not the other way
    round). ``tokens``
    makes a probe's keyword arguments from its ids, ``generator`` a seeded generator per
    probe name; ``trimmed_tokens`` is what a probe may hold when the head keeps one
    position's logits (the model's memory without a row of logits per token).

    Nothing for models whose forward takes no ``position_ids`` (:func:`reach` says what stayed
    untested), fixed-length text (OpenCLIP, always fed whole) and encoder-decoders (whose
    decoder positions the argument does not address).
    """
    cap = POSITION_PROBES.get(budget.level, 0)
    if budget.memory_bound:  # block-wise: each probe is a pass streaming every block
        cap = min(cap, budget.blockwise_vocabulary_probes)
    start = longest_row([*chosen.probes, *built], spec.arg)
    addressable = spec.positions and spec.fixed is None and spec.decoder_start is None
    if not cap or not addressable or start >= spec.limit:
        return []
    width = min(POSITION_ROW, spec.limit)
    # Row i starts at start + i * width, the last one moved back to end at the limit; only
    # the rows run are made, so a declared limit of 2^31 costs no more than a short one.
    rows = -(-(spec.limit - start) // width)
    trimmed = "logits_to_keep" in parameters_of(model.forward)
    per_probe = trimmed_tokens if trimmed and not budget.memory_bound else budget.tokens_per_probe
    rows_per_probe = max(1, per_probe // width)
    picked: Sequence[int] = range(rows)
    if rows > cap * rows_per_probe:  # spread evenly, first and last kept
        spread = torch.linspace(0, rows - 1, cap * rows_per_probe).round().long()
        picked = sorted(set(spread.tolist()))
    starts = [min(start + i * width, spec.limit - width) for i in picked]
    offset = table_offset(model)
    probes = []
    for first in range(0, len(starts), rows_per_probe):
        group = starts[first : first + rows_per_probe]
        name = f"positions-{group[0]}-{group[-1] + width - 1}"
        ids = torch.randint(0, spec.vocab, (len(group), width), generator=generator(name))
        kwargs = tokens(ids)
        kwargs["position_ids"] = torch.tensor(group).unsqueeze(1) + torch.arange(width) + offset
        how: dict[str, Any] = {
            "kind": "positions",
            "argument": spec.arg,
            "row": width,
            "starts": group,
            "table_offset": offset,
            "seed": chosen.seed,
        }
        probe = Probe(f"forward:{name}", "forward", kwargs, sweep=how, max_output=budget.max_output)
        probes.append(probe.on_hidden_states(1) if trimmed else probe)
    return probes


def table_offset(model: Any) -> int:
    """The table row of position 0: ``pad_token_id + 1`` for RoBERTa-style learned
    positions, else 0."""
    config = getattr(model, "config", None)
    if str(config_get(config, "model_type") or "") not in OFFSET_POSITIONS:
        return 0
    pad = config_get(config, "pad_token_id")
    return int(pad) + 1 if isinstance(pad, int) else 2


def longest_row(probes: Sequence[Probe], arg: str) -> int:
    """The longest sequence of ``arg`` any probe other than a position probe runs: the
    context length reached."""
    longest = 0
    for probe in probes:
        ids = probe.kwargs.get(arg)
        if isinstance(ids, torch.Tensor) and ids.dim() and probe.sweep.get("kind") != "positions":
            longest = max(longest, int(ids.shape[-1]))
    return longest


# --------------------------------------------------------------------------- reach


def token_limits(spec: Any) -> dict[str, Any]:
    """What bounds a token model's input space (a :class:`~.token_probes.TokenSpec`), as
    :func:`reach` reads it from :attr:`ModelInputs.limits`."""
    return {
        "argument": spec.arg,
        "vocab_size": spec.vocab,
        "position_limit": spec.limit,
        "position_ids": bool(spec.positions and spec.fixed is None and spec.decoder_start is None),
    }


def reach(inputs: ModelInputs) -> dict[str, Any]:
    """What the probes of ``inputs`` reached and what they did not: how many probes of each
    kind ran (a block-wise run fits fewer), the timesteps a denoiser ran at, and for token
    models the vocabulary ids, the positions (through long rows or position offsets) and the
    longest context run, each with its untested ranges."""
    kinds: dict[str, int] = {}
    steps: set[float] = set()
    for probe in inputs.probes:
        kind = str(probe.sweep.get("kind", "layout"))
        kinds[kind] = kinds.get(kind, 0) + 1
        t = probe.kwargs.get("timestep")
        if isinstance(t, torch.Tensor) and t.numel():
            steps.update(float(v) for v in t.flatten().unique())
    record: dict[str, Any] = {"probes": kinds}
    if steps:
        record["timesteps"] = {"reached": sorted(steps, reverse=True)}
    limits = inputs.limits or {}
    if limits.get("argument"):
        record.update(_token_reach(inputs.probes, limits))
    return record


def _token_reach(probes: Sequence[Probe], limits: Mapping[str, Any]) -> dict[str, Any]:
    """Vocabulary, positions and context reached, in memory that grows with the probes run,
    never with the declared vocabulary or position limit (a config may declare 2^31)."""
    arg = str(limits["argument"])
    vocab, limit = int(limits["vocab_size"]), int(limits["position_limit"])
    seen: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []  # covered positions, [first, stop)
    for probe in probes:
        interrupts.check()  # a signal some library swallowed still ends the run here
        ids = probe.kwargs.get(arg)
        if not isinstance(ids, torch.Tensor) or not ids.dim():
            continue
        flat = ids.reshape(-1)
        seen.append(flat[(flat >= 0) & (flat < vocab)].unique())
        if probe.sweep.get("kind") == "positions":
            row = int(probe.sweep["row"])
            spans += [(start, start + row) for start in probe.sweep["starts"]]
        else:
            spans.append((0, int(ids.shape[-1])))
    covered = _union(spans, limit)
    reached = sum(stop - first for first, stop in covered)
    ids_reached = int(torch.cat(seen).unique().numel()) if seen else 0
    context = longest_row(probes, arg)
    positions: dict[str, Any] = {
        "limit": limit,
        "reached": reached,
        "untested": _listed(_gaps(covered, limit)),
    }
    if not limits.get("position_ids") and reached < limit:
        positions["why"] = "the forward takes no position_ids: positions past the context run"
    return {
        "vocabulary": {
            "size": vocab,
            "reached": ids_reached,
            "untested_ids": vocab - ids_reached,
        },
        "positions": positions,
        "context": {
            "limit": limit,
            "reached": context,
            "untested": [] if context >= limit else [[context, limit - 1]],
        },
    }


def _union(spans: Sequence[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """``spans`` (each ``[first, stop)``) cut to ``[0, limit)`` and merged where they touch or
    overlap, in order."""
    merged: list[tuple[int, int]] = []
    for first, stop in sorted((max(0, a), min(limit, b)) for a, b in spans):
        if first >= stop:
            continue
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((first, stop))
    return merged


def _gaps(covered: Sequence[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """What ``covered`` (merged, in order) leaves of ``[0, limit)``, as ``[first, stop)``."""
    gaps, edge = [], 0
    for first, stop in covered:
        if first > edge:
            gaps.append((edge, first))
        edge = stop
    return [*gaps, (edge, limit)] if edge < limit else gaps


def _listed(gaps: Sequence[tuple[int, int]]) -> list[Any]:
    """``gaps`` as inclusive ``[first, last]`` pairs (the first :data:`LISTED_RANGES`, then a
    count of the rest)."""
    runs: list[Any] = [[first, stop - 1] for first, stop in gaps]
    if len(runs) > LISTED_RANGES:
        runs = [*runs[:LISTED_RANGES], f"{len(runs) - LISTED_RANGES} more ranges"]
    return runs
