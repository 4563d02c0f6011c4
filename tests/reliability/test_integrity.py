"""Certificate integrity beyond ``tests/test_push.py``'s seven tamper kinds (a shard byte, a
config key, an added file, a removed file, no certificate, a failing verdict, the card): a
renamed shard, a certificate edited to cover a changed file, files inside a pipeline's
component folders, and hidden files (neither certified nor uploaded, so no way to smuggle a
file into a repo). Each change is caught by ``validate --verify`` and by ``push`` (nothing sent
to the Hub), both naming the file. So is a certificate whose records contradict its ``pass``
(with its card re-rendered and every hash right), which ``pc.load`` warns of and the card
does not repeat; and a hostile source folder name reaches the card escaped.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import _certificates
import _harness
import pytest
import torch
from _fake_hub import FakeHub
from test_push import TOKEN, USER, _one_line_error, _online, _push

from precision_convert.validation.certify.certificate import CERTIFICATE_NAME, Certificate


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        server.add_token(TOKEN, USER)
        yield server


@pytest.fixture
def online(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    _online(monkeypatch, hub, tmp_path / "hf-home")
    hub.requests.clear()
    return hub


def _caught(output: Path, hub: FakeHub, culprit: str) -> None:
    """``validate --verify`` and ``push`` both refuse ``output``, naming ``culprit``."""
    verified = _harness.run_in_process(["validate", str(output), "--verify"])
    _one_line_error(verified, 1, culprit, "not as certified")
    done = _push(str(output), "ns/refused")
    _one_line_error(done, 1, culprit, "push refused")
    assert hub.requests == []  # the gate runs before anything talks to the Hub


def _rename_weights(out: Path) -> str:
    (out / "model.safetensors").rename(out / "model-renamed.safetensors")
    return "model-renamed.safetensors"


def _certificate_covers_a_change(out: Path) -> str:
    """The weights changed and the certificate's hash updated to match; the card, which the
    certificate renders, was not: the card gives it away."""
    import hashlib

    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    certificate = json.loads((out / CERTIFICATE_NAME).read_text())
    certificate["files"]["model.safetensors"] = hashlib.sha256(bytes(data)).hexdigest()
    certificate["metrics"]["series"][0]["value"][0] = 0.0  # and a prettier number
    (out / CERTIFICATE_NAME).write_text(json.dumps(certificate, indent=2) + "\n")
    return "README.md"


def _weights_replaced_by_a_link(out: Path) -> str:
    """A link to a file with other bytes: hashed through the link."""
    other = out.parent / "other.safetensors"
    data = bytearray((out / "model.safetensors").read_bytes())
    data[100] ^= 0xFF
    other.write_bytes(bytes(data))
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").symlink_to(other)
    return "model.safetensors"


@pytest.mark.parametrize(
    "tamper",
    [_rename_weights, _certificate_covers_a_change, _weights_replaced_by_a_link],
    ids=["renamed-shard", "certificate-edited", "weights-link"],
)
def test_tampering_is_caught(
    tamper: Callable[[Path], str], tmp_path: Path, sources: _harness.Sources, online: FakeHub
) -> None:
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    _harness.verify(output)
    _caught(output, online, tamper(output))


def test_hidden_files_are_neither_certified_nor_uploaded(
    tmp_path: Path, sources: _harness.Sources, online: FakeHub
) -> None:
    """``.git``/``.cache`` style paths are skipped by the hashes and by the upload alike: a
    hidden file cannot ride along into the repo."""
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    (output / ".cache").mkdir()
    (output / ".cache" / "payload.bin").write_bytes(b"smuggled")
    (output / ".env").write_text("SECRET=1\n")

    _harness.verify(output)
    done = _push(str(output), "ns/hidden")
    assert done.exit_code == 0, done.output
    pushed = online.files("ns/hidden")
    assert not [name for name in pushed if name.startswith(".") and name != ".gitattributes"]
    assert b"smuggled" not in b"".join(pushed.values())


# -- a whole pipeline: files in component folders ----------------------------------------------


@pytest.fixture(scope="module")
def certified_pipeline(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[[str], Path]
) -> Path:
    output = tmp_path_factory.mktemp("pipeline") / "sd-bf16"
    done = _harness.run_in_process(
        [
            "model",
            str(tiny_model("sd-pipeline")),
            "--to",
            "bf16",
            *_harness.QUICK,
            "-o",
            str(output),
        ]
    )
    assert done.exit_code == 0, done.stderr
    return output


def _component_weights_byte(out: Path) -> str:
    name = "unet/diffusion_pytorch_model.safetensors"
    data = bytearray((out / name).read_bytes())
    data[-2] ^= 0x01
    (out / name).write_bytes(bytes(data))
    return name


def _component_config_key(out: Path) -> str:
    name = "vae/config.json"
    config = json.loads((out / name).read_text())
    config["force_upcast"] = not config.get("force_upcast", False)
    (out / name).write_text(json.dumps(config))
    return name


def _copied_component_file(out: Path) -> str:
    name = next(p for p in sorted((out / "tokenizer").iterdir()) if p.is_file())
    name.write_bytes(name.read_bytes() + b"\n")
    return name.relative_to(out).as_posix()


def _scheduler_config(out: Path) -> str:
    name = next((out / "scheduler").glob("*.json"))
    name.write_text(name.read_text().replace("}", ', "beta_end": 0.5}', 1))
    return name.relative_to(out).as_posix()


def _file_added_to_a_component(out: Path) -> str:
    (out / "text_encoder" / "extra.safetensors").write_bytes(b"x")
    return "text_encoder/extra.safetensors"


def _component_file_removed(out: Path) -> str:
    (out / "text_encoder" / "config.json").unlink()
    return "text_encoder/config.json"


def _pipeline_index(out: Path) -> str:
    index = json.loads((out / "model_index.json").read_text())
    index["requires_safety_checker"] = False
    (out / "model_index.json").write_text(json.dumps(index))
    return "model_index.json"


PIPELINE_TAMPERS = [
    _component_weights_byte,
    _component_config_key,
    _copied_component_file,
    _scheduler_config,
    _file_added_to_a_component,
    _component_file_removed,
    _pipeline_index,
]


@pytest.mark.parametrize("tamper", PIPELINE_TAMPERS, ids=[t.__name__[1:] for t in PIPELINE_TAMPERS])
def test_pipeline_tampering_is_caught(
    tamper: Callable[[Path], str], tmp_path: Path, certified_pipeline: Path, online: FakeHub
) -> None:
    output = tmp_path / "out"
    shutil.copytree(certified_pipeline, output)
    _harness.verify(output)
    _caught(output, online, tamper(output))


# -- a certificate that contradicts itself -----------------------------------------------------


@pytest.mark.parametrize("old_format", [False, True], ids=["marked", "before-the-marks"])
@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_certificates.every_record_failed, "is marked failed"),
        (_certificates.coverage_dropped, "its coverage measurement is missing"),
        (_certificates.plain_load_dropped, "the record of the plain load is missing"),
    ],
    ids=["every-record-failed", "coverage-missing", "plain-load-missing"],
)
def test_a_pass_its_records_contradict_is_refused(
    edit: _certificates.Edit,
    named: str,
    old_format: bool,
    tmp_path: Path,
    sources: _harness.Sources,
    online: FakeHub,
) -> None:
    """The verdict left ``pass``, the card re-rendered, every hash right: only the records
    say otherwise, and ``validate --verify`` and ``push`` both refuse, naming the first record
    at fault and the command that certifies the files again (a certificate from before the
    ``deciding`` marks is judged by the same rule)."""
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    edits = [edit, _certificates.marks_stripped] if old_format else [edit]
    data = _certificates.rewrite(output, *edits)
    assert data["verdict"] == "pass"
    _caught(output, online, CERTIFICATE_NAME)
    refused = _harness.run_in_process(["validate", str(output), "--verify"])
    line = _one_line_error(refused, 1, "verdict 'pass' contradicted by its own records", named)
    assert f"precision-convert validate {output} --baseline SOURCE" in line
    if edit is _certificates.every_record_failed:
        assert f"{_certificates.first_deciding(data)} 1e+09" in line


def test_a_consistent_certificate_from_before_the_marks_is_accepted(
    tmp_path: Path, sources: _harness.Sources
) -> None:
    """``deciding`` and ``not_covered`` are derived for a certificate without them: it reads,
    verifies and renders the same card as with them."""
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    card = (output / "README.md").read_text()
    _certificates.rewrite(output, _certificates.marks_stripped)
    _harness.verify(output)
    assert (output / "README.md").read_text() == card
    assert Certificate.read(output).not_covered is None  # not recorded: derived when judged


def test_a_deciding_mark_that_hides_a_measurement_is_refused(
    tmp_path: Path, sources: _harness.Sources
) -> None:
    """Marking a series ``deciding: false`` cannot take a failed measurement out of the
    verdict: the mark must agree with the series' threshold."""
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    (output / "README.md").unlink()
    path = output / CERTIFICATE_NAME
    data = json.loads(path.read_text())
    series = next(s for s in data["metrics"]["series"] if s["metric"] == "rel_l2")
    series.update(deciding=False, passed=[False] * len(series["passed"]))
    path.write_text(json.dumps(data))
    refused = _harness.run_in_process(["validate", str(output), "--verify"])
    _one_line_error(refused, 1, "is marked deciding: false, but its threshold decides")


def test_pc_load_warns_in_one_line_and_loads(tmp_path: Path, sources: _harness.Sources) -> None:
    """``pc.load`` loads the weights of a contradicting certificate, as of any directory, and
    says in one warning line that nothing certifies them; a consistent one loads silently."""
    import warnings

    import precision_convert as pc
    from precision_convert.core.quiet import PrecisionConvertWarning

    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        reference = pc.load(output)
    assert not [w for w in said if issubclass(w.category, PrecisionConvertWarning)]

    data = _certificates.rewrite(output, _certificates.every_record_failed)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loaded = pc.load(output)
    [warning] = [w for w in said if issubclass(w.category, PrecisionConvertWarning)]
    text = str(warning.message)
    assert "\n" not in text and CERTIFICATE_NAME in text, text
    assert "contradicted by its own records" in text and "loaded anyway" in text
    assert _certificates.first_deciding(data) in text
    expected = reference.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name])


def test_the_card_claims_no_pass_its_records_contradict(
    tmp_path: Path, sources: _harness.Sources
) -> None:
    """The card of the report's certificate: not certified, why, no parity tag, no way of
    loading said to match fp32 (the report's card read "✅ matches fp32 (cosine ≥ 1000000000)")."""
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    assert "**certified**" in (output / "README.md").read_text()
    _certificates.rewrite(output, _certificates.every_record_failed)
    card = (output / "README.md").read_text()
    header, body = card.split("\n---\n", 1)
    assert "verdict: fail" in header and "parity-certified" not in header
    assert "**certified" not in body and "✅ matches fp32" not in body
    assert "**not certified**: its verdict `pass` is contradicted by its own records" in body
    assert "❌ contradicts its own metrics" in body


def test_a_hostile_folder_name_is_escaped_in_the_card(
    tmp_path: Path, sources: _harness.Sources
) -> None:
    """A source folder whose name sets the terminal title, turns the text red and carries an
    HTML tag: the card shows it with its control characters as escapes and the tag as text
    (the YAML header quotes it); the files still verify (the card is what the certificate
    renders)."""
    name = "\x1b]0;pwned\x07\x1b[31m<img src=x onerror=alert(1)>[x](javascript:y)`|"
    source = tmp_path / name
    shutil.copytree(sources.llama, source)
    output = tmp_path / "out"
    done = _harness.run_in_process(["model", str(source), *_harness.VALIDATE, "-o", str(output)])
    assert done.exit_code == 0, done.stderr
    card = (output / "README.md").read_text()
    body = card.split("\n---\n", 1)[1]
    assert not [c for c in card if ord(c) < 32 and c != "\n"]  # no control byte at all
    assert "<img" not in body and "[x](javascript" not in body
    shown = (
        "\\x1b\\]0;pwned\\x07\\x1b\\[31m&lt;img src=x onerror=alert(1)&gt;"
        "\\[x\\](javascript:y)&#96;\\|"
    )
    assert f"# bf16 conversion of {shown}\n" in body
    assert f"against the source ({shown})" in body
    _harness.verify(output)
