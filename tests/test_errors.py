"""Every error class exits the command with its own code, and ``one_line`` is the one way an
exception becomes a line of a message."""

from __future__ import annotations

import errno
import io
from pathlib import Path

import pytest
import typer
from rich.console import Console

import precision_convert.core.errors as errors
from precision_convert.cli._common import encodable, literal, reported_errors
from precision_convert.core.errors import one_line, printable
from precision_convert.validation.certify.certificate import Certificate

#: One instance of every error class, with the exit code the command gives it.
EXITS: list[tuple[errors.PrecisionConvertError, int]] = [
    (errors.PrecisionConvertError("base"), 2),
    (errors.InputError("bad flag", "src"), 2),
    (errors.UnsafeCheckpointError("pickle runs code", "model.bin"), 2),
    (errors.FileSystemError(OSError(errno.ENOSPC, "No space left", "out/model.safetensors")), 2),
    (errors.OutputExistsError("out"), 2),
    (errors.CannotBuildModel("rejected", "config.json", "hidden_size"), 2),
    (errors.WeightsDoNotMap("fused", "src"), 2),
    (errors.CertificateError("format 9, not 3", "out"), 2),
    (errors.HubAuthError("no token"), 2),
    (errors.HubPermissionError("403"), 2),
    (errors.PushFailed("lost", status=503), 2),
    (errors.CheckFailed("parity not met"), 1),
    (errors.CannotValidateError("no inputs"), 1),
    (errors.NotAsCertified("out", ["a: changed"]), 1),
    (errors.PushRefused("out", ["a: changed"]), 1),
    (errors.ChangedSinceCertified("model.safetensors"), 1),
]


def test_every_error_class_has_its_exit_code_checked() -> None:
    defined = {
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, errors.PrecisionConvertError)
    }
    assert {type(error) for error, _ in EXITS} == defined


@pytest.mark.parametrize(("error", "code"), EXITS, ids=lambda v: type(v).__name__)
def test_the_command_exits_with_the_error_s_code_and_one_line(
    error: errors.PrecisionConvertError, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(typer.Exit) as exited, reported_errors():
        raise error
    assert exited.value.exit_code == code
    assert capsys.readouterr().err == f"precision-convert: {error}\n"


def test_one_line_names_foreign_errors_and_keeps_ours_as_they_are() -> None:
    assert one_line(RuntimeError("\n  shapes differ \nsee below")) == "RuntimeError: shapes differ"
    assert one_line(ValueError("expected one of:\n  a, b\nmore")) == (
        "ValueError: expected one of: a, b"
    )
    assert one_line(KeyError()) == "KeyError"
    assert one_line(errors.InputError("no such file", "x")) == "x: no such file"
    assert one_line(errors.CheckFailed("")) == "CheckFailed"


def test_reading_several_certificates_is_refused_as_the_verifier_refuses(tmp_path: Path) -> None:
    for name in ("precision_certificate.json", "precision_certificate.fp16.json"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(errors.CertificateError) as refused:
        Certificate.read(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}: more than one certificate "
        "(precision_certificate.fp16.json, precision_certificate.json)"
    )


def test_data_in_markup_prints_as_it_is_with_its_control_characters_escaped() -> None:
    """``literal``: the one way data enters a line of rich markup."""
    name = "a\x1b[31m\x07[red]b[/bold]\u202e"
    console = Console(record=True, file=io.StringIO(), width=200)
    console.print(f"[green]{literal(name)}[/]")
    assert console.export_text() == "a\\x1b[31m\\x07[red]b[/bold]\\u202e\n"
    assert printable(literal(name)) == literal(name)  # no control character is left


def test_text_a_stream_cannot_encode_is_spelled_in_ascii() -> None:
    assert encodable("a → b — ≤ 0.1 ✗ …", "utf-8") == "a → b — ≤ 0.1 ✗ …"
    assert encodable("a → b — ≤ 0.1 ✗ …", "ascii") == "a -> b - <= 0.1 x ..."
    assert encodable("modèle → x", "ascii") == "mod\\xe8le -> x"
    assert encodable("modèle → x", "latin-1") == "modèle -> x"
    assert encodable("→", "no-such-encoding") == "->"
