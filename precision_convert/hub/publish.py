"""One push: the certificate gate, then the commit in the shape the output asks for (a new repo,
or a pull request adding a variant); see :mod:`precision_convert.hub`."""

from __future__ import annotations

import hashlib
import re
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from precision_convert.conversion.io.hashing import HashedFile
from precision_convert.core import interrupts
from precision_convert.core.errors import (
    HubAuthError,
    InputError,
    NotAsCertified,
    PushRefused,
)
from precision_convert.core.patterns import (
    CERTIFICATE_FILE,
    REPO_ID,
    SIGNATURE_FILE,
    is_variant_file,
    signature_name,
)
from precision_convert.hub.errors import hub_errors
from precision_convert.hub.upload import addition, changed_file, same_content
from precision_convert.validation.certify.card import base_model_id, render_card, stored_in
from precision_convert.validation.certify.card_text import code, escape
from precision_convert.validation.certify.certificate import CARD_NAME
from precision_convert.validation.certify.signing import signature_file
from precision_convert.validation.certify.verify import Verified, verify

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, HfApi


#: Remote files a new-repo push replaces when its output lacks them: whatever decides what
#: loads (weights, shard indexes, certificates; and their signatures, see :func:`_new_repo`).
#: Documentation and other files are left alone.
_LOAD_BEARING = re.compile(
    r"(\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|onnx|gguf)"
    r"|\.(safetensors|bin)\.index(\.[\w-]+)?\.json"
    rf"|(^|/){CERTIFICATE_FILE.pattern})$"
)
#: A branch may be named with or without this prefix.
_HEADS = "refs/heads/"
#: ``--revision refs/pr/N``: an open pull request, as huggingface_hub names its ref.
_PULL_REQUEST = re.compile(r"refs/pr/([1-9][0-9]*)")


@dataclass(frozen=True)
class PushResult:
    """What :func:`push_with_result` did."""

    url: str  # the pull request's URL, or the commit's
    repo_id: str
    shape: str  # "new-repo" or "variant-pr"
    revision: str  # the branch committed to or the PR was opened against
    pull_request: int | None  # the PR's number, when one was opened or updated
    reused_pull_request: bool
    uploaded: list[str]  # paths in the commit (unchanged files are skipped by the Hub client)
    deleted: list[str] = field(default_factory=list)
    changed: bool = True  # False: the branch or PR already held exactly these files
    proposed: bool = False  # a pull request was asked for (or pushed into)


# --------------------------------------------------------------------------- the gate


def check(converted: str | Path) -> Verified:
    """The certificate gate (the one verifier, keeping what the upload needs); offline.

    Raises:
        InputError: ``converted`` is not a directory.
        NotAsCertified: see :func:`~precision_convert.validation.certify.verify.verify`.
    """
    return verify(converted, blocks=True)


def _variant_paths(checked: Verified) -> list[str]:
    """The variant-named weight files and index, plus the variant's certificate (and its
    signature, when signed)."""
    assert checked.variant is not None
    found = [p for p in checked.files if is_variant_file(p, checked.variant)]
    signature = signature_file(checked)
    return sorted({*found, checked.certificate_name, *([signature] if signature else [])})


def _for_repo(checked: Verified, repo_id: str) -> Verified:
    """What is pushed to ``repo_id``: the card the gate verified, rendered again from the same
    certificate with the repo's id in its loading snippet (not a placeholder)."""
    text = render_card(checked.certificate, checked.directory, repo_id)
    files = dict(checked.files)
    if CARD_NAME in files:
        data = text.encode("utf-8")
        sha256 = hashlib.sha256(data).hexdigest()
        files[CARD_NAME] = HashedFile(CARD_NAME, files[CARD_NAME].location, sha256, len(data), data)
    return replace(checked, files=files, card=text)


# --------------------------------------------------------------------------- the commit


def push(
    converted: str | Path,
    repo_id: str,
    create_pr: bool = False,
    private: bool | None = None,
    revision: str | None = None,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Publish a certified directory to the Hub; returns the URL of the commit or the PR.

    Args:
        converted: a directory written and certified by ``precision-convert model``.
        repo_id: ``namespace/name``. The source repo its certificate records, for an output
            written with ``--variant``: a pull request adding the variant. Otherwise a new (or
            existing) repo that receives every file.
        create_pr: open a pull request instead of committing to the branch (an open PR of the
            same title by the same user is updated instead). Always on for a variant PR.
        private: create the repo private (ignored when it exists already).
        revision: the branch to commit to, or to open the PR against (default ``main``); or
            an open pull request to push into, ``refs/pr/N`` (as huggingface_hub takes it).
        token: a Hub token; default ``HF_TOKEN`` or the saved login.
        endpoint: the Hub's URL; default huggingface_hub's (``HF_ENDPOINT``).
        commit_message: the commit's summary (and a new PR's title); default one naming the
            conversion and its verdict.

    Raises:
        PushRefused: the certificate gate refused (see :func:`check`); nothing was sent.
        HubAuthError, HubPermissionError, InputError, PushFailed: see the module docstring.
    """
    return push_with_result(
        converted,
        repo_id,
        create_pr=create_pr,
        private=private,
        revision=revision,
        token=token,
        endpoint=endpoint,
        commit_message=commit_message,
    ).url


def push_with_result(
    converted: str | Path,
    repo_id: str,
    *,
    create_pr: bool = False,
    private: bool | None = None,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """:func:`push`, returning what was done (for the command's report)."""
    if not REPO_ID.fullmatch(repo_id):
        raise InputError(f"{repo_id!r} is not a Hub repo id (namespace/name)")
    branch, pull_request = _revision(revision)
    if pull_request is not None and create_pr:
        raise InputError(
            f"--revision {revision} pushes into that pull request; --create-pr would open "
            "another: drop one of them"
        )
    if commit_message is not None and not commit_message.strip():
        raise InputError("--commit-message is empty")
    try:
        checked = _for_repo(check(converted), repo_id)
    except NotAsCertified as exc:
        raise PushRefused(exc.path, exc.problems) from None
    source_id = base_model_id(checked.certificate)
    variant_pr = checked.variant is not None and repo_id == checked.certificate.source.get("id")
    if not variant_pr and repo_id == source_id and not create_pr and pull_request is None:
        raise InputError(
            f"{repo_id} is the source repo of this conversion: committing would replace its "
            "weights; push to a new repo, pass --create-pr, or convert with --variant to add "
            "the conversion to it as a variant"
        )
    if not variant_pr and CARD_NAME not in checked.files:  # only a variant PR goes without
        raise PushRefused(checked.directory, [f"{CARD_NAME}: missing (a new repo needs its card)"])
    from huggingface_hub import HfApi, get_token

    secret = token or get_token()
    if not secret:
        raise HubAuthError(
            "no Hugging Face token: set HF_TOKEN or log in (hf auth login) with a token that "
            "can write"
        )
    api = HfApi(endpoint=endpoint, token=secret)
    where = revision or "main"
    with hub_errors(repo_id, where, secret) as errors:
        identity = api.whoami()
        request = _Request(
            api,
            checked,
            repo_id,
            branch,
            pull_request,
            str(identity["name"]),
            create_pr or variant_pr,
            commit_message.strip() if commit_message else None,
        )
        errors.user, errors.identity = request.user, identity
        errors.proposes = request.create_pr or request.pull_request is not None
        if variant_pr:
            return _variant_pr(request)
        errors.creating = True
        api.create_repo(repo_id, exist_ok=True, private=private)
        errors.creating = False
        return _new_repo(request)


@dataclass(frozen=True)
class _Request:
    """One push, as asked: where to, by whom, how."""

    api: HfApi
    checked: Verified
    repo_id: str
    branch: str  # the branch to commit to or open the PR against ("" for an existing PR)
    pull_request: int | None  # --revision refs/pr/N: the open PR to push into
    user: str
    create_pr: bool
    message: str | None  # --commit-message

    def title(self, *, variant_pr: bool) -> str:
        return self.message or _title(
            self.checked, self.branch, self.create_pr, variant_pr=variant_pr
        )


def _revision(revision: str | None) -> tuple[str, int | None]:
    """(branch, None) for a branch name (``refs/heads/`` optional), ("", N) for ``refs/pr/N``."""
    name = (revision or "main").removeprefix(_HEADS)
    if match := _PULL_REQUEST.fullmatch(name):
        return "", int(match[1])
    if not name or name.startswith("refs/"):
        raise InputError(
            f"--revision {revision!r} is neither a branch name nor a pull request (refs/pr/N)"
        )
    return name, None


def _new_repo(request: _Request) -> PushResult:
    api, checked = request.api, request.checked
    title = request.title(variant_pr=False)
    paths = sorted(checked.files)
    plan = _target(request, title)
    remote = set(api.list_repo_files(request.repo_id, revision=plan.parent))
    stale = sorted(
        p
        for p in remote - set(paths)
        if (_LOAD_BEARING.search(p) or SIGNATURE_FILE.fullmatch(p)) and p != ".gitattributes"
    )
    description = _summary(checked, paths)
    if stale:
        removed = ", ".join(f"`{p}`" for p in stale)
        description += f"\n- removed: {removed} (what loads is exactly what was certified)"
    return _commit(request, plan, title, description, paths, stale, "new-repo")


def _variant_pr(request: _Request) -> PushResult:
    api, checked, repo_id = request.api, request.checked, request.repo_id
    assert checked.variant is not None
    title = request.title(variant_pr=True)
    paths = _variant_paths(checked)
    plan = _target(request, title)
    remote = {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, revision=plan.parent, recursive=True)
        if hasattr(entry, "blob_id")
    }
    # Files kept from the source (configs, tokenizer) must be what the repo serves: the variant
    # was certified with them, and users of the repo will load it with the repo's own.
    differing = [
        f"{path}: differs from {repo_id}'s (the variant was certified with other files)"
        for path, file in sorted(checked.files.items())
        if path not in paths and path in remote and not same_content(file, remote[path])
    ]
    if differing:
        raise PushRefused(checked.directory, differing)
    variant = checked.variant
    stale = sorted(
        p
        for p in remote
        if (is_variant_file(p, variant) or p == signature_name(variant)) and p not in paths
    )
    description = "\n\n".join([_summary(checked, paths), "---", _card_body(checked.card)])
    return _commit(request, plan, title, description, paths, stale, "variant-pr")


@dataclass(frozen=True)
class _Target:
    """Where the commit goes: a branch, a new PR on a branch, or an open PR's ref."""

    revision: str  # what create_commit is given
    branch: str
    parent: str  # the head the commit is built on
    create_pr: bool
    pull_request: int | None  # an open PR being updated
    pull_request_url: str | None


def _target(request: _Request, title: str) -> _Target:
    api, repo_id = request.api, request.repo_id
    refs = api.list_repo_refs(repo_id, include_pull_requests=True)
    prs = {r.ref: r.target_commit for r in refs.pull_requests or []}
    if request.pull_request is not None:
        return _into_pull_request(request, prs)
    heads = {ref.name: ref.target_commit for ref in refs.branches}
    branch = request.branch
    if branch not in heads:
        raise InputError(
            f"{repo_id}: {branch!r} is not a branch (branches: {', '.join(sorted(heads))}); "
            "--revision takes a branch name or refs/pr/N"
        )
    if request.create_pr:
        for discussion in api.get_repo_discussions(
            repo_id, author=request.user, discussion_type="pull_request", discussion_status="open"
        ):
            if discussion.title == title:
                ref = f"refs/pr/{discussion.num}"
                if ref in prs:
                    return _Target(ref, branch, prs[ref], False, discussion.num, discussion.url)
    return _Target(branch, branch, heads[branch], request.create_pr, None, None)


def _into_pull_request(request: _Request, prs: dict[str, str]) -> _Target:
    """``--revision refs/pr/N``: the open pull request N, whoever opened it."""
    number = request.pull_request
    ref = f"refs/pr/{number}"
    if number is None or ref not in prs:
        raise InputError(f"{request.repo_id}: no pull request #{number} (--revision {ref})")
    details = request.api.get_discussion_details(request.repo_id, number)
    if not details.is_pull_request or details.status != "open":
        raise InputError(
            f"{request.repo_id}: pull request #{number} is {details.status}, not open; push to "
            "a branch, or --create-pr to open another"
        )
    branch = (details.target_branch or "main").removeprefix(_HEADS)
    return _Target(ref, branch, prs[ref], False, number, details.url)


def _commit(
    request: _Request,
    target: _Target,
    title: str,
    description: str,
    paths: list[str],
    stale: list[str],
    shape: str,
) -> PushResult:
    from huggingface_hub import CommitOperationDelete

    api, checked, repo_id = request.api, request.checked, request.repo_id
    try:
        with ExitStack() as readers:  # large files' streams, closed once the commit is made
            operations: list[CommitOperationAdd | CommitOperationDelete] = [
                addition(checked.files[path], readers) for path in paths
            ]
            operations += [CommitOperationDelete(path) for path in stale]
            # A Ctrl-C swallowed on its way up stops the push before its commit.
            interrupts.check()
            info = api.create_commit(
                repo_id,
                operations,
                commit_message=title,
                commit_description=description,
                revision=target.revision,
                create_pr=target.create_pr,
                parent_commit=target.parent,
            )
    except Exception as exc:
        culprit = changed_file(exc)
        if culprit is None:
            raise
        problem = f"{culprit}: changed since certification (found while uploading it)"
        raise PushRefused(checked.directory, [problem]) from None
    changed = info.oid != target.parent
    number = info.pr_num if info.pr_url else target.pull_request
    url = info.pr_url or target.pull_request_url or info.commit_url
    return PushResult(
        url=url,
        repo_id=repo_id,
        shape=shape,
        revision=target.branch,
        pull_request=number,
        reused_pull_request=target.pull_request is not None,
        uploaded=paths,
        deleted=stale,
        changed=changed,
        proposed=request.create_pr or request.pull_request is not None,
    )


def _title(checked: Verified, branch: str, pull_request: bool, *, variant_pr: bool) -> str:
    """The commit summary, which is also the PR's title: stable for the same conversion, so a
    second push finds the PR the first one opened."""
    cert = checked.certificate
    verdict = f"certificate: {cert.verdict}"
    if variant_pr:
        title = f"precision-convert: add the {checked.variant} variant ({cert.target}, {verdict})"
    else:
        source = base_model_id(cert) or Path(str(cert.source.get("id") or "model")).name
        title = f"precision-convert: {cert.target} conversion of {source} ({verdict})"
    return f"{title} into {branch}" if pull_request and branch != "main" else title


def _summary(checked: Verified, paths: list[str]) -> str:
    """The parity summary for the commit (and PR) description."""
    cert = checked.certificate
    failed = sum(not m.passed for m in cert.metrics)
    source = cert.source.get("id") or "the source checkpoint"
    at = f" at {code(cert.source['revision'])}" if cert.source.get("revision") else ""
    stored = stored_in(cert)
    lines = [
        f"Converted with precision-convert {cert.tool.get('version', '')} and certified "
        f"against the source{f' ({stored})' if stored else ''} upcast to fp32: verdict "
        f"**{cert.verdict}**.",
        "",
        f"- target: `{cert.target}` (compute dtype `{cert.compute_dtype}`)",
        f"- source: {code(source)}{at}",
        f"- baseline: {cert.baseline.get('dtype')} ({cert.baseline.get('kind')}), "
        f"device {cert.device.get('type')}",
        f"- metrics: {len(cert.metrics)} judged, {failed} outside their bounds",
        f"- files: {len(paths)} in this commit; every file's sha256 is in "
        f"`{checked.certificate_name}`",
    ]
    if cert.signature is not None:
        lines.append(
            f"- signed: `{cert.signature['file']}` (OpenSSF model-signing), by the key whose "
            f"public half's sha256 is `{cert.signature['public_key_sha256']}`"
        )
    if cert.failures:
        failures = (escape(line, code_spans=True) for line in cert.failures)
        lines += ["", "Failures:", *(f"- {line}" for line in failures)]
    return "\n".join(lines)


def _card_body(card: str) -> str:
    """The card without its YAML front matter (a PR description renders Markdown only)."""
    match = re.match(r"^---\n.*?\n---\n", card, re.DOTALL)
    return card[match.end() :].strip() if match else card.strip()
