"""A local stand-in for the Hugging Face Hub, spoken to by the real ``huggingface_hub`` client.

Tests cannot reach huggingface.co, yet "SOURCE is a Hub repo id" and ``precision-convert push``
are promises of the CLI. A mock of ``snapshot_download`` or ``create_commit`` would prove nothing
about the requests the client really makes, so this module serves the Hub's HTTP protocol
instead, closely enough for the unmodified client (read against huggingface_hub 2.4, which also
keeps the routes 0.x clients use).

Read side:

- ``GET /api/models/{repo_id}[/revision/{rev}]``: model info, ``sha`` and ``siblings``.
- ``GET /api/models/{repo_id}/tree/{rev}[/{path}]?recursive=``: the file listing, paginated
  with a GitHub-style ``Link`` header like the Hub's cursor pages.
- ``GET /api/models/{repo_id}/refs[?include_prs=1]``: branches, tags and ``refs/pr/N``.
- ``HEAD``/``GET /{repo_id}/resolve/{rev}/{path}``: regular files answer directly with
  ``ETag`` (git blob sha1), ``X-Repo-Commit`` and ``Content-Length``; LFS files (weights) answer
  ``302`` to a separate "CDN" origin with ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``, as
  the Hub does, so the client's off-Hub redirect path runs too.
- ``GET /api/agent-harnesses``: the registry recent clients fetch for their user agent (empty).

Write side (what ``create_repo`` / ``create_commit`` / ``get_repo_discussions`` send):

- ``GET /api/whoami-v2``: the user a bearer token belongs to (tokens are configured with
  :meth:`FakeHub.add_token`; an unknown token is ``401`` on every route, a read-only token or a
  namespace the user does not own is ``403`` on writes).
- ``POST /api/repos/create``: a new repo gets an initial commit holding ``.gitattributes``, as
  on the Hub; an existing one is ``409``.
- ``POST /api/validate-yaml``: checks a card's front matter the way the Hub does for the keys
  model cards use (``license``, ``pipeline_tag``, ``base_model``, ``base_model_relation``, …).
- ``POST /api/models/{repo_id}/preupload/{rev}``: upload mode per file (``lfs`` for weights and
  binary or large files) and the ``oid`` the file already has on ``rev``.
- ``POST /{repo_id}.git/info/lfs/objects/batch``: the LFS batch API; objects the repo already
  holds come back without ``actions`` (the client then skips them), the others with an upload
  ``href`` on the CDN origin (``PUT``, content-addressed, the sha256 and size checked) and a
  ``verify`` action.
- ``POST /api/models/{repo_id}/commit/{rev}``: the NDJSON commit (``header``, ``file``,
  ``lfsFile``, ``deletedFile``, ``deletedFolder``); ``parentCommit`` must be the branch head
  (else ``412``); ``?create_pr=1`` opens a pull request on ``refs/pr/N`` and answers with
  ``pullRequestUrl``; committing to ``refs/pr/N`` updates that PR. ``rev`` must be a branch.
- ``GET /api/models/{repo_id}/discussions``: the repo's discussions and PRs, filtered by
  ``type``, ``status`` and ``author``, paginated like the Hub's; ``…/discussions/{num}``: one
  with its details (a PR's base branch).

Everything pushed stays downloadable through the read side (``snapshot_download`` of a branch
or of ``refs/pr/N``). ``requests`` logs every ``(method, path)``, ``uploads`` every LFS upload
that completed (``(repo_id, sha256)``), and ``bodies`` every request body, so tests can prove
what was (and was not) sent.

Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``) and ``X-Error-Message`` headers, which is what the client maps to its
exception classes.

Failures are planned with :meth:`FakeHub.inject` (a status instead of the answer, a body cut
off mid-transfer, a connection closed unanswered, a request parked until the test releases it,
or an action run just before a request is handled), so error paths run against the real client
too.

Clients must set ``HF_HUB_DISABLE_XET=1``: the Xet transfer protocol is not served.

Repositories live in memory as commits (``{sha: {path: bytes}}``) plus refs (branch/tag/PR name
→ sha). Routes are a table of (method, pattern, handler method) rows and ``_route_*`` methods
on :class:`_Handler`.

Both servers bind 127.0.0.1 on ephemeral ports, run in daemon threads, time out idle sockets,
cap request bodies, and are shut down by :meth:`FakeHub.stop` (or leaving the ``with`` block).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

#: Suffixes the Hub's default ``.gitattributes`` stores in LFS (the weight formats that matter).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")
#: Files above this size are stored in LFS whatever their name (the Hub's limit for git blobs).
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
#: Largest request body accepted; anything bigger is refused.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds an idle client socket may hold a handler thread.
SOCKET_TIMEOUT_S = 10.0
#: Seconds a parked request (``inject(hold=True)``) waits for its release at most.
HOLD_TIMEOUT_S = 60.0
#: Discussions per page of ``/discussions`` (the Hub pages by 50).
DISCUSSIONS_PAGE_SIZE = 50
#: The ``.gitattributes`` a new repo starts with (abridged from the Hub's default).
GITATTRIBUTES = "".join(
    f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in LFS_SUFFIXES
).encode()
#: ``base_model_relation`` values the Hub accepts.
BASE_MODEL_RELATIONS = ("adapter", "merge", "quantized", "finetune")
#: Licence ids the Hub's validator knows (the common ones; ``other`` needs ``license_name``).
LICENSES = (
    "apache-2.0", "mit", "openrail", "openrail++", "creativeml-openrail-m", "bigscience-openrail-m",
    "bigscience-bloom-rail-1.0", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0", "cc-by-nc-sa-4.0",
    "cc0-1.0", "bsd-3-clause", "gpl-3.0", "agpl-3.0", "lgpl-3.0", "llama2", "llama3", "llama3.1",
    "gemma", "unlicense", "artistic-2.0", "afl-3.0", "other", "unknown",
)  # fmt: skip
#: ``pipeline_tag`` values the Hub's validator knows (those of the models this project converts).
PIPELINE_TAGS = (
    "text-generation", "text2text-generation", "fill-mask", "feature-extraction",
    "sentence-similarity", "text-classification", "token-classification", "question-answering",
    "summarization", "translation", "image-classification", "image-feature-extraction",
    "zero-shot-image-classification", "image-to-text", "image-text-to-text", "text-to-image",
    "image-to-image", "unconditional-image-generation", "text-to-video", "image-to-video",
    "automatic-speech-recognition", "audio-classification", "text-to-speech", "object-detection",
)  # fmt: skip

_REPO = r"(?P<repo>[\w.-]+(?:/[\w.-]+)?)"
_SEGMENT = r"(?P<rev>[^/]+)"
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_SHA256 = r"(?P<oid>[0-9a-f]{64})"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of ``data``: what the Hub reports as a regular file's ``oid``/ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file git stores in place of ``data`` (its oid is the tree's ``oid``)."""
    digest = hashlib.sha256(data).hexdigest()
    spec = "https://git-lfs.github.com/spec/v1"
    return f"version {spec}\noid sha256:{digest}\nsize {len(data)}\n".encode()


def is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


@dataclass(frozen=True)
class Fault:
    """A planned misbehaviour for requests whose path matches ``path`` (``re.search``).

    ``status``: answer with this status instead of handling the request (no Hub error code, like
    a proxy or a server in trouble). ``truncate``: handle it, send the real headers and half the
    body, then drop the connection. ``drop``: close the connection without handling or answering.
    ``hold``: park the request before its body is read, set ``reached`` and wait for ``release``
    (or :data:`HOLD_TIMEOUT_S`), then drop it: the client (or the test, by killing it) decides
    what happens meanwhile. ``before``: run this callable, then handle the request normally (a
    concurrent change on the server). ``method`` limits the fault to one HTTP method, ``skip``
    lets that many matching requests through first, ``times`` fires it at most that often;
    ``headers`` go with a ``status`` answer (a ``Retry-After``).
    """

    path: str
    status: int | None = None
    truncate: bool = False
    drop: bool = False
    hold: bool = False
    before: Callable[[], None] | None = None
    method: str | None = None
    skip: int = 0
    times: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    reached: threading.Event = field(default_factory=threading.Event, compare=False)
    release: threading.Event = field(default_factory=threading.Event, compare=False)


class HubError(Exception):
    """An error answer in the Hub's format: status, ``X-Error-Code`` and a message."""

    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})  # more headers of the answer
        self.extra = extra  # more fields of the JSON body


@dataclass(frozen=True)
class Token:
    """What a bearer token grants: its user, write access or not, the user's organisations."""

    user: str
    write: bool = True
    orgs: tuple[str, ...] = ()

    def owns(self, repo_id: str) -> bool:
        namespace = repo_id.split("/")[0]
        return namespace == self.user or namespace in self.orgs


@dataclass
class Discussion:
    """A discussion or pull request of one repo (PRs live on ``refs/pr/{num}``)."""

    num: int
    title: str
    author: str
    is_pull_request: bool
    target_branch: str | None
    description: str
    status: str = "open"
    created_at: str = field(
        default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    )


@dataclass
class Repo:
    """One model repository: immutable commits, the refs that point at them, its LFS objects."""

    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False
    tags: set[str] = field(default_factory=set)
    lfs_objects: set[str] = field(default_factory=set)  # sha256 of LFS content the repo holds
    discussions: list[Discussion] = field(default_factory=list)
    messages: dict[str, tuple[str, str]] = field(default_factory=dict)  # sha -> (title, body)

    def resolve(self, revision: str) -> tuple[str, dict[str, bytes]]:
        """(commit sha, files) for a branch/tag/PR ref name or a full commit sha."""
        sha = self.refs.get(revision, revision)
        if sha not in self.commits:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha, self.commits[sha]

    @property
    def branches(self) -> list[str]:
        return [r for r in self.refs if r not in self.tags and not r.startswith("refs/")]

    def pull_request(self, num: int) -> Discussion:
        found = next((d for d in self.discussions if d.num == num and d.is_pull_request), None)
        if found is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: refs/pr/{num}")
        return found


class FakeHub:
    """An in-memory Hub plus its LFS "CDN", served over HTTP on 127.0.0.1.

    Use as a context manager; ``endpoint`` is the value for ``HF_ENDPOINT``. ``requests`` logs
    every ``(method, path)`` received by either server, ``uploads`` the ``(repo_id, sha256)``
    of every LFS upload that completed (in order), ``bodies`` every request body received.
    """

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.uploads: list[tuple[str, str]] = []
        self.bodies: list[bytes] = []
        self.tokens: dict[str, Token] = {}
        #: Entries per tree page; the Hub uses 1000. Lower it to exercise the client's paging.
        self.tree_page_size = 1000
        self._lock = threading.RLock()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self._blobs: dict[str, bytes] = {}  # sha256 -> LFS content, what the CDN serves
        self.faults: list[Fault] = []
        self._fault_hits: dict[int, int] = {}
        self._commit_counter = 0

    # ------------------------------------------------------------------ repository content

    def add_token(
        self, token: str, user: str, *, write: bool = True, orgs: tuple[str, ...] = ()
    ) -> Token:
        """Accept ``token`` as ``user``'s (write access unless ``write=False``)."""
        granted = Token(user, write, tuple(orgs))
        with self._lock:
            self.tokens[token] = granted
        return granted

    def add_commit(
        self,
        repo_id: str,
        files: Mapping[str, bytes] | Path,
        *,
        revision: str = "main",
        private: bool = False,
    ) -> str:
        """Store ``files`` (a mapping or every file under a directory) as a new commit.

        The branch ``revision`` is created or moved to it. Returns the commit sha, which
        depends on the repo, the revision name and the content, so it is stable across runs.
        """
        content = dict(_read_tree(files) if isinstance(files, Path) else files)
        digest = hashlib.sha1(f"{repo_id}\0{revision}\0".encode())
        for path in sorted(content):
            digest.update(f"{path}\0{git_blob_sha1(content[path])}\0".encode())
        sha = digest.hexdigest()
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo(repo_id, private=private))
            repo.commits[sha] = content
            repo.refs[revision] = sha
            repo.messages[sha] = (f"add {revision}", "")
            self._keep_blobs(repo, content)
        return sha

    def add_tag(self, repo_id: str, tag: str, revision: str = "main") -> str:
        """Tag ``revision`` of ``repo_id`` as ``tag`` (a tag is no branch: no commits onto it)."""
        with self._lock:
            repo = self.repos[repo_id]
            sha, _ = repo.resolve(revision)
            repo.refs[tag] = sha
            repo.tags.add(tag)
        return sha

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files of ``repo_id`` at ``revision`` (for assertions; ignores privacy)."""
        with self._lock:
            return dict(self.repos[repo_id].resolve(revision)[1])

    def _keep_blobs(self, repo: Repo, content: Mapping[str, bytes]) -> None:
        for path, data in content.items():
            if is_lfs(path):
                digest = hashlib.sha256(data).hexdigest()
                self._blobs[digest] = data
                repo.lfs_objects.add(digest)

    def repo(self, repo_id: str, user: Token | None = None) -> Repo:
        with self._lock:
            found = self.repos.get(repo_id)
        if found is None or (found.private and not (user and user.owns(repo_id))):
            # The Hub does not tell "private" from "missing" to an anonymous client.
            raise HubError(404, "RepoNotFound", "Repository not found")
        return found

    # ------------------------------------------------------------------ serving

    @property
    def endpoint(self) -> str:
        """The Hub origin (``HF_ENDPOINT``)."""
        return _origin(self._servers[0])

    @property
    def cdn(self) -> str:
        """The origin LFS content is served from and uploaded to (off-Hub for the client)."""
        return _origin(self._servers[1])

    def start(self) -> FakeHub:
        if self._servers:
            return self
        for role in ("hub", "cdn"):
            server = _Server(("127.0.0.1", 0), _Handler)
            server.daemon_threads = True
            server.hub = self  # type: ignore[attr-defined]
            server.role = role  # type: ignore[attr-defined]
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                daemon=True,
                name=f"fake-hub-{role}",
            )
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        with self._lock:
            for fault in self.faults:
                fault.release.set()  # parked requests give up at once
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._servers.clear()
        self._threads.clear()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def inject(
        self,
        path: str,
        *,
        status: int | None = None,
        truncate: bool = False,
        drop: bool = False,
        hold: bool = False,
        before: Callable[[], None] | None = None,
        method: str | None = None,
        skip: int = 0,
        times: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Fault:
        """Make requests matching ``path`` misbehave (see :class:`Fault`) until ``faults`` is
        cleared."""
        fault = Fault(
            path, status, truncate, drop, hold, before, method, skip, times, dict(headers or {})
        )
        with self._lock:
            self.faults.append(fault)
        return fault

    def fault_for(self, method: str, path: str) -> Fault | None:
        """The fault that fires for this request, counting it against ``skip``/``times``."""
        with self._lock:
            for fault in self.faults:
                if fault.method not in (None, method) or not re.search(fault.path, path):
                    continue
                seen = self._fault_hits.get(id(fault), 0)
                self._fault_hits[id(fault)] = seen + 1
                if seen < fault.skip:
                    continue
                if fault.times is not None and seen - fault.skip >= fault.times:
                    continue
                return fault
        return None

    def log(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    # ------------------------------------------------------------------ read answers

    def model_info(self, repo_id: str, revision: str, user: Token | None) -> dict[str, Any]:
        repo = self.repo(repo_id, user)
        sha, files = repo.resolve(revision)
        return {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0] if "/" in repo_id else None,
            "sha": sha,
            "private": repo.private,
            "disabled": False,
            "gated": False,
            "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(files)],
        }

    def tree(
        self, repo_id: str, revision: str, prefix: str, recursive: bool, user: Token | None
    ) -> list[dict[str, Any]]:
        """Tree entries under ``prefix`` the way ``/api/models/.../tree`` lists them."""
        _, files = self.repo(repo_id, user).resolve(revision)
        base = prefix.strip("/")
        if base and base in files:
            raise HubError(400, None, f"{base} is a file, not a directory")
        under = [p for p in sorted(files) if not base or p.startswith(base + "/")]
        if base and not under:
            raise HubError(404, "EntryNotFound", f"{base} does not exist on {revision}")
        entries: dict[str, dict[str, Any]] = {}
        for path in under:
            rest = path[len(base) + 1 :] if base else path
            parts = rest.split("/")
            depth = len(parts) if recursive else 1
            for i in range(1, min(depth, len(parts) - 1) + 1):  # directories on the way
                folder = "/".join(filter(None, [base, *parts[:i]]))
                entries.setdefault(
                    folder, {"type": "directory", "oid": _tree_oid(folder, files), "path": folder}
                )
            if len(parts) == 1 or recursive:
                entries[path] = _file_entry(path, files[path])
        return list(entries.values())

    def refs(self, repo_id: str, user: Token | None, include_prs: bool) -> dict[str, Any]:
        repo = self.repo(repo_id, user)

        def info(name: str, ref: str) -> dict[str, str]:
            return {"name": name, "ref": ref, "targetCommit": repo.refs[name]}

        with self._lock:
            answer: dict[str, Any] = {
                "branches": [info(b, f"refs/heads/{b}") for b in repo.branches],
                "tags": [info(t, f"refs/tags/{t}") for t in sorted(repo.tags)],
                "converts": [],
            }
            if include_prs:
                answer["pullRequests"] = [
                    info(r, r) for r in sorted(repo.refs) if r.startswith("refs/pr/")
                ]
        return answer

    # ------------------------------------------------------------------ write answers

    def create_repo(self, repo_id: str, user: Token, private: bool) -> Repo:
        require_write(user, repo_id)
        with self._lock:
            if repo_id in self.repos:
                raise HubError(
                    409,
                    None,
                    "You already created this model repo",
                    url=f"{self.endpoint}/{repo_id}",  # the Hub says where it is
                )
            repo = Repo(repo_id, private=private)
            self.repos[repo_id] = repo
            self._commit(repo, None, {".gitattributes": GITATTRIBUTES}, "initial commit", "")
            repo.refs["main"] = next(iter(repo.commits))
        return repo

    def upload_modes(
        self, repo_id: str, revision: str, files: list[dict[str, Any]], user: Token, pr: bool
    ) -> list[dict[str, Any]]:
        repo = self.repo(repo_id, user)
        require_write(user, repo_id, pull_request=pr)
        _, existing = repo.resolve(revision)
        answer = []
        for entry in files:
            path, size = entry["path"], int(entry["size"])
            sample = base64.b64decode(entry.get("sample") or "")
            lfs = is_lfs(path) or size > LFS_SIZE_THRESHOLD or b"\0" in sample
            row: dict[str, Any] = {
                "path": path,
                "uploadMode": "lfs" if lfs else "regular",
                "shouldIgnore": False,
            }
            if path in existing:
                data = existing[path]
                oid = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
                row["oid"] = oid
            answer.append(row)
        return answer

    def store_upload(self, repo_id: str, oid: str, data: bytes) -> None:
        """An LFS upload arrived: keep it when its content is what its address says."""
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, None, "uploaded content does not match its sha256")
        with self._lock:
            repo = self.repos.get(repo_id)
            if repo is None:
                raise HubError(404, "RepoNotFound", "Repository not found")
            self._blobs[oid] = data
            repo.lfs_objects.add(oid)
            self.uploads.append((repo_id, oid))

    def commit(
        self,
        repo_id: str,
        revision: str,
        lines: list[dict[str, Any]],
        user: Token,
        create_pr: bool,
    ) -> dict[str, Any]:
        repo = self.repo(repo_id, user)
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, None, "the first line of a commit must be its header")
        header = lines[0]["value"]
        summary = str(header.get("summary") or "").strip()
        if not summary:
            raise HubError(400, None, "commit summary must not be empty")
        description = str(header.get("description") or "")
        parent = header.get("parentCommit")
        pr_match = re.fullmatch(r"refs/pr/(\d+)", revision)
        with self._lock:
            if pr_match:
                if create_pr:
                    raise HubError(400, None, "cannot open a pull request from a pull request")
                discussion = repo.pull_request(int(pr_match[1]))
                if discussion.status != "open":
                    raise HubError(403, None, f"pull request #{discussion.num} is not open")
                if discussion.author != user.user:
                    require_write(user, repo_id)
                else:
                    require_write(user, repo_id, pull_request=True)
            else:
                require_write(user, repo_id, pull_request=create_pr)
                if revision not in repo.branches:
                    raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            head = repo.refs[revision]
            base = head
            if parent is not None:
                found = _commit_by_prefix(repo, str(parent))
                if found is None:
                    raise HubError(400, None, f"parent commit {parent} does not exist")
                if create_pr:
                    base = found  # the PR starts from the given parent
                elif found != head:
                    raise HubError(
                        412, None, "A commit has happened since. Please refresh and try again."
                    )
            files = self._apply(repo, dict(repo.commits[base]), lines[1:])
            sha = self._commit(repo, base, files, summary, description)
            answer: dict[str, Any] = {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{self.endpoint}/{repo_id}/commit/{sha}",
                "hookOutput": "",
            }
            if create_pr:
                num = len(repo.discussions) + 1
                repo.discussions.append(
                    Discussion(num, summary, user.user, True, revision, description)
                )
                repo.refs[f"refs/pr/{num}"] = sha
                answer["pullRequestUrl"] = f"{self.endpoint}/{repo_id}/discussions/{num}"
            else:
                repo.refs[revision] = sha
        return answer

    def _apply(
        self, repo: Repo, files: dict[str, bytes], operations: list[dict[str, Any]]
    ) -> dict[str, bytes]:
        for line in operations:
            key, value = line.get("key"), line.get("value") or {}
            path = str(value.get("path", "")).strip("/")
            if not path or ".." in path.split("/"):
                raise HubError(400, None, f"invalid path {path!r}")
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, None, "file content must be base64")
                try:
                    files[path] = base64.b64decode(value["content"], validate=True)
                except (KeyError, binascii.Error) as exc:
                    raise HubError(400, None, f"invalid base64 for {path}") from exc
            elif key == "lfsFile":
                oid = str(value.get("oid", ""))
                if value.get("algo") != "sha256" or oid not in repo.lfs_objects:
                    raise HubError(
                        422, None, f"LFS object {oid} of {path} was not uploaded to this repo"
                    )
                data = self._blobs[oid]
                if "size" in value and int(value["size"]) != len(data):
                    raise HubError(422, None, f"size of {path} does not match its LFS object")
                files[path] = data
            elif key == "deletedFile":
                if path not in files:
                    raise HubError(404, "EntryNotFound", "A file with this name doesn't exist")
                del files[path]
            elif key == "deletedFolder":
                gone = [p for p in files if p.startswith(path + "/")]
                if not gone:
                    raise HubError(404, "EntryNotFound", "A folder with this name doesn't exist")
                for p in gone:
                    del files[p]
            else:
                raise HubError(400, None, f"unknown commit operation {key!r}")
        return files

    def _commit(
        self, repo: Repo, parent: str | None, files: dict[str, bytes], title: str, body: str
    ) -> str:
        self._commit_counter += 1
        digest = hashlib.sha1(f"{repo.repo_id}\0{parent}\0{title}\0{self._commit_counter}".encode())
        for path in sorted(files):
            digest.update(f"{path}\0{git_blob_sha1(files[path])}\0".encode())
        sha = digest.hexdigest()
        repo.commits[sha] = files
        repo.messages[sha] = (title, body)
        self._keep_blobs(repo, files)
        return sha

    def discussions(
        self, repo_id: str, user: Token | None, query: dict[str, list[str]]
    ) -> dict[str, Any]:
        repo = self.repo(repo_id, user)
        kind = query.get("type", ["all"])[0]
        status = query.get("status", ["all"])[0]
        author = query.get("author", [None])[0]
        page = int(query.get("p", ["0"])[0])
        with self._lock:
            found = [
                d
                for d in reversed(repo.discussions)  # newest first, as on the Hub
                if (kind == "all" or (kind == "pull_request") == d.is_pull_request)
                and (status == "all" or d.status == status)
                and (author is None or d.author == author)
            ]
        start = page * DISCUSSIONS_PAGE_SIZE
        return {
            "discussions": [
                {
                    "num": d.num,
                    "title": d.title,
                    "status": d.status,
                    "isPullRequest": d.is_pull_request,
                    "createdAt": d.created_at,
                    "author": {"name": d.author},
                    "repo": {"name": repo_id, "type": "model"},
                    "pinned": False,
                    "numComments": 1,
                }
                for d in found[start : start + DISCUSSIONS_PAGE_SIZE]
            ],
            "count": len(found),
            "start": start,
            "numClosedDiscussions": sum(d.status == "closed" for d in repo.discussions),
        }

    def discussion(self, repo_id: str, user: Token | None, num: int) -> dict[str, Any]:
        """One discussion with its details (``get_discussion_details``): a PR's base branch."""
        repo = self.repo(repo_id, user)
        with self._lock:
            found = next((d for d in repo.discussions if d.num == num), None)
        if found is None:
            raise HubError(404, None, f"Discussion #{num} not found")
        details: dict[str, Any] = {
            "num": found.num,
            "title": found.title,
            "status": found.status,
            "isPullRequest": found.is_pull_request,
            "createdAt": found.created_at,
            "author": {"name": found.author},
            "repo": {"name": repo_id, "type": "model"},
            "events": [],
            "pinned": False,
            "locked": False,
        }
        if found.is_pull_request:
            details["changes"] = {"base": f"refs/heads/{found.target_branch}"}
            details["filesWithConflicts"] = []
            details["diff"] = ""
        return details


def require_write(user: Token | None, repo_id: str, *, pull_request: bool = False) -> None:
    """Writes need a token with write access; committing to a branch also needs the namespace
    (opening a PR does not, as on the Hub)."""
    if user is None:
        raise HubError(401, None, "You must be authenticated to perform this action")
    if not user.write:
        raise HubError(403, None, "You have read access but not the required write permissions")
    if not pull_request and not user.owns(repo_id):
        raise HubError(403, None, f"You don't have the rights to write to {repo_id}")


def validate_card(content: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a README.md, checking its front matter as the Hub does."""
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.DOTALL)
    if not match:
        return [], ["Empty or missing yaml metadata in repo card"]
    try:
        data = yaml.safe_load(match[1])
    except yaml.YAMLError as exc:
        return [f"Error parsing YAML metadata: {str(exc).splitlines()[0]}"], []
    if data is None:
        return [], ["Empty or missing yaml metadata in repo card"]
    if not isinstance(data, dict):
        return ["YAML metadata must be a mapping"], []
    errors: list[str] = []

    def strings(key: str, allowed: tuple[str, ...] | None = None, single: bool = False) -> None:
        value = data.get(key)
        if value is None:
            return
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or (single and not isinstance(value, str)):
            errors.append(f'"{key}" must be a string{"" if single else " or a list of strings"}')
            return
        for item in values:
            if not isinstance(item, str):
                errors.append(f'"{key}" must contain only strings')
            elif allowed is not None and item not in allowed:
                errors.append(f'"{key}" has an invalid value: {item!r}')

    strings("license", LICENSES)
    strings("tags")
    strings("language")
    strings("datasets")
    strings("library_name", single=True)
    strings("pipeline_tag", PIPELINE_TAGS, single=True)
    strings("base_model")
    strings("base_model_relation", BASE_MODEL_RELATIONS, single=True)
    bases = data.get("base_model")
    for base in [bases] if isinstance(bases, str) else bases if isinstance(bases, list) else []:
        if isinstance(base, str) and not _REPO_ID.match(base):
            errors.append(f'"base_model" is not a valid model id: {base!r}')
    if data.get("base_model_relation") is not None and not bases:
        errors.append('"base_model_relation" needs "base_model"')
    if data.get("license") == "other" and not data.get("license_name"):
        errors.append('"license: other" needs "license_name"')
    return errors, []


def _commit_by_prefix(repo: Repo, parent: str) -> str | None:
    found = [sha for sha in repo.commits if sha.startswith(parent)]
    return found[0] if len(found) == 1 else None


class _Server(ThreadingHTTPServer):
    """Quiet about clients that vanish mid-request (a killed push): that is a test's point."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def _origin(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def _file_entry(path: str, data: bytes) -> dict[str, Any]:
    if is_lfs(path):
        pointer = lfs_pointer(data)
        return {
            "type": "file",
            "oid": git_blob_sha1(pointer),
            "size": len(data),
            "lfs": {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": len(pointer),
            },
            "path": path,
        }
    return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}


def _tree_oid(folder: str, files: Mapping[str, bytes]) -> str:
    digest = hashlib.sha1(folder.encode())
    for path in sorted(p for p in files if p.startswith(folder + "/")):
        digest.update(git_blob_sha1(files[path]).encode())
    return digest.hexdigest()


def _read_tree(root: Path) -> Iterator[tuple[str, bytes]]:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            yield path.relative_to(root).as_posix(), path.read_bytes()


Route = tuple[str, "re.Pattern[str]", str]

#: (method, path pattern, handler method). HEAD routes reuse the GET handler without a body.
ROUTES: list[Route] = [
    ("GET", re.compile(rf"^/api/models/{_REPO}/revision/{_SEGMENT}$"), "_route_model_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/{_SEGMENT}(?P<path>/.*)?$"), "_route_tree"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/refs$"), "_route_refs"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/discussions$"), "_route_discussions"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/discussions/(?P<num>\d+)$"), "_route_discussion"),
    ("GET", re.compile(rf"^/api/models/{_REPO}$"), "_route_model_info"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/{_SEGMENT}/(?P<path>.+)$"), "_route_resolve"),
    ("GET", re.compile(r"^/api/agent-harnesses$"), "_route_agent_harnesses"),
    ("GET", re.compile(r"^/api/whoami-v2$"), "_route_whoami"),
    ("POST", re.compile(r"^/api/repos/create$"), "_route_create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "_route_validate_yaml"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/{_SEGMENT}$"), "_route_preupload"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/{_SEGMENT}$"), "_route_commit"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$"), "_route_lfs_batch"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/verify$"), "_route_lfs_verify"),
]
#: Routes of the CDN origin: LFS content by sha256, and the upload target the batch API names.
CDN_ROUTES: list[Route] = [
    ("GET", re.compile(rf"^/lfs/{_SHA256}$"), "_route_lfs_blob"),
    ("PUT", re.compile(rf"^/upload/{_SHA256}/{_REPO}$"), "_route_lfs_upload"),
]


@dataclass
class Answer:
    """A response to send: status, headers and body (dropped for HEAD)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @classmethod
    def json(cls, payload: Any, status: int = 200, **headers: str) -> Answer:
        return cls(
            status,
            {"Content-Type": "application/json; charset=utf-8", **headers},
            json.dumps(payload).encode(),
        )


class _Handler(BaseHTTPRequestHandler):
    """Dispatches one request through the route table of its server's role."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    timeout = SOCKET_TIMEOUT_S
    server_version = "fake-hub/1"
    user: Token | None = None

    @property
    def hub(self) -> FakeHub:
        return self.server.hub  # type: ignore[attr-defined,no-any-return]

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.hub.log(method, url.path)
        fault = self.hub.fault_for(method, url.path)
        if fault is not None and fault.hold:
            fault.reached.set()
            fault.release.wait(HOLD_TIMEOUT_S)
            self._hang_up()
            return
        if fault is not None and fault.before is not None:
            fault.before()
        body = self._read_body()
        if body is not None and body:
            with self.hub._lock:
                self.hub.bodies.append(body)
        if fault is not None and fault.drop:
            self._hang_up()  # the client sees EOF instead of an answer
            return
        routes = ROUTES if self.server.role == "hub" else CDN_ROUTES  # type: ignore[attr-defined]
        answer: Answer | None = None
        try:
            if body is None:
                raise HubError(413, None, f"request body over {MAX_BODY_BYTES} bytes")
            if fault is not None and fault.status is not None:
                raise HubError(fault.status, None, "injected fault", fault.headers)
            self.user = self._authenticate() if self.server.role == "hub" else None  # type: ignore[attr-defined]
            for route_method, pattern, name in routes:
                if route_method != method and not (method == "HEAD" and route_method == "GET"):
                    continue
                match = pattern.match(url.path)
                if match:
                    params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                    handler: Callable[..., Answer] = getattr(self, name)
                    answer = handler(query=parse_qs(url.query), body=body, **params)
                    break
            else:
                raise HubError(404, None, f"no route for {method} {url.path}")
        except HubError as error:
            answer = self._error(error)
        self._send(method, answer, truncate=fault is not None and fault.truncate)

    def _authenticate(self) -> Token | None:
        """The token's grant; an Authorization header with an unknown token is ``401``."""
        header = self.headers.get("Authorization")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        user = self.hub.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        return user

    def _hang_up(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client may have gone away first
            self.connection.shutdown(socket.SHUT_RDWR)

    def _read_body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            return None
        return self.rfile.read(length) if length else b""

    def _read_chunked(self) -> bytes | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            total += size
            if total > MAX_BODY_BYTES:
                self.close_connection = True
                return None
            chunks.append(self.rfile.read(size))
            self.rfile.readline()

    def _error(self, error: HubError) -> Answer:
        headers = {"X-Error-Message": error.message, **error.headers}
        if error.code:
            headers["X-Error-Code"] = error.code
        return Answer.json({"error": error.message, **error.extra}, error.status, **headers)

    def _send(self, method: str, answer: Answer, *, truncate: bool = False) -> None:
        self.send_response(answer.status)
        headers = {"X-Request-Id": f"Root={uuid.uuid4()}", **answer.headers}
        headers.setdefault("Content-Length", str(len(answer.body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if method == "HEAD" or not answer.body:
            return
        if not truncate:
            self.wfile.write(answer.body)
            return
        self.wfile.write(answer.body[: len(answer.body) // 2])
        self.wfile.flush()
        self._hang_up()  # the client sees a short body, then EOF

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: ``hub.requests`` is the log; stderr noise would only clutter test output."""

    def _json_body(self, body: bytes) -> Any:
        try:
            return json.loads(body or b"null")
        except ValueError as exc:
            raise HubError(400, None, "request body is not JSON") from exc

    def _writer(self) -> Token:
        if self.user is None:
            raise HubError(401, None, "You must be authenticated to perform this action")
        return self.user

    # ------------------------------------------------------------------ read routes

    def _route_model_info(self, repo: str, rev: str = "main", **_: Any) -> Answer:
        return Answer.json(self.hub.model_info(repo, rev, self.user))

    def _route_agent_harnesses(self, **_: Any) -> Answer:
        """The registry huggingface_hub >= 2 fetches once a day for its user agent: empty here."""
        return Answer.json({"standardEnvVars": [], "harnesses": {}})

    def _route_tree(
        self, repo: str, rev: str, query: dict[str, list[str]], path: str = "", **_: Any
    ) -> Answer:
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries = self.hub.tree(repo, rev, path, recursive, self.user)
        start = int(query.get("cursor", ["0"])[0])
        size = self.hub.tree_page_size
        page = entries[start : start + size]
        headers: dict[str, str] = {}
        if start + size < len(entries):
            split = urlsplit(self.path)
            kept = [f"{k}={quote(v[0])}" for k, v in query.items() if k != "cursor"]
            link = f"{self.hub.endpoint}{split.path}?{'&'.join([*kept, f'cursor={start + size}'])}"
            headers["Link"] = f'<{link}>; rel="next"'
        return Answer.json(page, **headers)

    def _route_refs(self, repo: str, query: dict[str, list[str]], **_: Any) -> Answer:
        include_prs = query.get("include_prs", ["0"])[0].lower() in ("1", "true")
        return Answer.json(self.hub.refs(repo, self.user, include_prs))

    def _route_discussions(self, repo: str, query: dict[str, list[str]], **_: Any) -> Answer:
        return Answer.json(self.hub.discussions(repo, self.user, query))

    def _route_discussion(self, repo: str, num: str, **_: Any) -> Answer:
        return Answer.json(self.hub.discussion(repo, self.user, int(num)))

    def _route_resolve(self, repo: str, rev: str, path: str, **_: Any) -> Answer:
        sha, files = self.hub.repo(repo, self.user).resolve(rev)
        if path not in files:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev!r}")
        data = files[path]
        if is_lfs(path):
            digest = hashlib.sha256(data).hexdigest()
            return Answer(
                302,
                {
                    "Location": f"{self.hub.cdn}/lfs/{digest}",
                    "X-Repo-Commit": sha,
                    "X-Linked-Etag": f'"{digest}"',
                    "X-Linked-Size": str(len(data)),
                    "ETag": f'"{git_blob_sha1(lfs_pointer(data))}"',
                },
            )
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha1(data)}"'}
        return self._content(data, headers)

    def _route_lfs_blob(self, oid: str, **_: Any) -> Answer:
        data = self.hub._blobs.get(oid)
        if data is None:
            raise HubError(404, None, "no such blob")
        return self._content(data, {"ETag": f'"{oid}"'})

    def _content(self, data: bytes, headers: dict[str, str]) -> Answer:
        """The bytes, honouring a ``Range: bytes=N-`` (the client resumes partial downloads)."""
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **headers}
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if not match:
            return Answer(200, headers, data)
        start = int(match[1])
        end = int(match[2]) if match[2] else len(data) - 1
        if start >= len(data) or end < start:
            return Answer(416, {"Content-Range": f"bytes */{len(data)}"})
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        return Answer(206, headers, data[start : end + 1])

    # ------------------------------------------------------------------ write routes

    def _route_whoami(self, **_: Any) -> Answer:
        user = self._writer()
        return Answer.json(
            {
                "type": "user",
                "id": hashlib.sha1(user.user.encode()).hexdigest()[:24],
                "name": user.user,
                "fullname": user.user,
                "orgs": [{"type": "org", "name": org} for org in user.orgs],
                "auth": {
                    "type": "access_token",
                    "accessToken": {
                        "displayName": "test token",
                        "role": "write" if user.write else "read",
                    },
                },
            }
        )

    def _route_create_repo(self, body: bytes, **_: Any) -> Answer:
        payload = self._json_body(body)
        name, organization = payload.get("name"), payload.get("organization")
        user = self._writer()
        if payload.get("type", "model") != "model":
            raise HubError(400, None, "only model repos are served")
        repo_id = f"{organization or user.user}/{name}"
        if not _REPO_ID.match(repo_id):
            raise HubError(400, None, f"invalid repo name {repo_id!r}")
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        self.hub.create_repo(repo_id, user, private)
        return Answer.json(
            {"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}
        )

    def _route_validate_yaml(self, body: bytes, **_: Any) -> Answer:
        payload = self._json_body(body)
        errors, warnings = validate_card(str(payload.get("content", "")))
        answer = {
            "errors": [{"message": m} for m in errors],
            "warnings": [{"message": m} for m in warnings],
        }
        return Answer.json(answer, 400 if errors else 200)

    def _route_preupload(
        self, repo: str, rev: str, body: bytes, query: dict[str, list[str]], **_: Any
    ) -> Answer:
        payload = self._json_body(body)
        pr = query.get("create_pr", ["0"])[0] == "1"
        files = self.hub.upload_modes(repo, rev, payload.get("files", []), self._writer(), pr)
        sha, _ = self.hub.repo(repo, self.user).resolve(rev)
        return Answer.json({"files": files, "commitOid": sha})

    def _route_lfs_batch(self, repo: str, body: bytes, **_: Any) -> Answer:
        payload = self._json_body(body)
        found = self.hub.repo(repo, self.user)
        require_write(self.user, repo, pull_request=True)  # PR authors upload too
        if payload.get("operation") != "upload":
            raise HubError(400, None, "only uploads are served")
        objects = []
        for item in payload.get("objects", []):
            oid, size = str(item.get("oid")), int(item.get("size", -1))
            answer: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if not re.fullmatch(_SHA256, oid) or size < 0:
                answer["error"] = {"code": 422, "message": "invalid object"}
            elif oid not in found.lfs_objects:
                answer["actions"] = {
                    "upload": {"href": f"{self.hub.cdn}/upload/{oid}/{repo}", "header": {}},
                    "verify": {
                        "href": f"{self.hub.endpoint}/{repo}.git/info/lfs/objects/verify",
                        "header": {},
                    },
                }
            objects.append(answer)
        return Answer(
            200,
            {"Content-Type": "application/vnd.git-lfs+json"},
            json.dumps({"transfer": "basic", "objects": objects}).encode(),
        )

    def _route_lfs_verify(self, repo: str, body: bytes, **_: Any) -> Answer:
        payload = self._json_body(body)
        found = self.hub.repo(repo, self.user)
        oid = str(payload.get("oid"))
        data = self.hub._blobs.get(oid)
        if oid not in found.lfs_objects or data is None or len(data) != payload.get("size"):
            raise HubError(404, None, f"LFS object {oid} not found")
        return Answer.json({"success": True})

    def _route_lfs_upload(self, oid: str, repo: str, body: bytes, **_: Any) -> Answer:
        self.hub.store_upload(repo, oid, body)
        return Answer(200)

    def _route_commit(
        self, repo: str, rev: str, body: bytes, query: dict[str, list[str]], **_: Any
    ) -> Answer:
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError as exc:
            raise HubError(400, None, "commit body is not NDJSON") from exc
        create_pr = query.get("create_pr", ["0"])[0] == "1"
        return Answer.json(self.hub.commit(repo, rev, lines, self._writer(), create_pr))
