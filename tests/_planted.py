"""Tiny real models whose fp16 overflow needs a context, built by planting weights.

Each builder returns a seeded model of a real transformers class (``planted=False``: the
same model without the planting, the control). Planted, a plain fp32 forward is finite
everywhere, a plain fp16 cast is non-finite on the triggering context and finite without it;
the overflow is real arithmetic in the feed-forward product ``act(gate) * up``, the input of
the down projection, whose column for the planted unit is scaled down so fp32 computes a sane
function. Norms bound what reaches each projection (an RMS norm caps one channel at
``sqrt(width)``), so the size comes from the unit's weights, and the context decides whether
the unit's input channel is lit at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _models import QWEN2

#: The first-position model: the suite's Qwen2-shaped decoder, which names no BOS token.
QWEN2_FIRST: dict[str, Any] = dict(QWEN2)
#: The id that overflows at position 0: an ordinary id (no special token), which no other
#: probe of the sweep puts first in a row (checked by the tests).
FIRST_ID = 77
#: Channels of the residual stream the planting reserves: X's own feature, a channel every
#: token holds (what the other tokens' keys read), and where the attention head writes.
_FEATURE, _CONSTANT, _LIT = 0, 1, 2
#: The feed-forward unit of layer 0 that overflows, and its gate and up weights.
FIRST_UNIT = 5
FIRST_GATE = FIRST_UP = 100.0


def qwen2_first_position(*, planted: bool = True) -> Any:
    """A Qwen2-shaped decoder where id :data:`FIRST_ID` overflows fp16 at position 0 only.

    Layer 0, head 0 (on rope's slowest pair, whose angle stays near 0 over the 64 positions,
    so distance does not matter): X's query reads X's feature channel; every token's key
    reads the constant channel, X's own key is pushed far negative by its feature. So X
    attends to the tokens before it and never to itself, except at position 0, where there is
    nothing else to attend to. Its value (X's feature, on one head dimension) then reaches
    the residual channel ``_LIT`` through ``o_proj``; elsewhere the head reads tokens whose
    value there is 0. MLP unit :data:`FIRST_UNIT`'s gate reads ``_LIT`` and its up reads X's
    feature: the product is 0 wherever X is not, and wherever X is not first, and past fp16's
    limit (about 1e5) when X opens the sequence. Every other writer of the three channels is
    zeroed, so nothing else lights them.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_FIRST)).eval()
    if not planted:
        return model
    config = model.config
    head = config.hidden_size // config.num_attention_heads
    slowest = head // 2 - 1  # rope's slowest pair: dims (slowest, slowest + head // 2)
    value_dim = 0  # head 0's value dimension the feature rides on
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, (_FEATURE, _CONSTANT, _LIT)] = 0.0
        embed[:, _CONSTANT] = 1.0
        embed[FIRST_ID, _FEATURE] = 1.0
        for proj in (attn.q_proj, attn.k_proj):  # head 0 (kv head 0): the slowest pair planted
            for dim in (slowest, slowest + head // 2):
                proj.weight[dim] = 0.0
                proj.bias[dim] = 0.0
        attn.q_proj.weight[slowest, _FEATURE] = 4.0
        attn.k_proj.weight[slowest, _CONSTANT] = 4.0
        attn.k_proj.weight[slowest, _FEATURE] = -12.0
        attn.v_proj.weight[value_dim] = 0.0
        attn.v_proj.bias[value_dim] = 0.0
        attn.v_proj.weight[value_dim, _FEATURE] = 0.25  # as large as the feature itself
        for writer in [m for block in model.model.layers for m in _writers(block)]:
            writer.weight[[_FEATURE, _CONSTANT, _LIT]] = 0.0
        attn.o_proj.weight[_LIT, value_dim] = 1.0
        mlp.gate_proj.weight[FIRST_UNIT] = 0.0
        mlp.gate_proj.weight[FIRST_UNIT, _LIT] = FIRST_GATE
        mlp.up_proj.weight[FIRST_UNIT] = 0.0
        mlp.up_proj.weight[FIRST_UNIT, _FEATURE] = FIRST_UP
        mlp.down_proj.weight[:, FIRST_UNIT] /= FIRST_GATE * FIRST_UP
    return model


def _writers(block: Any) -> list[Any]:
    """The projections of a Llama-style decoder block that write into the residual stream."""
    return [block.self_attn.o_proj, block.mlp.down_proj]


#: The long-generation model: a Flan-T5-shaped encoder-decoder (gated-GELU, untied head,
#: relative positions, pad 0 as the decoder's start token), small.
FLAN_T5_LOOP: dict[str, Any] = {
    "vocab_size": 128,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
    "n_positions": 512,
    "decoder_start_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
#: The token the greedy output repeats.
LOOP_ID = 42
#: The first decoder position whose self-attention no longer sees the start token: relative
#: distance 59 is the first in bucket 26 of T5's 32 causal buckets (max distance 128).
LOOP_START = 59
#: Decoder channels the planting reserves: one every token holds, the start token's own
#: feature, the loop token's feature, where the attention head writes, and the channel the
#: head (tied to the embedding) reads the loop token's logit from.
_EVERY, _START, _LOOP, _HEARD, _CHOICE = 0, 1, 2, 3, 4
#: The decoder feed-forward unit of block 0 that overflows, and its two input weights; the
#: unit of block 1 that fills the choice channel.
LOOP_UNIT = 7
_CHOICE_UNIT = 3
LOOP_GATE = LOOP_UP = 200.0
#: Score of the start token for head 0 (the sink), and the bias that takes it away.
_SINK = 20.0


def flan_t5_long_generation(*, planted: bool = True) -> Any:
    """A Flan-T5-shaped model whose greedy output repeats :data:`LOOP_ID` and whose decoder
    overflows fp16 once the start token is :data:`LOOP_START` or more positions behind.

    Decoder block 0, head 0: every query reads the channel every token holds and only the
    start token's key reads its own feature, so the head rests on the start token (a sink,
    score 20 against 0) while the relative-position bias is 0; T5's bias for buckets 26-31
    (distances of 59 and more) is -40, so from decoder position 59 on the sink is lost and the
    head averages the tokens of the last 59 positions, which greedy decoding made all
    :data:`LOOP_ID`: decoder block 1's feed-forward unit ``_CHOICE_UNIT`` fills channel
    ``_CHOICE`` from the every-token channel, and only that token's embedding (which is also
    the head: transformers 5 ties T5's) has weight there. The
    value of that token, on one head dimension, reaches channel ``_HEARD`` through ``o``; the
    start token's value there is 0. Feed-forward unit :data:`LOOP_UNIT`'s ``wi_0`` and
    ``wi_1`` both read ``_HEARD``: 0 while the sink holds, about 2e5 from position 59 (new
    token 60) on. Every other writer of the reserved channels is zeroed.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(**FLAN_T5_LOOP)).eval()
    if not planted:
        return model
    reserved = [_EVERY, _START, _LOOP, _HEARD, _CHOICE]
    start = model.config.decoder_start_token_id
    block = model.decoder.block[0]
    attn = block.layer[0].SelfAttention
    ff = block.layer[2].DenseReluDense
    with torch.no_grad():
        shared = model.shared.weight
        shared[:, reserved] = 0.0
        shared[:, _EVERY] = 1.0
        shared[start, _START] = 1.0
        shared[LOOP_ID, _LOOP] = 1.0
        shared[LOOP_ID, _CHOICE] = 3.0
        for proj in (attn.q, attn.k, attn.v):  # head 0's first dimension
            proj.weight[0] = 0.0
        attn.q.weight[0, _EVERY] = 4.0
        attn.k.weight[0, _START] = _SINK / 4.0
        attn.v.weight[0, _LOOP] = 1.0
        bias = attn.relative_attention_bias.weight
        bias[:, 0] = 0.0
        bias[26:, 0] = -2 * _SINK
        for decoder_block in model.decoder.block:
            for writer in _t5_writers(decoder_block):
                writer.weight[reserved] = 0.0
        attn.o.weight[_HEARD, 0] = 4.0
        ff.wi_0.weight[LOOP_UNIT] = 0.0
        ff.wi_0.weight[LOOP_UNIT, _HEARD] = LOOP_GATE
        ff.wi_1.weight[LOOP_UNIT] = 0.0
        ff.wi_1.weight[LOOP_UNIT, _HEARD] = LOOP_UP
        ff.wo.weight[:, LOOP_UNIT] /= LOOP_GATE * LOOP_UP
        choice = model.decoder.block[1].layer[2].DenseReluDense
        for proj in (choice.wi_0, choice.wi_1):
            proj.weight[_CHOICE_UNIT] = 0.0
            proj.weight[_CHOICE_UNIT, _EVERY] = 2.0
        choice.wo.weight[_CHOICE, _CHOICE_UNIT] = 20.0  # the greedy choice, at every step
    return model


def _t5_writers(block: Any) -> list[Any]:
    """The projections of a T5 decoder block that write into the residual stream."""
    layers = block.layer
    return [layers[0].SelfAttention.o, layers[1].EncDecAttention.o, layers[2].DenseReluDense.wo]


def converted_at_standard(
    root: Path, save: Callable[..., tuple[Path, Any]]
) -> Callable[[bool, str], tuple[Any, ...]]:
    """``get(planted, target)`` → (source, its trigger, output, certificate as JSON): the
    model ``save(path, planted=...)`` writes (planted, or its control) converted to ``target``
    at ``standard`` coverage, each once."""
    import precision_convert as pc

    sources: dict[bool, tuple[Path, Any]] = {}
    done: dict[tuple[bool, str], tuple[Any, ...]] = {}

    def get(planted: bool, target: str) -> tuple[Any, ...]:
        if planted not in sources:
            sources[planted] = save(root / f"source-{planted}", planted=planted)
        if (planted, target) not in done:
            out = root / f"{planted}-{target}"
            pc.convert(sources[planted][0], to=target, output=out, coverage="standard")
            cert = json.loads((out / "precision_certificate.json").read_text())
            done[planted, target] = (*sources[planted], out, cert)
        return done[planted, target]

    return get
