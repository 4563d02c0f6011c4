"""The tokenizer a model ships with, as probes use it: real text, special tokens, padding.

Probes need four things from a tokenizer: the ids of one line of text (with the special tokens
the tokenizer adds, as a user's call gets them), its special and added tokens, an id to pad a
batch with, and the side it pads on. Real tokenizers differ exactly there: Llama 3, Mistral
and GPT-2 ship no pad token, ``model_max_length`` is 1e30 where a tokenizer never set one, some
backends are Rust (BPE, WordPiece, WordLevel, Unigram), some sentencepiece in Python.

:class:`ProbeTokenizer` reads those once and never changes the tokenizer (its files are the
user's), and probes pad batches by hand with an attention mask, so nothing needs a pad token:
without one they pad with eos (or unk, bos), and the mask keeps those positions out of the
comparison. A tokenizer that cannot be loaded or cannot encode a sentence is kept as a one-line
note, and the probes fall back to seeded ids.

Example:
    >>> tokenizer = tokenizer_for(Path("tiny-llama"))
    >>> rows = [tokenizer.encode(text, limit=64) for text in ("A red fox.", "Hi")]
    >>> ids, mask = pad_rows(rows, tokenizer.pad()[0], side="left")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from precision_convert.core.errors import one_line

#: A ``model_max_length`` at or past this is no limit: transformers stores int(1e30) for a
#: tokenizer that never set one, and real context lengths stay far below a trillion tokens.
UNBOUNDED = 10**12
#: Checked once per tokenizer: whether it can encode at all (cut short: some tokenizers warn
#: about any text longer than their model_max_length).
TRIAL_TEXT = "A red fox jumps over the sleeping dog."
TRIAL_LENGTH = 8
#: The ids each special token of a tokenizer may have, in the order probes prefer as padding.
_PAD_CHOICES = (
    ("pad_token_id", "the tokenizer's pad token"),
    ("eos_token_id", "eos: the tokenizer has no pad token"),
    ("unk_token_id", "unk: the tokenizer has no pad or eos token"),
    ("bos_token_id", "bos: the tokenizer has no pad, eos or unk token"),
)


@dataclass(frozen=True)
class ProbeTokenizer:
    """A loaded tokenizer (or the reason there is none usable) and what probes read from it.

    ``tokenizer`` is None when the one shipped could not be loaded or run: ``note`` says why,
    in one line for the certificate.
    """

    tokenizer: Any | None
    where: str  # the folder it was read from, by name only (certificates are published)
    note: str | None = None
    #: The model's own processor where it ships one that puts images into prompts (a
    #: vision-language model's: image processor, tokenizer and image token together).
    processor: Any | None = None

    @classmethod
    def wrap(cls, tokenizer: Any, where: str = "") -> ProbeTokenizer:
        """``tokenizer`` if it can encode a sentence, else an unusable one with a note."""
        try:
            ids = tokenizer(TRIAL_TEXT, truncation=True, max_length=TRIAL_LENGTH)["input_ids"]
            if not ids or not all(isinstance(i, int) for i in ids):
                raise ValueError("it encodes a sentence to no token ids")
        # Tokenizers' Rust backend raises plain Exception; any failure here means "unusable".
        except Exception as exc:
            return cls.unusable(where, f"cannot encode text ({one_line(exc)})")
        return cls(tokenizer, where)

    @classmethod
    def unusable(cls, where: str, why: str) -> ProbeTokenizer:
        name = f"the tokenizer in {where}/" if where else "the tokenizer"
        return cls(None, where, f"{name} {why}: token probes use seeded ids instead")

    @property
    def usable(self) -> bool:
        return self.tokenizer is not None

    def encode(self, text: str, limit: int) -> list[int]:
        """``text``'s ids as a user's call gets them (bos/eos added by the tokenizer's own
        rules), at most ``limit`` of them."""
        assert self.tokenizer is not None, "encode() is for a usable tokenizer"
        ids = self.tokenizer(text, add_special_tokens=True, truncation=True, max_length=limit)
        return list(ids["input_ids"])[:limit]

    def pad(self) -> tuple[int, str]:
        """The id probes pad with and why that one: the pad token, else eos, unk or bos.

        Padding is masked out, so any id serves; a real special token keeps the embedding
        lookup in the range the model was trained on.
        """
        for attribute, why in _PAD_CHOICES:
            value = getattr(self.tokenizer, attribute, None)
            if isinstance(value, list | tuple):
                value = value[0] if value else None
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value, why
        return 0, "id 0: the tokenizer has no pad, eos, unk or bos token"

    @property
    def padding_side(self) -> str:
        return str(getattr(self.tokenizer, "padding_side", "right") or "right")

    @property
    def max_length(self) -> int | None:
        """``model_max_length``, None when the tokenizer sets no real limit."""
        value = getattr(self.tokenizer, "model_max_length", None)
        if not isinstance(value, int | float) or value <= 0 or value >= UNBOUNDED:
            return None
        return int(value)

    def special_tokens(self) -> list[tuple[str, int]]:
        """Every special and added token with its id: the named ones (bos, eos, unk, ...)
        first, then added tokens by id; each id once."""
        t = self.tokenizer
        found: dict[int, str] = {}
        named = list(getattr(t, "all_special_tokens", None) or [])
        for token, token_id in zip(named, _ids_of(t, named), strict=True):
            if token_id is not None:
                found.setdefault(token_id, str(token))
        added = getattr(t, "added_tokens_decoder", None) or {}
        for token_id in sorted(i for i in added if isinstance(i, int)):
            found.setdefault(token_id, str(getattr(added[token_id], "content", added[token_id])))
        return [(token, token_id) for token_id, token in found.items()]

    def chat(self, turns: Sequence[str], limit: int) -> list[int] | None:
        """``turns`` (user, assistant, ...) through the tokenizer's chat template; None when
        it has none or the template refuses them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return None
        roles = ("user", "assistant")
        messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
        try:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        except Exception:  # jinja raises its own errors: no chat row then
            return None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        flat = list(ids[0] if ids and isinstance(ids[0], list) else ids)
        return flat[:limit] if flat and all(isinstance(i, int) for i in flat) else None

    def describe(self) -> dict[str, Any]:
        """The tokenizer as the certificate records it: class, backend, padding."""
        if self.tokenizer is None:
            return {"usable": False, "note": self.note}
        pad_id, pad_why = self.pad()
        return {
            "usable": True,
            "class": type(self.tokenizer).__name__,
            "backend": _backend(self.tokenizer),
            "pad_id": pad_id,
            "pad": pad_why,
            "padding_side": self.padding_side,
            "model_max_length": self.max_length if self.max_length is not None else "unbounded",
            "special_tokens": len(self.special_tokens()),
            "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
            **({"processor": type(self.processor).__name__} if self.processor else {}),
        }


def _ids_of(tokenizer: Any, tokens: list[str]) -> list[int | None]:
    if not tokens:
        return []
    ids = tokenizer.convert_tokens_to_ids(tokens)
    return [i if isinstance(i, int) and i >= 0 else None for i in ids]


def _backend(tokenizer: Any) -> str:
    """``fast BPE``, ``fast WordPiece``, ``sentencepiece``...: what turns text into ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    if backend is not None:
        return f"fast {type(backend.model).__name__}"
    if getattr(tokenizer, "sp_model", None) is not None:
        return "sentencepiece"
    return "python"


def pad_rows(
    rows: Sequence[Sequence[int]], pad_id: int, *, side: str = "right", width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of ids as one batch padded with ``pad_id`` on ``side`` (to ``width``, else the
    longest row), and its attention mask: 1 on real tokens, 0 on padding."""
    width = width if width is not None else max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        row = list(row)[:width]
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[r, where] = torch.tensor(row, dtype=torch.long)
        mask[r, where] = 1
    return ids, mask


def probe_tokenizer(value: Any | None) -> ProbeTokenizer | None:
    """``value`` as a :class:`ProbeTokenizer`: one already, a library tokenizer, or None."""
    if value is None or isinstance(value, ProbeTokenizer):
        return value
    return ProbeTokenizer.wrap(value)


def tokenizer_for(directory: Path) -> ProbeTokenizer | None:
    """The tokenizer shipped with a model, or its pipeline's matching ``tokenizer*`` folder.

    A pipeline's ``text_encoder_2`` pairs with ``tokenizer_2``. None when no tokenizer files
    are there; an unusable one (with its note) when they are but cannot be loaded or run.
    Remote tokenizer code never runs.
    """
    candidates = [directory]
    if directory.name.startswith("text_encoder"):
        candidates.append(directory.parent / directory.name.replace("text_encoder", "tokenizer"))
    failed: ProbeTokenizer | None = None
    for candidate in candidates:
        files = (
            [*candidate.glob("tokenizer*"), *candidate.glob("*.model")]
            if candidate.is_dir()
            else []
        )
        if not files:
            continue
        from transformers import AutoTokenizer

        # A pipeline's tokenizer folder is named; the model's own folder is the model.
        where = candidate.name if candidate != directory else ""
        try:
            loaded = AutoTokenizer.from_pretrained(candidate)
        # Loading runs the library's converters and the Rust parser, which raise plain
        # Exception on a malformed tokenizer.json: every failure is a note, never a crash.
        except Exception as exc:
            failed = failed or ProbeTokenizer.unusable(where, f"cannot be loaded ({one_line(exc)})")
            continue
        found = ProbeTokenizer.wrap(loaded, where)
        if found.usable:
            return replace(found, processor=image_processor_for(candidate))
        failed = failed or found
    return failed


#: Files a saved processor writes beside the tokenizer's.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def image_processor_for(directory: Path) -> Any | None:
    """The processor a vision-language model ships (``AutoProcessor``, never remote code),
    when it puts images into prompts: it names an image token and has an image processor.
    None otherwise, or when it cannot be loaded (token probes do not need it)."""
    if not any((directory / name).is_file() for name in _PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(directory, trust_remote_code=False)
    # The library's loaders raise plain Exception on files they cannot read: no processor.
    except Exception:
        return None
    token = getattr(processor, "image_token", None)
    has_images = getattr(processor, "image_processor", None) is not None
    return processor if isinstance(token, str) and has_images else None
