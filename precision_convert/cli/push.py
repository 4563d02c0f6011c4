"""``precision-convert push CONVERTED REPO_ID``: publish a certified output to the Hub."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from precision_convert.cli._common import (
    console,
    existing_directory,
    literal,
    out_line,
    reported_errors,
)

if TYPE_CHECKING:
    from precision_convert.hub import PushResult


def push_command(
    converted: Annotated[
        Path,
        typer.Argument(
            metavar="CONVERTED",
            help="A directory written and certified by `precision-convert model`.",
        ),
    ],
    repo_id: Annotated[
        str,
        typer.Argument(
            metavar="REPO_ID",
            help="Hub repo to publish to (namespace/name). The source repo of an output written "
            "with --variant: a pull request adding the variant.",
        ),
    ],
    create_pr: Annotated[
        bool,
        typer.Option(
            "--create-pr",
            help="Open a pull request instead of committing to the branch (re-running updates "
            "the same PR).",
        ),
    ] = False,
    private: Annotated[
        bool, typer.Option("--private", help="Create the repo private (if it does not exist).")
    ] = False,
    revision: Annotated[
        str | None,
        typer.Option(
            metavar="REV",
            help="Branch to commit to, or to open the pull request against (default: main); "
            "or refs/pr/N to push into that open pull request.",
        ),
    ] = None,
    commit_message: Annotated[
        str | None,
        typer.Option(
            "--commit-message",
            metavar="TEXT",
            help="The commit's summary (and a new pull request's title); default: one naming "
            "the conversion and its verdict.",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            metavar="TOKEN",
            help="Hub token with write access (default: HF_TOKEN or your login); never printed.",
            show_default=False,
        ),
    ] = None,
    sign: Annotated[
        Path | None,
        typer.Option(
            "--sign",
            metavar="KEY",
            help="Sign the certificate and the files it covers with this elliptic-curve private "
            "key (PEM) before the upload (as validate --sign does); the signature goes up too.",
        ),
    ] = None,
) -> None:
    """Upload a converted model, only if its certificate passes and matches every file.

    Prints the URL of the commit or pull request on stdout.

    Exit 1: the certificate gate refused (each differing file named; nothing uploaded).

    Exit 2: no token, a rejected token, no write permission, or the Hub did not complete it.
    """

    def on_disk() -> str:
        return (
            f"the push may not have finished; run it again to resume (files the Hub already "
            f"holds are not sent again); {converted} is unchanged"
        )

    with reported_errors():  # before the Hub client and the verifier's imports
        existing_directory(converted, "expected a converted model directory")
    with reported_errors(on_disk):
        if sign is not None:
            _sign_before_push(converted, sign)
        result = push_and_report(
            converted,
            repo_id,
            create_pr=create_pr,
            private=private or None,
            revision=revision,
            commit_message=commit_message,
            token=token,
        )
        out_line(result.url)


def _sign_before_push(converted: Path, key_file: Path) -> None:
    """``--sign``: sign the output as ``validate --sign`` does; what is not certified is
    refused as the push's gate refuses it (nothing signed, nothing uploaded)."""
    from precision_convert.cli.validate import sign_output
    from precision_convert.core.errors import NotAsCertified, PushRefused
    from precision_convert.validation.certify.signing import private_key

    key = private_key(key_file)
    try:
        sign_output(converted, key)
    except NotAsCertified as exc:
        raise PushRefused(exc.path, exc.problems) from None


def push_and_report(
    converted: Path,
    repo_id: str,
    *,
    create_pr: bool = False,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    with_url: bool = False,
) -> PushResult:
    """Push and say what happened on stderr (``with_url``: the URL too, for ``model --push``,
    whose stdout is the conversion's report); for ``push`` and for ``model … --push`` (call it
    inside :func:`~precision_convert.cli._common.reported_errors`, after validation)."""
    from precision_convert.cli._reports import code_note
    from precision_convert.core.errors import PushFailed
    from precision_convert.core.hub_client import RETRIED_STATUSES
    from precision_convert.core.patterns import code_files
    from precision_convert.hub import push_with_result
    from precision_convert.hub.errors import retry_wait_limit

    maximum = retry_wait_limit()
    with _quiet_hub_client(), console.status(f"pushing to {literal(repo_id)}…", spinner="dots"):
        for attempt in range(_WAITED_RETRIES + 1):
            try:
                result = push_with_result(
                    converted,
                    repo_id,
                    create_pr=create_pr,
                    private=private,
                    revision=revision,
                    commit_message=commit_message,
                    token=token,
                )
                break
            except PushFailed as exc:
                # A call the client does not retry (the commit) was told to wait: wait as
                # asked (the client's hook has announced a long wait and refused one beyond
                # the maximum), then resume; what the Hub holds is not sent again.
                wait = exc.retry_after
                asked = exc.status in RETRIED_STATUSES
                if wait is None or not asked or wait > maximum or attempt == _WAITED_RETRIES:
                    raise
                time.sleep(wait)
    line = _report(result) + (f": {result.url}" if with_url else "")
    console.print(literal(line), highlight=False, soft_wrap=True)
    if code := code_files(result.uploaded):
        console.print(code_note(code, "published"), highlight=False, soft_wrap=True)
    return result


#: Pushes resumed after a wait the Hub asked for, before its answer is reported as the error.
_WAITED_RETRIES = 3


def _report(result: PushResult) -> str:
    count = f"{len(result.uploaded)} certified files"
    removed = f", {len(result.deleted)} stale files removed" if result.deleted else ""
    if result.pull_request is None:
        where = f"{result.repo_id}@{result.revision}"
        if not result.changed and result.proposed:
            return (
                f"no pull request opened: {where} already holds these {count}, so there is "
                "nothing to propose"
            )
        if not result.changed:
            return f"nothing to push: {where} already holds these {count}"
        return f"pushed {count} to {where}{removed}"
    what = "variant pull request" if result.shape == "variant-pr" else "pull request"
    where = f"{what} #{result.pull_request} on {result.repo_id} (into {result.revision})"
    if not result.changed:
        return f"nothing to push: the open {where} already holds these {count}"
    verb = "updated" if result.reused_pull_request else "opened"
    return f"{verb} {where}: {count}{removed}"


@contextmanager
def _quiet_hub_client() -> Iterator[None]:
    """huggingface_hub logs each retry and no-op commit as a warning on stderr and draws its
    own upload bars; the command shows one status line and reports one line itself. The
    command owns its process, so it may mute them meanwhile (and restores them after)."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    bars = not are_progress_bars_disabled()
    logger.setLevel(logging.ERROR)
    if bars:
        disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            enable_progress_bars()
