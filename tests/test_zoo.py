"""The real-config zoo: each family is what its published checkpoint is, and it certifies.

The structural tests check what makes a zoo entry a small model *of that family* (the values
kept from its published config, its tokenizer's kind, size and special tokens, its shard
layout); the conversion tests run every family through both safe targets at ``quick``
coverage and require a passing certificate.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import _models
import pytest
from _models import zoo

from precision_convert.api.conversion import convert

FAMILIES = sorted(zoo.FAMILIES)
SAFE_TARGETS = ("bf16-safe", "fp16-safe")

def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_is_the_familys(tiny_model: Callable[[str], Path], name: str) -> None:
    from transformers import AutoTokenizer

    directory = tiny_model(name)
    config = _config(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == config["vocab_size"]
    assert (tokenizer.pad_token is None) == (name in zoo.PADLESS)
    assert tokenizer.convert_tokens_to_ids(tokenizer.eos_token) == config["eos_token_id"]
    # Real text splits into learned sub-words, not single bytes.
    words = tokenizer.tokenize("the river bank")
    assert len(words) <= 4, words


def test_llama_keeps_its_published_layout(tiny_model: Callable[[str], Path]) -> None:
    directory = tiny_model("llama-3.2-1b")
    config = _config(directory)
    published = zoo.causal_lm.LLAMA_3_2_1B
    for key in ("vocab_size", "rope_scaling", "rope_theta", "max_position_embeddings"):
        assert config[key] == published[key]
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4  # GQA as 32/8
    assert config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_mistral_is_sharded_with_an_index(tiny_model: Callable[[str], Path]) -> None:
    directory = tiny_model("mistral-7b-v0.3")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert (directory / "tokenizer.model").is_file()  # the sentencepiece model ships too


@pytest.mark.parametrize("target", SAFE_TARGETS)
@pytest.mark.parametrize("name", FAMILIES)
def test_family_certifies(
    tiny_model: Callable[[str], Path], tmp_path: Path, name: str, target: str
) -> None:
    source = tiny_model(name)
    result = convert(source, to=target, output=tmp_path / "out", coverage="quick")
    certificate = result.certificate
    assert certificate is not None
    assert certificate.verdict == "pass", certificate.failures
    if (source / "model.safetensors.index.json").exists():
        assert (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_zoo_scales_only_depth_and_width() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        zoo._build.scaled(zoo.causal_lm.GPT2, n_embd=32, vocab_size=100)


def test_builders_leave_the_callers_rng_alone() -> None:
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    zoo._build.transformers_model(
        zoo._build.scaled(zoo.causal_lm.GPT2, n_embd=8, n_head=2, n_layer=1)
    )
    assert torch.equal(torch.rand(3), expected)


assert _models  # the fixture module must be importable before the zoo is
