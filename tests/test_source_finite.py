"""A source whose own weights hold NaN or ±inf is not certified.

The read that hashes the source checks every floating tensor in the same pass: a broken
source is refused before anything is written (exit 2, the tensor named); with
``--allow-nonfinite-source`` it goes on and the certificate fails, naming the tensors and the
probes its fp32 baseline could not answer, which count against coverage. Attention masks
stored as ±inf by design are reported, not refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import _batch
import _models
import pytest
import torch
from _corrupt import assert_one_error_line, tree_digest
from jsonschema import Draft202012Validator
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import precision_convert.conversion.io.finite as finite
from precision_convert.api.conversion import convert
from precision_convert.cli.main import app
from precision_convert.conversion.io.source import open_source
from precision_convert.errors import InputError
from precision_convert.validation.certify.certificate import CERTIFICATE_NAME, measurements

SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "schema" / "certificate.schema.json"
#: The embedding row given a NaN: absent from the chosen probe's seeded ids, so only sweep
#: probes (the vocabulary, a long sequence) reach it, as in a real broken row.
ROW = 37
TENSOR = "model.embed_tokens.weight"


def _llama(path: Path, value: float = float("nan")) -> Path:
    """The tiny Llama (untied head: the row is read only where its token is) with ``value``
    at one embedding entry."""
    torch.manual_seed(0)
    model = _models.llama(tie_word_embeddings=False).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[ROW, 0] = value
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama(tmp_path_factory.mktemp("broken") / "src")


def _cli(*args: str) -> object:
    return CliRunner().invoke(app, list(args))


def _assert_failed_certificate(out: Path) -> dict[str, object]:
    """The certificate of a broken source: verdict fail, the tensor named, the probes the
    baseline could not answer listed, coverage counting them; valid against the schema."""
    on_disk = json.loads((out / CERTIFICATE_NAME).read_text())
    errors = list(Draft202012Validator(json.loads(SCHEMA.read_text())).iter_errors(on_disk))
    assert not errors, [e.message for e in errors]
    assert on_disk["verdict"] == "fail"
    assert on_disk["source"]["nonfinite"] == {
        "": [{"tensor": TENSOR, "nan": 1, "inf": 0, "by_design": False}]
    }
    assert any("not finite" in f and TENSOR in f for f in on_disk["failures"])
    [component] = on_disk["components"]
    unjudged = component["inputs"]["unjudged"]
    assert unjudged and not set(unjudged) & set(component["inputs"]["probes"])
    [coverage] = [m for m in measurements(on_disk["metrics"]) if m.metric == "coverage"]
    judged = len(component["inputs"]["probes"])
    assert coverage.value is not None
    assert coverage.value <= judged / (judged + len(unjudged)) + 1e-9
    assert not coverage.passed
    assert any(all(p in n for p in unjudged) for n in on_disk["notes"])
    assert "not finite" in (out / "README.md").read_text()
    return on_disk


def test_model_refuses_a_broken_source(broken: Path, tmp_path: Path) -> None:
    before = tree_digest(broken)
    result = _cli("model", str(broken), "--to", "bf16-safe", "-o", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert_one_error_line(result.stderr, TENSOR, "1 NaN", "--allow-nonfinite-source")
    assert list(tmp_path.iterdir()) == []  # no output, no staging, no lock
    assert tree_digest(broken) == before


def test_model_with_the_override_fails_the_certificate(broken: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _cli(
        "model", str(broken), "--to", "bf16-safe", "-o", str(out), "--coverage", "quick",
        "--allow-nonfinite-source",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    _assert_failed_certificate(out)


def test_validate_against_a_broken_baseline(broken: Path, tmp_path: Path) -> None:
    """An output of the broken source: validating it against that source is refused (the
    output untouched), and with the override it fails."""
    out = tmp_path / "out"
    convert(broken, to="bf16", output=out, validate=False, allow_nonfinite_source=True)
    before = tree_digest(out)
    refused = _cli("validate", str(out), "--baseline", str(broken), "--coverage", "quick")
    assert refused.exit_code == 2, refused.output
    assert_one_error_line(refused.stderr, TENSOR, "--allow-nonfinite-source")
    assert tree_digest(out) == before
    allowed = _cli(
        "validate", str(out), "--baseline", str(broken), "--coverage", "quick",
        "--allow-nonfinite-source",
    )  # fmt: skip
    assert allowed.exit_code == 1, allowed.output
    _assert_failed_certificate(out)


def test_library_call_and_pickle_source(tmp_path: Path) -> None:
    """``pc.convert`` raises the same refusal for a ``.bin`` source (read through
    ``torch.load``), an Inf this time; with the override it certifies nothing."""
    src = _llama(tmp_path / "src", float("-inf"))
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")
    with pytest.raises(InputError, match=rf"{TENSOR} \(1 ±inf\)"):
        convert(src, to="bf16", output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = convert(
        src, to="bf16", output=tmp_path / "out", coverage="quick", allow_nonfinite_source=True
    )
    assert result.certificate.verdict == "fail"
    assert result.certificate.source["nonfinite"][""][0]["inf"] == 1


def test_the_read_hashes_and_checks_in_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks far smaller than the tensors (a tensor spans many, a block several tensors'
    edges): the digest is the file's sha256 and every non-finite value is counted once. A
    causal-mask buffer of -inf is by design; a mask holding NaN, or a weight holding inf, is
    not; large finite values are not mistaken for inf."""
    src = _llama(tmp_path / "src")
    weights = src / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.causal_mask"] = torch.full((4, 4), float("-inf")).triu(1)
    tensors["model.layers.1.self_attn.causal_mask"] = torch.tensor([0.0, float("nan")])
    # Finite, though its sum overflows float32: counted, and found clean.
    tensors["model.layers.0.big"] = torch.full((8,), 3e38)
    norm = tensors["model.norm.weight"]
    norm[-3:] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    save_file(tensors, weights, metadata={"format": "pt"})
    monkeypatch.setattr(finite, "BLOCK_BYTES", 24)
    read = finite.read_source(src, {"": open_source(src)})
    assert read.files == {"model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()}
    found = {t.tensor: (t.nan, t.inf, t.by_design) for t in read.nonfinite[""]}
    assert found == {
        TENSOR: (1, 0, False),
        "model.layers.0.self_attn.causal_mask": (0, 6, True),
        "model.layers.1.self_attn.causal_mask": (1, 0, False),
        "model.norm.weight": (1, 2, False),
    }
    line = read.broken_line()
    assert line is not None and "(3 tensors)" in line and "causal_mask (1 NaN)" in line
    assert "layers.0.self_attn.causal_mask" not in line


def test_a_mask_by_design_is_reported_not_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    torch.manual_seed(0)
    _models.llama(tie_word_embeddings=False).eval().save_pretrained(src)
    weights = src / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.causal_mask"] = torch.full((4, 4), float("-inf")).triu(1)
    save_file(tensors, weights, metadata={"format": "pt"})
    read = finite.read_source(src, {"": open_source(src)})
    read.refuse_broken(src, allow=False)  # nothing to refuse
    assert [t.by_design for t in read.nonfinite[""]] == [True]


def test_a_smoke_check_of_an_output_with_inf_is_no_broken_source(tmp_path: Path) -> None:
    """A plain fp16 output whose weight overflowed to inf is what a smoke check finds, not a
    broken source: ``validate`` without ``--baseline`` runs and fails, it refuses nothing."""
    src = _llama(tmp_path / "src", 1e6)  # finite in fp32, inf in fp16
    out = tmp_path / "out"
    convert(src, to="fp16", output=out, validate=False)
    assert finite.read_source(out, {"": open_source(out)}).broken()  # the inf is there
    result = _cli("validate", str(out), "--coverage", "quick")
    assert result.exit_code == 1, result.output
    on_disk = json.loads((out / CERTIFICATE_NAME).read_text())
    assert on_disk["verdict"] == "fail" and on_disk["source"]["nonfinite"] == {}
    assert not any("source's own weights" in f for f in on_disk["failures"])


def test_batch_entry(broken: Path, tmp_path: Path) -> None:
    """A batch entry of the broken source fails before writing; one with
    ``allow_nonfinite_source = true`` runs and fails its certificate."""
    (tmp_path / "batch.toml").write_text(
        f"""
[defaults]
to = ["bf16"]
output_dir = "out"
coverage = "quick"

[[model]]
source = "{broken}"
name = "refused"

[[model]]
source = "{broken}"
name = "allowed"
allow_nonfinite_source = true
"""
    )
    run = _batch.run(tmp_path)
    results = run.results()
    refused, allowed = results["refused-bf16"], results["allowed-bf16"]
    assert refused["status"] == "failed" and refused["reason"].startswith("convert: ")
    assert TENSOR in refused["reason"] and "--allow-nonfinite-source" in refused["reason"]
    assert not (run.output_dir / "refused-bf16").exists()
    assert allowed["status"] == "failed" and allowed["verdict"] == "fail", allowed
    assert "Traceback" not in run.stderr
