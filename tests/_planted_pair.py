"""The token pair: a Llama-shaped model that overflows fp16 only when token B precedes token A.

Built from real weights, not hooks. Three residual dimensions are reserved in layer 0: ``FA``
(token A's own feature), ``FB`` (token B's key feature) and ``FV`` (the feature B's value
writes). No other token's embedding has anything there, so after ``input_layernorm`` A and B
each carry about 8 on their own dimension.

* **Attention** (layer 0, query head 0 and its key-value head): the query reads ``FA`` and
  ``FB``, the key reads ``FB``, both on the head's slowest rotary pair, whose angle stays near
  zero across the position table (``rope_theta`` 1e6): distance does not matter. A query of A
  or B locks onto any B before it (or B itself); with no B, it sees all-zero keys and spreads
  uniformly. The value reads ``FB`` into head dimension 0, and ``o_proj`` writes that (and only
  that) to ``FV``; no other head writes ``FA``, ``FB`` or ``FV``.
* **MLP** (layer 0, channel 0): ``gate_proj`` reads ``FA`` and ``up_proj`` reads ``FV``, each
  with weight :data:`FACTOR`. At A with B earlier both factors are large at once and
  ``act(gate) * up``, what ``down_proj`` receives, reaches about 2e5 (past fp16's 65504);
  A alone has no ``FV`` (up is 0), B alone or A before B has no ``FA`` where B's value lands
  (gate is 0): well below.

Each factor alone peaks during the sweep (A anywhere, B anywhere), so calibration's per-channel
bound on ``down_proj``'s input is their product, past the limit. A and B are chosen so that no
probe of the coverage sweep holds B before A in one row: the trigger is a context the sweep does
not enumerate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _models import LLAMA

#: Reserved residual dimensions of layer 0.
FA, FB, FV = 0, 1, 2
#: The two factors' weights: at the trigger each is about 5.6 * 80 = 450, their product 2e5.
FACTOR = 80.0
#: Query/key weight on the slowest rotary pair: scores of 16 * 1.5**2 = 36 lock attention.
LOCK = 1.5
#: The suite's tied Llama with a wider vocabulary and a slow rope (long-range rotary pairs).
CONFIG: dict[str, Any] = {**LLAMA, "vocab_size": 1024, "rope_theta": 1e6}
#: Where the trigger prompt puts B and A, and its length.
B_AT, A_AT, LENGTH = 5, 40, 48


def model(*, planted: bool = True, pair: tuple[int, int] = (0, 0)) -> Any:
    """The seeded Llama; with ``planted``, the pair ``(A, B)`` planted as described above."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    built = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    if planted:
        _plant(built, *pair)
    return built


def _plant(built: Any, a: int, b: int) -> None:
    config = built.config
    head = config.hidden_size // config.num_attention_heads
    slowest = head // 2 - 1
    group = config.num_attention_heads // config.num_key_value_heads
    layer = built.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        embed = built.model.embed_tokens.weight
        embed[:, [FA, FB, FV]] = 0.0
        embed[a, FA] = 1.0
        embed[b, FB] = 1.0
        attn.q_proj.weight[:head] = 0.0
        attn.q_proj.weight[slowest, [FA, FB]] = LOCK
        attn.k_proj.weight[:head] = 0.0
        attn.k_proj.weight[slowest, FB] = LOCK
        attn.v_proj.weight[:head] = 0.0
        attn.v_proj.weight[0, FB] = 1.0
        # Query heads sharing the key-value head write nothing; no other head writes the
        # reserved dimensions; head 0 writes its value's dimension 0 to FV (8 / 8 = 1, as
        # large as FA's own 1 at A).
        attn.o_proj.weight[:, : group * head] = 0.0
        attn.o_proj.weight[[FA, FB, FV]] = 0.0
        attn.o_proj.weight[FV, 0] = 1.0 / 8
        mlp.gate_proj.weight[0] = 0.0
        mlp.gate_proj.weight[0, FA] = FACTOR
        mlp.up_proj.weight[0] = 0.0
        mlp.up_proj.weight[0, FV] = FACTOR


def prompt(a: int, b: int, *, order: str = "BA") -> torch.Tensor:
    """A (1, LENGTH) prompt of seeded filler ids with B and A placed as ``order`` says
    (``"BA"``: the trigger, ``"AB"``, ``"A"`` or ``"B"``)."""
    ids = torch.randint(
        3, CONFIG["vocab_size"], (1, LENGTH), generator=torch.Generator().manual_seed(1)
    )
    ids[(ids == a) | (ids == b)] = max(a, b) + 1  # filler holds neither
    places = {"BA": (b, a), "AB": (a, b), "A": (a,), "B": (b,)}[order]
    for token, at in zip(places, (B_AT, A_AT), strict=False):
        ids[0, at] = token
    return ids


def down_input_peak(built: Any, ids: torch.Tensor) -> float:
    """The largest |x| layer 0's ``down_proj`` receives on ``ids`` (fp32)."""
    seen: list[float] = []
    down = built.model.layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(
        lambda m, args: seen.append(float(args[0].abs().amax()))
    )
    try:
        with torch.no_grad():
            built(input_ids=ids)
    finally:
        handle.remove()
    return seen[0]


def sweep_rows(built: Any, level: str) -> list[list[int]]:
    """Every row of token ids the coverage sweep at ``level`` feeds ``built``."""
    from precision_convert.validation.probe.inputs.layouts import input_candidates
    from precision_convert.validation.probe.inputs.sweep import sweep

    chosen = next(iter(input_candidates(built, seed=0)))
    rows: list[list[int]] = []
    for probe in sweep(built, chosen, level).probes:
        ids = probe.kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            rows += ids.reshape(-1, ids.shape[-1]).tolist()
    return rows


def pair_outside(rows: list[list[int]]) -> tuple[int, int]:
    """The first ``(A, B)`` (ids counted from 3 up) that no row holds with B before A."""
    vocab = CONFIG["vocab_size"]
    for a in range(3, vocab):
        before_a: set[int] = set()
        for row in rows:
            if a in row:  # everything before A's last place in the row
                before_a.update(row[: len(row) - 1 - row[::-1].index(a)])
        for b in range(a + 1, vocab):
            if b not in before_a:
                return a, b
    raise AssertionError("every pair occurs")


def save(path: Path, *, planted: bool = True) -> tuple[Path, tuple[int, int]]:
    """The model saved to ``path`` with its pair ``(A, B)``, chosen outside the quick and
    standard sweeps' rows."""
    rows = sweep_rows(model(planted=False), "standard") + sweep_rows(model(planted=False), "quick")
    pair = pair_outside(rows)
    model(planted=planted, pair=pair).save_pretrained(path)
    return path, pair
