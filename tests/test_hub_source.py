"""``precision-convert model OWNER/NAME``: a Hub repo id as SOURCE, with the real client.

The CLI runs as a subprocess of the installed package, pointed at :mod:`_fake_hub` through
``HF_ENDPOINT``: huggingface_hub reads its settings when imported, and this test process has
already imported it in offline mode (``conftest.py``), so a child with its own environment is
the only clean way to go online. Each run gets its own ``HF_HOME``, so every test downloads
afresh and no run is satisfied from another's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _fake_hub import FakeHub, is_lfs
from safetensors.torch import load_file, save_file

from precision_convert.core.names import units

REPO = "acme/tiny-t5"
NAME = "tiny-t5"
#: Environment that must not leak from the developer's shell into the child: a real token
#: would be sent to the fake server, a cache path would bypass the per-test ``HF_HOME``.
_SCRUBBED = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "PRECISION_CONVERT_DEBUG",
)


@dataclass(frozen=True)
class Served:
    """The running fake Hub and what it serves: ``REPO`` at ``main`` and at tag ``v2``."""

    hub: FakeHub
    main: Path
    v2: Path
    main_sha: str
    v2_sha: str


@pytest.fixture(scope="module")
def served(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    main = tiny_model("t5-encoder")
    v2 = _negated(main, tmp_path_factory.mktemp("hub-v2"))
    with FakeHub() as hub:
        main_sha = hub.add_commit(REPO, main)
        v2_sha = hub.add_commit(REPO, v2, revision="v2")
        yield Served(hub, main, v2, main_sha, v2_sha)


@pytest.fixture
def hub(served: Served) -> Iterator[FakeHub]:
    """The shared server with a clean request log; faults and paging are reset afterwards."""
    served.hub.requests.clear()
    yield served.hub
    served.hub.faults.clear()
    served.hub.tree_page_size = 1000


def _negated(source: Path, directory: Path) -> Path:
    """``source`` with every floating tensor negated: a revision whose weights surely differ."""
    state = load_file(source / "model.safetensors")
    save_file(
        {k: -v if v.is_floating_point() else v for k, v in state.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_bytes((source / "config.json").read_bytes())
    return directory


def _cli(
    args: list[str], endpoint: str, cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``precision-convert`` against ``endpoint`` with a private cache, online."""
    script = Path(sys.executable).with_name("precision-convert")
    command = (
        [str(script)]
        if script.is_file()
        else [sys.executable, "-c", "from precision_convert.cli.main import run; run()"]
    )
    return subprocess.run(
        command + args,
        cwd=cwd,
        env=_online_env(endpoint, cwd),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _online_env(endpoint: str, cwd: Path) -> dict[str, str]:
    """This process's environment, pointed at ``endpoint`` with a private cache, online."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_OFFLINE="0",
        HF_HOME=str(cwd / ".hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
        PRECISION_CONVERT_HUB_TIMEOUT="2",
        PYTHONUNBUFFERED="1",
        COLUMNS="200",
    )
    return env


def _check_output(source: Path, output: Path) -> dict[str, Any]:
    """bf16-safe: every tensor is bf16 or (in a recorded fp32 module) fp32, equal to source.to()."""
    config = json.loads((output / "config.json").read_text())
    block = config["precision_convert"]
    assert block["target"] == "bf16-safe" and block["compute_dtype"] == "bfloat16"
    assert config["dtype"] == "bfloat16"
    fp32 = set(block["fp32_modules"])
    assert fp32, "T5's norms should stay fp32 in bf16-safe"
    original = load_file(source / "model.safetensors")
    stored = load_file(output / "model.safetensors")
    assert stored.keys() == original.keys()
    unit_of = units(original)
    for name, tensor in stored.items():
        expected = torch.float32 if unit_of[name] in fp32 else torch.bfloat16
        assert tensor.dtype == expected, name
        assert torch.equal(tensor, original[name].to(expected)), name
    assert any(t.dtype == torch.bfloat16 for t in stored.values())
    return block


def _repo_requests(hub: FakeHub) -> list[tuple[str, str]]:
    """What the client asked the server, less the client's own agent-registry look-up."""
    return [r for r in hub.requests if r[1] != "/api/agent-harnesses"]


def _assert_one_line_error(done: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("precision-convert: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert done.stdout == ""
    return lines[0]


# --------------------------------------------------------------------------- conversion


def test_hub_id_converts_to_the_default_output(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    done = _cli(["model", REPO, "--to", "bf16-safe", "--no-validate"], hub.endpoint, tmp_path)
    assert done.returncode == 0, done.stderr
    output = tmp_path / f"{NAME}-bf16-safe"
    assert output.is_dir(), sorted(p.name for p in tmp_path.iterdir())
    _check_output(served.main, output)
    assert sorted(p.name for p in output.iterdir()) == ["config.json", "model.safetensors"]
    # The real download protocol ran: branch resolved to a commit, tree listed, weights
    # fetched through the LFS redirect, and nothing else was asked for.
    sha = served.main_sha
    assert set(_repo_requests(hub)) == {
        ("GET", f"/api/models/{REPO}/revision/main"),
        ("GET", f"/api/models/{REPO}/tree/{sha}"),
        ("HEAD", f"/{REPO}/resolve/{sha}/config.json"),
        ("GET", f"/{REPO}/resolve/{sha}/config.json"),
        ("HEAD", f"/{REPO}/resolve/{sha}/model.safetensors"),
        ("GET", f"/lfs/{_sha256(served.main / 'model.safetensors')}"),
    }


def test_revision_selects_what_is_converted(served: Served, hub: FakeHub, tmp_path: Path) -> None:
    output = tmp_path / "out"
    hub.tree_page_size = 1  # the listing comes in Link-header pages, as big repos' do
    args = ["--revision", "v2", "--to", "bf16-safe", "--no-validate", "-o", str(output)]
    done = _cli(["model", REPO, *args], hub.endpoint, tmp_path)
    assert done.returncode == 0, done.stderr
    _check_output(served.v2, output)
    main_weights = load_file(served.main / "model.safetensors")
    stored = load_file(output / "model.safetensors")
    assert not all(torch.equal(stored[k], main_weights[k].to(stored[k].dtype)) for k in stored)
    paths = [path for _, path in _repo_requests(hub)]
    assert f"/{REPO}/resolve/{served.v2_sha}/model.safetensors" in paths
    assert f"/api/models/{REPO}/revision/v2" in paths
    assert paths.count(f"/api/models/{REPO}/tree/{served.v2_sha}") == 2  # both pages fetched
    assert not any(served.main_sha in path or path.endswith("/revision/main") for path in paths)


def test_validation_certifies_against_the_hub_source(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    output = tmp_path / "out"
    done = _cli(
        ["model", REPO, "--to", "bf16-safe", "-o", str(output), "--json"], hub.endpoint, tmp_path
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["source"] == REPO and result["validated"] and result["verdict"] == "pass"
    _check_output(served.main, output)
    certificate = json.loads((output / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "pass"
    source = certificate["source"]
    # source_info names a Hub snapshot by repo id and the commit the branch pointed at.
    assert source["id"] == REPO
    assert source["revision"] == served.main_sha
    assert certificate["baseline"]["kind"] == "source"
    assert source["files"] == {"model.safetensors": _sha256(served.main / "model.safetensors")}


# --------------------------------------------------------------------------- errors


def test_unknown_repo_is_one_line_and_exit_2(hub: FakeHub, tmp_path: Path) -> None:
    missing = "acme/no-such-model"
    done = _cli(["model", missing, "--to", "bf16-safe", "--no-validate"], hub.endpoint, tmp_path)
    _assert_one_line_error(done, missing, "no such model repo")
    assert ("GET", f"/api/models/{missing}/revision/main") in hub.requests
    _assert_nothing_written(tmp_path)


def test_unknown_revision_is_named(hub: FakeHub, tmp_path: Path) -> None:
    done = _cli(
        ["model", REPO, "--revision", "v9", "--to", "bf16-safe", "--no-validate"],
        hub.endpoint,
        tmp_path,
    )
    _assert_one_line_error(done, REPO, "'v9'")
    _assert_nothing_written(tmp_path)


def test_hub_down_is_one_line_and_quick(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    done = _cli(
        ["model", REPO, "--to", "bf16-safe", "--no-validate"], f"http://127.0.0.1:{port}", tmp_path
    )
    elapsed = time.monotonic() - started
    _assert_one_line_error(done, REPO, "could not provide it", "ConnectError")
    assert elapsed < 20, f"took {elapsed:.1f}s to give up on a Hub that is down"
    _assert_nothing_written(tmp_path)


def test_hub_that_never_answers_times_out(tmp_path: Path) -> None:
    """A server that accepts the connection and stays silent: huggingface_hub's own client
    would wait forever; the CLI bounds every wait for data."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes handshakes; nobody ever reads or answers
        started = time.monotonic()
        done = _cli(
            ["model", REPO, "--to", "bf16-safe", "--no-validate"],
            f"http://127.0.0.1:{silent.getsockname()[1]}",
            tmp_path,
            timeout=60,
        )
        elapsed = time.monotonic() - started
    _assert_one_line_error(done, REPO, "could not provide it", "Timeout")
    assert elapsed < 30, f"took {elapsed:.1f}s to give up on a silent Hub"
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("where", "fault"),
    [
        # The connection drops: httpx's RemoteProtocolError is no OSError, and once leaked
        # out of resolve() as a traceback with exit 1.
        (rf"^/{REPO}/resolve/[0-9a-f]+/model\.safetensors$", {"drop": True}),
        # The Hub (or a proxy in front of it) is in trouble.
        (rf"^/api/models/{REPO}/", {"status": 503}),
    ],
    ids=["connection-dropped", "hub-503"],
)
def test_hub_failure_mid_way_is_one_line_and_exit_2(
    hub: FakeHub, tmp_path: Path, where: str, fault: dict[str, Any]
) -> None:
    hub.inject(where, **fault)
    done = _cli(["model", REPO, "--to", "bf16-safe", "--no-validate"], hub.endpoint, tmp_path)
    _assert_one_line_error(done, REPO, "could not provide it")
    assert any(re.search(where, path) for _, path in hub.requests)
    _assert_nothing_written(tmp_path)


def test_a_hub_asking_to_wait_a_day_is_one_line_saying_when(hub: FakeHub, tmp_path: Path) -> None:
    """``Retry-After: 86400``: huggingface_hub would sleep a day (five times over, for the
    requests it retries); the command stops at once and says when to try again."""
    hub.inject(rf"^/api/models/{REPO}", status=429, headers={"Retry-After": "86400"})
    started = time.monotonic()
    done = _cli(["model", REPO, "--to", "bf16-safe", "--no-validate"], hub.endpoint, tmp_path)
    assert time.monotonic() - started < 60
    line = _assert_one_line_error(
        done, REPO, "asking to wait 24 h, more than PRECISION_CONVERT_MAX_RETRY_WAIT allows"
    )
    assert "try again after" in line
    _assert_nothing_written(tmp_path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_nothing_written(cwd: Path) -> None:
    """No output directory, and no staging left beside where it would have gone."""
    assert sorted(p.name for p in cwd.iterdir() if p.name != ".hf-home") == []


# --------------------------------------------------------------------------- pc.load


def test_load_of_a_variant_downloads_only_its_weights(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    """``pc.load(repo, variant="bf16")`` fetches the variant's weights and the other files,
    never the repo's fp32 weights (which used to double the bytes downloaded)."""
    repo = "acme/tiny-t5-variants"
    fp32 = (served.main / "model.safetensors").read_bytes()
    state = load_file(served.main / "model.safetensors")
    variant = tmp_path / "model.bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, variant, {"format": "pt"})
    files = {
        "config.json": (served.main / "config.json").read_bytes(),
        "model.safetensors": fp32,
        "model.bf16.safetensors": variant.read_bytes(),
        "README.md": b"# tiny\n",
    }
    hub.add_commit(repo, files)
    hub.requests.clear()
    script = (
        "import precision_convert as pc, torch\n"
        f"model = pc.load({repo!r}, variant='bf16')\n"
        "print(sorted({str(p.dtype) for p in model.parameters()}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=_online_env(hub.endpoint, tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['torch.bfloat16']"
    # Bytes served: regular files answered by /resolve/, LFS content by the CDN's /lfs/.
    by_oid = {hashlib.sha256(data).hexdigest(): data for data in files.values()}
    served_bytes = 0
    for method, path in hub.requests:
        regular = re.fullmatch(rf"/{repo}/resolve/[0-9a-f]+/(.+)", path)
        if method == "GET" and path.startswith("/lfs/"):
            served_bytes += len(by_oid[path.removeprefix("/lfs/")])
        elif method == "GET" and regular and not is_lfs(regular[1]):
            served_bytes += len(files[regular[1]])
    wanted = sum(len(files[n]) for n in ("model.bf16.safetensors", "config.json", "README.md"))
    assert served_bytes == wanted, (served_bytes, wanted, len(fp32))
