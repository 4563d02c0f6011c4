"""The tokenizer a model ships with, so probes can feed it real text."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tokenizer_for(directory: Path) -> Any | None:
    """The tokenizer shipped with a model, or its pipeline's matching ``tokenizer*`` folder.

    A pipeline's ``text_encoder_2`` pairs with ``tokenizer_2``. None when there is none or it
    cannot be built: seeded random ids then serve as well.
    """
    candidates = [directory]
    if directory.name.startswith("text_encoder"):
        candidates.append(directory.parent / directory.name.replace("text_encoder", "tokenizer"))
    for candidate in candidates:
        files = (
            [*candidate.glob("tokenizer*"), *candidate.glob("*.model")]
            if candidate.is_dir()
            else []
        )
        if files:
            from transformers import AutoTokenizer

            try:
                return AutoTokenizer.from_pretrained(candidate)
            except (OSError, ValueError, KeyError, TypeError, ImportError):
                continue
    return None
