"""Shared steps of every zoo builder: shrink a published config, seed, build and save."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

#: The only config keys a zoo entry may change: depth and width. Everything else (vocabulary,
#: special-token ids, position limits, rope, tying, attention layout, norms, activations) stays
#: as published, which is what makes a zoo model a small model *of that family*.
DEPTH_AND_WIDTH = frozenset(
    {
        # transformers text models
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "query_pre_attn_scalar",  # Gemma-2: tied to head_dim (1/sqrt(head_dim) scaling)
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "d_model",
        "d_ff",
        "d_kv",
        "num_layers",
        "num_decoder_layers",
        "num_heads",
        "projection_dim",
        # diffusers
        "block_out_channels",
        "layers_per_block",
        "attention_head_dim",
        "cross_attention_dim",
        "transformer_layers_per_block",
        "num_single_layers",
        "joint_attention_dim",
        "caption_projection_dim",
        "pooled_projection_dim",
        "text_embed_dim",
        "time_embed_dim",
        "addition_time_embed_dim",
        "projection_class_embeddings_input_dim",
        "norm_num_groups",
        "axes_dims_rope",
    }
)

#: Keys of a published config.json that describe the file, not the model.
_FILE_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "_diffusers_version")


def scaled(published: Mapping[str, Any], **sizes: Any) -> dict[str, Any]:
    """``published`` with only depth and width replaced by ``sizes``.

    Raises:
        ValueError: a key in ``sizes`` is not depth or width (see :data:`DEPTH_AND_WIDTH`).
    """
    other = sorted(set(sizes) - DEPTH_AND_WIDTH)
    if other:
        raise ValueError(f"the zoo scales only depth and width, not {', '.join(other)}")
    values = {k: v for k, v in published.items() if k not in _FILE_KEYS}
    values.update(sizes)
    return values


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch for the block only: building a zoo model leaves the caller's RNG alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def dtype_of(name: str | None) -> torch.dtype:
    """The torch dtype a config's ``torch_dtype`` names (float32 when it names none)."""
    return getattr(torch, name or "float32")


def transformers_model(values: Mapping[str, Any], seed: int = 0) -> Any:
    """The class ``values["architectures"][0]`` built from ``values``, seeded, in eval mode.

    Weights are created in fp32 and then stored in the published ``torch_dtype``, as the
    published checkpoint stores them.
    """
    import transformers

    values = dict(values)
    dtype = dtype_of(values.pop("torch_dtype", None))
    config = transformers.AutoConfig.for_model(**values)
    config.dtype = dtype
    model_class = getattr(transformers, values["architectures"][0])
    with seeded(seed):
        model = model_class(config)
    return model.to(dtype).eval()


def save_transformers(
    values: Mapping[str, Any],
    path: Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    adjust: Callable[[Any], None] | None = None,
) -> Any:
    """Build :func:`transformers_model` (then ``adjust`` it) and ``save_pretrained`` it."""
    model = transformers_model(values, seed)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    # The config as the checkpoint publishes it (older key names such as ``torch_dtype`` and
    # ``rope_scaling`` included), not as this transformers would re-serialize it: that file is
    # what users download and what a converter has to read.
    write_json(path / "config.json", values)
    return model


def publish_tokenizer(tokenizer: Any, path: Path, tokenizer_class: str) -> None:
    """Save ``tokenizer`` naming the class its published ``tokenizer_config.json`` names."""
    tokenizer.save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = tokenizer_class
    write_json(config_file, config)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
