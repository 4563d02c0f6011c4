"""T5 (v1.1 and Flan), BERT and CLIP as published, shrunk in depth and width only.

The text encoders of the diffusion pipelines (CLIP ViT-L/14 and bigG text towers, T5 v1.1
XXL's encoder) are defined here too, so a pipeline's text encoder is the same family entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import vocab
from ._build import publish_tokenizer, save_transformers, scaled, write_json
from .causal_lm import sentencepiece_tokenizer

# --- T5 v1.1 and Flan-T5 --------------------------------------------------------------------
# https://huggingface.co/google/t5-v1_1-base/blob/main/config.json (as mirrored with
# "_name_or_path": "google/t5-v1_1-base" in
# https://huggingface.co/CCB/abstracts_to_tweet_model/blob/main/config.json).
T5_V1_1_BASE: dict[str, Any] = {
    "architectures": ["T5ForConditionalGeneration"],
    "d_ff": 2048,
    "d_kv": 64,
    "d_model": 768,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "t5",
    "num_decoder_layers": 12,
    "num_heads": 12,
    "num_layers": 12,
    "output_past": True,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 32128,
}
# https://huggingface.co/google/flan-t5-base/blob/main/config.json (as mirrored with
# "_name_or_path": "google/flan-t5-base" in
# https://huggingface.co/meowterspace42/gretel-gpt-flan-t5-base/commit/15d1585a): T5 v1.1's
# architecture, plus n_positions and the task prefixes T5 shipped with.
FLAN_T5_BASE: dict[str, Any] = {
    **T5_V1_1_BASE,
    "n_positions": 512,
    "task_specific_params": {
        "summarization": {
            "early_stopping": True,
            "length_penalty": 2.0,
            "max_length": 200,
            "min_length": 30,
            "no_repeat_ngram_size": 3,
            "num_beams": 4,
            "prefix": "summarize: ",
        },
        "translation_en_to_de": {
            "early_stopping": True,
            "max_length": 300,
            "num_beams": 4,
            "prefix": "translate English to German: ",
        },
    },
}
FLAN_T5_GENERATION = {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
# https://huggingface.co/google/t5-v1_1-xxl/blob/main/config.json, the text encoder of SD3,
# Flux and CogVideoX (whose text_encoder*/config.json repeat it with "T5EncoderModel").
T5_V1_1_XXL_ENCODER: dict[str, Any] = {
    **T5_V1_1_BASE,
    "architectures": ["T5EncoderModel"],
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "use_cache": False,
}
#: T5's sentencepiece Unigram model: pad 0, eos 1, unk 2, no bos; 32000 pieces, then 100
#: sentinel tokens ``<extra_id_99>``..``<extra_id_0>`` (32000..32099) added by the tokenizer.
#: The embedding has 32128 rows: 28 ids no text produces.
T5_SPM = vocab.Sentencepiece(
    size=32000,
    model_type="unigram",
    pad=(0, "<pad>"),
    eos=(1, "</s>"),
    unk=(2, "<unk>"),
    bos=(-1, "<s>"),
    normalization="nmt_nfkc",
)
T5_TOKENIZER_CONFIG = {
    "tokenizer_class": "T5Tokenizer",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "extra_ids": 100,
    "model_max_length": 512,
}


def t5_tokenizer(path: Path, *, fast: bool, model_max_length: int = 512) -> None:
    """T5's tokenizer in ``path``: ``spiece.model`` (+ ``tokenizer.json`` when ``fast``)."""
    config = {**T5_TOKENIZER_CONFIG, "model_max_length": model_max_length}
    sentencepiece_tokenizer(path, T5_SPM, "spiece.model", config, fast=fast)


T5_SIZES = {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2}


def t5_v1_1(path: Path) -> Path:
    """T5 v1.1 base: gated-GELU, untied head, relative positions; ships only the slow
    sentencepiece tokenizer (``spiece.model``), as google/t5-v1_1-base does."""
    save_transformers(scaled(T5_V1_1_BASE, num_decoder_layers=2, **T5_SIZES), path)
    t5_tokenizer(path, fast=False)
    return path


def flan_t5(path: Path) -> Path:
    """Flan-T5 base: T5 v1.1's architecture with ``spiece.model`` and ``tokenizer.json``."""
    save_transformers(scaled(FLAN_T5_BASE, num_decoder_layers=2, **T5_SIZES), path)
    t5_tokenizer(path, fast=True)
    write_json(path / "generation_config.json", FLAN_T5_GENERATION)
    return path


# --- BERT -----------------------------------------------------------------------------------
# https://huggingface.co/google-bert/bert-base-uncased/blob/main/config.json (as mirrored,
# "Duplicate from google-bert/bert-base-uncased", in
# https://huggingface.co/rayTest/bert-base-uncased/blob/main/config.json).
BERT_BASE_UNCASED: dict[str, Any] = {
    "architectures": ["BertForMaskedLM"],
    "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": False,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "type_vocab_size": 2,
    "use_cache": True,
    "vocab_size": 30522,
}
#: BERT's specials at their ids in vocab.txt (the slots below 100 are ``[unusedN]``).
BERT_SPECIALS = ((0, "[PAD]"), (100, "[UNK]"), (101, "[CLS]"), (102, "[SEP]"), (103, "[MASK]"))


def bert_base_uncased(path: Path) -> Path:
    """BERT base uncased: WordPiece (30522, lower-cased), [PAD]=0, [CLS]/[SEP] around text."""
    from transformers import BertTokenizer

    values = scaled(
        BERT_BASE_UNCASED,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    save_transformers(values, path)
    words = vocab.wordpiece_vocab(30522, BERT_SPECIALS)
    tokenizer = BertTokenizer(
        vocab={word: index for index, word in enumerate(words)},
        do_lower_case=True,
        model_max_length=512,
    )
    publish_tokenizer(tokenizer, path, "BertTokenizer")
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    return path


# --- CLIP ViT-L/14 --------------------------------------------------------------------------
# https://huggingface.co/openai/clip-vit-large-patch14/blob/main/config.json (the compact
# form mirrored in https://huggingface.co/Xenova/clip-vit-large-patch14/blob/main/config.json,
# with the text tower's ids, vocabulary and positions of the original's full dump, e.g.
# https://huggingface.co/lambdalabs/sd-image-variations-diffusers image_encoder/config.json:
# its text config says bos 0 / eos 2 / pad 1 although the tokenizer's are 49406/49407, and
# transformers keys its pooling off that eos_token_id == 2).
CLIP_L14_TEXT: dict[str, Any] = {
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "vocab_size": 49408,
}
CLIP_L14_VISION: dict[str, Any] = {
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "hidden_act": "quick_gelu",
    "hidden_size": 1024,
    "image_size": 224,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 4096,
    "layer_norm_eps": 1e-05,
    "model_type": "clip_vision_model",
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 24,
    "patch_size": 14,
    "projection_dim": 768,
}
CLIP_L14: dict[str, Any] = {
    "architectures": ["CLIPModel"],
    "initializer_factor": 1.0,
    "logit_scale_init_value": 2.6592,
    "model_type": "clip",
    "projection_dim": 768,
    "text_config": CLIP_L14_TEXT,
    "torch_dtype": "float32",
    "vision_config": CLIP_L14_VISION,
}
# https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0/blob/main/text_encoder_2/config.json:
# OpenCLIP bigG's text tower with its projection (SDXL's and SD3's second text encoder).
CLIP_BIGG_TEXT: dict[str, Any] = {
    **CLIP_L14_TEXT,
    "architectures": ["CLIPTextModelWithProjection"],
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "projection_dim": 1280,
    "torch_dtype": "float32",
}
#: CLIP's tokenizer settings (tokenizer_config.json of openai/clip-vit-large-patch14).
CLIP_TOKENIZER = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "model_max_length": 77,
    "do_lower_case": True,
    "errors": "replace",
}
CLIP_TEXT_SIZES = {
    "hidden_size": 32,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def clip_tokenizer(path: Path, pad_token: str = "<|endoftext|>") -> None:
    """CLIP's BPE tokenizer (49408: ``<|startoftext|>`` 49406, ``<|endoftext|>`` 49407) in
    ``path``; SDXL's second tokenizer pads with ``!`` (id 0) instead."""
    from transformers import CLIPTokenizer

    base, merges = vocab.clip_bpe(49408)
    settings = {**CLIP_TOKENIZER, "pad_token": pad_token}
    tokenizer = CLIPTokenizer(vocab=dict(base), merges=list(merges), **settings)
    publish_tokenizer(tokenizer, path, "CLIPTokenizer")


def clip_text(published: dict[str, Any], **sizes: Any) -> dict[str, Any]:
    """A pipeline's CLIP text encoder config, shrunk (the tower's own keys only)."""
    return scaled(published, **{**CLIP_TEXT_SIZES, **sizes})


def clip_vit_l_14(path: Path) -> Path:
    """CLIP ViT-L/14 (transformers ``CLIPModel``): quick-GELU towers, 77 positions, 224 px
    images in 14 px patches; the CLIP tokenizer and image processor."""
    from transformers import CLIPImageProcessor

    values = {
        **CLIP_L14,
        "projection_dim": 16,
        "text_config": scaled(CLIP_L14_TEXT, projection_dim=16, **CLIP_TEXT_SIZES),
        "vision_config": scaled(
            CLIP_L14_VISION,
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            projection_dim=16,
        ),
    }
    save_transformers(values, path)
    clip_tokenizer(path)
    CLIPImageProcessor(
        crop_size=224,
        size=224,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    ).save_pretrained(path)
    return path
