"""Token probes work with any tokenizer a model ships, or none.

Each kind real checkpoints ship is built offline: fast byte-level BPE without a pad token (Llama
3, GPT-2), pad = eos, a slow sentencepiece tokenizer, a sentencepiece model converted by
transformers (Mistral, Llama 2), WordPiece (BERT), WordLevel, added and special tokens, a chat
template, ``model_max_length`` left at transformers' 1e30, and a tokenizer that cannot be used
at all. The probe builder must go through the real tokenizer for text, special tokens and
padded batches (each probe records ``ids_from``), pad by hand where there is no pad token, and
never touch the tokenizer or its files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import zoo
from typer.testing import CliRunner

from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs
from precision_convert.validation.probe.inputs.sweep import sweep
from precision_convert.validation.probe.inputs.token_probes import TEXTS
from precision_convert.validation.probe.inputs.tokenizers import ProbeTokenizer, tokenizer_for
from precision_convert.validation.probe.run.execute import run_probes, run_sweep, select_inputs

#: The probes that must go through the tokenizer when it is usable.
TOKENIZED = ("forward:special", "forward:text", "forward:padded")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


# --------------------------------------------------------------------------- tokenizers


def byte_level_bpe(size: int = 600, **kwargs: Any) -> Any:
    """A Llama-3/GPT-2 style fast tokenizer: byte-level BPE, ``<|endoftext|>`` as eos, no pad
    unless ``kwargs`` set one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = zoo.vocab.byte_level_bpe(size - 1)
    backend = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", model_max_length=512, **kwargs
    )


def sentencepiece_file(directory: Path, name: str, model_type: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    spec = zoo.vocab.Sentencepiece(size=400, model_type=model_type)
    (directory / name).write_bytes(zoo.vocab.sentencepiece_model(spec))
    return directory / name


def slow_sentencepiece(tmp: Path) -> Any:
    """A tokenizer that runs sentencepiece in Python (``SentencePieceBackend``), no pad."""
    from transformers import SiglipTokenizer

    return SiglipTokenizer(
        vocab_file=str(sentencepiece_file(tmp, "spiece.model", "unigram")), pad_token=None
    )


def converted_sentencepiece(tmp: Path) -> Any:
    """A Llama-2/Mistral style directory: a sentencepiece BPE ``tokenizer.model`` and a config
    naming ``LlamaTokenizer`` with no pad token, loaded the way users load it."""
    from transformers import AutoTokenizer

    sentencepiece_file(tmp, "tokenizer.model", "bpe")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(tmp)


def wordpiece(tmp: Path) -> Any:
    """BERT's tokenizer: WordPiece with [PAD]/[UNK]/[CLS]/[SEP]/[MASK]."""
    from transformers import BertTokenizer

    specials = ((0, "[PAD]"), (100, "[UNK]"), (101, "[CLS]"), (102, "[SEP]"), (103, "[MASK]"))
    words = zoo.vocab.wordpiece_vocab(400, specials)
    return BertTokenizer(vocab={w: i for i, w in enumerate(words)})


def word_level(tmp: Path) -> Any:
    """A WordLevel tokenizer (whole words, unknown words map to [UNK]), eos and no pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for line in TEXTS for w in line.replace("\n", " ").split()})
    table = {w: i for i, w in enumerate(["[UNK]", "<eos>", *words])}
    backend = Tokenizer(models.WordLevel(vocab=table, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")


def bpe_with_added_tokens(tmp: Path) -> Any:
    """Byte-level BPE plus tokens added past the base vocabulary, special and not, and a chat
    template that uses them (as Qwen2/ChatML tokenizers ship)."""
    tokenizer = byte_level_bpe(chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool>"])
    return tokenizer


# --------------------------------------------------------------------------- models


def llama_for(tokenizer: Any) -> Any:
    """A tiny Llama whose vocabulary and eos are the tokenizer's (no pad, as Llama 3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def bert_for(tokenizer: Any) -> Any:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    return BertModel(config).eval()


def swept(model: Any, tokenizer: Any, level: str = "quick") -> ModelInputs:
    """The layout chosen on the fp32 model, then ``level``'s sweep; every probe run once."""
    chosen, outputs = select_inputs(model, input_candidates(model, tokenizer=tokenizer), run_probes)
    full = sweep(model, chosen, level, tokenizer)
    kept, _ = run_sweep(model, chosen, full, run_probes, outputs)
    assert [p.name for p in kept.probes] == [p.name for p in full.probes], kept.notes
    return full


def probes_of(inputs: ModelInputs) -> dict[str, Any]:
    return {p.name: p for p in inputs.probes}


def digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


# --------------------------------------------------------------------------- tests


def test_no_pad_token_pads_with_eos_on_both_sides_and_touches_nothing(tmp_path: Path) -> None:
    """Llama 3 / GPT-2: no pad token. Batches are padded by hand with eos and masked; the
    tokenizer object and its saved files stay exactly as they were."""
    byte_level_bpe().save_pretrained(tmp_path / "tok")
    before = digest(tmp_path / "tok")
    tokenizer = tokenizer_for(tmp_path / "tok")
    assert tokenizer is not None and tokenizer.usable
    model = llama_for(tokenizer.tokenizer)
    inputs = swept(model, tokenizer)
    assert tokenizer.tokenizer.pad_token is None  # never given one behind the user's back
    assert digest(tmp_path / "tok") == before
    eos = tokenizer.tokenizer.eos_token_id

    assert inputs.origin == "tokenizer"  # the layout probe is real text too
    record = inputs.describe()
    assert record["tokenizer"]["pad_id"] == eos
    assert record["tokenizer"]["pad"] == "eos: the tokenizer has no pad token"
    assert record["tokenizer"]["backend"] == "fast BPE"
    probes = probes_of(inputs)
    for name in (*TOKENIZED, "forward:padded-left"):
        assert probes[name].sweep["ids_from"] == "tokenizer", name
        assert record["probes"][name]["sweep"]["ids_from"] == "tokenizer"

    # Real text: each row is exactly what the tokenizer gives for its line, then eos padding.
    text = probes["forward:text"]
    for row, line in enumerate(TEXTS):
        expected = tokenizer.tokenizer(line)["input_ids"]
        n = len(expected)
        assert text.kwargs["input_ids"][row, :n].tolist() == expected
        assert (text.kwargs["input_ids"][row, n:] == eos).all()
        assert text.kwargs["attention_mask"][row].sum() == n

    right, left = probes["forward:padded"], probes["forward:padded-left"]
    lengths = right.sweep["lengths"]
    assert len(set(lengths)) == len(lengths) > 1 and right.sweep["side"] == "right"
    stream = tokenizer.tokenizer(" ".join(TEXTS))["input_ids"]
    for row, n in enumerate(lengths):
        assert right.kwargs["input_ids"][row, :n].tolist() == stream[:n]
        assert left.kwargs["input_ids"][row, -n:].tolist() == stream[:n]  # same rows, left
        assert (left.kwargs["input_ids"][row, :-n] == eos).all()
        assert left.kwargs["attention_mask"][row, -n:].all()
        # As generate does: the first real token is at position 0 whatever the padding.
        assert left.kwargs["position_ids"][row, -n:].tolist() == list(range(n))
    assert left.positions is not None and torch.equal(
        left.positions, left.kwargs["attention_mask"].bool()
    )


def test_pad_token_equal_to_eos() -> None:
    tokenizer = byte_level_bpe(pad_token="<|endoftext|>")
    inputs = swept(llama_for(tokenizer), tokenizer)
    record = inputs.describe()["tokenizer"]
    assert record["pad_id"] == tokenizer.eos_token_id == tokenizer.pad_token_id
    assert record["pad"] == "the tokenizer's pad token"
    padded = probes_of(inputs)["forward:padded"]
    assert padded.sweep["pad_id"] == tokenizer.eos_token_id


KINDS: dict[str, tuple[Callable[[Path], Any], Callable[[Any], Any], str]] = {
    "slow-sentencepiece": (slow_sentencepiece, llama_for, "sentencepiece"),
    "converted-sentencepiece": (converted_sentencepiece, llama_for, "fast BPE"),
    "wordpiece-bert": (wordpiece, bert_for, "fast WordPiece"),
    "word-level": (word_level, llama_for, "fast WordLevel"),
    "added-tokens": (bpe_with_added_tokens, llama_for, "fast BPE"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_tokenizer_kind_feeds_text_specials_and_padding(tmp_path: Path, kind: str) -> None:
    build, model_for, backend = KINDS[kind]
    tokenizer = build(tmp_path / "tok")
    model = model_for(tokenizer)
    inputs = swept(model, tokenizer)
    record = inputs.describe()
    assert record["tokenizer"]["backend"] == backend
    assert record["tokenizer"]["class"] == type(tokenizer).__name__
    assert "notes" not in record
    probes = probes_of(inputs)
    for name in TOKENIZED:
        assert probes[name].sweep["ids_from"] == "tokenizer", name
    # Left padding only where generate uses it: decoder-only models.
    assert ("forward:padded-left" in probes) == (model_for is llama_for)
    special = probes["forward:special"]
    ids = set(special.kwargs["input_ids"][special.kwargs["attention_mask"].bool()].tolist())
    wanted = {i for _, i in ProbeTokenizer.wrap(tokenizer).special_tokens()}
    assert special.sweep["reached"] == len(wanted & ids) == special.sweep["special_tokens"]
    if kind == "wordpiece-bert":
        assert record["tokenizer"]["pad"] == "the tokenizer's pad token"
        cls_sep = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id}
        assert cls_sep <= ids
    else:
        assert tokenizer.pad_token_id is None
        assert record["tokenizer"]["pad_id"] == tokenizer.eos_token_id


def test_added_tokens_and_chat_template_go_through_the_tokenizer(tmp_path: Path) -> None:
    tokenizer = bpe_with_added_tokens(tmp_path)
    inputs = swept(llama_for(tokenizer), tokenizer)
    special = probes_of(inputs)["forward:special"]
    assert special.sweep["chat_template"] is True
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": TEXTS[1]}],
        tokenize=True,
        return_dict=False,
    )
    assert special.kwargs["input_ids"][0, : len(chat)].tolist() == chat
    ids = set(special.kwargs["input_ids"].flatten().tolist())
    added = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<tool>"])
    assert set(added) <= ids and min(added) >= 599  # past the base vocabulary


def test_tokenizer_probes_replay_from_the_certificate_record(tmp_path: Path) -> None:
    """The record names how each probe was made; with the same tokenizer a replay rebuilds
    every tensor to its recorded digest."""
    from precision_convert.validation.probe.inputs.sweep import replay

    tokenizer = bpe_with_added_tokens(tmp_path)
    model = llama_for(tokenizer)
    record = json.loads(json.dumps(swept(model, tokenizer, "standard").describe()))
    replayed = replay(model, record, tokenizer=tokenizer)
    assert [p.name for p in replayed.probes] == list(record["probes"])
    assert {"forward:special", "forward:text", "forward:padded-left"} <= set(record["probes"])


@pytest.mark.parametrize("limit", [int(1e30), 1e30], ids=["int", "float"])
def test_model_max_length_of_1e30_is_no_limit(tmp_path: Path, limit: float) -> None:
    """transformers stores int(1e30) when a tokenizer sets no limit (a config may hold the
    float): no overflow anywhere, and text is cut at the model's position limit."""
    byte_level_bpe().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["model_max_length"] = limit
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = tokenizer_for(tmp_path)
    assert tokenizer is not None and tokenizer.max_length is None
    assert tokenizer.describe()["model_max_length"] == "unbounded"
    inputs = swept(llama_for(tokenizer.tokenizer), tokenizer, "standard")
    assert probes_of(inputs)["forward:text"].sweep["ids_from"] == "tokenizer"
    assert max(p.kwargs["input_ids"].shape[1] for p in inputs.probes) == 128


def broken_tokenizer_llama(path: Path) -> Path:
    """A tiny Llama whose tokenizer.json cannot be parsed."""
    tokenizer = byte_level_bpe()
    llama_for(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    return path


def test_a_broken_tokenizer_is_a_note_and_probes_fall_back_to_ids(tmp_path: Path) -> None:
    source = broken_tokenizer_llama(tmp_path / "src")
    tokenizer = tokenizer_for(source)
    assert tokenizer is not None and not tokenizer.usable
    assert tokenizer.note is not None and tokenizer.note.startswith("the tokenizer cannot be")
    assert "\n" not in tokenizer.note and str(tmp_path) not in tokenizer.note
    model = llama_for(byte_level_bpe())
    inputs = swept(model, tokenizer)
    assert inputs.origin == "builder" and inputs.notes == (tokenizer.note,)
    probes = probes_of(inputs)
    assert "forward:text" not in probes
    assert probes["forward:special"].sweep["ids_from"] == "seeded"
    assert probes["forward:padded"].sweep["ids_from"] == "seeded"
    assert inputs.describe()["tokenizer"] == {"usable": False, "note": tokenizer.note}

    # A tokenizer that loads but cannot encode is the same: a note, not a crash.
    class Refuses:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("sentencepiece model missing")

    refused = ProbeTokenizer.wrap(Refuses())
    assert not refused.usable and "RuntimeError: sentencepiece model missing" in str(refused.note)

    # The whole job: exit 0, a passing certificate, one line in its notes.
    from precision_convert.cli.main import app

    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["model", str(source), "--to", "bf16-safe", "-o", str(out), "--coverage", "quick"]
    )
    assert result.exit_code == 0, result.output
    certificate = json.loads((out / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "pass"
    assert [n for n in certificate["notes"] if "tokenizer" in n] == [tokenizer.note]


def test_a_tokenizer_of_another_model_is_a_note(tmp_path: Path) -> None:
    """Ids past the model's vocabulary: the tokenizer is not this model's."""
    tokenizer = byte_level_bpe()
    model = llama_for(word_level(tmp_path))  # a vocabulary far smaller than the BPE's
    inputs = swept(model, tokenizer)
    assert inputs.origin == "builder" and len(inputs.notes) == 1
    assert "gives ids past the model's vocabulary of" in inputs.notes[0]
    assert inputs.describe()["tokenizer"]["usable"] is False
    probes = probes_of(inputs)
    assert "forward:text" not in probes
    assert probes["forward:padded"].sweep["ids_from"] == "seeded"


def test_a_pipeline_that_pads_prompts_to_no_limit_fails_in_one_line(tmp_path: Path) -> None:
    """diffusers pads prompts to ``tokenizer.model_max_length``; left unset (1e30) the pipeline
    cannot run for anyone. The certificate says so in one line instead of a traceback."""
    from _models import sd_pipeline

    from precision_convert.cli.main import app

    source = sd_pipeline(tmp_path / "sd")
    config_file = source / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["model_max_length"]
    config_file.write_text(json.dumps(config))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["model", str(source), "--to", "bf16-safe", "-o", str(out), "--coverage", "quick"]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "end to end (OverflowError: int too big to convert)" in result.stderr
    certificate = json.loads((out / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "fail"
    assert any("OverflowError" in line for line in certificate["failures"])


# --------------------------------------------------------------------------- the zoo

#: Files of a model directory that belong to its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "chat_template.jinja")  # fmt: skip


@pytest.mark.parametrize("target", ["bf16-safe", "fp16-safe"])
@pytest.mark.parametrize("name", zoo.PADLESS)
def test_padless_zoo_models_certify_through_their_own_tokenizer(
    tiny_model: Callable[[str], Path],
    zoo_converted: Callable[[str, str], Any],
    tmp_path: Path,
    name: str,
    target: str,
) -> None:
    """Llama 3.2, Mistral v0.3 and GPT-2 as published ship no pad token: each converts with a
    passing certificate whose text, special-token and padded probes went through the real
    tokenizer, and no tokenizer file changes. (The conversion is test_zoo's, shared.)"""
    source = tiny_model(name)
    result = zoo_converted(name, target)
    # The source, tokenizer files included, is byte for byte a fresh build of the family.
    assert digest(source) == digest(zoo.build(name, tmp_path / "fresh"))
    shipped = [f for f in TOKENIZER_FILES if (source / f).is_file()]
    assert "tokenizer.json" in shipped
    for file in shipped:  # copied into the output unchanged
        assert (result.output / file).read_bytes() == (source / file).read_bytes()

    certificate = result.certificate
    assert certificate is not None and certificate.verdict == "pass", certificate.failures
    assert not [n for n in certificate.notes if "tokenizer" in n]
    inputs = certificate.components[0].inputs
    config = json.loads((source / "config.json").read_text())
    assert inputs["origin"] == "tokenizer"
    assert inputs["tokenizer"]["usable"] is True
    assert inputs["tokenizer"]["pad"] == "eos: the tokenizer has no pad token"
    assert inputs["tokenizer"]["pad_id"] == config["eos_token_id"]
    for probe in (*TOKENIZED, "forward:padded-left"):
        assert inputs["probes"][probe]["sweep"]["ids_from"] == "tokenizer", probe
    passed = {m.probe for m in certificate.metrics if m.passed}
    assert {*TOKENIZED, "forward:padded-left"} <= passed


def test_cli_converts_a_llama_without_a_pad_token(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The reproduction: ``precision-convert model <Llama 3.2> --to bf16-safe`` ended in
    'Asking to pad but the tokenizer does not have a padding token', exit 1."""
    from precision_convert.cli.main import app

    source = tiny_model("llama-3.2-1b")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["model", str(source), "--to", "bf16-safe", "-o", str(out), "--coverage", "quick"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "precision_certificate.json").read_text())["verdict"] == "pass"
