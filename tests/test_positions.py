"""Every position of the table reached at a cost that stays linear, and certificates that say
which positions and context lengths were not.

``standard`` coverage runs sequences up to 2048 tokens; a GPT-2 with ``n_positions=4096``
whose position rows overflow fp16 from 2304 on was certified in fp16-safe, and its
certificate never said that positions past 2048 were not fed. Short rows with
``position_ids`` offsets now reach the whole table; the long-context ladder stays as it was,
and the certificate records both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _models
import pytest
import torch

import precision_convert as pc
from precision_convert.api.conversion import convert
from precision_convert.validation.certify.card import render
from precision_convert.validation.certify.runner import validate
from precision_convert.validation.probe.inputs import positions
from precision_convert.validation.probe.inputs.positions import reach
from precision_convert.validation.probe.run.execute import build_inputs

#: First position whose embedding sum overflows fp16, and the table's length.
OVER, LIMIT = 2304, 4096
#: The channel the overflow is built in.
CHANNEL = 5


def far_position_gpt2() -> Any:
    """A GPT-2 of 4096 positions whose embedding sum overflows fp16 from position 2304 only.

    Channel ``CHANNEL`` of every token embedding is raised by 30000 (LayerNorm removes a
    shared offset; fp16 holds 30000) and the position rows from 2304 on by 40000 more: the
    sum reaches 70000 > 65504 at positions no 2048-token ladder feeds. The head is untied so
    the raised channel stays out of the logits. fp32 computes a sane function everywhere.
    """
    torch.manual_seed(0)
    model = _models.gpt2(n_positions=LIMIT, n_layer=1, tie_word_embeddings=False).eval()
    with torch.no_grad():
        model.transformer.wte.weight[:, CHANNEL] += 30000.0
        model.transformer.wpe.weight[OVER:, CHANNEL] += 40000.0
    return model


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("far-positions") / "src"
    far_position_gpt2().save_pretrained(path)
    return path


def _far_run(model: Any) -> torch.Tensor:
    ids = torch.randint(0, 128, (1, OVER + 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_standard_reaches_every_position_and_refuses_plain_fp16(
    source: Path, tmp_path: Path
) -> None:
    convert(source, to="fp16", output=tmp_path / "fp16", validate=False)
    certificate = validate(tmp_path / "fp16", baseline=source)
    assert certificate.verdict == "fail"
    inputs = certificate.components[0].inputs
    kinds = {name: p.get("sweep", {}).get("kind") for name, p in inputs["probes"].items()}
    failing = {m.probe for m in certificate.metrics if not m.passed}
    assert failing and {kinds[p] for p in failing} == {"positions"}, failing
    assert any("NaN/Inf" in line for line in certificate.failures)
    # The ladder is as it was (2048 at standard) and passes; the position rows reach the rest.
    assert (
        max(
            p["sweep"]["length"]
            for p in inputs["probes"].values()
            if p.get("sweep", {}).get("kind") == "length"
        )
        == 2048
    )
    reached = inputs["reach"]
    assert reached["positions"] == {"limit": LIMIT, "reached": LIMIT, "untested": []}
    assert reached["context"] == {"limit": LIMIT, "reached": 2048, "untested": [[2048, 4095]]}
    assert reached["vocabulary"]["untested_ids"] == 0
    card = render(certificate)
    assert "positions reached: 4096 of 4096" in card
    assert "contexts of 2049 to 4096 tokens untested" in card


def test_fp16_safe_keeps_the_position_table_fp32_and_is_right_past_it(
    source: Path, tmp_path: Path
) -> None:
    """Calibration sees the position rows too: the island search keeps ``wpe`` in fp32."""
    result = convert(source, to="fp16-safe", output=tmp_path / "safe")
    assert result.certificate.verdict == "pass", result.certificate.failures
    islands = {i.name: i.reason for i in result.components[0].plan.islands}
    assert islands.get("transformer.wpe") == "range", islands
    reference = _far_run(far_position_gpt2())
    got = _far_run(pc.load(tmp_path / "safe"))
    assert torch.isfinite(got).all()
    past = torch.nn.functional.cosine_similarity(
        got[0, OVER:].flatten(), reference[0, OVER:].flatten(), 0
    )
    assert past >= 0.999


def test_a_certificate_that_did_not_reach_every_position_says_which(
    source: Path, tmp_path: Path
) -> None:
    """``quick`` feeds one 256-token sequence: plain fp16 passes there, and the certificate
    and card say that positions and contexts from 256 on were never fed."""
    convert(source, to="fp16", output=tmp_path / "fp16", validate=False)
    certificate = validate(tmp_path / "fp16", baseline=source, coverage="quick")
    reached = certificate.components[0].inputs["reach"]
    assert reached["positions"]["untested"] == [[256, 4095]]
    assert reached["context"]["untested"] == [[256, 4095]]
    assert "untested: 256–4095" in render(certificate)


def test_position_rows_spread_over_a_table_longer_than_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More positions than the level's probes hold: evenly spread rows (the table's last row
    among them), and the gaps between them recorded, not claimed."""
    monkeypatch.setitem(positions.POSITION_PROBES, "standard", 1)
    model = _models.gpt2(n_positions=16384).eval()
    inputs = build_inputs(model, coverage="standard")
    rows = [p for p in inputs.probes if p.sweep.get("kind") == "positions"]
    assert len(rows) == 1
    ids = rows[0].kwargs["position_ids"]
    assert int(ids.max()) == 16383 and int(ids.min()) == 2048
    assert torch.equal(ids[:, 1:] - ids[:, :-1], torch.ones_like(ids[:, 1:]))  # rows run on
    record = reach(inputs)["positions"]
    assert record["reached"] == 2048 + ids.numel()
    assert record["untested"] and record["untested"][0][0] > 2048


def test_rope_models_take_position_rows_and_trim_their_logits() -> None:
    """A Llama's rope angles are reached the same way; its head keeps the last position's
    logits and every position's hidden states, so a wide vocabulary costs no row per
    position."""
    model = _models.llama(max_position_embeddings=4096).eval()
    inputs = build_inputs(model, coverage="standard")
    rows = [p for p in inputs.probes if p.sweep.get("kind") == "positions"]
    assert rows and all(p.kwargs["logits_to_keep"] == 1 for p in rows)
    assert reach(inputs)["positions"]["untested"] == []


def test_a_model_without_position_ids_says_why_its_positions_were_not_reached() -> None:
    model = _models.t5_encoder().eval()
    record = reach(build_inputs(model, coverage="quick"))["positions"]
    assert record["untested"] == [[256, 511]]
    assert "position_ids" in record["why"]


def test_block_wise_validation_says_which_position_rows_it_ran(
    source: Path, tmp_path: Path
) -> None:
    """Block by block every probe is a pass streaming every block: the position rows are
    fewer, spread to the table's end, and the record says which ran and what they missed."""
    convert(source, to="fp16", output=tmp_path / "fp16", validate=False)
    certificate = validate(tmp_path / "fp16", baseline=source, max_memory="1MB")
    component = certificate.components[0]
    assert component.mode == "blockwise" and certificate.verdict == "fail"
    reached = component.inputs["reach"]
    assert 0 < reached["probes"]["positions"] <= 2
    assert reached["positions"]["untested"] and reached["positions"]["reached"] < LIMIT
    ran = [
        p
        for p in component.inputs["probes"].values()
        if p.get("sweep", {}).get("kind") == "positions"
    ]
    assert max(s + p["sweep"]["row"] for p in ran for s in p["sweep"]["starts"]) == LIMIT
    assert "blockwise validation" in render(certificate)
