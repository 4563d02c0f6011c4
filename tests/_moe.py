"""A tiny Mixtral shaped after Mixtral-8x7B, and one whose router sends rare ids to a hot expert.

The config is the published one, shrunk in width and depth only (8 experts, 2 per token, 32000
tokens, untied head, bf16 as published); the tokenizer is the Llama-2 sentencepiece kind that
Mixtral ships, written offline as the zoo writes its Llama-family ones. transformers 5 runs the
experts fused (``model.layers.N.mlp.experts``: one ``gate_up_proj`` and one ``down_proj`` for
all eight), loaded from the per-expert names the checkpoint stores
(``block_sparse_moe.experts.E.w1/w2/w3``).

The hot model is planted through real weights: the three rare ids' embeddings, and only theirs,
carry hidden feature 0 (attention writes nothing there); the router sends that feature to
expert :data:`HOT`, whose first rows of ``w1`` and ``w3`` read it with a large weight, so
``act(gate) * up`` reaches about 2.0e5 on those ids in fp32 (fp16 overflows to inf, and the
logits turn NaN) and stays small on every other id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _models  # noqa: F401 - puts the zoo (examples/zoo) on the path
from zoo._build import save_transformers, scaled, write_json
from zoo.causal_lm import LLAMA2_SPM, llama_tokenizer_config, sentencepiece_tokenizer

# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}
MIXTRAL_GENERATION = {"bos_token_id": 1, "eos_token_id": 2}
#: The three rare ids (among the sentencepiece model's last, lowest-scored pieces) and the
#: expert the router sends them to.
RARE = (31990, 31993, 31997)
HOT = 5
#: Rows of ``w1`` and ``w3`` that read the rare ids' feature, and their weight on it.
_HOT_ROWS, _HOT_WEIGHT = 4, 80.0
#: The router's weight from that feature to the hot expert: it always wins the top 2.
_ROUTER_WEIGHT = 4.0
#: The fused experts module of the planted layer, as the model runs it.
HOT_EXPERTS = "model.layers.0.mlp.experts"


def mixtral(path: Path, *, hot: bool = False) -> Path:
    """Write the tiny Mixtral (``hot``: with the planted expert) to ``path``."""
    values = scaled(
        MIXTRAL_8X7B,
        hidden_size=32,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    save_transformers(values, path, adjust=_plant if hot else None)
    sentencepiece_tokenizer(
        path,
        LLAMA2_SPM,
        "tokenizer.model",
        llama_tokenizer_config(legacy=True),
    )
    write_json(path / "generation_config.json", MIXTRAL_GENERATION)
    return path


def _plant(model: Any) -> None:
    """Scale real weights so the rare ids, and only they, overflow the hot expert in fp16."""
    rare = list(RARE)
    embedding = model.model.embed_tokens.weight
    embedding[:, 0] = 0.0
    embedding[rare, 0] = 1.0
    layer = model.model.layers[0]
    layer.self_attn.o_proj.weight[0] = 0.0  # attention leaves feature 0 alone
    layer.mlp.gate.weight[HOT, 0] = _ROUTER_WEIGHT
    experts = layer.mlp.experts
    inner = experts.down_proj.shape[-1]  # gate_up_proj stacks w1's rows, then w3's
    experts.gate_up_proj[HOT, :_HOT_ROWS, 0] = _HOT_WEIGHT
    experts.gate_up_proj[HOT, inner : inner + _HOT_ROWS, 0] = _HOT_WEIGHT
