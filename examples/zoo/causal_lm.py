"""Decoder-only language models as published, shrunk in depth and width only.

Each ``PUBLISHED`` dict is the checkpoint's ``config.json`` (the source is cited above it);
each builder writes a directory laid out as the checkpoint's own: weights (sharded with an
index where the checkpoint is), ``config.json``, ``generation_config.json`` and the tokenizer
files with the family's special tokens and pad/bos/eos conventions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import vocab
from ._build import publish_tokenizer, save_transformers, scaled, write_json

# --- Llama-3.2-1B -------------------------------------------------------------------------
# https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json (values as mirrored in
# https://huggingface.co/h3110Fr13nd/llama-3.2-1b-onnx/blob/main/config.json and
# kevinstephano/thunder_model_blocks hf_llama/llama_config.py, commit 4e20de36 of the Hub repo).
LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
# The repository's generation_config.json.
LLAMA_3_2_1B_GENERATION = {
    "bos_token_id": 128000,
    "do_sample": True,
    "eos_token_id": 128001,
    "temperature": 0.6,
    "top_p": 0.9,
}
#: Llama 3's pre-tokenizer split (tokenizer.json of every Llama-3.x checkpoint).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: The chat format of Llama 3 (header tokens around each role, ``<|eot_id|>`` after each
#: turn); the published template's tool-calling and date branches are left out.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def llama3_specials() -> list[str]:
    """Llama 3's 256 special tokens, ids 128000..128255, named as in its tokenizer.json."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    reserved = iter(range(256))
    return [named.get(i) or f"<|reserved_special_token_{next(reserved)}|>" for i in range(256)]


def llama3_tokenizer() -> Any:
    """Llama 3's tokenizer: byte-level BPE of 128000 tokens plus 256 specials, no pad token.

    Shipped as ``PreTrainedTokenizerFast`` (tokenizer.json only); ``<|begin_of_text|>`` is
    prepended by the post-processor, as in the published tokenizer.json.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    base, merges = vocab.byte_level_bpe(128000)
    backend = Tokenizer(models.BPE(vocab=dict(base), merges=list(merges), ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    specials = llama3_specials()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = specials[0]
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 128000)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=specials[1],
        model_max_length=131072,
        chat_template=LLAMA3_CHAT_TEMPLATE,
    )


def llama_3_2_1b(path: Path) -> Path:
    """Llama-3.2-1B: GQA 4:1, llama3 rope scaling, tied embeddings, 128256 tokens, no pad."""
    values = scaled(
        LLAMA_3_2_1B,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
    )
    save_transformers(values, path)
    publish_tokenizer(llama3_tokenizer(), path, "PreTrainedTokenizerFast")
    write_json(path / "generation_config.json", LLAMA_3_2_1B_GENERATION)
    return path


# --- Mistral-7B-v0.3 ----------------------------------------------------------------------
# https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.3/blob/c170c708c41dac9275d15a8fff4eca08d52bab71/config.json
# (the base model's config.json has the same values: mirrored with "_name_or_path":
# "mistralai/Mistral-7B-v0.3" in https://huggingface.co/pathlighter/Mistral-7B-v0.3-EoT).
MISTRAL_7B_V0_3: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32768,
}
MISTRAL_7B_V0_3_GENERATION = {"bos_token_id": 1, "eos_token_id": 2}
#: Mistral's v3 tokenizer: ids 3..770 are control tokens (the tool-calling markers, then
#: ``[control_8]``..``[control_768]``, which fine-tuning recipes borrow as pad, id 770), ids
#: 771..1026 the byte-fallback pieces.
MISTRAL_V3_CONTROL = (
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    *(f"[control_{i}]" for i in range(8, 769)),
)
MISTRAL_V3_SPM = vocab.Sentencepiece(
    size=32768,
    model_type="bpe",
    control=MISTRAL_V3_CONTROL,
    byte_fallback=True,
    split_digits=True,
    remove_extra_whitespaces=False,
)


def sentencepiece_tokenizer(
    path: Path, spec: vocab.Sentencepiece, model_file: str, config: dict[str, Any]
) -> Any:
    """Write the sentencepiece model and ``tokenizer_config.json``, then let transformers
    convert it (writing ``tokenizer.json``) exactly as it does for a published checkpoint."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    (path / model_file).write_bytes(vocab.sentencepiece_model(spec))
    write_json(path / "tokenizer_config.json", config)
    tokenizer_class = config["tokenizer_class"]
    tokenizer = getattr(transformers, tokenizer_class).from_pretrained(path)
    publish_tokenizer(tokenizer, path, tokenizer_class)
    return tokenizer


def mistral_7b_v0_3(path: Path) -> Path:
    """Mistral-7B-v0.3: GQA 4:1, no sliding window, untied head, 32768 tokens, no pad.

    Saved in three shards with an index, as the published checkpoint is.
    """
    values = scaled(
        MISTRAL_7B_V0_3,
        hidden_size=32,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    save_transformers(values, path, max_shard_size="1MB")
    sentencepiece_tokenizer(
        path,
        MISTRAL_V3_SPM,
        "tokenizer.model",
        {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "legacy": False,
            "model_max_length": 1000000000000000019884624838656,
        },
    )
    write_json(path / "generation_config.json", MISTRAL_7B_V0_3_GENERATION)
    return path


# --- GPT-2 ----------------------------------------------------------------------------------
# https://huggingface.co/openai-community/gpt2/blob/main/config.json (as mirrored with
# "_name_or_path": "openai-community/gpt2" in
# https://huggingface.co/TopperThijs/GPT2-quantinez-test/commit/d5a6fd11).
GPT2: dict[str, Any] = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_inner": None,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}
GPT2_GENERATION = {"bos_token_id": 50256, "eos_token_id": 50256}


def gpt2_tokenizer() -> Any:
    """GPT-2's tokenizer: byte-level BPE, 50000 merges, ``<|endoftext|>`` = 50256, no pad."""
    from transformers import GPT2Tokenizer

    base, merges = vocab.byte_level_bpe(50256)
    return GPT2Tokenizer(vocab=dict(base), merges=list(merges), model_max_length=1024)


def gpt2(path: Path) -> Path:
    """GPT-2 (124M): learned positions (1024), tied head, fp32 as published, no pad token."""
    values = scaled(GPT2, n_embd=32, n_head=4, n_layer=2)
    save_transformers(values, path)
    publish_tokenizer(gpt2_tokenizer(), path, "GPT2Tokenizer")
    write_json(path / "generation_config.json", GPT2_GENERATION)
    return path
