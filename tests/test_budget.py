"""A certificate's time budget (``--budget``): durations read as people write them, a budget
below the model's smallest certificate refused before the sweep, and probes a tight budget
cannot afford left out, listed as not covered in the certificate, ``--json``, the report and
the card, never claimed by the verdict."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from precision_convert.batch.manifest import read_manifest
from precision_convert.cli.main import app
from precision_convert.core.errors import InputError
from precision_convert.core.units import parse_duration
from precision_convert.validation.certify.certificate import Certificate
from precision_convert.validation.certify.consistency import BUDGET, contradiction
from precision_convert.validation.probe.inputs.budgets import CAUGHT_FIRST
from precision_convert.validation.probe.run import time_budget


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("2m30s", 150), ("1.5h", 5400)],
)
def test_durations_read_as_people_write_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10", "", "ten minutes", "1d", "-5m", "0s", "m"])
def test_a_bad_budget_is_one_line_and_exit_2(text: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)
    done = CliRunner().invoke(app, ["validate", str(tmp_path), "--budget", text])
    assert done.exit_code == 2, done.output
    assert done.stderr.count("\n") == 1, done.stderr
    assert "--budget" in done.stderr and "duration" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_manifest_budget_is_checked_with_the_other_keys(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    manifest = tmp_path / "batch.toml"
    manifest.write_text(
        '[defaults]\nto = "bf16-safe"\nbudget = "ten minutes"\n\n[[model]]\nsource = "src"\n'
    )
    with pytest.raises(InputError, match=r"budget.*not a duration"):
        read_manifest(manifest)
    manifest.write_text(
        '[defaults]\nto = "bf16-safe"\nbudget = "10m"\n\n[[model]]\nsource = "src"\n'
    )
    assert read_manifest(manifest).jobs[0].options.budget == "10m"


def test_a_budget_below_the_smallest_certificate_is_refused_with_its_estimate(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The layout's probe and one probe of each kind, on fp32 and the deciding loads: a
    budget that cannot hold them is refused in one line naming the estimate, exit 2, and
    nothing is written."""
    out = tmp_path / "out"
    done = CliRunner().invoke(
        app,
        [
            *("model", str(tiny_model("t5-encoder")), "--to", "bf16-safe", "-o", str(out)),
            *("--coverage", "quick", "--budget", "0.1s"),
        ],
    )
    assert done.exit_code == 2, done.output
    errors = [line for line in done.stderr.splitlines() if not line.startswith("progress: ")]
    assert len(errors) == 1, done.stderr
    assert "--budget 0.1 s is below the smallest certificate of this model, about " in errors[0]
    assert not out.exists()


def test_a_tight_budget_leaves_probes_out_and_every_reader_is_told(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kind's probe timed at 100 s (the model's probes themselves run for real): the
    smallest certificate fits 1h25m, the whole sweep does not. What was left out is listed
    in the certificate's not_covered (why "budget"), in model --json, in the report and in
    the card's first lines; the consistency rule accepts the pass, which says it is limited."""
    monkeypatch.setattr(time_budget, "_timed", lambda *args: 100.0)
    monkeypatch.setattr(time_budget, "_block_seconds", lambda *args: 1.0)  # pace 1: no noise
    out = tmp_path / "out"
    command = ["model", str(tiny_model("t5-encoder")), "--to", "bf16-safe", "-o", str(out)]
    done = CliRunner().invoke(app, [*command, "--coverage", "quick", "--budget", "1h25m", "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    left = [item for item in result["not_covered"] if item["why"] == BUDGET]
    assert left and all("probe(s) not run" in item["what"] for item in left), result

    certificate = Certificate.from_dict(
        json.loads((out / "precision_certificate.json").read_text())
    )
    assert certificate.verdict == "pass" and contradiction(certificate) is None
    assert [i for i in certificate.not_covered or () if i["why"] == BUDGET] == left
    budget = certificate.components[0].inputs["budget"]
    assert budget["seconds"] == 5100 and budget["left_out"]
    assert budget["minimum_seconds"] <= 5100 < budget["estimate_seconds"] + 800
    recorded = certificate.components[0].inputs["probes"]
    assert not set(budget["left_out"]) & set(recorded)  # left out: not run, not recorded
    kinds = [p.get("sweep", {}).get("kind") for p in recorded.values()]
    assert set(budget["left_out_kinds"]) <= set(kinds)  # one probe of each kind still ran
    # the kinds kept come in the order of what they caught
    ranks = [CAUGHT_FIRST.index(k) for k in kinds if k in CAUGHT_FIRST]
    assert ranks == sorted(ranks), kinds

    card = (out / "README.md").read_text().split("---", 2)[2]
    first = "\n".join(card.strip().splitlines()[:6])
    assert "**Not a full certificate**: coverage limited by --budget 85 min" in first, first
    assert "coverage: limited by --budget (see not_covered)" in (out / "README.md").read_text()

    report = CliRunner().invoke(app, ["validate", str(out), "--verify"])
    assert report.exit_code == 0, report.output  # the card regenerates from the certificate
    printed = CliRunner().invoke(
        app, [*command, "--coverage", "quick", "--budget", "1h25m", "--overwrite"]
    )
    lines = printed.stdout.splitlines()
    assert any(line.startswith("not covered: model: ") for line in lines), printed.stdout
    assert any(line.startswith("verdict: pass, coverage limited by --budget") for line in lines), (
        printed.stdout
    )
