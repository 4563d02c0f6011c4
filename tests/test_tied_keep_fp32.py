"""``--keep-fp32`` names modules as the model shows them: a head tied to the embedding
(``lm_head`` of a small Llama, which the checkpoint stores once, as ``model.embed_tokens``) is
kept fp32 with the weight it shares, and every way of loading the output keeps the tie.

The record says what loads: both names of the tied weight are listed in fp32 and as sharing
their storage, and so say ``inspect --json``, the conversion's island table and ``pc.load``
(GPT-2's ``transformer.wte``/``lm_head`` and T5's ``shared``/``lm_head`` alike). Validation
checks every parameter ``pc.load`` gives against the record, and fails a record that lies."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import precision_convert as pc
from precision_convert.cli.main import app

#: Relative L2 distance of the logits from the fp32 source's that a bf16-safe model stays within.
CLOSE = 0.02


@dataclass(frozen=True)
class Converted:
    source: Path
    out: Path
    report: str  # what the command printed


@pytest.fixture(scope="module")
def converted(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Converted:
    source = tiny_model("llama")
    assert json.loads((source / "config.json").read_text())["tie_word_embeddings"] is True
    out = tmp_path_factory.mktemp("tied") / "llama-bf16-safe"
    done = CliRunner().invoke(
        app,
        [
            "model",
            str(source),
            "--to",
            "bf16-safe",
            "--keep-fp32",
            "lm_head",
            "-o",
            str(out),
            "--coverage",
            "quick",
            "--report",
            "full",
        ],
    )
    assert done.exit_code == 0, done.output
    return Converted(source, out, done.stdout)


def test_the_shared_weight_is_stored_once_in_fp32(converted: Converted) -> None:
    out = converted.out
    with safe_open(out / "model.safetensors", "pt") as stored:
        names = stored.keys()
        dtypes = {name: stored.get_slice(name).get_dtype() for name in names}
        record = json.loads(stored.metadata()["precision_convert"])
    assert "lm_head.weight" not in dtypes  # tied: stored once, under the embedding's name
    assert dtypes["model.embed_tokens.weight"] == "F32"
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "BF16"
    assert record["islands"]["model.embed_tokens"] == "user"
    config = json.loads((out / "config.json").read_text())
    assert config["precision_convert"]["islands"] == record["islands"]
    certificate = json.loads((out / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "pass"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 33).reshape(2, 16) % 256
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("how", ["pc.load", "from_pretrained"])
def test_both_loads_keep_the_tie_and_the_fp32_numbers(converted: Converted, how: str) -> None:
    from transformers import AutoModelForCausalLM

    source, out = converted.source, converted.out
    reference = _logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval())
    model = pc.load(out) if how == "pc.load" else AutoModelForCausalLM.from_pretrained(out).eval()
    head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
    assert head.data_ptr() == embedding.data_ptr()  # still one tensor
    if how == "pc.load":  # the stored dtypes, as the record says
        assert head.dtype == torch.float32
        assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    logits = _logits(model)
    assert torch.isfinite(logits).all()
    assert float((logits - reference).norm() / reference.norm()) < CLOSE


def test_a_name_no_module_answers_to_is_still_refused(converted: Converted, tmp_path: Path) -> None:
    source = converted.source
    done = CliRunner().invoke(
        app,
        [
            "model",
            str(source),
            "--to",
            "bf16",
            "--keep-fp32",
            "lm_heads",
            "-o",
            str(tmp_path / "o"),
        ],
    )
    assert done.exit_code == 2
    assert done.stderr.strip() == (
        "precision-convert: --keep-fp32 'lm_heads' matches no module of the model"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("pattern", "head_bias"),
    [("lm_head", False), ("lm_head", True), ("model.embed_tokens", True)],
    ids=["head", "head-with-bias", "embedding"],
)
def test_a_pattern_naming_either_tied_module_keeps_both(pattern: str, head_bias: bool) -> None:
    """A head with a bias of its own beside the shared weight is a unit too: it must follow
    the weight into fp32, or the loaded head would hold two dtypes. Without one, the head
    stores nothing, yet is an island all the same: it is what the record says loads."""
    from precision_convert.conversion.io.tensors import MemoryTensor
    from precision_convert.conversion.plan import build_plan
    from precision_convert.core.dtypes import FP32
    from precision_convert.recipes import Recipe

    shapes = {"model.embed_tokens.weight": (16, 4), "model.layers.0.mlp.weight": (4, 4)}
    if head_bias:
        shapes["lm_head.bias"] = (16,)
    tensors = [MemoryTensor(n, FP32, s, torch.zeros(s)) for n, s in shapes.items()]
    recipe = Recipe(name="plain", description="", library="any", keep_normalization=False)
    plan = build_plan(
        tensors,
        target="bf16",
        recipe=recipe,
        keep_fp32=[pattern],
        tied={"lm_head.weight": "model.embed_tokens.weight"},
    )
    assert {i.name for i in plan.islands} == {"model.embed_tokens", "lm_head"}
    assert plan.record("0").tied == {"lm_head.weight": "model.embed_tokens.weight"}
    stored = {t.name: t.stored for t in plan.tensors}
    assert stored["model.layers.0.mlp.weight"] != FP32
    assert {n for n, dtype in stored.items() if dtype == FP32} == set(shapes) - {
        "model.layers.0.mlp.weight"
    }


# --------------------------------------------------------------------------- what the record says

TIE = {"lm_head.weight": "model.embed_tokens.weight"}


def _record(out: Path) -> dict[str, Any]:
    with safe_open(out / "model.safetensors", "pt") as stored:
        record: dict[str, Any] = json.loads(stored.metadata()["precision_convert"])
    config = json.loads((out / "config.json").read_text())
    assert config["precision_convert"] == record  # both copies say the same
    return record


def _inspected(out: Path) -> dict[str, Any]:
    done = CliRunner().invoke(app, ["inspect", str(out), "--json"])
    assert done.exit_code == 0, done.output
    component: dict[str, Any] = json.loads(done.stdout)["components"][0]
    return component


def _loaded_fp32(model: torch.nn.Module) -> set[str]:
    return {
        n for n, p in model.named_parameters(remove_duplicate=False) if p.dtype == torch.float32
    }


def test_the_record_inspect_the_report_and_pc_load_agree(converted: Converted) -> None:
    from precision_convert.conversion.io.source import open_source
    from precision_convert.conversion.runtime.record import loaded_mismatch

    out = converted.out
    record = _record(out)
    assert {"lm_head", "model.embed_tokens"} <= set(record["fp32_modules"])
    assert record["islands"]["lm_head"] == record["islands"]["model.embed_tokens"] == "user"
    assert record["tied"] == TIE

    inspected = _inspected(out)
    assert inspected["record"] == record
    assert inspected["tied"] == TIE
    rows = {m["name"]: m["dtypes"] for m in inspected["modules"]}
    assert rows["model.embed_tokens"] == ["fp32"]

    # The conversion's island table names both, each as the user's.
    rows_printed = [line for line in converted.report.splitlines() if "user" in line]
    assert any("lm_head" in line for line in rows_printed), converted.report
    assert any("model.embed_tokens" in line for line in rows_printed), converted.report

    model = pc.load(out)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= _loaded_fp32(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert loaded_mismatch(model, open_source(out)) is None  # every parameter, as recorded

    certificate = json.loads((out / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "pass"


def _with_record(out: Path, copy: Path, **changes: Any) -> Path:
    """A copy of ``out`` whose record (config and shard metadata) has ``changes``; a change
    to None drops the field."""
    from precision_convert.conversion.runtime.resave import add_metadata

    shutil.copytree(out, copy)
    record = {**_record(out), **changes}
    record = {k: v for k, v in record.items() if v is not None}
    config = json.loads((copy / "config.json").read_text())
    config["precision_convert"] = record
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    add_metadata(copy / "model.safetensors", {"precision_convert": json.dumps(record)})
    return copy


def test_a_record_that_does_not_say_what_loads_fails_the_certificate(
    converted: Converted, tmp_path: Path
) -> None:
    """The record earlier versions wrote (the head missing, no tie): it still loads, as its
    files hold, but validating it names the parameter whose dtype it gets wrong."""
    record = _record(converted.out)
    old = _with_record(
        converted.out,
        tmp_path / "old-record",
        fp32_modules=[m for m in record["fp32_modules"] if m != "lm_head"],
        islands={k: v for k, v in record["islands"].items() if k != "lm_head"},
        tied=None,
    )
    model = pc.load(old)  # old records without tie info still load
    assert model.lm_head.weight.dtype == torch.float32
    certificate = pc.validate(old, baseline=converted.source, device="cpu", coverage="quick")
    assert certificate.verdict == "fail"
    assert certificate.failures[0] == (
        "model: the precision_convert record says 'lm_head.weight' is bfloat16 but pc.load gives "
        "'lm_head.weight' in float32: the record does not say what loads"
    )
    assert json.loads((old / "precision_certificate.json").read_text())["verdict"] == "fail"


def test_a_record_giving_tied_names_two_dtypes_is_refused(
    converted: Converted, tmp_path: Path
) -> None:
    record = _record(converted.out)
    torn = _with_record(
        converted.out,
        tmp_path / "torn",
        fp32_modules=[m for m in record["fp32_modules"] if m != "lm_head"],
    )
    from precision_convert.errors import InputError

    with pytest.raises(
        InputError, match=re.escape("but not 'lm_head.weight', which share their storage")
    ):
        pc.load(torn)


def test_a_record_without_tie_info_reads_as_before() -> None:
    from precision_convert.conversion.plan import PlanRecord

    old = {"version": "0.1.0", "fp32_modules": ["model.norm"], "islands": {"model.norm": "x"}}
    record = PlanRecord.from_dict(old)
    assert record.tied == {}
    assert record.to_dict() == old  # written back as it was: no empty "tied"


def _converted(source: Path, out: Path, *keep: str) -> Path:
    """``source`` converted to bf16-safe keeping ``keep`` (no validation: the record, the
    inspection and pc.load are what is compared here)."""
    keep_fp32 = [x for name in keep for x in ("--keep-fp32", name)]
    args = ["model", str(source), "--to", "bf16-safe", *keep_fp32, "-o", str(out), "--no-validate"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    return out


def _agree(out: Path, tied: dict[str, str], fp32: set[str]) -> None:
    """The record, inspect --json and pc.load agree: ``tied`` shares storage, and the modules
    ``fp32`` (each name of a tied weight among them) load in fp32, every other in bf16."""
    from precision_convert.conversion.io.source import open_source
    from precision_convert.conversion.runtime.record import loaded_mismatch

    record = _record(out)
    assert record.get("tied", {}) == tied
    assert inspected_record(out) == record
    model = pc.load(out)
    assert loaded_mismatch(model, open_source(out)) is None
    for alias, holder in tied.items():
        assert model.get_parameter(alias) is model.get_parameter(holder)
    loaded = _loaded_fp32(model)
    assert {n.rpartition(".")[0] for n in loaded} == fp32
    assert set(record["fp32_modules"]) == fp32


def inspected_record(out: Path) -> dict[str, Any]:
    inspected = _inspected(out)
    assert inspected["tied"] == (inspected["record"] or {}).get("tied", {})
    record: dict[str, Any] = inspected["record"]
    return record


@pytest.mark.parametrize("keep", ["lm_head", "transformer.wte"])
def test_gpt2_head_and_embedding_are_recorded_together(keep: str, tmp_path: Path) -> None:
    import _models

    source = tmp_path / "gpt2"
    _models.gpt2().save_pretrained(source)
    out = _converted(source, tmp_path / "out", keep)
    norms = {f"transformer.h.{i}.ln_{j}" for i in (0, 1) for j in (1, 2)} | {"transformer.ln_f"}
    fp32 = {"lm_head", "transformer.wte"} | norms
    _agree(out, {"lm_head.weight": "transformer.wte.weight"}, fp32)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_t5_shared_and_head_follow_the_config(tie: bool, tmp_path: Path) -> None:
    """T5 ties ``shared``, both ``embed_tokens`` and ``lm_head`` where the config says so:
    keeping the head keeps all four where they are one weight. Where it does not, the
    checkpoint stores each of them, each loads as its own tensor, and the head is kept alone."""
    import _models
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(**{**_models.T5_ENCODER, "is_encoder_decoder": True})
    config.tie_word_embeddings = tie  # an attribute: T5Config's constructor drops the keyword
    source = tmp_path / "t5"
    T5ForConditionalGeneration(config).save_pretrained(source)
    out = _converted(source, tmp_path / "out", "lm_head")
    embeddings = {"encoder.embed_tokens", "decoder.embed_tokens"}
    tied = {f"{m}.weight": "shared.weight" for m in [*embeddings, "lm_head"]} if tie else {}
    record = _record(out)
    norms = {m for m in record["fp32_modules"] if "layer_norm" in m}
    kept = {"lm_head", "shared", *embeddings} if tie else {"lm_head"}
    _agree(out, tied, kept | norms)
