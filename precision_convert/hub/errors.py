"""What the Hub answered, in this project's words (one line each, never the token), and whether a
token may push at all before a batch runs."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from precision_convert.core.errors import (
    HubAuthError,
    HubPermissionError,
    InputError,
    PrecisionConvertError,
    PushFailed,
    first_line,
)
from precision_convert.core.hub_client import (
    MAX_RETRY_WAIT_VARIABLE,
    WaitTooLong,
    clock,
    max_retry_wait,
    retry_after,
)
from precision_convert.core.units import duration


def check_write_access(
    pushes: Iterable[tuple[str, bool]], *, token: str | None = None, endpoint: str | None = None
) -> str:
    """Before a batch runs anything that would end in these pushes: a token the Hub accepts,
    with write access, and for each push that is not a pull request a namespace its user may
    create repos in. ``pushes``: ``(repo_id, opens a pull request)``. Returns the user.

    Raises:
        HubAuthError: no token, or the Hub rejected it.
        HubPermissionError: a read-only token, or repos in namespaces the user does not own.
    """
    from huggingface_hub import HfApi, get_token

    targets = list(pushes)
    secret = token or get_token()
    if not secret:
        raise HubAuthError(
            f"the manifest pushes ({targets[0][0]}…) and there is no Hugging Face token: set "
            "HF_TOKEN or log in (hf auth login) with a token that can write"
        )
    with hub_errors(targets[0][0], "main", secret):
        identity = HfApi(endpoint=endpoint, token=secret).whoami()
    user = str(identity["name"])
    if _role(identity) == "read":
        raise HubPermissionError(
            "the manifest pushes and this token is read-only: use one with write access "
            "(HF_TOKEN, or hf auth login); nothing was run"
        )
    mine = {user, *_organizations(identity)}
    foreign = sorted({r for r, proposes in targets if not proposes and r.split("/")[0] not in mine})
    if foreign:
        raise HubPermissionError(
            f"{', '.join(foreign)}: {user} may create repos only in {', '.join(sorted(mine))}; "
            "push there, or set create_pr = true to propose the files to an existing repo; "
            "nothing was run"
        )
    return user


def _role(identity: Mapping[str, Any]) -> str | None:
    """The token's role from whoami: ``read``, ``write`` or ``fineGrained``."""
    return identity.get("auth", {}).get("accessToken", {}).get("role")


def _organizations(identity: Mapping[str, Any]) -> list[str]:
    return [o["name"] for o in identity.get("orgs", []) if isinstance(o, dict) and "name" in o]


def retry_wait_limit() -> float:
    """The longest wait before a retry that a push may make (``PRECISION_CONVERT_MAX_RETRY_WAIT``),
    read before anything is sent, so a bad value is refused as bad input rather than met
    mid-push.

    Raises:
        InputError: not a number of seconds.
    """
    try:
        return max_retry_wait()
    except ValueError as exc:
        raise InputError(str(exc)) from None


@dataclass
class HubErrors:
    """What :func:`_translate` needs to word an error: the repo, the revision asked for, the
    token to scrub, and for a 403 what the push was doing and for whom (set as it goes on)."""

    repo_id: str
    revision: str
    token: str
    user: str | None = None  # once whoami answered
    proposes: bool = False  # the push opens or updates a pull request
    identity: Mapping[str, Any] = field(default_factory=dict)  # whoami's answer
    creating: bool = False  # the request in flight creates the repo


@contextmanager
def hub_errors(repo_id: str, revision: str, token: str) -> Iterator[HubErrors]:
    """Turn whatever huggingface_hub or its HTTP client raises into one of our errors: one
    line, naming the repo, never the token."""
    errors = HubErrors(repo_id, revision, token)
    try:
        yield errors
    except PrecisionConvertError:
        raise
    except Exception as exc:
        raise _translate(exc, errors) from None


def _forbidden_hint(
    repo_id: str, user: str, proposes: bool, identity: Mapping[str, Any], *, creating: bool
) -> str:
    """What to do about a 403 on this push: it depends on the token, the namespace and the
    step (--create-pr helps only where the repo exists: a pull request needs no write access
    to the repo's namespace, creating a repo does)."""
    if _role(identity) == "read":
        return "this token is read-only: use one with write access (HF_TOKEN, or hf auth login)"
    namespace, name = repo_id.split("/", 1)
    if namespace in {user, *_organizations(identity)}:
        return f"use a token with write access to {namespace}"
    foreign = f"{namespace} is neither your namespace ({user}) nor one of your organizations"
    if creating:
        return f"{foreign}: push to {user}/{name} instead"
    if proposes:
        return f"{foreign}, and its pull requests are closed to {user}"
    return f"{foreign}: --create-pr proposes the files as a pull request instead"


def _translate(exc: Exception, errors: HubErrors) -> PrecisionConvertError:
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalTokenNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, branch, token = errors.repo_id, errors.revision, errors.token
    # The client wraps a failed LFS upload ("Error while uploading 'x'"): the cause says why.
    where = ""
    if isinstance(exc, RuntimeError) and exc.__cause__ is not None:
        match = re.search(r"uploading '([^']+)'", str(exc))
        where = f" while uploading {match[1]}" if match else ""
        exc = exc.__cause__  # type: ignore[assignment]

    def scrub(text: str) -> str:
        return text.replace(token, "***") if token else text

    def said(error: BaseException) -> str:  # what the Hub answered, in one line
        message = getattr(error, "server_message", None) or str(error)
        return scrub(first_line(str(message)) or type(error).__name__)

    if isinstance(exc, WaitTooLong):
        return PushFailed(
            f"{repo_id}: the Hub answered {exc.status} to {exc.request} asking to wait "
            f"{duration(exc.seconds)}, more than {MAX_RETRY_WAIT_VARIABLE} allows "
            f"({exc.maximum:g} s); run push again after {clock(exc.seconds)}: files the Hub "
            "already holds are not uploaded twice",
            status=exc.status,
            retry_after=exc.seconds,
        )
    if isinstance(exc, LocalTokenNotFoundError):
        return HubAuthError("no Hugging Face token: set HF_TOKEN or log in (hf auth login)")
    if isinstance(exc, RevisionNotFoundError):
        return InputError(
            f"{repo_id}: {branch!r} is not a branch; --revision takes a branch name or refs/pr/N"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return InputError(f"{repo_id}: no such model repo on the Hub, or this token cannot see it")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        after = retry_after(exc.response.headers.get("Retry-After"))
        if status == 401:
            return HubAuthError(
                "the Hub rejected the token (401 Unauthorized): set HF_TOKEN to a valid token "
                "or log in again (hf auth login)"
            )
        if status == 403:
            refused = "the Hub would not create it" if errors.creating else "cannot write to it"
            hint = "use a token with write access to it"
            if errors.user is not None:
                hint = _forbidden_hint(
                    repo_id, errors.user, errors.proposes, errors.identity, creating=errors.creating
                )
            return HubPermissionError(f"{repo_id}: {refused} (403 Forbidden: {said(exc)}); {hint}")
        if status in (409, 412):
            return PushFailed(
                f"{repo_id}: {branch!r} moved while pushing ({said(exc)}); nothing was "
                "committed: run push again",
                status=status,
                retry_after=after,
            )
        if status == 429 or status >= 500:
            return PushFailed(
                f"{repo_id}: the Hub answered {status}{where} and did not recover (the client "
                "retries what it can); run push again later: files it already holds are not "
                "uploaded twice",
                status=status,
                retry_after=after,
            )
        return PushFailed(
            f"{repo_id}: the Hub refused the push{where} ({status}: {said(exc)})",
            status=status,
            retry_after=after,
        )
    if isinstance(exc, ValueError) and "README.md" in str(exc):
        return PushFailed(
            f"{repo_id}: the Hub refused the card's metadata ({said(exc)})", status=400
        )
    return PushFailed(
        f"{repo_id}: the push did not complete{where} ({type(exc).__name__}: {said(exc)}); "
        "run push again to resume"
    )
