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
    path: Path,
    spec: vocab.Sentencepiece,
    model_file: str,
    config: dict[str, Any],
    added: tuple[tuple[str, bool], ...] = (),
    *,
    fast: bool = True,
) -> None:
    """Write the sentencepiece model and ``tokenizer_config.json``; with ``fast``, let
    transformers convert it (writing ``tokenizer.json``, plus the ``added`` tokens past the
    model's pieces: (content, special)) exactly as for a published checkpoint."""
    import transformers
    from tokenizers import AddedToken

    path.mkdir(parents=True, exist_ok=True)
    (path / model_file).write_bytes(vocab.sentencepiece_model(spec))
    write_json(path / "tokenizer_config.json", config)
    if not fast:
        return
    tokenizer_class = config["tokenizer_class"]
    tokenizer = getattr(transformers, tokenizer_class).from_pretrained(path)
    for content, special in added:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens({"additional_special_tokens": [token]})
        else:
            tokenizer.add_tokens([token])
    publish_tokenizer(tokenizer, path, tokenizer_class)


def llama_tokenizer_config(*, legacy: bool) -> dict[str, Any]:
    """``tokenizer_config.json`` of the sentencepiece ``LlamaTokenizer`` that Llama-2, Mistral
    and Mixtral publish: BOS added, no pad token (``legacy``: the Llama-2-era handling of
    text after special tokens, which Mistral v0.3 turns off)."""
    return {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "legacy": legacy,
        "model_max_length": 1000000000000000019884624838656,
    }


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
        llama_tokenizer_config(legacy=False),
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


# --- Qwen2.5-0.5B ---------------------------------------------------------------------------
# https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json (as mirrored with
# "_name_or_path": "Qwen/Qwen2.5-0.5B" in
# https://huggingface.co/osllmai-community/Qwen2.5-0.5B/blob/main/config.json, without the
# pad_token_id and flags a fine-tuning tool added there).
QWEN2_5_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN2_5_GENERATION = {
    "bos_token_id": 151643,
    "do_sample": False,
    "eos_token_id": 151643,
    "max_new_tokens": 2048,
}
#: Qwen2's 22 added tokens after its 151643 byte-level tokens: (content, special). The
#: tokenizer has 151665 tokens; the embedding has 151936 rows (padded for the hardware), so
#: ids 151665..151935 exist in the model and in no text.
QWEN2_ADDED = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
#: ChatML as Qwen2.5 formats it (the published template's tool-calling branches left out).
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def qwen2_tokenizer() -> Any:
    """Qwen2.5's tokenizer: byte-level BPE, 151643 + 22 added tokens, pad = eos = endoftext."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    base, merges = vocab.byte_level_bpe(151643)
    tokenizer = Qwen2Tokenizer(
        vocab=dict(base),
        merges=list(merges),
        model_max_length=131072,
        chat_template=QWEN2_CHAT_TEMPLATE,
    )
    for content, special in QWEN2_ADDED:
        token = AddedToken(content, special=special, normalized=False)
        if content in tokenizer.get_vocab():
            continue
        if special:
            tokenizer.add_special_tokens({"additional_special_tokens": [token]})
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def qwen2_5_0_5b(path: Path) -> Path:
    """Qwen2.5-0.5B: GQA 7:1, tied, rope 1e6; its tokenizer (151665) is shorter than its
    embedding (151936), and its pad token is its eos, ``<|endoftext|>``."""
    values = scaled(
        QWEN2_5_0_5B,
        hidden_size=56,
        intermediate_size=304,
        num_hidden_layers=2,
        num_attention_heads=7,
        num_key_value_heads=1,
    )
    save_transformers(values, path)
    publish_tokenizer(qwen2_tokenizer(), path, "Qwen2Tokenizer")
    write_json(path / "generation_config.json", QWEN2_5_GENERATION)
    return path


# --- Gemma-2-2B -----------------------------------------------------------------------------
# https://huggingface.co/google/gemma-2-2b/blob/main/config.json (as mirrored with
# "_name_or_path": "google/gemma-2-2b" in
# https://huggingface.co/PrunaAI/google-gemma-2-2b-HQQ-1bit-smashed/raw/1075e2b2/config.json).
GEMMA_2_2B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 256000,
}
GEMMA_2_GENERATION = {
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "pad_token_id": 0,
}
#: Gemma's sentencepiece layout: pad 0, eos 1, bos 2, unk 3, then control pieces up to the
#: turn markers at 106/107, then byte fallback.
GEMMA_SPM = vocab.Sentencepiece(
    size=256000,
    model_type="bpe",
    pad=(0, "<pad>"),
    eos=(1, "<eos>"),
    bos=(2, "<bos>"),
    unk=(3, "<unk>"),
    control=("<mask>", "[@BOS@]", *(f"<unused{i}>" for i in range(100))),
    user_defined=("<start_of_turn>", "<end_of_turn>"),
    byte_fallback=True,
    add_dummy_prefix=False,
    split_digits=True,
    remove_extra_whitespaces=False,
)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def gemma_2_2b(path: Path) -> Path:
    """Gemma-2-2B: GQA 2:1, alternating sliding (4096) and global attention, attention and
    final-logit softcapping, tied, 256000 tokens with a pad token; fp32 in three shards."""
    values = scaled(
        GEMMA_2_2B,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
    )
    save_transformers(values, path, max_shard_size="13MB")
    sentencepiece_tokenizer(
        path,
        GEMMA_SPM,
        "tokenizer.model",
        {
            "tokenizer_class": "GemmaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
            "chat_template": GEMMA_CHAT_TEMPLATE,
            "model_max_length": 1000000000000000019884624838656,
            "spaces_between_special_tokens": False,
        },
    )
    write_json(path / "generation_config.json", GEMMA_2_GENERATION)
    return path


# --- Phi-3-mini-4k-instruct -----------------------------------------------------------------
# https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json (as mirrored,
# "Duplicate from microsoft/Phi-3-mini-4k-instruct", in
# https://huggingface.co/Alignment-Lab-AI/idfkphi4kiguess/blob/main/config.json). Its auto_map
# names remote code the native Phi3 classes replace: a converter must not need it.
PHI_3_MINI_4K: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_phi3.Phi3Config",
        "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
    },
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32064,
}
PHI_3_GENERATION = {"bos_token_id": 1, "eos_token_id": [32000, 32001, 32007], "pad_token_id": 32000}
#: Phi-3's added tokens, ids 32000..32010 after the Llama-2 sentencepiece model's 32000; the
#: embedding has 32064 rows.
PHI_3_ADDED = (
    ("<|endoftext|>", True),
    ("<|assistant|>", True),
    ("<|placeholder1|>", True),
    ("<|placeholder2|>", True),
    ("<|placeholder3|>", True),
    ("<|placeholder4|>", True),
    ("<|system|>", True),
    ("<|end|>", True),
    ("<|placeholder5|>", True),
    ("<|placeholder6|>", True),
    ("<|user|>", True),
)
PHI_3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
LLAMA2_SPM = vocab.Sentencepiece(
    size=32000,
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    remove_extra_whitespaces=False,
)


def phi_3_mini_4k(path: Path) -> Path:
    """Phi-3-mini-4k-instruct: fused qkv and gate-up projections, sliding window 2047, untied;
    pad = ``<|endoftext|>`` (its eos), padding on the left; 32011 tokens, 32064 embedding rows;
    bf16 in two shards."""
    values = scaled(
        PHI_3_MINI_4K,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    save_transformers(values, path, max_shard_size="3MB")
    sentencepiece_tokenizer(
        path,
        LLAMA2_SPM,
        "tokenizer.model",
        {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "legacy": False,
            "padding_side": "left",
            "chat_template": PHI_3_CHAT_TEMPLATE,
            "model_max_length": 4096,
        },
        added=PHI_3_ADDED,
    )
    write_json(path / "generation_config.json", PHI_3_GENERATION)
    return path
