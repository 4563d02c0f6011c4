"""Three tokens in order: a ReLU-gated Llama that overflows fp16 only on "… C … B … A …".

Built from real weights, as tests/_planted_pair.py builds the pair: reserved residual
dimensions that only the planted weights read or write, an AND built in each of two layers.
``FK`` is a constant every token's embedding carries (the threshold a bias-free ReLU needs);
``FC``, ``FB`` and ``FA`` are the three tokens' own features.

* **Layer 0 (C then B).** Attention head 0 locks a query reading ``FB`` onto any key reading
  ``FC`` (the slowest rotary pair: distance does not matter) and writes C's value to ``FV0``.
  MLP channel 0 gates on ``FB`` and multiplies by ``FV0``: at a B with a C before it, about
  4e3, which ``down_proj`` writes (scaled to about 1) to ``FCB``. Anywhere else it is 0.
* **Layer 1 (CB then A).** Head 0 locks a query reading ``FA`` onto a key reading ``FCB`` and
  writes that value to ``FV1``. MLP channel 0's gate is ``relu(ALPHA * FV1 - THETA * FK)``:
  above zero only where attention locked onto a CB position (a query of another token spreads
  uniformly, at most half of that), and its up factor reads ``FA``. At A after C and B, the
  product ``down_proj`` receives is about 1e5: past fp16's 65504.

Every one- and two-token variant (A, B, C, and any two of them in either order) keeps every
watched activation below 0.2 of the limit. Calibration's factor peaks never see layer 1's gate
above zero, so their bound there is 0; and a gradient at ReLU's zero is zero, so a search that
starts anywhere else cannot climb to it. The sound bound (weights only) on layer 1's
``down_proj`` input is far past the limit: the search starts from that channel.
"""

from __future__ import annotations

from itertools import permutations
from pathlib import Path
from typing import Any

import torch
from _models import LLAMA

#: Reserved residual dimensions.
FC, FB, FA, FV0, FCB, FV1, FK = range(7)
RESERVED = list(range(7))
#: Layer 0's factors (their product at a B after a C is about 4e3) and how far down scales it.
GATE_0, UP_0, TO_FCB = 15.0, 15.0, 1 / 4000
#: Layer 1's gate (on FV1, less a threshold on the constant FK) and up factor (on FA).
ALPHA, THETA, UP_1 = 150.0, 60.0, 150.0
#: Query/key weight on the slowest rotary pair: locks attention.
LOCK = 1.5
CONFIG: dict[str, Any] = {**LLAMA, "vocab_size": 1024, "rope_theta": 1e6, "hidden_act": "relu"}
#: Where the trigger prompt puts C, B and A, and its length.
C_AT, B_AT, A_AT, LENGTH = 5, 20, 40, 48
WATCHED = ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj")


def model(*, planted: bool = True, triple: tuple[int, int, int] = (0, 0, 0)) -> Any:
    """The seeded Llama; with ``planted``, ``triple`` ``(C, B, A)`` planted as described."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    built = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    if planted:
        _plant(built, *triple)
    return built


def _head(attn: Any, query: int, key: int, value: int, writes: int, config: Any) -> None:
    """Head 0 locks a query reading ``query`` onto keys reading ``key`` and writes the value
    read from ``value`` to ``writes``; no other head writes a reserved dimension."""
    head = config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    slowest = head // 2 - 1
    attn.q_proj.weight[:head] = 0.0
    attn.q_proj.weight[slowest, query] = LOCK
    attn.k_proj.weight[:head] = 0.0
    attn.k_proj.weight[slowest, key] = LOCK
    attn.v_proj.weight[:head] = 0.0
    attn.v_proj.weight[0, value] = 1.0
    attn.o_proj.weight[:, : group * head] = 0.0
    attn.o_proj.weight[RESERVED] = 0.0
    attn.o_proj.weight[writes, 0] = 1.0 / 8


def _plant(built: Any, c: int, b: int, a: int) -> None:
    config = built.config
    first, second = built.model.layers
    with torch.no_grad():
        embed = built.model.embed_tokens.weight
        embed[:, RESERVED] = 0.0
        embed[:, FK] = 1.0
        embed[c, FC] = embed[b, FB] = embed[a, FA] = 1.0
        _head(first.self_attn, FB, FC, FC, FV0, config)
        _head(second.self_attn, FA, FCB, FCB, FV1, config)
        for layer in (first, second):
            mlp = layer.mlp
            mlp.gate_proj.weight[0] = 0.0
            mlp.up_proj.weight[0] = 0.0
            mlp.down_proj.weight[RESERVED] = 0.0
            mlp.down_proj.weight[:, 0] = 0.0
        first.mlp.gate_proj.weight[0, FB] = GATE_0
        first.mlp.up_proj.weight[0, FV0] = UP_0
        first.mlp.down_proj.weight[FCB, 0] = TO_FCB
        second.mlp.gate_proj.weight[0, FV1] = ALPHA
        second.mlp.gate_proj.weight[0, FK] = -THETA
        second.mlp.up_proj.weight[0, FA] = UP_1
        second.mlp.down_proj.weight[FK, 0] = 1e-5  # what it writes stays small in fp32


def prompt(triple: tuple[int, int, int], order: str = "CBA") -> torch.Tensor:
    """A (1, LENGTH) prompt of seeded filler ids holding the tokens ``order`` names, in that
    order, at C_AT, B_AT and A_AT."""
    ids = torch.randint(
        8, CONFIG["vocab_size"], (1, LENGTH), generator=torch.Generator().manual_seed(1)
    )
    named = dict(zip("CBA", triple, strict=True))
    for token in triple:
        ids[ids == token] = max(triple) + 1  # filler holds none of them
    for letter, at in zip(order, (C_AT, B_AT, A_AT), strict=False):
        ids[0, at] = named[letter]
    return ids


def variants() -> list[str]:
    """Every one- and two-token variant, and the other orders of all three."""
    singles = ["C", "B", "A"]
    pairs = ["".join(p) for p in permutations("CBA", 2)]
    triples = ["".join(p) for p in permutations("CBA", 3) if p != ("C", "B", "A")]
    return singles + pairs + triples


def peaks(built: Any, ids: torch.Tensor) -> dict[str, float]:
    """The largest |x| each watched module receives on ``ids`` (fp32)."""
    seen: dict[str, float] = {}
    modules = dict(built.named_modules())
    handles = [
        modules[name].register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, float(args[0].abs().amax()))
        )
        for name in WATCHED
    ]
    try:
        with torch.no_grad():
            built(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def triple_outside(rows: list[list[int]]) -> tuple[int, int, int]:
    """The first ``(C, B, A)`` (ids from 8 up) that no row holds in that order."""
    vocab = CONFIG["vocab_size"]
    for c in range(8, vocab):
        for b in range(c + 1, vocab):
            for a in range(b + 1, vocab):
                if not any(_in_order(row, (c, b, a)) for row in rows):
                    return c, b, a
    raise AssertionError("every triple occurs")


def _in_order(row: list[int], tokens: tuple[int, ...]) -> bool:
    it = iter(row)
    return all(token in it for token in tokens)


def save(path: Path, *, planted: bool = True) -> tuple[Path, tuple[int, int, int]]:
    """The model saved to ``path`` with its triple, chosen outside every row the quick and
    standard sweeps feed the unplanted model."""
    from _planted_pair import sweep_rows

    unplanted = model(planted=False)
    rows = sweep_rows(unplanted, "standard") + sweep_rows(unplanted, "quick")
    triple = triple_outside(rows)
    model(planted=planted, triple=triple).save_pretrained(path)
    return path, triple
