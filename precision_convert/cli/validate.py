"""``precision-convert validate CONVERTED [--baseline SOURCE]``: certify parity against fp32."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from precision_convert.cli._common import (
    AllowNonfiniteSourceOption,
    CalibrationDataOption,
    CoverageOption,
    DeviceOption,
    ReportLevel,
    ReportOption,
    VerboseOption,
    emit_json,
    reported_errors,
    step_progress,
)

if TYPE_CHECKING:
    from precision_convert.validation.certify.certificate import Certificate


def validate_command(
    converted: Annotated[
        Path,
        typer.Argument(
            metavar="CONVERTED", help="A directory written by `precision-convert model`."
        ),
    ],
    baseline: Annotated[
        str | None,
        typer.Option(
            metavar="SOURCE",
            help="The source to certify against (directory or Hub id). Without it, only a "
            "smoke check: the converted weights against themselves upcast to fp32, which "
            "never certifies (verdict smoke-pass at best).",
        ),
    ] = None,
    device: DeviceOption = "auto",
    inputs: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="safetensors file of named tensors to feed instead of the built inputs "
            "(pipelines: <component>/<argument>).",
        ),
    ] = None,
    max_memory: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Memory budget, e.g. 8GB; a model whose fp32 copy does not fit is compared "
            "block by block.",
        ),
    ] = None,
    coverage: CoverageOption = None,
    calibration_data: CalibrationDataOption = None,
    trust_remote_code: Annotated[
        bool,
        typer.Option("--trust-remote-code", help="Allow the model's own code (auto_map) to run."),
    ] = False,
    allow_nonfinite_source: AllowNonfiniteSourceOption = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Only check, by sha256, that the files are the ones the certificate "
            "certified (the card regenerated and compared too); runs no model.",
        ),
    ] = False,
    report: ReportOption = ReportLevel.summary,
    verbose: VerboseOption = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the certificate as one JSON object.")
    ] = False,
) -> None:
    """Compare a converted model with its fp32 baseline and write precision_certificate.json."""
    with reported_errors():  # torch loads here: a Ctrl-C meanwhile still gets its line
        from precision_convert.cli._reports import note_unvalidated, print_certificate
        from precision_convert.core.errors import CannotValidateError
        from precision_convert.validation.certify.runner import validate
        from precision_convert.validation.probe.inputs.budgets import DEFAULT_LEVEL

    if verify:
        verify_only(converted, json_output)
        return

    def on_disk() -> str:
        return f"{converted} is unchanged (a certificate is written only when validation ends)"

    with reported_errors(on_disk):
        try:
            # The certificate and card go into CONVERTED: under the lock every writer of an
            # output takes (locked=True), so neither this run nor a `model --overwrite` (or a
            # batch job) replaces what the other is writing; the later one stops at once.
            with step_progress("validating against fp32", True, verbose):
                certificate = validate(
                    converted,
                    baseline,
                    device,
                    inputs=inputs,
                    max_memory=max_memory,
                    coverage=coverage or DEFAULT_LEVEL,
                    calibration_data=calibration_data,
                    trust_remote_code=trust_remote_code,
                    allow_nonfinite_source=allow_nonfinite_source,
                    locked=True,
                )
        except CannotValidateError:
            note_unvalidated(converted)
            raise
        if json_output:
            emit_json(certificate.to_dict())
        else:
            print_certificate(certificate, converted, full=report == "full")
        require_pass(certificate, converted)


def verify_only(converted: Path, json_output: bool) -> None:
    """``--verify``: the one verifier ``push`` and ``batch --resume`` use too, offline; exit 1
    naming each file at fault (or a verdict other than pass)."""
    from precision_convert.validation.certify.verify import verify

    with reported_errors():
        checked = verify(converted)
    if json_output:
        emit_json(
            {
                "verified": True,
                "certificate": checked.certificate_name,
                "verdict": checked.certificate.verdict,
                "files": len(checked.files),
            }
        )
    else:
        typer.echo(
            f"verified: {len(checked.files)} files match {checked.certificate_name} "
            f"(verdict {checked.certificate.verdict})"
        )


def require_pass(certificate: Certificate, converted: Path, *, calibrated: bool = True) -> None:
    """Raise CheckFailed (exit 1) saying why, unless the verdict is pass (a smoke check is
    not a certification, whatever it found). ``calibrated``: whether the conversion measured
    the model for islands (a failing safe conversion that did not is told how to)."""
    from precision_convert.core.dtypes import Target
    from precision_convert.core.errors import CheckFailed

    why = certificate.why_not_certified(converted)  # None: passed
    if why is not None:
        target = Target.lookup(certificate.target)
        if certificate.verdict == "fail" and target is not None and not target.safe:
            safe = target.with_islands
            why += f"; a plain cast keeps nothing in fp32, --to {safe} keeps what needs it"
        elif certificate.verdict == "fail" and target is not None and not calibrated:
            why += (
                "; the recipe's islands were not enough: --calibrate measures the model and "
                f"keeps in fp32 what {target.compute.short} gets wrong"
            )
        raise CheckFailed(f"{converted}: not certified: {why}")
