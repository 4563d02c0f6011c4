"""``precision-convert model SOURCE --to TARGET``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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
    byte_progress,
    emit_json,
    reported_errors,
)
from precision_convert.cli.validate import require_pass
from precision_convert.conversion.io.source import local_directory
from precision_convert.conversion.plan import check_target
from precision_convert.core.dtypes import MEASURED_TARGETS, SAFE_TARGETS, TARGETS


def targets_help() -> str:
    """``--to``'s help, read from the target table: the safe targets, then the plain casts."""
    plain = [name for name in TARGETS if name not in SAFE_TARGETS]
    return f"{', '.join(SAFE_TARGETS)}, {' or '.join(plain)} (plain cast)."


def model(
    source: Annotated[
        str,
        typer.Argument(metavar="SOURCE", help="Model/pipeline/OpenCLIP directory or Hub repo id."),
    ],
    to: Annotated[
        str,
        typer.Option("--to", metavar="TARGET", help=targets_help()),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            metavar="DIR",
            help="Output directory (default: ./<source>-<target>).",
        ),
    ] = None,
    revision: Annotated[
        str | None,
        typer.Option(metavar="REV", help="Hub revision (branch, tag or commit) of SOURCE."),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            metavar="NAME|FILE", help="Recipe name or TOML file (default: matched by class)."
        ),
    ] = None,
    keep_fp32: Annotated[
        list[str] | None,
        typer.Option(
            "--keep-fp32",
            metavar="PATTERN",
            help="Also keep modules matching PATTERN in fp32 (repeatable; * = one name "
            "component, ** = any run of them).",
        ),
    ] = None,
    calibrate: Annotated[
        bool | None,
        typer.Option(
            "--calibrate/--no-calibrate",
            help="Run the model in fp32 to find islands no recipe names (default: on for "
            f"{' and '.join(MEASURED_TARGETS)} only).",
            show_default=False,
        ),
    ] = None,
    calibration_data: CalibrationDataOption = None,
    inputs: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            metavar="FILE",
            help="safetensors file of named inputs that replaces validation's built probes "
            "(pipelines: '<component>/<argument>').",
        ),
    ] = None,
    coverage: CoverageOption = None,
    budget: BudgetOption = None,
    validate: Annotated[
        bool, typer.Option("--validate/--no-validate", help="Certify parity against fp32.")
    ] = True,
    device: DeviceOption = "auto",
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing output directory.")
    ] = False,
    trust_remote_code: Annotated[
        bool,
        typer.Option("--trust-remote-code", help="Allow the model's own code (auto_map) to run."),
    ] = False,
    allow_nonfinite_source: AllowNonfiniteSourceOption = False,
    allow_unexercised: AllowUnexercisedOption = None,
    variant: Annotated[
        str | None,
        typer.Option(
            "--variant",
            metavar="NAME",
            help="Write the weights under the Hub's variant names (model.NAME.safetensors…) "
            "and keep the source's configs unchanged, so the output can be added to the "
            "source repo (push it there: a variant pull request) and loaded with "
            "from_pretrained(..., variant=NAME).",
        ),
    ] = None,
    push: Annotated[
        str | None,
        typer.Option(
            "--push",
            metavar="REPO_ID",
            help="After a passing certificate, publish the output to this Hub repo "
            "(see `precision-convert push`).",
        ),
    ] = None,
    create_pr: Annotated[
        bool, typer.Option("--create-pr", help="With --push: open a pull request.")
    ] = False,
    private: Annotated[
        bool, typer.Option("--private", help="With --push: create the repo private.")
    ] = False,
    report: ReportOption = ReportLevel.summary,
    verbose: VerboseOption = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON result.")] = False,
) -> None:
    """Convert a checkpoint to TARGET and (by default) certify it against the fp32 baseline."""
    if push is not None and not validate:
        with reported_errors():
            from precision_convert.core.errors import InputError

            raise InputError("--push needs a certificate: drop --no-validate")
    with reported_errors():  # torch loads here: a Ctrl-C meanwhile still gets its line
        check_target(to)  # cheap checks first: bad input is said before the heavy imports
        local_directory(source, revision)
        from precision_convert.api.conversion import convert, default_output
        from precision_convert.api.options import ConversionOptions
        from precision_convert.cli._reports import (
            note_uncertified,
            note_unvalidated,
            print_certificate,
            print_conversion,
        )
        from precision_convert.core.errors import CannotValidateError

    target = output if output is not None else default_output(source, to)
    before = _inode(target)

    def on_disk() -> str:
        return interrupted_output(target, before, source, push)

    # One handler from the first write to the last line printed: a Ctrl-C while the report
    # prints still says what is on disk.
    with reported_errors(on_disk):
        with byte_progress("converting", not json_output, verbose) as progress:
            try:
                options = ConversionOptions(
                    revision=revision,
                    recipe=recipe,
                    keep_fp32=tuple(keep_fp32 or ()),
                    calibrate=calibrate,
                    calibration_data=calibration_data,
                    inputs=inputs,
                    coverage=coverage,
                    budget=budget,
                    device=None if device == "auto" else device,
                    trust_remote_code=trust_remote_code,
                    allow_nonfinite_source=allow_nonfinite_source,
                    allow_unexercised=tuple(allow_unexercised or ()),
                    variant=variant,
                )
                result = convert(
                    source,
                    to,
                    output,
                    validate=validate,
                    options=options,
                    overwrite=overwrite,
                    on_progress=progress,
                )
            except CannotValidateError:  # the output is written, with a failing certificate
                note_unvalidated(target)
                raise
        if json_output:
            emit_json(result.to_json())
        else:
            print_conversion(result, full=report == "full")
        if not validate:
            note_uncertified(result.output, source)
        if result.certificate is not None:
            if not json_output:
                print_certificate(result.certificate, result.output, full=report == "full")
            calibrated = all(c.calibration is not None for c in result.components)
            require_pass(result.certificate, result.output, calibrated=calibrated)
            if push is not None:
                from precision_convert.cli.push import push_and_report

                push_and_report(
                    result.output,
                    push,
                    create_pr=create_pr,
                    private=private or None,
                    with_url=True,
                )


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def interrupted_output(target: Path, before: int | None, source: str, push: str | None) -> str:
    """What an interrupted ``model`` run left at ``target``, looked up after the fact.

    The output is staged, validated there and renamed into place whole with its certificate,
    so ``target`` is either as it was (``before``: its inode when the run started) or this
    run's complete output (without a certificate only under ``--no-validate``).
    """
    from precision_convert.validation.certify.certificate import Certificate, certificate_files

    now = _inode(target)
    if now is None:
        return f"nothing was written ({target} does not exist)"
    if now == before:
        return f"{target} is as it was: nothing of this run was kept"
    found = certificate_files(target)
    if not found:
        return (
            f"{target} holds the converted weights, not certified: "
            f"precision-convert validate {target} --baseline {source}"
        )
    verdict = Certificate.read(target).verdict
    held = f"{target} holds the converted model and {found[0]} (verdict {verdict})"
    if push is not None and verdict == "pass":
        held += f"; the push may not have finished: precision-convert push {target} {push}"
    return held
