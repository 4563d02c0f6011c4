"""A zoo of tiny models with the shapes published checkpoints have, built offline.

Every entry starts from the ``config.json`` of a published checkpoint (cited where it is
defined) and changes only depth and width, so vocabulary size, special-token ids, position
limits, rope settings, tying, attention layout and the classes' ``_keep_in_fp32_modules`` are
the real ones; each ships a tokenizer of the family's own kind and conventions (no pad token
where the family has none), its ``generation_config.json`` and its shard layout. Weights are
random from a fixed seed, stored in the published dtype. No download is needed.

This package is the one definition of test and example models: ``examples/`` scripts import
it directly, ``tests/_models.py`` re-exports it for the tests and benches.

Usage::

    import zoo
    zoo.build("llama-3.2-1b", Path("tiny-llama"))   # a directory from_pretrained can load
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from . import causal_lm, encoders, pipelines

#: name -> builder writing the family's directory at the given path (and returning it).
FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama-3.2-1b": causal_lm.llama_3_2_1b,
    "mistral-7b-v0.3": causal_lm.mistral_7b_v0_3,
    "qwen2.5-0.5b": causal_lm.qwen2_5_0_5b,
    "gemma-2-2b": causal_lm.gemma_2_2b,
    "phi-3-mini-4k": causal_lm.phi_3_mini_4k,
    "gpt2": causal_lm.gpt2,
    "t5-v1.1-base": encoders.t5_v1_1,
    "flan-t5-base": encoders.flan_t5,
    "bert-base-uncased": encoders.bert_base_uncased,
    "clip-vit-large-patch14": encoders.clip_vit_l_14,
    "stable-diffusion-1.5": pipelines.stable_diffusion_1_5,
    "stable-diffusion-xl": pipelines.stable_diffusion_xl,
    "stable-diffusion-3": pipelines.stable_diffusion_3,
    "flux.1-dev": pipelines.flux_1_dev,
    "cogvideox-5b": pipelines.cogvideox_5b,
}

#: Families whose tokenizers are sentencepiece models (T5's, Llama-2's, Gemma's), written
#: with the ``sentencepiece`` trainer and converted through its ``protobuf`` messages.
SENTENCEPIECE = (
    "mistral-7b-v0.3",
    "gemma-2-2b",
    "phi-3-mini-4k",
    "t5-v1.1-base",
    "flan-t5-base",
    "stable-diffusion-3",
    "flux.1-dev",
    "cogvideox-5b",
)
#: The packages (pip names) a sentencepiece family needs, by the module each provides.
SENTENCEPIECE_PACKAGES = {"sentencepiece": "sentencepiece", "google.protobuf": "protobuf"}

#: Families whose tokenizer has no pad token, as published (Llama 3, Mistral, GPT-2).
PADLESS = ("llama-3.2-1b", "mistral-7b-v0.3", "gpt2")


def build(name: str, path: Path) -> Path:
    """Write zoo family ``name`` to ``path`` (a new directory) and return ``path``."""
    if name not in FAMILIES:
        raise KeyError(f"no zoo family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name](path)


def missing_packages(name: str) -> list[str]:
    """The pip packages family ``name`` needs that are not installed (checked before any
    file is written)."""
    import importlib.util

    if name not in SENTENCEPIECE:
        return []
    missing = []
    for module, package in SENTENCEPIECE_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package (google) is absent
            found = False
        if not found:
            missing.append(package)
    return missing
