"""Search for the worst context: token sequences that drive a bounded module toward its bound.

A bound (:mod:`~precision_convert.conversion.analysis.factors`) says what a module *could*
receive; a probe shows what it does. For each module whose bound comes within the activation
margin of fp16's limit, the fp32 model is searched for a context that drives the bound's
channel up: a greedy coordinate search over one-hot token inputs, as adversarial-prompt work
does (GCG, Zou et al. 2023). Each step takes the gradient of the channel's peak with respect
to every position's one-hot token, keeps the ids that would raise it most at each position,
tries a batch of single-token swaps drawn from them, and moves to the best when it is higher.
It starts from the id windows where the bound's factors peaked during the sweep (the token
that peaked the up factor followed by the one that peaked the gate, and the reverse).

Observed peaks miss what no probe reached, and a gradient cannot lead there: behind a ReLU at
zero, or a product of two factors that are both zero, it is zero. So the search also starts
from the channels whose sound bound (:mod:`~precision_convert.conversion.analysis.proofs`, from
the weights alone) is largest and not proven: it tries every ordering of up to
:data:`LONGEST_COMBINATION` of the tokens that drive those channels' factor rows most directly
(:func:`~precision_convert.conversion.analysis.proofs.driving_tokens`), then climbs from the
best.

The search costs a share of the certificate's floor (:attr:`~.budgets.Budget.context_search`):
none at ``quick``. The worst context found becomes a probe like any other (kind ``context``,
its ids recorded inline), so the fp32 baseline, every candidate and every load path are judged
on it, and calibration sees its peaks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from precision_convert.conversion.analysis.activations import ACTIVATION_MARGIN
from precision_convert.conversion.analysis.factors import CONVEX, PRODUCT, Bound
from precision_convert.conversion.analysis.proofs import SoundBound, driving_tokens
from precision_convert.core.dtypes import WATCHED_RANGE, FiniteRange
from precision_convert.validation.probe.inputs.context_probes import context_probe
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    parameters_of,
    seeded_generator,
)
from precision_convert.validation.probe.inputs.token_probes import TokenSpec, token_spec

#: Ids kept per position from the gradient, single-token swaps tried per step, and steps
#: without a higher peak before a search stops.
TOP_IDS = 32
SWAPS = 64
PATIENCE = 4
#: Shortest context searched: a seed shorter than this is extended with seeded random ids.
MIN_LENGTH = 8
#: Most bounded modules searched, and most context probes added (the highest peaks first).
MOST_TARGETS = 8
MOST_PROBES = 4
#: Unproven sound bounds searched (the largest first), the tokens driving them that are
#: combined, and the most of them in one seed: 8 tokens give 8 + 56 + 336 seeds.
MOST_SOUND_TARGETS = 4
DRIVING_TOKENS = 8
LONGEST_COMBINATION = 3


#: Where a search started (:attr:`Found.origin`).
OBSERVED = "observed factor peaks"
SOUND = "sound bound"


class _Reached(Exception):
    """Raised by the objective's hook: the rest of the forward is not needed."""


@dataclass(frozen=True)
class Found:
    """One bounded module's search: where it started and the worst context it reached."""

    bound: Bound
    seeds: int
    steps: int
    evaluations: int
    start_peak: float
    peak: float
    context: tuple[int, ...]
    origin: str = OBSERVED

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.bound.module,
            "side": self.bound.side,
            "channel": self.bound.channel,
            "bound": self.bound.bound,
            "observed_peak": self.bound.observed,
            "seeds": self.seeds,
            "steps": self.steps,
            "evaluations": self.evaluations,
            "start_peak": self.start_peak,
            "peak": self.peak,
            "context": list(self.context),
            "from": self.origin,
        }


def near_bounds(bounds: Sequence[Bound], limit: FiniteRange) -> list[Bound]:
    """Bounds within the activation margin of ``limit``, highest first."""
    near = limit.finite_max / ACTIVATION_MARGIN
    return sorted((b for b in bounds if b.bound > near), key=lambda b: -b.bound)


def sound_targets(
    model: Any, proofs: Sequence[SoundBound], observed: Sequence[Bound], limit: FiniteRange
) -> list[Bound]:
    """The largest channels of the sound bounds not proven below ``limit`` (a gated MLP's
    down input, attention's output projection input), as search targets seeded with every
    ordering of up to :data:`LONGEST_COMBINATION` of the tokens that drive the largest sound
    bounds (:func:`~precision_convert.conversion.analysis.proofs.driving_tokens`)."""
    unproven = sorted(
        (
            p
            for p in proofs
            if p.kind in (PRODUCT, CONVEX) and not p.proven(limit.finite_max, ACTIVATION_MARGIN)
        ),
        key=lambda p: -(p.input or 0.0),
    )[:MOST_SOUND_TARGETS]
    if not unproven:
        return []
    tokens = driving_tokens(model, proofs, DRIVING_TOKENS)
    seeds = tuple(
        combination
        for n in range(1, LONGEST_COMBINATION + 1)
        for combination in itertools.permutations(tokens, n)
    )
    seen = {(b.module, b.side): b.observed for b in observed}
    return [p.as_target(seen.get((p.module, "input"), 0.0), seeds) for p in unproven]


def searchable(model: Any, inputs: ModelInputs) -> TokenSpec | str:
    """The token spec the search feeds, or why ``model`` cannot be searched."""
    first = inputs.probes[0] if inputs.probes else None
    if first is None or first.method != "forward":
        return "the model takes no token ids"
    spec = token_spec(model, first, None, inputs.task)
    if spec is None or spec.arg != "input_ids" or spec.fixed is not None:
        return "the model takes no token ids"
    if spec.decoder_start is not None:
        return "encoder-decoder models are not searched (only decoder-only and encoder-only)"
    if "inputs_embeds" not in parameters_of(model.forward):
        return "the model's forward takes no inputs_embeds (no gradient over tokens)"
    return spec


class _Objective:
    """The bound's channel peak per row of a batch of contexts (with a gradient when asked)."""

    def __init__(self, model: Any, bound: Bound, device: torch.device) -> None:
        self.model, self.bound, self.device = model, bound, device
        self.module = dict(model.named_modules())[bound.module]
        self.params = parameters_of(model.forward)

    def _run(self, **kwargs: Any) -> torch.Tensor:
        caught: list[torch.Tensor] = []
        channel = self.bound.channel

        def take(tensor: torch.Tensor) -> None:
            rows = tensor[..., channel].float().abs()
            caught.append(rows.reshape(rows.shape[0], -1).amax(1))
            raise _Reached

        if self.bound.side == "input":
            handle = self.module.register_forward_pre_hook(lambda m, args: take(args[0]))
        else:
            handle = self.module.register_forward_hook(lambda m, args, out: take(out))
        if "use_cache" in self.params:
            kwargs["use_cache"] = False
        try:
            self.model(**kwargs)
        except _Reached:
            pass
        finally:
            handle.remove()
        if not caught:
            raise RuntimeError(f"{self.bound.module} did not run")
        return caught[0]

    def peaks(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            found = self._run(input_ids=ids.to(self.device)).cpu()
        return torch.where(found.isfinite(), found, 0)

    def gradient(self, ids: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """d(peak)/d(one-hot id) at every position of the one context ``ids`` (1, length)."""
        one_hot = torch.nn.functional.one_hot(ids[0].to(self.device), embedding.shape[0])
        one_hot = one_hot.to(embedding.dtype).requires_grad_(True)
        with torch.enable_grad():
            peak = self._run(inputs_embeds=(one_hot @ embedding)[None])
            (grad,) = torch.autograd.grad(peak.sum(), one_hot)
        return grad.cpu()


def _search_one(
    model: Any,
    bound: Bound,
    vocab: int,
    device: torch.device,
    deadline: float,
    steps_left: int,
    generator: torch.Generator,
    origin: str,
) -> Found:
    objective = _Objective(model, bound, device)
    embedding = model.get_input_embeddings().weight.detach()[:vocab]
    seeds = [list(s) for s in bound.seeds if all(0 <= i < vocab for i in s)]
    if not seeds:
        seeds = [torch.randint(vocab, (MIN_LENGTH,), generator=generator).tolist()]
    contexts = [
        s + torch.randint(vocab, (MIN_LENGTH - len(s),), generator=generator).tolist()
        if len(s) < MIN_LENGTH
        else s
        for s in seeds
    ]
    # Every seed is tried (the search's start); the best one is climbed.
    width = max(len(c) for c in contexts)
    batch = torch.tensor([[c[0]] * (width - len(c)) + c for c in contexts])
    scores = objective.peaks(batch)
    best_at = int(scores.argmax())
    ids, best = batch[best_at : best_at + 1], float(scores[best_at])
    start, steps, evaluations, stalled = best, 0, len(contexts), 0
    last = 0.0  # the last step's seconds: a step that would end past the deadline is not begun
    while steps < steps_left and stalled < PATIENCE and time.perf_counter() + last < deadline:
        began = time.perf_counter()
        grad = objective.gradient(ids, embedding)
        top = grad.topk(min(TOP_IDS, vocab), dim=1).indices
        where = torch.randint(ids.shape[1], (SWAPS,), generator=generator)
        pick = torch.randint(top.shape[1], (SWAPS,), generator=generator)
        trial = ids.repeat(SWAPS, 1)
        trial[torch.arange(SWAPS), where] = top[where, pick]
        scores = objective.peaks(trial)
        steps, evaluations = steps + 1, evaluations + SWAPS
        at = int(scores.argmax())
        if float(scores[at]) > best:
            ids, best, stalled = trial[at : at + 1], float(scores[at]), 0
        else:
            stalled += 1
        last = time.perf_counter() - began
    context = tuple(ids[0].tolist())
    return Found(bound, len(contexts), steps, evaluations, start, best, context, origin)


def search_contexts(
    model: Any,
    inputs: ModelInputs,
    bounds: Sequence[Bound],
    *,
    seconds: float,
    steps: int,
    device: torch.device,
    seed: int,
    sound: Sequence[Bound] = (),
) -> tuple[list[Probe], dict[str, Any]]:
    """Search ``model`` (fp32, resident) for the worst context of each bound near the range
    every certificate watches (fp16's limit), and of each ``sound`` target
    (:func:`sound_targets`), within ``seconds`` and ``steps`` per module; returns the probes
    of the contexts that beat the sweep's peak (highest first) and the certificate's record
    of the search."""
    near = near_bounds(bounds, WATCHED_RANGE)
    picked = {(b.module, b.side, b.channel) for b in near[:MOST_TARGETS]}
    sound = [b for b in sound if (b.module, b.side, b.channel) not in picked]
    targets = [
        *((b, OBSERVED) for b in near[:MOST_TARGETS]),
        *((b, SOUND) for b in sound[:MOST_SOUND_TARGETS]),
    ]
    record: dict[str, Any] = {
        "budget_seconds": round(seconds, 3),
        "near_limit": len(near),
        "sound_targets": len(sound),
        "searched": [],
        "highest_peak": None,
        "seconds": 0.0,
    }
    if not targets:
        return [], record
    spec = searchable(model, inputs)
    if isinstance(spec, str):
        return [], {**record, "not_searched": spec}
    began = time.perf_counter()
    deadline = began + seconds
    generator = seeded_generator(seed, "context-search")
    found: list[Found] = []
    for k, (bound, origin) in enumerate(targets):
        # Each module gets an equal share of what is left; seeds are always tried.
        share = (deadline - time.perf_counter()) / (len(targets) - k)
        end = time.perf_counter() + max(share, 0.0)
        found.append(_search_one(model, bound, spec.vocab, device, end, steps, generator, origin))
    record["seconds"] = round(time.perf_counter() - began, 3)
    record["searched"] = [f.to_json() for f in found]
    record["highest_peak"] = max(f.peak for f in found)
    if len(near) > MOST_TARGETS:
        record["not_searched"] = f"{len(near) - MOST_TARGETS} more modules near the limit"
    worse = sorted((f for f in found if f.peak > f.bound.observed), key=lambda f: -f.peak)
    template = inputs.probes[0].kwargs
    probes = [
        context_probe(spec, template, f.context, k, f.bound.module)
        for k, f in enumerate(worse[:MOST_PROBES])
    ]
    return probes, record
