"""Publishing a converted directory to the Hugging Face Hub: only what its certificate covers.

:func:`push` (``pc.push``, ``precision-convert push``, ``model … --push``) runs in two stages:

1. **The gate** (:func:`check`: the one verifier,
   :func:`~precision_convert.validation.certify.verify.verify`, that ``batch --resume`` and
   ``validate --verify`` use too), local and offline. It reads the certificate
   (``precision_certificate.json``, or ``precision_certificate.<variant>.json`` for an output
   written with ``--variant``), hashes every file it is about to upload — the bytes, never a
   name such as a Hub-cache blob's — and refuses (:class:`~precision_convert.errors.PushRefused`,
   exit 1) unless the verdict is ``pass`` and every file matches: each changed, missing or
   extra file is named. The card (``README.md``) is regenerated from the certificate and must be
   identical, so a hand-edited card is refused too. Nothing is sent when the gate refuses.
2. **The upload**, through ``huggingface_hub.HfApi`` in one of two shapes:

   - *new repo*: ``create_repo(exist_ok=True)`` and one commit holding every file (on the
     branch, or in a pull request with ``create_pr``);
   - *variant PR*: when the output was written with ``--variant`` and ``repo_id`` is the source
     repo its certificate records, a pull request adding only the variant-named weights and
     ``precision_certificate.<variant>.json`` (the source's own weights, configs and card are
     never touched), with the parity summary and the card in its description.

   What is uploaded is exactly what the gate hashed: files up to a block (8 MiB) are read once
   and sent from memory; larger ones are read again through :class:`CertifiedReader`, which
   checks every block against the digest the gate took of it before handing it to the client,
   so a file changed in between is refused (nothing committed, its new bytes never sent).
   Streams take the Hub's HTTP (LFS) upload path rather than Xet's, which would read the file
   itself, outside this check.

   The commit names the branch head it was built on (``parent_commit``), so a branch that moves
   meanwhile is an error rather than an overwrite. An open pull request with the same title by
   the same user is updated instead of opening another; ``revision="refs/pr/N"`` commits into
   open pull request N, as huggingface_hub takes it. Uploads go through huggingface_hub's
   preupload and LFS machinery: the Hub reports the objects it already holds and the client
   skips them, so a push that was interrupted uploads only what is missing when run again; the
   client retries 429 and 5xx answers itself.

The token comes from the ``token`` argument, ``HF_TOKEN`` or the user's login, is handed only to
``HfApi``, and is scrubbed from every message this module produces. Errors surface as this
project's: :class:`~precision_convert.errors.HubAuthError` (missing or rejected token),
:class:`~precision_convert.errors.HubPermissionError` (403, with the hint that fits the token,
the namespace and the step), ``InputError`` (bad repo id, a revision that is neither a branch
nor an open pull request), :class:`~precision_convert.errors.PushFailed` (the Hub did not
complete the push) — each one line. :func:`check_write_access` asks the same of a token before
a batch runs anything that would end in pushes.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from precision_convert import interrupts
from precision_convert.conversion.io.hashing import BLOCK_BYTES, HashedFile
from precision_convert.errors import (
    HubAuthError,
    HubPermissionError,
    InputError,
    NotAsCertified,
    PrecisionConvertError,
    PushFailed,
    PushRefused,
)
from precision_convert.validation.certify.card import base_model_id, render_card
from precision_convert.validation.certify.certificate import CARD_NAME
from precision_convert.validation.certify.verify import Verified, is_variant_file, verify

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, HfApi

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: Remote files a new-repo push replaces when its output lacks them: whatever decides what
#: loads (weights, shard indexes, certificates). Documentation and other files are left alone.
_LOAD_BEARING = re.compile(
    r"(\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|onnx|gguf)"
    r"|\.(safetensors|bin)\.index(\.[\w-]+)?\.json"
    r"|(^|/)precision_certificate(\.[\w-]+)?\.json)$"
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
    """The variant-named weight files and index, plus the variant's certificate."""
    assert checked.variant is not None
    found = [p for p in checked.files if is_variant_file(p, checked.variant)]
    return sorted({*found, checked.certificate_name})


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


# --------------------------------------------------------------------------- the upload


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
    if not _REPO_ID.match(repo_id):
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
    with _hub_errors(repo_id, where, secret) as errors:
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
        errors.request, errors.identity = request, identity
        if variant_pr:
            return _variant_pr(request)
        errors.creating = True
        api.create_repo(repo_id, exist_ok=True, private=private)
        errors.creating = False
        return _new_repo(request)


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
    with _hub_errors(targets[0][0], "main", secret):
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
        p for p in remote - set(paths) if _LOAD_BEARING.search(p) and p != ".gitattributes"
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
        if path not in paths and path in remote and not _same(file, remote[path])
    ]
    if differing:
        raise PushRefused(checked.directory, differing)
    variant = checked.variant
    stale = sorted(p for p in remote if is_variant_file(p, variant) and p not in paths)
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
    if ref not in prs:
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
                _addition(checked.files[path], readers) for path in paths
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
        culprit = _changed_file(exc)
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


def _addition(file: HashedFile, readers: ExitStack) -> CommitOperationAdd:
    """The commit operation for ``file``: its bytes as the gate read them, with the certified
    sha256 as the LFS object id (the client never hashes the file again)."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.lfs import UploadInfo

    if file.data is not None:  # small: the very bytes that were hashed
        return CommitOperationAdd(file.path, file.data)
    # Built on the path (which reads nothing), then given the certified stream and upload info:
    # a file object passed in directly would be read whole once more just to hash it.
    add = CommitOperationAdd(file.path, file.location)
    add.path_or_fileobj = readers.enter_context(CertifiedReader(file))
    # The sample (read from the path) only tells text from binary; it is not uploaded.
    add.upload_info = UploadInfo(file.size, add.upload_info.sample, bytes.fromhex(file.sha256))
    return add


class CertifiedReader(io.BufferedIOBase):
    """A large file as the gate hashed it: every block read to upload is checked against the
    digest the gate took of it before any byte of it is handed out, so what is sent is exactly
    what was certified. A changed block raises :class:`ChangedSinceCertified` instead (the
    upload fails, the commit is never made). Reads may come in any order and more than once
    (multipart uploads, retries): each is checked. At most one block is kept in memory, and
    none once the client seeks elsewhere (it rewinds the stream when its upload ends)."""

    def __init__(self, file: HashedFile) -> None:
        super().__init__()
        self.file = file
        self._handle: BinaryIO | None = None
        self._position = 0
        self._index = -1  # the block in memory
        self._block = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.file.size}[whence]
        self._position = max(0, base + offset)
        if self._position // BLOCK_BYTES != self._index:  # the client rewinds after an upload:
            self._block, self._index = b"", -1  # the block is not kept while others upload
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        left = self.file.size - self._position if size is None or size < 0 else size
        pieces = []
        while left > 0 and self._position < self.file.size:
            index, offset = divmod(self._position, BLOCK_BYTES)
            piece = self._load(index)[offset : offset + left]
            pieces.append(piece)
            self._position += len(piece)
            left -= len(piece)
        return b"".join(pieces)

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def _load(self, index: int) -> bytes:
        if index != self._index:
            if self._handle is None:
                self._handle = self.file.location.open("rb")
            self._handle.seek(index * BLOCK_BYTES)
            block = self._handle.read(BLOCK_BYTES)
            expected = self.file.blocks[index] if index < len(self.file.blocks) else b""
            if hashlib.sha256(block).digest() != expected:
                raise ChangedSinceCertified(self.file.path)
            self._block, self._index = block, index
        return self._block

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._block = b""
        super().close()


class ChangedSinceCertified(Exception):
    """A file's bytes changed between the gate and its upload (raised inside the client)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"{path}: changed since certification")


def _changed_file(exc: BaseException) -> str | None:
    """The file named by a :class:`ChangedSinceCertified` somewhere in ``exc``'s chain (the
    client wraps what a read raises: "Error while uploading ...")."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ChangedSinceCertified):
            return current.path
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _same(file: HashedFile, remote: Any) -> bool:
    """Whether a local file equals a Hub tree entry (LFS: sha256; git: blob sha1)."""
    lfs = getattr(remote, "lfs", None)
    if lfs is not None:
        return bool(lfs.sha256 == file.sha256)
    data = file.data if file.data is not None else file.location.read_bytes()
    return bool(remote.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())


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
    at = f" at `{cert.source['revision']}`" if cert.source.get("revision") else ""
    lines = [
        f"Converted with precision-convert {cert.tool.get('version', '')} and certified "
        f"against the source upcast to fp32: verdict **{cert.verdict}**.",
        "",
        f"- target: `{cert.target}` (compute dtype `{cert.compute_dtype}`)",
        f"- source: `{source}`{at}",
        f"- baseline: {cert.baseline.get('dtype')} ({cert.baseline.get('kind')}), "
        f"device {cert.device.get('type')}",
        f"- metrics: {len(cert.metrics)} judged, {failed} outside their bounds",
        f"- files: {len(paths)} in this commit; every file's sha256 is in "
        f"`{checked.certificate_name}`",
    ]
    if cert.failures:
        lines += ["", "Failures:", *(f"- {line}" for line in cert.failures)]
    return "\n".join(lines)


def _card_body(card: str) -> str:
    """The card without its YAML front matter (a PR description renders Markdown only)."""
    match = re.match(r"^---\n.*?\n---\n", card, re.DOTALL)
    return card[match.end() :].strip() if match else card.strip()


# --------------------------------------------------------------------------- errors


@dataclass
class _Errors:
    """What :func:`_translate` needs to word an error: the repo, the revision asked for, the
    token to scrub, and for a 403 what the push was doing and for whom (set as it goes on)."""

    repo_id: str
    revision: str
    token: str
    request: _Request | None = None  # once the token's user is known
    identity: Mapping[str, Any] = field(default_factory=dict)  # whoami's answer
    creating: bool = False  # the request in flight creates the repo


@contextmanager
def _hub_errors(repo_id: str, revision: str, token: str) -> Iterator[_Errors]:
    """Turn whatever huggingface_hub or its HTTP client raises into one of our errors: one
    line, naming the repo, never the token."""
    errors = _Errors(repo_id, revision, token)
    try:
        yield errors
    except PrecisionConvertError:
        raise
    except Exception as exc:
        raise _translate(exc, errors) from None


def _forbidden_hint(request: _Request, identity: Mapping[str, Any], *, creating: bool) -> str:
    """What to do about a 403 on this push: it depends on the token, the namespace and the
    step (--create-pr helps only where the repo exists: a pull request needs no write access
    to the repo's namespace, creating a repo does)."""
    if _role(identity) == "read":
        return "this token is read-only: use one with write access (HF_TOKEN, or hf auth login)"
    namespace, name = request.repo_id.split("/", 1)
    if namespace in {request.user, *_organizations(identity)}:
        return f"use a token with write access to {namespace}"
    foreign = (
        f"{namespace} is neither your namespace ({request.user}) nor one of your organizations"
    )
    if creating:
        return f"{foreign}: push to {request.user}/{name} instead"
    if request.create_pr or request.pull_request is not None:
        return f"{foreign}, and its pull requests are closed to {request.user}"
    return f"{foreign}: --create-pr proposes the files as a pull request instead"


def _translate(exc: Exception, errors: _Errors) -> PrecisionConvertError:
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

    def first_line(error: BaseException) -> str:
        message = getattr(error, "server_message", None) or str(error)
        lines = [line.strip() for line in str(message).splitlines() if line.strip()]
        return scrub(lines[0] if lines else type(error).__name__)

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
        after = _retry_after(exc.response.headers.get("Retry-After"))
        answered = {"status": status, "retry_after": after}
        if status == 401:
            return HubAuthError(
                "the Hub rejected the token (401 Unauthorized): set HF_TOKEN to a valid token "
                "or log in again (hf auth login)"
            )
        if status == 403:
            refused = "the Hub would not create it" if errors.creating else "cannot write to it"
            hint = "use a token with write access to it"
            if errors.request is not None:
                hint = _forbidden_hint(errors.request, errors.identity, creating=errors.creating)
            return HubPermissionError(
                f"{repo_id}: {refused} (403 Forbidden: {first_line(exc)}); {hint}"
            )
        if status in (409, 412):
            return PushFailed(
                f"{repo_id}: {branch!r} moved while pushing ({first_line(exc)}); nothing was "
                "committed: run push again",
                **answered,
            )
        if status == 429 or status >= 500:
            return PushFailed(
                f"{repo_id}: the Hub answered {status}{where} and did not recover (the client "
                "retries what it can); run push again later: files it already holds are not "
                "uploaded twice",
                **answered,
            )
        return PushFailed(
            f"{repo_id}: the Hub refused the push{where} ({status}: {first_line(exc)})",
            **answered,
        )
    if isinstance(exc, ValueError) and "README.md" in str(exc):
        return PushFailed(
            f"{repo_id}: the Hub refused the card's metadata ({first_line(exc)})", status=400
        )
    return PushFailed(
        f"{repo_id}: the push did not complete{where} ({type(exc).__name__}: {first_line(exc)}); "
        "run push again to resume"
    )


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: a number of seconds or an HTTP date."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())
