"""Tokenizers of the kinds real checkpoints ship, built offline at their real sizes.

There is no corpus here to learn 128k merges from, so every vocabulary is generated: merges
(or pieces) learned from :data:`CORPUS` first, so ordinary English text splits into real
sub-words, then filled with generated merges of the alphabet until the vocabulary has the size
of the published one. What matters to a converter and its probes is real here: the tokenizer
class, its pipeline (byte-level BPE, sentencepiece BPE with byte fallback, Unigram, WordPiece),
the special tokens and their ids, pad/bos/eos conventions and the vocabulary size.

Sentencepiece tokenizers are trained with the ``sentencepiece`` trainer and written as the
``.model`` file the family ships; ``tokenizer.json`` is then converted from it by transformers,
as the published ``tokenizer.json`` files were.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

#: Text the learned part of every vocabulary comes from: the probes' sentences, plus prose,
#: digits and punctuation, so real text splits into sub-words rather than single bytes.
CORPUS: tuple[str, ...] = (
    "A red fox jumps over the sleeping dog near the river bank.",
    "Precision matters: 65504 is the largest finite half-precision number!",
    "The quick brown fox jumps over the lazy dog while the cat watches from the window.",
    "Numbers overflow when they exceed the range of the format they are stored in.",
    "In 1969 the first people walked on the moon; millions watched it on television.",
    "Please convert the model, validate it against the baseline and push the result.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "Rain fell over the mountains for three days, and the rivers rose above their banks.",
    "def add(a, b):\n    return a + b\n",
    "What is the capital of France? The capital of France is Paris.",
)


def _corpus_lines(repeat: int = 8) -> list[str]:
    return list(CORPUS) * repeat


def _fill(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    units: Sequence[str],
    size: int,
    right_units: Sequence[str] | None = None,
) -> None:
    """Add merges of ``units`` with ``right_units`` (then of those merges with ``right_units``)
    until ``size`` tokens.

    Every new token is the concatenation of two tokens already in the vocabulary, so the BPE
    stays well formed: each merge's parts exist before the merge does.
    """
    right = list(right_units if right_units is not None else units)
    frontier = list(units)
    while len(vocab) < size:
        grown: list[str] = []
        for left, part in itertools.product(frontier, right):
            token = left + part
            if token in vocab:
                continue
            vocab[token] = len(vocab)
            merges.append((left, part))
            grown.append(token)
            if len(vocab) == size:
                return
        frontier = grown


def _trained_bpe(
    learner: Any, size: int, **trainer: Any
) -> tuple[list[str], list[tuple[str, str]]]:
    """Tokens (in id order) and merges a BPE ``learner`` learns from :data:`CORPUS`."""
    from tokenizers import trainers

    learner.train_from_iterator(
        _corpus_lines(), trainers.BpeTrainer(vocab_size=size, show_progress=False, **trainer)
    )
    model = json.loads(learner.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return tokens, merges  # type: ignore[return-value]


@cache
def byte_level_bpe(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (GPT-2, Llama-3, Qwen2) of exactly ``size`` tokens: vocab and merges.

    The 256 byte symbols, merges learned from :data:`CORPUS`, then generated merges.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokens, merges = _trained_bpe(
        learner, min(size, 2048), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    vocab = {token: index for index, token in enumerate(tokens)}
    _fill(vocab, merges, [t for t in tokens if len(t) == 1], size)
    return vocab, merges


@cache
def clip_bpe(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's BPE of ``size`` tokens: bytes, bytes ending a word (``</w>``), merges, and
    ``<|startoftext|>``/``<|endoftext|>`` as its last two ids (49406/49407 in CLIP's)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    learner = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    learner.normalizer = normalizers.Lowercase()
    # CLIP splits words on whitespace and drops it (no "Ġ" marks), then maps bytes.
    learner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    _, learned = _trained_bpe(learner, 2048, initial_alphabet=alphabet, end_of_word_suffix="</w>")
    ends = [c + "</w>" for c in alphabet]
    vocab = {token: index for index, token in enumerate([*alphabet, *ends])}
    merges: list[tuple[str, str]] = []
    for left, right in learned:
        if left in vocab and right in vocab and left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    _fill(vocab, merges, alphabet, size - 2, right_units=[*alphabet, *ends])
    vocab["<|startoftext|>"] = size - 2
    vocab["<|endoftext|>"] = size - 1
    return vocab, merges


@dataclass(frozen=True)
class Sentencepiece:
    """What a family's sentencepiece ``.model`` holds besides its learned pieces.

    ``meta`` are the unk/bos/eos/pad ids the trainer reserves (-1: none); ``control`` and
    ``user_defined`` symbols follow them in order (control symbols are never produced from
    text, user-defined ones are matched whole), then the 256 byte pieces with ``byte_fallback``.
    """

    size: int
    model_type: str  # "bpe" or "unigram"
    unk: tuple[int, str] = (0, "<unk>")
    bos: tuple[int, str] = (1, "<s>")
    eos: tuple[int, str] = (2, "</s>")
    pad: tuple[int, str] = (-1, "<pad>")
    control: tuple[str, ...] = ()
    user_defined: tuple[str, ...] = ()
    byte_fallback: bool = False
    add_dummy_prefix: bool = True
    split_digits: bool = False
    remove_extra_whitespaces: bool = True
    normalization: str = "identity"


@cache
def sentencepiece_model(spec: Sentencepiece) -> bytes:
    """A serialized sentencepiece model of exactly ``spec.size`` pieces, from the trainer.

    The trainer learns what :data:`CORPUS` supports (a few hundred pieces); the rest are
    generated concatenations of its characters, appended with falling scores, so both the
    sentencepiece runtime and transformers' converter see an ordinary model.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_lines()),
        model_writer=buffer,
        model_type=spec.model_type,
        vocab_size=min(spec.size, 2048 + len(spec.control) + len(spec.user_defined)),
        hard_vocab_limit=False,
        unk_id=spec.unk[0],
        unk_piece=spec.unk[1],
        bos_id=spec.bos[0],
        bos_piece=spec.bos[1],
        eos_id=spec.eos[0],
        eos_piece=spec.eos[1],
        pad_id=spec.pad[0],
        pad_piece=spec.pad[1],
        control_symbols=list(spec.control),
        user_defined_symbols=list(spec.user_defined),
        byte_fallback=spec.byte_fallback,
        add_dummy_prefix=spec.add_dummy_prefix,
        split_digits=spec.split_digits,
        remove_extra_whitespaces=spec.remove_extra_whitespaces,
        normalization_rule_name=spec.normalization,
        num_threads=1,
        minloglevel=2,  # the trainer logs every step to stderr otherwise
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buffer.getvalue())
    normal = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    have = {piece.piece for piece in proto.pieces}
    chars = [
        p.piece
        for p in proto.pieces
        if p.type == normal and len(p.piece) == 1 and not (spec.split_digits and p.piece.isdigit())
    ]
    score = min(piece.score for piece in proto.pieces)
    for piece in _concatenations(chars):
        if len(proto.pieces) >= spec.size:
            break
        if piece not in have:
            score -= 1.0
            proto.pieces.add(piece=piece, score=score, type=normal)
    proto.trainer_spec.vocab_size = len(proto.pieces)
    return proto.SerializeToString()


def _concatenations(chars: Sequence[str]) -> Iterator[str]:
    for length in itertools.count(2):
        for combo in itertools.product(chars, repeat=length):
            yield "".join(combo)


@cache
def wordpiece_vocab(size: int, specials: tuple[tuple[int, str], ...]) -> tuple[str, ...]:
    """A WordPiece vocabulary (BERT's ``vocab.txt``) of ``size`` entries, specials at their ids.

    Words and ``##`` continuations learned from :data:`CORPUS`, then generated ones; the
    remaining slots below the highest special id are ``[unusedN]`` as in BERT's own file.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    learner = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    learner.normalizer = normalizers.BertNormalizer(lowercase=True)
    learner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    learner.train_from_iterator(
        _corpus_lines(), trainers.WordPieceTrainer(vocab_size=2048, show_progress=False)
    )
    learned = [t for t, _ in sorted(learner.get_vocab().items(), key=lambda kv: kv[1])]
    slots: list[str | None] = [None] * size
    for index, token in specials:
        slots[index] = token
    reserved = {token for _, token in specials}
    letters = [t for t in learned if len(t) == 1 and t.isalpha()]
    candidates = itertools.chain(learned, _generated_words(letters))
    words = (w for w in candidates if w not in reserved)
    seen: set[str] = set(reserved)
    unused = itertools.count()
    last_special = max(index for index, _ in specials)
    for index in range(size):
        if slots[index] is not None:
            continue
        if index < last_special:
            slots[index] = f"[unused{next(unused)}]"
            continue
        for word in words:
            if word not in seen:
                seen.add(word)
                slots[index] = word
                break
    return tuple(s for s in slots if s is not None)


def _generated_words(letters: Sequence[str]) -> Iterator[str]:
    for word in _concatenations(letters):
        yield word
        yield "##" + word
