"""A local stand-in for the Hugging Face Hub, spoken to by the real ``huggingface_hub`` client.

Tests cannot reach huggingface.co, yet "SOURCE is a Hub repo id" is a promise of the CLI. A
mock of ``snapshot_download`` would prove nothing about the requests the client really makes,
so this module serves the Hub's HTTP protocol instead, closely enough for the unmodified client
(read against huggingface_hub 2.4, which also keeps the routes 0.x clients use):

- ``GET /api/models/{repo_id}[/revision/{rev}]``: model info, ``sha`` and ``siblings``.
- ``GET /api/models/{repo_id}/tree/{rev}[/{path}]?recursive=``: the file listing, paginated
  with a GitHub-style ``Link`` header like the Hub's cursor pages.
- ``HEAD``/``GET /{repo_id}/resolve/{rev}/{path}``: regular files answer directly with
  ``ETag`` (git blob sha1), ``X-Repo-Commit`` and ``Content-Length``; LFS files (weights) answer
  ``302`` to a separate "CDN" origin with ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``, as
  the Hub does, so the client's off-Hub redirect path runs too.
- ``GET /api/agent-harnesses``: the registry recent clients fetch for their user agent (empty).
- Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
  ``EntryNotFound``) and ``X-Error-Message`` headers, which is what the client maps to its
  exception classes.

Failures are planned with :meth:`FakeHub.inject` (a status instead of the answer, a body cut
off mid-transfer, a connection closed unanswered), so error paths run against the real client
too.

Clients must set ``HF_HUB_DISABLE_XET=1``: the Xet transfer protocol is not served.

Repositories live in memory as commits (``{sha: {path: bytes}}``) plus refs (branch/tag name →
sha), so a later push endpoint can add a commit and move a branch. Routes are a table of
(method, pattern, handler method); new endpoints (``/api/repos/create``, ``/api/validate-yaml``,
preupload, commit) are new rows and ``_route_*`` methods on :class:`_Handler`.

Both servers bind 127.0.0.1 on ephemeral ports, run in daemon threads, time out idle sockets,
cap request bodies, and are shut down by :meth:`FakeHub.stop` (or leaving the ``with`` block).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

#: Suffixes the Hub's default ``.gitattributes`` stores in LFS (the weight formats that matter).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")
#: Largest request body accepted (future upload endpoints); anything bigger is refused.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds an idle client socket may hold a handler thread.
SOCKET_TIMEOUT_S = 10.0

_REPO = r"(?P<repo>[\w.-]+(?:/[\w.-]+)?)"
_SEGMENT = r"(?P<rev>[^/]+)"


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

    ``status``: answer with this status (no Hub error code, like a proxy or a server in
    trouble). ``truncate``: send the real headers and half the body, then drop the connection.
    ``drop``: close the connection without answering at all.
    """

    path: str
    status: int | None = None
    truncate: bool = False
    drop: bool = False


class HubError(Exception):
    """An error answer in the Hub's format: status, ``X-Error-Code`` and a message."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass
class Repo:
    """One model repository: immutable commits and the refs that point at them."""

    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False

    def resolve(self, revision: str) -> tuple[str, dict[str, bytes]]:
        """(commit sha, files) for a branch/tag name or a full commit sha."""
        sha = self.refs.get(revision, revision)
        if sha not in self.commits:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha, self.commits[sha]


class FakeHub:
    """An in-memory Hub plus its LFS "CDN", served over HTTP on 127.0.0.1.

    Use as a context manager; ``endpoint`` is the value for ``HF_ENDPOINT``. ``requests`` logs
    every ``(method, path)`` received by either server, so tests can assert exactly what the
    client asked for (and that nothing else was asked).
    """

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        #: Entries per tree page; the Hub uses 1000. Lower it to exercise the client's paging.
        self.tree_page_size = 1000
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self._blobs: dict[str, bytes] = {}  # sha256 -> LFS content, what the CDN serves
        self.faults: list[Fault] = []

    # ------------------------------------------------------------------ repository content

    def add_commit(
        self,
        repo_id: str,
        files: Mapping[str, bytes] | Path,
        *,
        revision: str = "main",
        private: bool = False,
    ) -> str:
        """Store ``files`` (a mapping or every file under a directory) as a new commit.

        The branch/tag ``revision`` is created or moved to it. Returns the commit sha, which
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
            for path, data in content.items():
                if is_lfs(path):
                    self._blobs[hashlib.sha256(data).hexdigest()] = data
        return sha

    def repo(self, repo_id: str) -> Repo:
        with self._lock:
            found = self.repos.get(repo_id)
        if found is None or found.private:
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
        """The origin LFS downloads are redirected to (a different port: off-Hub for the client)."""
        return _origin(self._servers[1])

    def start(self) -> FakeHub:
        if self._servers:
            return self
        for role in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
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
        self, path: str, *, status: int | None = None, truncate: bool = False, drop: bool = False
    ) -> Fault:
        """Make requests matching ``path`` fail (see :class:`Fault`) until ``faults`` is cleared."""
        fault = Fault(path, status, truncate, drop)
        with self._lock:
            self.faults.append(fault)
        return fault

    def fault_for(self, path: str) -> Fault | None:
        with self._lock:
            return next((f for f in self.faults if re.search(f.path, path)), None)

    def log(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    # ------------------------------------------------------------------ answers

    def model_info(self, repo_id: str, revision: str) -> dict[str, Any]:
        repo = self.repo(repo_id)
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
        self, repo_id: str, revision: str, prefix: str, recursive: bool
    ) -> list[dict[str, Any]]:
        """Tree entries under ``prefix`` the way ``/api/models/.../tree`` lists them."""
        _, files = self.repo(repo_id).resolve(revision)
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
    ("GET", re.compile(rf"^/api/models/{_REPO}$"), "_route_model_info"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/{_SEGMENT}/(?P<path>.+)$"), "_route_resolve"),
    ("GET", re.compile(r"^/api/agent-harnesses$"), "_route_agent_harnesses"),
]
#: Routes of the CDN origin (LFS content by sha256).
CDN_ROUTES: list[Route] = [
    ("GET", re.compile(r"^/lfs/(?P<sha256>[0-9a-f]{64})$"), "_route_lfs_blob"),
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
        body = self._read_body()
        routes = ROUTES if self.server.role == "hub" else CDN_ROUTES  # type: ignore[attr-defined]
        answer: Answer | None = None
        try:
            if body is None:
                raise HubError(413, None, f"request body over {MAX_BODY_BYTES} bytes")
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
        fault = self.hub.fault_for(url.path)
        if fault is not None and fault.drop:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # the client sees EOF instead of an answer
            return
        if fault is not None and fault.status is not None:
            answer = Answer.json({"error": "injected fault"}, fault.status)
        self._send(method, answer, truncate=fault is not None and fault.truncate)

    def _read_body(self) -> bytes | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            return None
        return self.rfile.read(length) if length else b""

    def _error(self, error: HubError) -> Answer:
        headers = {"X-Error-Message": error.message}
        if error.code:
            headers["X-Error-Code"] = error.code
        return Answer.json({"error": error.message}, error.status, **headers)

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
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)  # the client sees a short body, then EOF

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: ``hub.requests`` is the log; stderr noise would only clutter test output."""

    # ------------------------------------------------------------------ routes

    def _route_model_info(self, repo: str, rev: str = "main", **_: Any) -> Answer:
        return Answer.json(self.hub.model_info(repo, rev))

    def _route_agent_harnesses(self, **_: Any) -> Answer:
        """The registry huggingface_hub >= 2 fetches once a day for its user agent: empty here."""
        return Answer.json({"standardEnvVars": [], "harnesses": {}})

    def _route_tree(
        self, repo: str, rev: str, query: dict[str, list[str]], path: str = "", **_: Any
    ) -> Answer:
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries = self.hub.tree(repo, rev, path, recursive)
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

    def _route_resolve(self, repo: str, rev: str, path: str, **_: Any) -> Answer:
        sha, files = self.hub.repo(repo).resolve(rev)
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

    def _route_lfs_blob(self, sha256: str, **_: Any) -> Answer:
        data = self.hub._blobs.get(sha256)
        if data is None:
            raise HubError(404, None, "no such blob")
        return self._content(data, {"ETag": f'"{sha256}"'})

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
