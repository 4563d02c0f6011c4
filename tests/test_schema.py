"""The JSON that scripts read is what docs/json-schema.md documents.

``inspect --json``, ``model --json`` and ``precision_certificate.json`` are validated against
the JSON Schema files in docs/schema/. The schemas close every object whose keys are ours
(``additionalProperties: false``), so a field added, renamed or retyped without updating the
documentation fails here.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator, ValidationError

from precision_convert.api.conversion import convert
from precision_convert.api.inspection import inspect_source
from precision_convert.core.errors import CertificateError, CheckFailed
from precision_convert.validation.certify.certificate import CERTIFICATE_NAME

SCHEMAS = Path(__file__).resolve().parents[1] / "docs" / "schema"


def _validator(name: str) -> Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _assert_valid(name: str, payload: dict[str, Any]) -> None:
    errors = sorted(_validator(name).iter_errors(payload), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


@pytest.fixture(scope="module")
def converted(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An fp16-safe conversion (calibrated, validated): both the result and a certificate."""
    out = tmp_path_factory.mktemp("schema") / "llama-fp16-safe"
    return convert(tiny_model("llama"), to="fp16-safe", output=out, coverage="quick")


def test_model_json_matches_its_schema(converted: Any) -> None:
    payload = json.loads(json.dumps(converted.to_json(), default=str))  # as emit_json writes it
    assert payload["schema"] == "precision-convert/conversion/1"
    assert payload["components"][0]["calibration"] is not None  # the calibrated shape is checked
    _assert_valid("conversion", payload)
    with pytest.raises(ValidationError):  # the schema is closed: undocumented keys fail
        _validator("conversion").validate({**payload, "undocumented": 1})


def test_certificate_matches_its_schema(converted: Any) -> None:
    payload = json.loads((converted.output / CERTIFICATE_NAME).read_text(encoding="utf-8"))
    assert payload["schema"] == "precision-convert/certificate/3"
    assert payload["load_paths"] and payload["metrics"]
    _assert_valid("certificate", payload)
    broken = {**payload, "verdict": "maybe"}
    with pytest.raises(ValidationError):
        _validator("certificate").validate(broken)


def test_a_version_2_certificate_reads_as_it_did(converted: Any, tmp_path: Path) -> None:
    """Schema 2 wrote ``metrics`` as a flat list of measurements: such a certificate is read
    (its measurements the same, in the order schema 3 stores them) and verifies its files."""
    import shutil

    from precision_convert.validation.certify.certificate import Certificate
    from precision_convert.validation.certify.verify import verify

    copy = tmp_path / "old"
    shutil.copytree(converted.output, copy)
    current = Certificate.read(copy)
    payload = json.loads((copy / CERTIFICATE_NAME).read_text(encoding="utf-8"))
    flat = [m.to_dict() for m in current.metrics]
    payload |= {"schema": "precision-convert/certificate/2", "metrics": flat}
    (copy / CERTIFICATE_NAME).write_text(json.dumps(payload, indent=2) + "\n")
    old = Certificate.read(copy)
    assert old.metrics == current.metrics and len(flat) > 10
    assert old.verdict == current.verdict == "pass"
    verify(copy)  # the card regenerated from it is the card on disk
    payload["metrics"][0] = {"value": 1}  # a malformed row is named, not a traceback
    (copy / CERTIFICATE_NAME).write_text(json.dumps(payload))
    with pytest.raises(CertificateError, match="metrics"):
        Certificate.read(copy)


def test_inspect_json_matches_its_schema(tiny_model: Any, tmp_path: Path) -> None:
    report = inspect_source(
        tiny_model("t5-encoder"), calibrate=True, chart=tmp_path / "chart.png", coverage="quick"
    )
    payload = json.loads(json.dumps(report.to_json(), default=str))
    assert payload["schema"] == "precision-convert/inspect/1"
    assert payload["components"][0]["calibration"] is not None
    _assert_valid("inspect", payload)


def test_inspect_json_of_a_converted_model_matches_its_schema(converted: Any) -> None:
    """A converted model's record and its tied head are part of the documented report."""
    payload = json.loads(json.dumps(inspect_source(converted.output).to_json(), default=str))
    component = payload["components"][0]
    assert component["record"]["plan_sha256"] == converted.components[0].plan.sha256
    assert component["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    _assert_valid("inspect", payload)


def test_a_certificate_is_read_back_against_its_schema(converted: Any, tmp_path: Path) -> None:
    """What a reader trusts is what the schema describes: a field of the wrong kind, an
    unknown one or another format version is refused by name, and push refuses it."""
    from precision_convert.hub import check
    from precision_convert.validation.certify.certificate import Certificate, CertificateError

    payload = json.loads((converted.output / CERTIFICATE_NAME).read_text(encoding="utf-8"))
    assert Certificate.from_dict(payload).passed
    wrong_mode = json.loads(json.dumps(payload))
    wrong_mode["components"][0]["mode"] = "eyeballed"
    for broken, says in (
        (wrong_mode, "components/0/mode: 'eyeballed' is not one of"),
        ({**payload, "reviewed_by": "me"}, "'reviewed_by' was unexpected"),
        ({**payload, "verdict": 1}, "verdict: 1 is not one of"),
        ({**payload, "schema": "precision-convert/certificate/9"}, "another version"),
    ):
        with pytest.raises(CertificateError, match=re.escape(says)):
            Certificate.from_dict(broken)
    out = tmp_path / "out"
    shutil.copytree(converted.output, out)
    (out / CERTIFICATE_NAME).write_text(json.dumps(wrong_mode), encoding="utf-8")
    with pytest.raises(CheckFailed, match=r"unreadable \(components/0/mode"):
        check(out)
