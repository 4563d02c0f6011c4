"""Metrics, thresholds, certificates and model cards, on hand-made tensors (no models)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from precision_convert.core.errors import CannotValidateError, InputError
from precision_convert.validation.certify.card import render
from precision_convert.validation.certify.certificate import (
    CERTIFICATE_NAME,
    Certificate,
    ComponentRecord,
    LoadPath,
    metric_failures,
    write,
)
from precision_convert.validation.certify.consistency import contradiction
from precision_convert.validation.certify.load_paths import failure_lines
from precision_convert.validation.certify.runner import parse_memory
from precision_convert.validation.certify.verify import hash_files, verify_files
from precision_convert.validation.probe.inputs.layouts import inputs_from_tensors
from precision_convert.validation.probe.run.execute import build_inputs
from precision_convert.validation.probe.run.metrics import (
    Measurement,
    OutputKind,
    compare,
    judge,
    kind_of,
    measure,
)
from precision_convert.validation.probe.run.parity import thresholds_for


def test_identical_outputs_are_perfect() -> None:
    x = torch.randn(2, 8, 16)
    values = compare(x, x.clone(), OutputKind.LOGITS)
    assert values["nonfinite"] == 0 and values["rel_l2"] == 0 and values["kl"] == 0
    assert values["cosine"] == pytest.approx(1.0) and values["top1"] == 1.0


def test_nan_is_fatal_whatever_the_thresholds_say() -> None:
    base = torch.randn(4, 4)
    cand = base.clone()
    cand[0, 0] = math.nan
    values = compare(base, cand, OutputKind.TENSOR)
    loose = {"rel_l2": 1e9, "cosine": -1.0, "nonfinite": 1e9}
    rows = measure("", "forward", "out", values, loose)
    nonfinite = next(r for r in rows if r.metric == "nonfinite")
    assert nonfinite.value == 1 and nonfinite.threshold == 0 and not nonfinite.passed
    assert not next(r for r in rows if r.metric == "rel_l2").passed  # NaN never passes
    assert next(r for r in rows if r.metric == "max_abs").passed  # reported, never judged


def test_logit_metrics_see_a_changed_argmax() -> None:
    base = torch.zeros(1, 4, 10)
    base[..., 3] = 5.0
    cand = base.clone()
    cand[0, :2, 7] = 9.0  # two of four positions now pick another token
    values = compare(base, cand, OutputKind.LOGITS)
    assert values["top1"] == 0.5 and values["kl"] > 1.0
    assert not judge("top1", values["top1"], {"top1": 0.9})[1]


def test_top1_counts_fp32_near_ties_as_agreement() -> None:
    """Two tokens whose fp32 logits differ by 0.01 (probabilities within 1%): half precision
    may pick either, and that is not a different answer; a margin of 1.0 is."""
    base = torch.zeros(1, 4, 10)
    base[..., 3] = 5.0
    base[..., 6] = 4.99
    cand = base.clone()
    cand[0, :, 6] = 5.01  # rounding flips the near-tie everywhere
    assert compare(base, cand, OutputKind.LOGITS)["top1"] == 1.0
    base[..., 6] = 4.0
    cand = base.clone()
    cand[0, :2, 6] = 6.0  # a real change of answer at two positions
    assert compare(base, cand, OutputKind.LOGITS)["top1"] == 0.5


def test_constant_frames_are_fatal_and_psnr_uses_the_baseline_range() -> None:
    base = torch.rand(1, 3, 2, 8, 8)  # (B, C, F, H, W)
    black = base.clone()
    black[:, :, 1] = 0.0  # the second frame turned black in every channel
    values = compare(base, black, OutputKind.IMAGE)
    assert values["constant_frames"] == 3
    threshold, ok = judge("constant_frames", values["constant_frames"], {"constant_frames": 99})
    assert threshold == 0 and not ok  # recipes cannot loosen a fatal check
    noisy = base + 0.001 * torch.randn_like(base)
    assert compare(base, noisy, OutputKind.IMAGE)["psnr"] > 50


def test_output_kinds() -> None:
    assert kind_of("logits", images=False) is OutputKind.LOGITS
    assert kind_of("text_model_output.last_hidden_state", images=False) is OutputKind.TENSOR
    assert kind_of("logits_per_image", images=False) is OutputKind.TENSOR
    assert kind_of("sample", images=True) is OutputKind.IMAGE


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        compare(torch.zeros(2), torch.zeros(3), OutputKind.TENSOR)


def test_thresholds_merge_defaults_task_and_recipe() -> None:
    defaults = thresholds_for("encoder")
    pipeline = thresholds_for("pipeline")
    assert pipeline["psnr"] < defaults["psnr"]  # the pipeline table loosens what compounds
    assert pipeline["top1"] == defaults["top1"]  # and inherits the rest
    tightened = thresholds_for("encoder", {"thresholds": {"rel_l2": 0.01}})
    assert tightened["rel_l2"] == 0.01
    with pytest.raises(InputError, match="unknown validation thresholds"):
        thresholds_for("encoder", {"thresholds": {"rel_l3": 0.1}})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5 GB", 1_500_000_000), ("4096", 4096)],
)
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


def test_parse_memory_rejects_nonsense() -> None:
    with pytest.raises(InputError, match="8GB"):
        parse_memory("lots")


def _certificate(files: dict[str, str], *, verdict: str = "pass") -> Certificate:
    values = {"rel_l2": 0.004, "cosine": 0.99999, "nonfinite": 0.0}
    thresholds = thresholds_for("encoder")
    return Certificate(
        verdict=verdict,
        target="bf16-safe",
        compute_dtype="bfloat16",
        source={"id": "google/flan-t5-small", "revision": "a" * 40, "files": {}},
        baseline={"dtype": "float32", "kind": "source"},
        device={"type": "cpu", "name": "x86_64", "modes": ["whole"]},
        versions={"torch": torch.__version__},
        components=[ComponentRecord("", "T5EncoderModel", "transformers", "encoder", "whole")],
        # As a real certificate measures it: coverage of the model, then its output's metrics.
        metrics=measure("", "forward", "*", {"coverage": 1.0}, thresholds)
        + measure("", "forward", "last_hidden_state", values, thresholds),
        failures=[] if verdict == "pass" else ["forward/last_hidden_state: 3 NaN/Inf values"],
        files=files,
        tool={"name": "precision-convert", "version": "0.1.0"},
        load_paths=[
            LoadPath("", "pc.load", 'precision_convert.load("<repo>")', verdict, True),
            LoadPath("", "plain", 'T5EncoderModel.from_pretrained("<repo>")', "pass", True),
        ],
    )


def test_certificate_round_trip_and_file_check(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    certificate = _certificate(hash_files(tmp_path))
    write(certificate, tmp_path)
    assert CERTIFICATE_NAME not in certificate.files  # never hashes itself
    again = Certificate.read(tmp_path)
    assert again.to_dict() == certificate.to_dict()
    assert verify_files(tmp_path, again) == []
    (tmp_path / "model.safetensors").write_bytes(b"tampered")
    (tmp_path / "extra.txt").write_text("new")
    problems = verify_files(tmp_path, again)
    assert "model.safetensors: changed since certification" in problems
    assert "extra.txt: not covered by the certificate" in problems


def test_a_record_that_does_not_decide_never_changes_the_verdict(tmp_path: Path) -> None:
    """A reported-only measurement (no threshold: its series reads ``deciding: false``)
    recorded as failed, and a failing way of loading that does not decide, give the writer no
    failure line and the reader no contradiction, before and after a round trip."""
    certificate = _certificate({})
    certificate.metrics.append(
        Measurement("", "forward", "last_hidden_state", "max_abs", 3.0, None, "max", False)
    )
    call = 'T5EncoderModel.from_pretrained("<repo>", dtype="auto")'
    certificate.load_paths.append(LoadPath("", "auto", call, "fail", False, detail="differs"))
    assert metric_failures(certificate.metrics) == []
    assert failure_lines(certificate.load_paths) == []
    assert contradiction(certificate) is None
    write(certificate, tmp_path)
    again = Certificate.read(tmp_path)
    series = again.to_dict()["metrics"]["series"]
    assert next(s for s in series if s["metric"] == "max_abs")["deciding"] is False
    assert contradiction(again) is None and again.verdict == "pass"


def test_model_card_yaml_and_table() -> None:
    card = ModelCard(render(_certificate({}), charts=["precision_activations.png"]))
    data = card.data.to_dict()
    assert data["base_model"] == "google/flan-t5-small"
    assert {"bf16", "precision-safe", "parity-certified"} <= set(data["tags"])
    assert data["library_name"] == "transformers"
    assert data["precision_convert"]["verdict"] == "pass"
    assert data["precision_convert"]["target"] == "bf16-safe"
    assert "| `last_hidden_state` | rel_l2 | 0.004 | ≤ 0.1 | ✅ | forward |" in card.text
    assert "![activation ranges of the model](precision_activations.png)" in card.text


def test_failed_card_says_why_and_claims_nothing() -> None:
    card = ModelCard(render(_certificate({}, verdict="fail")))
    assert "parity-certified" not in card.data.tags
    assert "## Why it failed" in card.text and "3 NaN/Inf values" in card.text


def test_an_unknown_module_cannot_be_fed() -> None:
    with pytest.raises(CannotValidateError, match="pass --inputs"):
        build_inputs(torch.nn.Linear(4, 4))


def test_supplied_inputs_must_match_the_signature() -> None:
    from _models import make

    with pytest.raises(CannotValidateError, match="does not take"):
        inputs_from_tensors(make("dit-transformer"), {"bogus": torch.zeros(1)})


def test_spilled_outputs_round_trip_and_keep_nothing_resident(tmp_path: Path) -> None:
    """Inside ``spilled_outputs`` run_probes keeps each probe's outputs in a file: what comes
    back equals what went in (an output under two names, bools, empty results), and probes
    that read earlier outputs still resolve."""
    from precision_convert.validation.probe.run.execute import (
        SpilledOutputs,
        run_probes,
        spilled_outputs,
    )

    store = SpilledOutputs(tmp_path)
    hidden = torch.randn(2, 3)
    store["a"] = {"last": hidden, "states.-1": hidden, "mask": torch.tensor([True, False])}
    store["b"] = {}
    again = store["a"]
    assert torch.equal(again["last"], hidden) and torch.equal(again["states.-1"], hidden)
    assert again["mask"].dtype == torch.bool and store["b"] == {} and list(store) == ["a", "b"]
    del store["b"]
    assert len(store) == 1 and len(list(tmp_path.rglob("*.pt"))) == 1
    # A view writes its own elements only, not the whole buffer it is a slice of.
    logits = torch.randn(1000, 1000)
    store["view"] = {"last_row": logits[-1]}
    assert torch.equal(store["view"]["last_row"], logits[-1])
    assert max(f.stat().st_size for f in tmp_path.rglob("*.pt")) < 100_000

    from _models import make

    model = make("llama")
    inputs = build_inputs(model, seed=0, coverage="quick")
    in_memory = run_probes(model, inputs)
    with spilled_outputs(tmp_path):
        spilled = run_probes(model, inputs)
    assert isinstance(spilled, SpilledOutputs) and list(spilled) == list(in_memory)
    for probe, outputs in in_memory.items():
        assert spilled[probe].keys() == outputs.keys()
        assert all(torch.equal(spilled[probe][k], v) for k, v in outputs.items())


def test_a_candidate_that_fails_to_run_is_an_error_not_a_crash() -> None:
    """pc.load's model raising on the probes (a dtype clash at a boundary, say) becomes one
    certificate failure line naming the component; it is freed all the same."""
    from _models import make

    from precision_convert.validation.certify.whole import _compare_candidate
    from precision_convert.validation.probe.run.execute import run_probes

    class Broken(torch.nn.Module):
        def forward(self, **kwargs: object) -> None:
            raise RuntimeError("mat1 and mat2 must have the same dtype\nmore detail")

    model = make("llama")
    inputs = build_inputs(model, seed=0)
    baseline = run_probes(model, inputs)
    metrics, errors = _compare_candidate(
        Broken, "text_encoder", inputs, baseline, {}, torch.device("cpu")
    )
    assert metrics == [] and errors == [
        "text_encoder: the converted model failed to run: "
        "RuntimeError: mat1 and mat2 must have the same dtype"
    ]
    metrics, _ = _compare_candidate(lambda: model, "", inputs, baseline, {}, torch.device("cpu"))
    assert metrics and all(m.value == 0 or m.metric != "rel_l2" for m in metrics)
