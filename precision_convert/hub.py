"""Publishing a converted directory to the Hugging Face Hub: only what its certificate covers.

:func:`push` (``pc.push``, ``precision-convert push``, ``model … --push``) runs in two stages:

1. **The gate** (:func:`check`), local and offline. It reads the certificate
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

   The commit names the branch head it was built on (``parent_commit``), so a branch that moves
   meanwhile is an error rather than an overwrite. An open pull request with the same title by
   the same user is updated instead of opening another. Uploads go through huggingface_hub's
   preupload and LFS machinery: the Hub reports the objects it already holds and the client
   skips them, so a push that was interrupted uploads only what is missing when run again; the
   client retries 429 and 5xx answers itself.

The token comes from the ``token`` argument, ``HF_TOKEN`` or the user's login, is handed only to
``HfApi``, and is scrubbed from every message this module produces. Errors surface as this
project's: :class:`~precision_convert.errors.HubAuthError` (missing or rejected token),
:class:`~precision_convert.errors.HubPermissionError` (403), ``InputError`` (bad repo id, a
revision that is no branch), :class:`~precision_convert.errors.PushFailed` (the Hub did not
complete the push) — each one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.errors import (
    HubAuthError,
    HubPermissionError,
    InputError,
    NotAsCertified,
    PrecisionConvertError,
    PushFailed,
    PushRefused,
)
from precision_convert.validation.certify.card import CHART_NAME, base_model_id, render
from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    CERTIFICATE_FILE,
    CERTIFICATE_NAME,
    Certificate,
)

if TYPE_CHECKING:
    from huggingface_hub import HfApi

#: Files up to this size are read whole: the bytes hashed are then the very bytes sent.
_IN_MEMORY_BYTES = 8 * 1024 * 1024
_HASH_THREADS = min(8, os.cpu_count() or 1)
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


@dataclass(frozen=True)
class LocalFile:
    """One file of the converted directory, hashed from its bytes."""

    path: str  # relative POSIX path, the path in the repo
    location: Path
    sha256: str
    size: int
    data: bytes | None  # the content for small files: what was hashed is what is sent


@dataclass(frozen=True)
class Checked:
    """What passed the gate: the certificate, its variant and every file, hashed."""

    directory: Path
    certificate: Certificate
    certificate_name: str
    variant: str | None
    files: dict[str, LocalFile]
    card: str  # the card text (README.md, or rendered when a variant output has none)

    def variant_paths(self) -> list[str]:
        """The variant-named weight files and index, plus the variant's certificate."""
        found = [p for p in self.files if self.variant and is_variant_file(p, self.variant)]
        return sorted({*found, self.certificate_name})


@dataclass(frozen=True)
class PushResult:
    """What :func:`publish` did."""

    url: str  # the pull request's URL, or the commit's
    repo_id: str
    shape: str  # "new-repo" or "variant-pr"
    revision: str  # the branch committed to or the PR was opened against
    pull_request: int | None  # the PR's number, when one was opened or updated
    reused_pull_request: bool
    uploaded: list[str]  # paths in the commit (unchanged files are skipped by the Hub client)
    deleted: list[str] = field(default_factory=list)
    changed: bool = True  # False: the branch or PR already held exactly these files


def is_variant_file(path: str, variant: str) -> bool:
    """``model.<v>.safetensors``, ``model.<v>-00001-of-00002.safetensors``,
    ``model.safetensors.index.<v>.json`` (and the same for diffusers' names, in any folder)."""
    name = path.rsplit("/", 1)[-1]
    v = re.escape(variant)
    return bool(
        re.fullmatch(rf".+\.{v}(-\d+-of-\d+)?\.safetensors", name)
        or re.fullmatch(rf".+\.safetensors\.index\.{v}\.json", name)
    )


# --------------------------------------------------------------------------- the gate


def check(converted: str | Path) -> Checked:
    """The certificate gate: hash every file and compare it with the certificate; offline.

    Raises:
        InputError: ``converted`` is not a directory.
        NotAsCertified: no certificate, a verdict other than ``pass``, a changed, missing or
            extra file, or a card that is not the one the certificate renders.
    """
    directory = Path(converted)
    if not directory.is_dir():
        raise InputError("no such directory: push takes a converted model directory", directory)
    paths = _listing(directory)
    names = [p for p in paths if "/" not in p and CERTIFICATE_FILE.fullmatch(p)]
    if not names:
        raise NotAsCertified(
            directory,
            [
                f"{CERTIFICATE_NAME}: missing (certify the output against its source first: "
                f"precision-convert validate {directory} --baseline SOURCE)"
            ],
        )
    if len(names) > 1:
        raise NotAsCertified(directory, [f"more than one certificate ({', '.join(sorted(names))})"])
    certificate_name = names[0]
    variant = CERTIFICATE_FILE.fullmatch(certificate_name)["variant"]  # type: ignore[index]
    try:
        certificate = Certificate.from_dict(
            json.loads((directory / certificate_name).read_text(encoding="utf-8"))
        )
    except (OSError, ValueError, TypeError, KeyError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NotAsCertified(directory, [f"{certificate_name}: unreadable ({detail})"]) from None

    problems: list[str] = []
    recorded = certificate.source.get("variant")
    if recorded != variant:
        problems.append(
            f"{certificate_name}: records variant {recorded!r} but is named for {variant!r}"
        )
    if not certificate.passed:
        problems.append(f"{certificate_name}: {certificate.why_not_certified(directory)}")

    files = _hash(directory, paths)
    covered = {p: f for p, f in files.items() if p not in (certificate_name, CARD_NAME)}
    for name in sorted(covered):
        expected = certificate.files.get(name)
        if expected is None:
            problems.append(f"{name}: not covered by the certificate")
        elif expected != covered[name].sha256:
            problems.append(f"{name}: changed since certification")
    problems += [
        f"{name}: missing" for name in sorted(set(certificate.files) - set(covered) - {CARD_NAME})
    ]
    if variant is not None and not any(is_variant_file(p, variant) for p in covered):
        problems.append(f"{certificate_name}: no {variant!r}-variant weight file beside it")

    expected_card = render_card(certificate, directory)
    card_file = files.get(CARD_NAME)
    if card_file is None:
        if variant is None:  # a variant PR never uploads the card; a new repo needs it
            problems.append(f"{CARD_NAME}: missing (it is written with the certificate)")
        card = expected_card
    else:
        card = _content(card_file).decode("utf-8", errors="replace")
        if card != expected_card:
            problems.append(f"{CARD_NAME}: differs from the card the certificate renders")
    if problems:
        raise NotAsCertified(directory, problems)
    return Checked(directory, certificate, certificate_name, variant, files, card)


def render_card(certificate: Certificate, directory: Path, repo_id: str | None = None) -> str:
    """The card :func:`~precision_convert.validation.certify.card.write_card` writes for
    ``certificate`` into ``directory`` (a pure function of both), without writing it; with
    ``repo_id``, the card as pushed there (its loading snippet names the repo)."""
    charts = [p.relative_to(directory).as_posix() for p in sorted(directory.rglob(CHART_NAME))]
    return render(certificate, charts=charts, repo_id=repo_id)


def _for_repo(checked: Checked, repo_id: str) -> Checked:
    """What is pushed to ``repo_id``: the card the gate verified, rendered again from the same
    certificate with the repo's id in its loading snippet (not a placeholder)."""
    text = render_card(checked.certificate, checked.directory, repo_id)
    files = dict(checked.files)
    if CARD_NAME in files:
        data = text.encode("utf-8")
        sha256 = hashlib.sha256(data).hexdigest()
        files[CARD_NAME] = LocalFile(CARD_NAME, files[CARD_NAME].location, sha256, len(data), data)
    return replace(checked, files=files, card=text)


def _listing(directory: Path) -> list[str]:
    """Every file under ``directory`` (relative POSIX paths), minus hidden paths (``.cache``,
    ``.git``), which are neither certified nor uploaded."""
    found = []
    for root, dirs, names in os.walk(directory, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith(".") and os.path.isfile(os.path.join(root, name)):
                found.append(Path(root, name).relative_to(directory).as_posix())
    return found


def _hash(directory: Path, paths: list[str]) -> dict[str, LocalFile]:
    """sha256 of each file's bytes (in parallel: hashlib releases the GIL)."""

    def one(path: str) -> LocalFile:
        location = directory / path
        with location.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= _IN_MEMORY_BYTES:
                data = f.read()
                return LocalFile(path, location, hashlib.sha256(data).hexdigest(), len(data), data)
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        return LocalFile(path, location, digest, size, None)

    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        return {f.path: f for f in pool.map(one, paths)}


def _content(file: LocalFile) -> bytes:
    return file.data if file.data is not None else file.location.read_bytes()


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
        revision: the branch to commit to, or to open the PR against (default ``main``).
        token: a Hub token; default ``HF_TOKEN`` or the saved login.
        endpoint: the Hub's URL; default huggingface_hub's (``HF_ENDPOINT``).

    Raises:
        PushRefused: the certificate gate refused (see :func:`check`); nothing was sent.
        HubAuthError, HubPermissionError, InputError, PushFailed: see the module docstring.
    """
    return publish(
        converted,
        repo_id,
        create_pr=create_pr,
        private=private,
        revision=revision,
        token=token,
        endpoint=endpoint,
    ).url


def publish(
    converted: str | Path,
    repo_id: str,
    *,
    create_pr: bool = False,
    private: bool | None = None,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
) -> PushResult:
    """:func:`push`, returning what was done (for the command's report)."""
    if not _REPO_ID.match(repo_id):
        raise InputError(f"{repo_id!r} is not a Hub repo id (namespace/name)")
    branch = _branch(revision)
    try:
        checked = _for_repo(check(converted), repo_id)
    except NotAsCertified as exc:
        raise PushRefused(exc.path, exc.problems) from None
    source_id = base_model_id(checked.certificate)
    variant_pr = checked.variant is not None and repo_id == checked.certificate.source.get("id")
    if not variant_pr and repo_id == source_id and not create_pr:
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
    with _hub_errors(repo_id, branch, secret):
        user = str(api.whoami()["name"])
        if variant_pr:
            return _variant_pr(api, checked, repo_id, branch, user)
        return _new_repo(api, checked, repo_id, branch, user, create_pr, private)


def _branch(revision: str | None) -> str:
    name = (revision or "main").removeprefix(_HEADS)
    if not name or name.startswith("refs/"):
        raise InputError(f"--revision {revision!r} is not a branch name")
    return name


def _new_repo(
    api: HfApi,
    checked: Checked,
    repo_id: str,
    branch: str,
    user: str,
    create_pr: bool,
    private: bool | None,
) -> PushResult:
    api.create_repo(repo_id, exist_ok=True, private=private)
    title = _title(checked, branch, create_pr, variant_pr=False)
    paths = sorted(checked.files)
    plan = _target(api, repo_id, branch, user, title, create_pr)
    remote = set(api.list_repo_files(repo_id, revision=plan.parent))
    stale = sorted(
        p for p in remote - set(paths) if _LOAD_BEARING.search(p) and p != ".gitattributes"
    )
    description = _summary(checked, paths)
    if stale:
        removed = ", ".join(f"`{p}`" for p in stale)
        description += f"\n- removed: {removed} (what loads is exactly what was certified)"
    return _commit(api, checked, repo_id, plan, title, description, paths, stale, "new-repo")


def _variant_pr(api: HfApi, checked: Checked, repo_id: str, branch: str, user: str) -> PushResult:
    assert checked.variant is not None
    title = _title(checked, branch, True, variant_pr=True)
    paths = checked.variant_paths()
    plan = _target(api, repo_id, branch, user, title, True)
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
    return _commit(api, checked, repo_id, plan, title, description, paths, stale, "variant-pr")


@dataclass(frozen=True)
class _Target:
    """Where the commit goes: a branch, a new PR on a branch, or an open PR's ref."""

    revision: str  # what create_commit is given
    branch: str
    parent: str  # the head the commit is built on
    create_pr: bool
    pull_request: int | None  # an open PR being updated
    pull_request_url: str | None


def _target(
    api: HfApi, repo_id: str, branch: str, user: str, title: str, create_pr: bool
) -> _Target:
    refs = api.list_repo_refs(repo_id, include_pull_requests=True)
    heads = {ref.name: ref.target_commit for ref in refs.branches}
    if branch not in heads:
        raise InputError(
            f"{repo_id}: {branch!r} is not a branch (branches: {', '.join(sorted(heads))}); "
            "--revision takes a branch name"
        )
    if create_pr:
        for discussion in api.get_repo_discussions(
            repo_id, author=user, discussion_type="pull_request", discussion_status="open"
        ):
            if discussion.title == title:
                ref = f"refs/pr/{discussion.num}"
                prs = {r.ref: r.target_commit for r in refs.pull_requests or []}
                if ref in prs:
                    return _Target(ref, branch, prs[ref], False, discussion.num, discussion.url)
    return _Target(branch, branch, heads[branch], create_pr, None, None)


def _commit(
    api: HfApi,
    checked: Checked,
    repo_id: str,
    target: _Target,
    title: str,
    description: str,
    paths: list[str],
    stale: list[str],
    shape: str,
) -> PushResult:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    operations: list[CommitOperationAdd | CommitOperationDelete] = []
    for path in paths:
        file = checked.files[path]
        add = CommitOperationAdd(path, file.data if file.data is not None else file.location)
        # The certified hash of these very bytes: the client uses it as the LFS object id
        # (the Hub checks content against it) instead of reading the file once more.
        add.upload_info.sha256 = bytes.fromhex(file.sha256)
        operations.append(add)
    operations += [CommitOperationDelete(path) for path in stale]
    info = api.create_commit(
        repo_id,
        operations,
        commit_message=title,
        commit_description=description,
        revision=target.revision,
        create_pr=target.create_pr,
        parent_commit=target.parent,
    )
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
    )


def _same(file: LocalFile, remote: Any) -> bool:
    """Whether a local file equals a Hub tree entry (LFS: sha256; git: blob sha1)."""
    lfs = getattr(remote, "lfs", None)
    if lfs is not None:
        return bool(lfs.sha256 == file.sha256)
    data = _content(file)
    return bool(remote.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())


def _title(checked: Checked, branch: str, pull_request: bool, *, variant_pr: bool) -> str:
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


def _summary(checked: Checked, paths: list[str]) -> str:
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


@contextmanager
def _hub_errors(repo_id: str, branch: str, token: str) -> Iterator[None]:
    """Turn whatever huggingface_hub or its HTTP client raises into one of our errors: one
    line, naming the repo, never the token."""
    try:
        yield
    except PrecisionConvertError:
        raise
    except Exception as exc:
        raise _translate(exc, repo_id, branch, token) from None


def _translate(exc: Exception, repo_id: str, branch: str, token: str) -> PrecisionConvertError:
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalTokenNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

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
        return InputError(f"{repo_id}: {branch!r} is not a branch; --revision takes a branch name")
    if isinstance(exc, RepositoryNotFoundError):
        return InputError(f"{repo_id}: no such model repo on the Hub, or this token cannot see it")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        after = str(exc.response.headers.get("Retry-After", ""))
        answered = {"status": status, "retry_after": float(after) if after.isdigit() else None}
        if status == 401:
            return HubAuthError(
                "the Hub rejected the token (401 Unauthorized): set HF_TOKEN to a valid token "
                "or log in again (hf auth login)"
            )
        if status == 403:
            return HubPermissionError(
                f"{repo_id}: this token may not write to it (403 Forbidden: "
                f"{first_line(exc)}); use a write token of the repo's namespace, or --create-pr"
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
