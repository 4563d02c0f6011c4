"""``precision-convert validate CONVERTED [--baseline SOURCE]``: certify parity against fp32."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from precision_convert.cli._common import (
    AllowNonfiniteSourceOption,
    AllowUnexercisedOption,
    BudgetOption,
    CalibrationDataOption,
    CoverageOption,
    DeviceOption,
    ReportLevel,
    ReportOption,
    VerboseOption,
    console,
    emit_json,
    existing_directory,
    literal,
    out_line,
    reported_errors,
    step_progress,
)

if TYPE_CHECKING:
    from precision_convert.validation.certify.certificate import Certificate
    from precision_convert.validation.certify.signing import Key


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
    budget: BudgetOption = None,
    calibration_data: CalibrationDataOption = None,
    trust_remote_code: Annotated[
        bool,
        typer.Option("--trust-remote-code", help="Allow the model's own code (auto_map) to run."),
    ] = False,
    allow_nonfinite_source: AllowNonfiniteSourceOption = False,
    allow_unexercised: AllowUnexercisedOption = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Only check, by sha256, that the files are the ones the certificate "
            "certified (the card regenerated and compared too); runs no model.",
        ),
    ] = False,
    sign: Annotated[
        Path | None,
        typer.Option(
            "--sign",
            metavar="KEY",
            help="Sign the certificate and the files it covers with this elliptic-curve private "
            "key (PEM), offline, once certified: writes precision_certificate.sig (needs the "
            "signing extra). With --verify: sign an output certified already.",
        ),
    ] = None,
    public_key: Annotated[
        Path | None,
        typer.Option(
            "--public-key",
            metavar="FILE",
            help="With --verify: require a signature made with this public key's private half "
            "(PEM); prints its fingerprint.",
        ),
    ] = None,
    report: ReportOption = ReportLevel.summary,
    verbose: VerboseOption = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the certificate as one JSON object.")
    ] = False,
) -> None:
    """Compare a converted model with its fp32 baseline and write precision_certificate.json."""
    with reported_errors():  # torch loads here: a Ctrl-C meanwhile still gets its line
        existing_directory(converted, "validate takes a converted model directory")  # first
        from precision_convert.cli._reports import note_unvalidated, print_certificate
        from precision_convert.core.errors import CannotValidateError
        from precision_convert.validation.certify.runner import validate
        from precision_convert.validation.probe.inputs.budgets import DEFAULT_LEVEL

        key = _key(sign, public_key, verify)

    if verify:
        verify_only(converted, json_output, key)
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
                    budget=budget,
                    trust_remote_code=trust_remote_code,
                    allow_nonfinite_source=allow_nonfinite_source,
                    allow_unexercised=tuple(allow_unexercised or ()),
                    locked=True,
                )
        except CannotValidateError:
            note_unvalidated(converted)
            raise
        if key is not None and certificate.passed:  # only what is certified is signed
            certificate = sign_output(converted, key)
        if json_output:
            emit_json(certificate.to_dict())
        else:
            print_certificate(certificate, converted, full=report == "full")
        require_pass(certificate, converted)


def verify_only(converted: Path, json_output: bool, key: Key | None = None) -> None:
    """``--verify``: the one verifier ``push`` and ``batch --resume`` use too, offline; exit 1
    naming each file at fault (or a verdict other than pass). ``key``: a public key whose
    signature is required (exit 1 without one), or a private key to sign with once verified."""
    from precision_convert.validation.certify import signing
    from precision_convert.validation.certify.verify import verify

    with reported_errors():
        if key is not None and key.private:
            sign_output(converted, key)  # verifies first: only what is certified is signed
        checked = verify(converted)
        if key is not None and not key.private:
            signing.check(checked, key)
    recorded = checked.certificate.signature
    checked_signer = key is not None and not key.private
    if json_output:
        emit_json(
            {
                "verified": True,
                "certificate": checked.certificate_name,
                "verdict": checked.certificate.verdict,
                "files": len(checked.files),
                "signature": recorded and {**recorded, "checked": checked_signer},
            }
        )
        return
    out_line(
        f"verified: {len(checked.files)} files match {checked.certificate_name} "
        f"(verdict {checked.certificate.verdict})"
    )
    if recorded is None:
        out_line("unsigned: the hashes show accidental change, not who wrote the files")
        return
    signer = f"the public key sha256:{recorded['public_key_sha256']}"
    if checked_signer:  # the certificate names the key it is signed with (signing.check)
        out_line(f"signed: {recorded['file']} verifies with {signer}")
    else:
        out_line(
            f"signed: {recorded['file']} (by {signer}, as the certificate says; "
            "--public-key FILE checks it)"
        )


def _key(sign: Path | None, public_key: Path | None, verify: bool) -> Key | None:
    """The key ``--sign`` or ``--public-key`` names, read (exit 2 when unusable), before
    anything runs."""
    from precision_convert.core.errors import InputError
    from precision_convert.validation.certify import signing

    if public_key is not None and not verify:
        raise InputError("--public-key checks a signature: use it with --verify")
    if sign is not None and public_key is not None:
        raise InputError("--sign and --public-key: sign or check a signature, not both at once")
    if sign is not None:
        return signing.private_key(sign)
    return signing.public_key(public_key) if public_key is not None else None


def sign_output(converted: Path, key: Key) -> Certificate:
    """Sign ``converted`` with ``key`` and say so (stderr: stdout holds the report); for
    ``validate --sign`` and ``push --sign``."""
    from precision_convert.validation.certify.signing import sign

    certificate = sign(converted, key)
    signature = (certificate.signature or {}).get("file")
    line = f"signed: {signature} with the key sha256:{key.fingerprint}"
    console.print(literal(line), highlight=False, soft_wrap=True)
    return certificate


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
