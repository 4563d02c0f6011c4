"""``precision-convert push`` / ``pc.push`` against :mod:`_fake_hub`, with the real client.

Most tests run the command in-process (``typer.testing.CliRunner``) with huggingface_hub's
settings pointed at the fake Hub for the duration of the test (conftest imported it offline);
the interrupted-push test runs the installed console script as a subprocess, because only a
real process can be killed mid-upload. The tiny model is built, uploaded and converted from its
Hub id once per module; each test pushes to its own repo.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _certificates
import _models
import pytest
import torch
from _fake_hub import FakeHub
from safetensors.torch import load_file
from typer.testing import CliRunner

from precision_convert.cli.main import app
from precision_convert.conversion.io.hashing import BLOCK_BYTES
from precision_convert.validation.certify.card import write_card
from precision_convert.validation.certify.certificate import (
    CERTIFICATE_NAME,
    Certificate,
)

SOURCE_REPO = "ns/tiny"
VARIANT = "bf16"
USER = "ns"
#: Recognisable, so a leak anywhere is found by a plain search.
TOKEN = "hf_FAKEtokenDoNotLeak123"
READ_TOKEN = "hf_FAKEreadOnlyDoNotLeak456"
WRONG_TOKEN = "hf_FAKEwrongDoNotLeak789"
_SECRETS = (TOKEN, READ_TOKEN, WRONG_TOKEN)
#: What uploads something: none of these may appear when a push is refused.
_WRITES = ("POST", "PUT")


@dataclass(frozen=True)
class Served:
    hub: FakeHub
    source: Path  # the fp32 model uploaded as SOURCE_REPO (three shards)
    output: Path  # `precision-convert model ns/tiny --to bf16-safe`, certified
    variant_output: Path  # the same with `--variant bf16`: certified, for a PR into ns/tiny
    home: Path  # the huggingface_hub cache/token location used by the tests


def _online(mp: pytest.MonkeyPatch, hub: FakeHub, home: Path, token: str | None = TOKEN) -> None:
    """Point this process's huggingface_hub at ``hub``; monkeypatch undoes it afterwards."""
    import huggingface_hub.constants as constants
    from huggingface_hub import hf_api

    mp.setattr(constants, "ENDPOINT", hub.endpoint)
    # The module-level client (huggingface_hub.model_info, which diffusers' pipeline loader
    # calls) read the endpoint at import, as HF_ENDPOINT would have set it.
    mp.setattr(hf_api.api, "endpoint", hub.endpoint)
    mp.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )
    mp.setattr(constants, "HF_HUB_OFFLINE", False)
    mp.setattr(constants, "HF_HUB_DISABLE_XET", True)
    mp.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    mp.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))  # no saved login
    mp.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    if token is None:
        mp.delenv("HF_TOKEN", raising=False)
    else:
        mp.setenv("HF_TOKEN", token)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("push")
    source = root / "source"
    _models.make("t5-encoder").save_pretrained(source, max_shard_size="40KB")
    assert len(list(source.glob("*.safetensors"))) == 3
    home = root / "hf-home"
    output = root / "tiny-bf16-safe"
    variant_output = root / "tiny-bf16-variant"
    with FakeHub() as hub:
        hub.add_token(TOKEN, USER)
        hub.add_token(READ_TOKEN, USER, write=False)
        hub.add_commit(SOURCE_REPO, source)
        with pytest.MonkeyPatch.context() as mp:
            _online(mp, hub, home)
            for out, extra in ((output, []), (variant_output, ["--variant", VARIANT])):
                done = CliRunner().invoke(
                    app, ["model", SOURCE_REPO, "--to", "bf16-safe", "-o", str(out), *extra]
                )
                assert done.exit_code == 0, done.output
        yield Served(hub, source, output, variant_output, home)


@pytest.fixture
def hub(served: Served, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The shared server, online for this test, with a clean log; faults cleared afterwards."""
    _online(monkeypatch, served.hub, served.home)
    served.hub.requests.clear()
    yield served.hub
    for fault in served.hub.faults:
        fault.release.set()
    served.hub.faults.clear()


def _push(*args: str) -> Any:
    return CliRunner().invoke(app, ["push", *args])


def _one_line_error(done: Any, code: int, *fragments: str) -> str:
    assert done.exit_code == code, (done.exit_code, done.output)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("precision-convert: "), lines[0]
    assert "Traceback" not in done.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert done.stdout == ""
    return lines[0]


def _writes(hub: FakeHub) -> list[tuple[str, str]]:
    return [r for r in hub.requests if r[0] in _WRITES and r[1] != "/api/validate-yaml"]


def _local_files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _as_pushed(directory: Path, repo_id: str) -> dict[str, bytes]:
    """The files of ``directory`` as a push to ``repo_id`` sends them: the card's loading
    snippet names the repo instead of a placeholder, nothing else differs."""
    files = _local_files(directory)
    card = files["README.md"].decode()
    assert '"<this repo or dir>"' in card
    files["README.md"] = card.replace('"<this repo or dir>"', f'"{repo_id}"').encode()
    return files


def _download(repo_id: str, target: Path, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, cache_dir=target))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _copy(served: Served, tmp_path: Path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(served.output, copy)
    return copy


def _assert_no_secret(*texts: str | bytes, roots: tuple[Path, ...] = ()) -> None:
    blobs = [t.encode() if isinstance(t, str) else t for t in texts]
    for root in roots:
        blobs += [p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    for secret in _SECRETS:
        assert not any(secret.encode() in blob for blob in blobs), f"{secret} leaked"


def _assert_hub_holds_no_secret(hub: FakeHub) -> None:
    stored: list[bytes] = list(hub.bodies) + list(hub._blobs.values())
    for repo in hub.repos.values():
        stored += [data for files in repo.commits.values() for data in files.values()]
        stored += [f"{t}\n{b}".encode() for t, b in repo.messages.values()]
        stored += [f"{d.title}\n{d.description}".encode() for d in repo.discussions]
    _assert_no_secret(*stored)


# --------------------------------------------------------------------------- new repo


def test_round_trip_to_a_new_repo(served: Served, hub: FakeHub, tmp_path: Path) -> None:
    repo_id = "ns/tiny-bf16-safe"
    done = _push(str(served.output), repo_id)
    assert done.exit_code == 0, done.output
    url = done.stdout.strip()
    assert url.startswith(f"{hub.endpoint}/{repo_id}/commit/"), url
    assert "pushed" in done.stderr and repo_id in done.stderr
    # What the real client sent: card validated, repo created, upload modes asked, the three
    # shards through the LFS batch API and the CDN, then one commit.
    paths = [path for _, path in hub.requests]
    assert "/api/validate-yaml" in paths and "/api/repos/create" in paths
    assert paths.count(f"/api/models/{repo_id}/commit/main") == 1
    assert len([p for p in paths if p.startswith("/upload/")]) == 3

    snapshot = _download(repo_id, tmp_path / "cache")
    pushed = _local_files(snapshot)
    assert pushed.pop(".gitattributes")  # the Hub's own first commit
    # Byte-identical, nothing more, nothing less; the card as rendered for this repo.
    assert pushed == _as_pushed(served.output, repo_id)

    repo = hub.repos[repo_id]
    title, body = repo.messages[repo.refs["main"]]
    assert "bf16-safe" in title and "certificate: pass" in title
    assert "verdict **pass**" in body

    from huggingface_hub import ModelCard

    card = ModelCard.load(snapshot / "README.md")
    assert card.data.base_model == SOURCE_REPO
    assert "precision-convert" in card.data.tags
    # The Hub's client reads the card as written (its YAML normalised the same on both sides).
    written = _as_pushed(served.output, repo_id)["README.md"].decode()
    assert card.content == ModelCard(written).content

    # It loads with pc.load and with plain from_pretrained, and matches fp32.
    from transformers import T5EncoderModel

    import precision_convert as pc

    ids = torch.arange(12).reshape(1, 12) % 100
    reference = T5EncoderModel.from_pretrained(served.source).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids).last_hidden_state
        for model in (pc.load(snapshot), T5EncoderModel.from_pretrained(snapshot)):
            got = model.eval()(input_ids=ids).last_hidden_state.float()
            assert (got - expected).norm() / expected.norm() < 0.05

    # The same push again finds everything in place: no upload, no new commit.
    head = repo.refs["main"]
    hub.requests.clear()
    again = _push(str(served.output), repo_id)
    assert again.exit_code == 0, again.output
    assert "nothing to push" in again.stderr
    assert repo.refs["main"] == head
    assert not [p for _, p in hub.requests if p.startswith("/upload/") or "/commit/" in p]

    _assert_no_secret(done.output, again.output, roots=(tmp_path, served.output, served.home))
    _assert_hub_holds_no_secret(hub)


def test_a_push_names_the_code_it_publishes(served: Served, hub: FakeHub, tmp_path: Path) -> None:
    """Python files a source carried (``auto_map`` modules) go up with the weights, and the
    push says so: they run on every ``trust_remote_code=True`` load of the repo."""
    out = _copy(served, tmp_path)
    code = "modeling_custom.py"
    (out / code).write_text("class Custom: ...\n", encoding="utf-8")
    path = out / CERTIFICATE_NAME
    record = json.loads(path.read_text(encoding="utf-8"))
    record["files"][code] = _sha256((out / code).read_bytes())  # certified as the copy it is
    path.write_text(json.dumps(record, indent=2), encoding="utf-8")
    write_card(Certificate.read(out), out)  # the card names the code too
    done = _push(str(out), "ns/with-code")
    assert done.exit_code == 0, done.output
    notes = [line for line in done.stderr.splitlines() if "trust_remote_code" in line]
    assert notes == [f"note: code that runs if you pass trust_remote_code, published: {code}"]
    assert code in hub.repos["ns/with-code"].commits[hub.repos["ns/with-code"].refs["main"]]


def test_pc_push_takes_token_and_endpoint(
    served: Served, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import precision_convert as pc

    monkeypatch.delenv("HF_TOKEN")
    level = logging.getLogger("huggingface_hub").level
    url = pc.push(served.output, "ns/api-push", private=True, token=TOKEN, endpoint=hub.endpoint)
    assert url.startswith(f"{hub.endpoint}/ns/api-push/commit/")
    assert hub.repos["ns/api-push"].private
    assert logging.getLogger("huggingface_hub").level == level  # no process-wide trace


def test_create_pr_leaves_main_and_is_reused(served: Served, hub: FakeHub, tmp_path: Path) -> None:
    repo_id = "ns/tiny-pr"
    main = hub.add_commit(repo_id, {"README.md": b"# my model\n"})
    first = _push(str(served.output), repo_id, "--create-pr")
    assert first.exit_code == 0, first.output
    assert first.stdout.strip() == f"{hub.endpoint}/{repo_id}/discussions/1"
    repo = hub.repos[repo_id]
    assert repo.refs["main"] == main  # main untouched
    [pr] = repo.discussions
    assert pr.is_pull_request and pr.author == USER and pr.target_branch == "main"
    pushed = _local_files(_download(repo_id, tmp_path / "cache", revision="refs/pr/1"))
    assert pushed == _as_pushed(served.output, repo_id)

    again = _push(str(served.output), repo_id, "--create-pr")
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == first.stdout.strip()
    assert len(repo.discussions) == 1  # the open PR of the same title was reused
    assert "pull request #1" in again.stderr
    assert repo.refs["main"] == main

    # --revision BRANCH opens the PR against that branch.
    hub.add_commit(repo_id, {"README.md": b"# dev\n"}, revision="dev")
    dev = _push(str(served.output), repo_id, "--create-pr", "--revision", "dev")
    assert dev.exit_code == 0, dev.output
    assert repo.discussions[-1].target_branch == "dev" and len(repo.discussions) == 2


def test_existing_repo_keeps_docs_and_loses_uncertified_weights(
    served: Served, hub: FakeHub
) -> None:
    repo_id = "ns/tiny-existing"
    hub.add_commit(
        repo_id, {"LICENSE": b"MIT\n", "pytorch_model.bin": b"old fp32 weights", "README.md": b"x"}
    )
    done = _push(str(served.output), repo_id)
    assert done.exit_code == 0, done.output
    assert "1 stale files removed" in done.stderr
    files = hub.files(repo_id)
    assert files.pop("LICENSE") == b"MIT\n"  # not load-bearing: left alone
    assert files == _as_pushed(served.output, repo_id)  # uncertified weights removed
    repo = hub.repos[repo_id]
    assert "pytorch_model.bin" in repo.messages[repo.refs["main"]][1]


@pytest.mark.parametrize("revision", ["v1", "sha"])
def test_revision_must_be_a_branch(served: Served, hub: FakeHub, revision: str) -> None:
    repo_id = "ns/tiny-tagged"
    sha = hub.add_commit(repo_id, {"README.md": b"# tagged\n"})
    hub.add_tag(repo_id, "v1")
    name = sha if revision == "sha" else revision
    done = _push(str(served.output), repo_id, "--create-pr", "--revision", name)
    _one_line_error(done, 2, repo_id, "is not a branch")
    assert not [w for w in _writes(hub) if w[1] != "/api/repos/create"]


def test_revision_refs_pr_pushes_into_that_pull_request(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    """``--revision refs/pr/N`` (as huggingface_hub takes it): the commit goes into open PR N,
    whatever its title, and main is untouched."""
    repo_id = "ns/tiny-into-pr"
    main = hub.add_commit(repo_id, {"README.md": b"# my model\n"})
    first = _push(str(served.variant_output), repo_id, "--create-pr")
    assert first.exit_code == 0, first.output
    repo = hub.repos[repo_id]
    [pr] = repo.discussions
    done = _push(str(served.output), repo_id, "--revision", f"refs/pr/{pr.num}")
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == f"{hub.endpoint}/{repo_id}/discussions/{pr.num}"
    assert f"updated pull request #{pr.num} on {repo_id} (into main)" in done.stderr
    assert len(repo.discussions) == 1 and repo.refs["main"] == main
    pushed = _local_files(_download(repo_id, tmp_path / "cache", revision=f"refs/pr/{pr.num}"))
    assert pushed == _as_pushed(served.output, repo_id)  # the variant weights it held are gone


def test_revision_refs_pr_must_be_an_open_pull_request(served: Served, hub: FakeHub) -> None:
    repo_id = "ns/tiny-closed-pr"
    hub.add_commit(repo_id, {"README.md": b"# my model\n"})
    assert _push(str(served.output), repo_id, "--create-pr").exit_code == 0
    missing = _push(str(served.output), repo_id, "--revision", "refs/pr/7")
    _one_line_error(missing, 2, repo_id, "no pull request #7")
    both = _push(str(served.output), repo_id, "--revision", "refs/pr/1", "--create-pr")
    _one_line_error(both, 2, "refs/pr/1", "drop one of them")
    tag = _push(str(served.output), repo_id, "--revision", "refs/tags/v1")
    _one_line_error(tag, 2, "neither a branch name nor a pull request (refs/pr/N)")
    hub.repos[repo_id].discussions[0].status = "closed"
    hub.requests.clear()
    closed = _push(str(served.output), repo_id, "--revision", "refs/pr/1")
    _one_line_error(closed, 2, repo_id, "pull request #1 is closed")
    assert [w for w in _writes(hub) if w[1] != "/api/repos/create"] == []


def test_token_and_commit_message_options(
    served: Served, hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``push --token`` and ``--commit-message``, as ``hf upload`` users expect."""
    monkeypatch.delenv("HF_TOKEN")
    repo_id = "ns/tiny-token-option"
    message = "bf16-safe copy, certified"
    done = _push(str(served.output), repo_id, "--token", TOKEN, "--commit-message", message)
    assert done.exit_code == 0, done.output
    repo = hub.repos[repo_id]
    title, body = repo.messages[repo.refs["main"]]
    assert title == message and "verdict **pass**" in body
    _assert_no_secret(done.output, roots=(tmp_path, served.home))
    wrong = _push(str(served.output), repo_id, "--token", WRONG_TOKEN)
    _one_line_error(wrong, 2, "rejected the token")
    _assert_no_secret(wrong.output)


def test_create_pr_when_the_branch_already_holds_the_files_says_why(
    served: Served, hub: FakeHub
) -> None:
    repo_id = "ns/tiny-already-there"
    assert _push(str(served.output), repo_id).exit_code == 0
    done = _push(str(served.output), repo_id, "--create-pr")
    assert done.exit_code == 0, done.output
    assert "no pull request opened" in done.stderr and "nothing to propose" in done.stderr
    assert f"{repo_id}@main already holds these" in done.stderr
    assert hub.repos[repo_id].discussions == []


# --------------------------------------------------------------------------- the gate


def _flip_a_byte(out: Path) -> str:
    shard = out / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard.name


def _change_config(out: Path) -> str:
    config = json.loads((out / "config.json").read_text())
    config["d_ff"] = config["d_ff"] * 2
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return "config.json"


def _add_file(out: Path) -> str:
    (out / "notes.txt").write_text("not certified\n")
    return "notes.txt"


def _delete_shard(out: Path) -> str:
    (out / "model-00003-of-00003.safetensors").unlink()
    return "model-00003-of-00003.safetensors"


def _delete_certificate(out: Path) -> str:
    (out / CERTIFICATE_NAME).unlink()
    return CERTIFICATE_NAME


def _fail_verdict(out: Path) -> str:
    """A certificate that honestly says fail, with the card it renders."""
    certificate = Certificate.read(out)
    certificate.verdict = "fail"
    certificate.failures = ["forward/last_hidden_state: rel_l2 0.5 (must be <= 0.01)"]
    (out / CERTIFICATE_NAME).write_text(json.dumps(certificate.to_dict(), indent=2) + "\n")
    write_card(certificate, out)
    return CERTIFICATE_NAME


def _contradicting_pass(out: Path) -> str:
    """The verdict left ``pass`` over records that all failed, with the card it renders."""
    _certificates.rewrite(out, _certificates.every_record_failed)
    return CERTIFICATE_NAME


def _required_record_missing(out: Path) -> str:
    """The verdict left ``pass`` without the coverage measurement it requires."""
    _certificates.rewrite(out, _certificates.coverage_dropped)
    return CERTIFICATE_NAME


def _edit_card(out: Path) -> str:
    with (out / "README.md").open("a") as card:
        card.write("\nBest model ever, no caveats.\n")
    return "README.md"


@pytest.mark.parametrize(
    "tamper",
    [
        _flip_a_byte,
        _change_config,
        _add_file,
        _delete_shard,
        _delete_certificate,
        _fail_verdict,
        _contradicting_pass,
        _required_record_missing,
        _edit_card,
    ],
    ids=[
        "shard-byte",
        "config-key",
        "added-file",
        "removed-file",
        "no-certificate",
        "fail-verdict",
        "contradicting-pass",
        "required-record-missing",
        "card",
    ],
)
def test_gate_refuses_and_uploads_nothing(
    served: Served, hub: FakeHub, tmp_path: Path, tamper: Callable[[Path], str]
) -> None:
    """Each change after certification is caught by ``push`` (nothing sent) and by
    ``validate --verify``, both naming the file: one verifier, the same problems."""
    out = _copy(served, tmp_path)
    verified = CliRunner().invoke(app, ["validate", str(out), "--verify"])
    assert verified.exit_code == 0 and "verified:" in verified.stdout, verified.output
    culprit = tamper(out)
    done = _push(str(out), "ns/refused")
    line = _one_line_error(done, 1, culprit, "push refused")
    if tamper is _fail_verdict:
        assert "'fail'" in line
    if tamper in (_contradicting_pass, _required_record_missing):
        assert "verdict 'pass' contradicted by its own records" in line
    assert hub.requests == []  # the gate runs before anything talks to the Hub
    assert "ns/refused" not in hub.repos
    verified = CliRunner().invoke(app, ["validate", str(out), "--verify"])
    verify_line = _one_line_error(verified, 1, culprit, "not as certified")
    problems = line.split("push refused, nothing uploaded: ", 1)[1]
    assert verify_line.split("not as certified: ", 1)[1] == problems


def test_gate_hashes_bytes_not_names(served: Served, hub: FakeHub, tmp_path: Path) -> None:
    """A shard that is a link to a Hub-cache-style blob (named by a sha256) is still hashed:
    the name proves nothing about the bytes."""
    out = _copy(served, tmp_path)
    shard = out / "model-00001-of-00003.safetensors"
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    data = bytearray(shard.read_bytes())
    blob = blobs / _sha256(bytes(data))  # named for the certified content ...
    data[-2] ^= 0x01
    blob.write_bytes(bytes(data))  # ... holding something else
    shard.unlink()
    shard.symlink_to(blob)
    done = _push(str(out), "ns/refused")
    _one_line_error(done, 1, shard.name, "changed since certification")
    assert hub.requests == []


def _with_a_large_file(served: Served, tmp_path: Path) -> Path:
    """A certified copy of the output holding one more file, larger than a block (so the push
    re-reads it to upload instead of keeping it in memory), covered by the certificate."""
    out = _copy(served, tmp_path)
    large = out / "large.safetensors"
    large.write_bytes(os.urandom(2 * BLOCK_BYTES + 1000))
    certificate = Certificate.read(out)
    certificate.files[large.name] = _sha256(large.read_bytes())
    (out / CERTIFICATE_NAME).write_text(json.dumps(certificate.to_dict(), indent=2) + "\n")
    write_card(certificate, out)
    return out


@pytest.mark.parametrize("offset", [0, 2 * BLOCK_BYTES + 500], ids=["first-block", "last-block"])
def test_a_file_changed_between_gate_and_upload_is_never_sent(
    served: Served, hub: FakeHub, tmp_path: Path, offset: int
) -> None:
    """The gate hashes a large shard; it changes in place (a tool saving over it) before the
    client uploads it: the push is refused naming it, its changed bytes never leave the machine,
    nothing is committed and nothing is stored under the certified object id."""
    out = _with_a_large_file(served, tmp_path)
    large = out / "large.safetensors"
    certified = _sha256(large.read_bytes())
    marker = b"changed after the gate" * 4

    def change_it() -> None:
        with large.open("r+b") as f:
            f.seek(offset)
            f.write(marker)

    repo_id = f"ns/changed-{offset}"
    hub.inject(r"\.git/info/lfs/objects/batch$", before=change_it, times=1)
    done = _push(str(out), repo_id)
    _one_line_error(done, 1, "large.safetensors: changed since certification", "push refused")
    assert marker in large.read_bytes()  # it really changed under the push
    assert not any(marker in body for body in hub.bodies)
    assert certified not in hub._blobs and (repo_id, certified) not in hub.uploads
    assert set(hub.files(repo_id)) == {".gitattributes"}  # no commit


def test_a_large_file_read_again_for_a_retry_is_checked_again(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    """The client retries a failed upload by rewinding the stream: the second read is checked
    block by block too, and what the Hub stores is the certified file."""
    out = _with_a_large_file(served, tmp_path)
    certified = (out / "large.safetensors").read_bytes()
    hub.inject(rf"^/upload/{_sha256(certified)}/", status=503, times=1)
    done = _push(str(out), "ns/large-retried")
    assert done.exit_code == 0, done.output
    uploads = [p for m, p in hub.requests if m == "PUT" and _sha256(certified) in p]
    assert len(uploads) == 2  # refused once, then sent again
    assert hub.files("ns/large-retried")["large.safetensors"] == certified


def test_a_small_file_changed_after_the_gate_goes_up_as_certified(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    """Files up to a block are read once, hashed and kept: a change after the gate does not
    reach the Hub, which stores the bytes that were certified."""
    out = _copy(served, tmp_path)
    shard = out / "model-00001-of-00003.safetensors"
    certified = shard.read_bytes()
    hub.inject(r"/preupload/", before=lambda: shard.write_bytes(b"changed"), times=1)
    done = _push(str(out), "ns/small-changed")
    assert done.exit_code == 0, done.output
    assert shard.read_bytes() == b"changed"
    assert hub.files("ns/small-changed")[shard.name] == certified


def test_source_repo_is_not_overwritten(served: Served, hub: FakeHub) -> None:
    done = _push(str(served.output), SOURCE_REPO)
    _one_line_error(done, 2, SOURCE_REPO, "source repo")
    assert _writes(hub) == []


# --------------------------------------------------------------------------- auth


def test_wrong_token_is_one_line_and_never_shown(
    served: Served, hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_TOKEN", WRONG_TOKEN)
    done = _push(str(served.output), "ns/wrong-token")
    _one_line_error(done, 2, "rejected the token")
    assert _writes(hub) == []
    _assert_no_secret(done.output, roots=(tmp_path, served.home))
    _assert_hub_holds_no_secret(hub)


def test_missing_token_is_one_line(
    served: Served, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN")
    done = _push(str(served.output), "ns/no-token")
    _one_line_error(done, 2, "no Hugging Face token", "HF_TOKEN")
    assert hub.requests == []


@pytest.mark.parametrize(
    ("token", "repo_id", "hint"),
    [
        (READ_TOKEN, "ns/read-only", "this token is read-only: use one with write access"),
        (TOKEN, "someone-else/model", "push to ns/model instead"),
    ],
    ids=["read-only-token", "foreign-namespace"],
)
def test_no_write_permission_names_the_repo(
    served: Served,
    hub: FakeHub,
    monkeypatch: pytest.MonkeyPatch,
    token: str,
    repo_id: str,
    hint: str,
) -> None:
    """A 403 says what would help: never --create-pr where it cannot (a read-only token, a
    repo that cannot be created in someone else's namespace)."""
    monkeypatch.setenv("HF_TOKEN", token)
    done = _push(str(served.output), repo_id)
    line = _one_line_error(done, 2, repo_id, "403", hint)
    assert "--create-pr" not in line
    assert repo_id not in hub.repos
    assert [w for w in _writes(hub) if w[1] != "/api/repos/create"] == []
    _assert_no_secret(done.output)


def test_a_403_on_someone_elses_repo_suggests_a_pull_request(served: Served, hub: FakeHub) -> None:
    repo_id = "someone-else/existing"
    main = hub.add_commit(repo_id, {"README.md": b"# theirs\n"})
    done = _push(str(served.output), repo_id)
    _one_line_error(done, 2, repo_id, "403", "--create-pr proposes the files as a pull request")
    assert hub.repos[repo_id].refs["main"] == main


def test_a_pr_needs_no_write_access_to_the_namespace(served: Served, hub: FakeHub) -> None:
    repo_id = "someone-else/model"
    main = hub.add_commit(repo_id, {"README.md": b"# theirs\n"})
    done = _push(str(served.output), repo_id, "--create-pr")
    assert done.exit_code == 0, done.output
    repo = hub.repos[repo_id]
    assert repo.refs["main"] == main and repo.discussions[0].author == USER


# --------------------------------------------------------------------------- failures


def test_transient_hub_errors_are_retried(served: Served, hub: FakeHub) -> None:
    repo_id = "ns/tiny-retried"
    hub.inject(r"/preupload/", status=503, times=1)
    done = _push(str(served.output), repo_id)
    assert done.exit_code == 0, done.output
    assert [p for _, p in hub.requests].count(f"/api/models/{repo_id}/preupload/main") == 2


@pytest.mark.parametrize("form", ["seconds", "http-date"])
def test_retry_after_is_read_as_seconds_or_an_http_date(
    served: Served, hub: FakeHub, form: str
) -> None:
    """A 429's ``Retry-After`` reaches the caller that retries (batch), in either form the
    HTTP standard allows."""
    from email.utils import formatdate

    from precision_convert.core.errors import PushFailed
    from precision_convert.hub import push_with_result

    value = "30" if form == "seconds" else formatdate(time.time() + 30, usegmt=True)
    hub.inject(r"/commit/", status=429, headers={"Retry-After": value})
    with pytest.raises(PushFailed) as refused:
        push_with_result(served.output, f"ns/tiny-429-{form}")
    assert refused.value.status == 429
    assert refused.value.retry_after is not None and 28 <= refused.value.retry_after <= 30


@pytest.fixture
def command_client() -> Iterator[None]:
    """huggingface_hub's client as the command sets it up for its process (``run()`` calls
    :func:`bound_hub_requests`; CliRunner does not), for this test only."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    from precision_convert.core.hub_client import bound_hub_requests

    before = _http._GLOBAL_CLIENT_FACTORY
    bound_hub_requests()
    yield
    set_client_factory(before)


def test_a_wait_beyond_the_maximum_stops_with_when_to_retry(
    served: Served, hub: FakeHub, command_client: None
) -> None:
    """``Retry-After: 86400`` on the preupload: no sleeping for a day (the client would, five
    times over), but one line saying when to run push again; nothing committed, and the rerun
    completes."""
    from datetime import UTC, datetime, timedelta

    repo_id = "ns/tiny-retry-tomorrow"
    hub.inject(r"/preupload/", status=429, headers={"Retry-After": "86400"})
    started = time.monotonic()
    done = _push(str(served.output), repo_id)
    assert time.monotonic() - started < 30
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%d")
    _one_line_error(
        done,
        2,
        f"{repo_id}: the Hub answered 429 to POST /api/models/{repo_id}/preupload/main asking "
        "to wait 24 h, more than PRECISION_CONVERT_MAX_RETRY_WAIT allows (300 s)",
        f"run push again after {tomorrow} ",
    )
    paths = [p for _, p in hub.requests]
    assert paths.count(f"/api/models/{repo_id}/preupload/main") == 1  # not retried
    assert set(hub.files(repo_id)) == {".gitattributes"}  # the repo as created, no commit
    hub.faults.clear()
    again = _push(str(served.output), repo_id)
    assert again.exit_code == 0, again.output
    assert hub.files(repo_id).keys() - {".gitattributes"} == _local_files(served.output).keys()


@pytest.mark.parametrize("where", ["preupload", "commit"])
def test_a_wait_within_the_maximum_is_honoured_and_announced(
    served: Served,
    hub: FakeHub,
    command_client: None,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """A short ``Retry-After`` is waited, by the client (the preupload) or by the command (the
    commit, which the client does not retry), and the push completes. A wait longer than
    ``ANNOUNCED_WAIT`` (lowered here, so that a 1 s wait counts) is said on stderr."""
    import precision_convert.core.hub_client as hub_client

    monkeypatch.setattr(hub_client, "ANNOUNCED_WAIT", 0.5)
    repo_id = f"ns/tiny-retry-soon-{where}"
    hub.inject(rf"/{where}/", status=429, headers={"Retry-After": "1"}, times=1)
    started = time.monotonic()
    done = _push(str(served.output), repo_id)
    assert done.exit_code == 0, done.output
    assert time.monotonic() - started >= 1.0
    path = f"/api/models/{repo_id}/{where}/main"
    assert [p for _, p in hub.requests].count(path) == 2
    (line,) = [line for line in done.stderr.splitlines() if "waiting" in line]
    assert line.startswith(f"precision-convert: the Hub answered 429 to POST {path}: waiting 1 s")
    assert line.endswith(" UTC")
    assert hub.files(repo_id).keys() - {".gitattributes"} == _local_files(served.output).keys()


def test_a_bad_maximum_is_refused_before_anything_is_sent(
    served: Served, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRECISION_CONVERT_MAX_RETRY_WAIT", "a while")
    done = _push(str(served.output), "ns/tiny-bad-maximum")
    _one_line_error(done, 2, "PRECISION_CONVERT_MAX_RETRY_WAIT='a while'", "in seconds")
    assert hub.requests == []


def test_failed_commit_is_one_line_and_a_rerun_completes(served: Served, hub: FakeHub) -> None:
    repo_id = "ns/tiny-commit-503"
    hub.inject(r"/commit/", status=503)  # the commit call is not retried by the client
    done = _push(str(served.output), repo_id)
    _one_line_error(done, 2, repo_id, "503", "run push again")
    assert set(hub.files(repo_id)) == {".gitattributes"}  # nothing committed
    uploaded = {oid for repo, oid in hub.uploads if repo == repo_id}
    hub.faults.clear()
    hub.requests.clear()
    again = _push(str(served.output), repo_id)
    assert again.exit_code == 0, again.output
    assert not [p for _, p in hub.requests if p.startswith("/upload/")]  # all already there
    assert uploaded >= {
        _sha256(d) for p, d in _local_files(served.output).items() if p.endswith(".safetensors")
    }
    assert hub.files(repo_id).keys() - {".gitattributes"} == _local_files(served.output).keys()


def test_a_branch_that_moves_is_not_overwritten(served: Served, hub: FakeHub) -> None:
    repo_id = "ns/tiny-raced"
    hub.add_commit(repo_id, {"README.md": b"# first\n"})

    def someone_else_commits() -> None:
        hub.add_commit(repo_id, {"README.md": b"# theirs\n"})

    hub.inject(rf"^/api/models/{repo_id}/commit/", before=someone_else_commits, times=1)
    done = _push(str(served.output), repo_id)
    _one_line_error(done, 2, repo_id, "moved")
    assert hub.files(repo_id) == {"README.md": b"# theirs\n"}


def test_killed_push_resumes_without_uploading_twice(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    repo_id = "ns/tiny-interrupted"
    start = len(hub.uploads)
    held = hub.inject(r"^/upload/", method="PUT", hold=True, skip=1, times=1)
    process = _spawn(["push", str(served.output), repo_id], hub, tmp_path)
    try:
        assert held.reached.wait(120), "the second LFS upload never started"
    finally:
        process.kill()  # mid-upload: one object stored, one parked, maybe one in flight
        stdout, stderr = process.communicate(timeout=30)
    held.release.set()
    hub.faults.clear()
    first_run = {oid for repo, oid in hub.uploads[start:] if repo == repo_id}
    assert first_run, "nothing was uploaded before the kill"
    assert set(hub.files(repo_id)) == {".gitattributes"}  # nothing committed

    hub.requests.clear()
    done = _push(str(served.output), repo_id)
    assert done.exit_code == 0, done.output
    resent = {p.split("/")[2] for m, p in hub.requests if m == "PUT"}
    assert resent and not resent & first_run  # what the Hub held was skipped
    weights = {
        _sha256(d) for p, d in _local_files(served.output).items() if p.endswith(".safetensors")
    }
    counts = Counter(oid for repo, oid in hub.uploads[start:] if repo == repo_id)
    assert set(counts) == weights and set(counts.values()) == {1}  # each object uploaded once
    pushed = hub.files(repo_id)
    pushed.pop(".gitattributes")
    assert pushed == _as_pushed(served.output, repo_id)
    _assert_no_secret(stdout, stderr, done.output)


def _spawn(args: list[str], hub: FakeHub, cwd: Path) -> subprocess.Popen[str]:
    script = Path(sys.executable).with_name("precision-convert")
    command = (
        [str(script)]
        if script.is_file()
        else [sys.executable, "-c", "from precision_convert.cli.main import run; run()"]
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGING")) and k != "PRECISION_CONVERT_DEBUG"
    }
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_TOKEN=TOKEN,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_OFFLINE="0",
        HF_HOME=str(cwd / ".hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONUNBUFFERED="1",
    )
    return subprocess.Popen(
        command + args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# --------------------------------------------------------------------------- variant PR


def _variant_copy(served: Served, tmp_path: Path) -> Path:
    copy = tmp_path / "variant"
    shutil.copytree(served.variant_output, copy)
    return copy


def test_variant_output_keeps_the_source_config_and_names(served: Served) -> None:
    """``--variant``: the Hub's variant names, the source's own config, the variant's
    certificate; and plain ``from_pretrained(dir, variant=)`` reads it."""
    out = served.variant_output
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "README.md",
        "config.json",
        f"model.{VARIANT}-00001-of-00003.safetensors",
        f"model.{VARIANT}-00002-of-00003.safetensors",
        f"model.{VARIANT}-00003-of-00003.safetensors",
        f"model.safetensors.index.{VARIANT}.json",
        f"precision_certificate.{VARIANT}.json",
    ]
    assert (out / "config.json").read_bytes() == (served.source / "config.json").read_bytes()
    index = json.loads((out / f"model.safetensors.index.{VARIANT}.json").read_text())
    assert set(index["weight_map"].values()) == {
        f"model.{VARIANT}-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    }
    certificate = Certificate.read(out)
    assert certificate.passed and certificate.source["variant"] == VARIANT
    assert certificate.source["id"] == SOURCE_REPO
    calls = {p.label: p.call for p in certificate.load_paths}
    assert calls["plain"] == f'T5EncoderModel.from_pretrained("<repo>", variant="{VARIANT}")'
    assert calls["pc.load"] == f'precision_convert.load("<repo>", variant="{VARIANT}")'
    assert f"precision_certificate.{VARIANT}.json" in (out / "README.md").read_text()
    # The source's config says float32, so the plain load of a variant upcasts: finite, and
    # the certificate measured exactly that load.
    assert certificate.load_path("plain").verdict == "pass"


def test_variant_output_opens_a_pr_into_its_source(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    variant = VARIANT
    out = _variant_copy(served, tmp_path)
    repo = hub.repos[SOURCE_REPO]
    main, source_files = repo.refs["main"], hub.files(SOURCE_REPO)
    done = _push(str(out), SOURCE_REPO)
    assert done.exit_code == 0, done.output
    url = done.stdout.strip()
    num = int(url.rsplit("/", 1)[1])
    assert url == f"{hub.endpoint}/{SOURCE_REPO}/discussions/{num}"
    assert repo.refs["main"] == main and hub.files(SOURCE_REPO) == source_files

    added = {p: d for p, d in _local_files(out).items() if f".{variant}" in p}
    assert sorted(added) == [
        f"model.{variant}-00001-of-00003.safetensors",
        f"model.{variant}-00002-of-00003.safetensors",
        f"model.{variant}-00003-of-00003.safetensors",
        f"model.safetensors.index.{variant}.json",
        f"precision_certificate.{variant}.json",
    ]
    pr_files = hub.files(SOURCE_REPO, f"refs/pr/{num}")
    assert pr_files == {**source_files, **added}  # the source's own files untouched
    pr = repo.pull_request(num)
    assert "verdict **pass**" in pr.description and "## Parity" in pr.description

    # transformers loads the variant from the PR revision, as does pc.load (with the dtype
    # map the shards carry, since the source's config has none).
    from transformers import T5EncoderModel

    import precision_convert as pc

    revision = f"refs/pr/{num}"
    model = T5EncoderModel.from_pretrained(SOURCE_REPO, revision=revision, variant=variant)
    loaded = pc.load(SOURCE_REPO, variant=variant, revision=revision)
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob(f"model.{variant}-*.safetensors")):
        stored.update(load_file(shard))
    state, kept = model.state_dict(), loaded.state_dict()
    for name, tensor in stored.items():
        assert torch.equal(state[name].float(), tensor.float()), name
        assert kept[name].dtype == tensor.dtype and torch.equal(kept[name], tensor), name
    assert {t.dtype for t in stored.values()} == {torch.bfloat16, torch.float32}

    again = _push(str(out), SOURCE_REPO)
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == url
    assert len([d for d in repo.discussions if d.is_pull_request]) == 1
    assert repo.refs["main"] == main


def test_variant_kept_files_must_match_the_source(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    out = _variant_copy(served, tmp_path)
    # Certified, but with a config the source repo does not serve.
    config = json.loads((out / "config.json").read_text())
    config["dropout_rate"] = 0.5
    (out / "config.json").write_text(json.dumps(config))
    name = next(out.glob("precision_certificate.*.json"))
    certificate = Certificate.from_dict(json.loads(name.read_text()))
    certificate.files = {
        **certificate.files,
        "config.json": _sha256((out / "config.json").read_bytes()),
    }
    name.write_text(json.dumps(certificate.to_dict(), indent=2) + "\n")
    write_card(certificate, out)
    before = len(hub.repos[SOURCE_REPO].discussions)
    done = _push(str(out), SOURCE_REPO)
    _one_line_error(done, 1, "config.json", "differs from ns/tiny")
    assert len(hub.repos[SOURCE_REPO].discussions) == before
    assert not [p for _, p in hub.requests if p.startswith("/upload/") or "/commit/" in p]


def test_card_yaml_describes_the_relation(served: Served) -> None:
    from huggingface_hub import ModelCard

    data = ModelCard.load(served.output / "README.md").data
    assert data.base_model == SOURCE_REPO
    assert data.base_model_relation == "quantized"
    assert data.library_name == "transformers"
    assert {"precision-convert", "bf16-safe", "bf16"} <= set(data.tags)


def test_fake_hub_validates_card_yaml() -> None:
    """The Hub's metadata checks that the pushed cards must pass (and what fails them)."""
    from _fake_hub import validate_card

    good = "---\nbase_model: ns/tiny\nbase_model_relation: quantized\nlicense: mit\n---\n# x\n"
    assert validate_card(good) == ([], [])
    errors, _ = validate_card("---\nbase_model_relation: quantized\n---\n")
    assert errors
    errors, _ = validate_card("---\nbase_model: not a repo\npipeline_tag: dancing\n---\n")
    assert len(errors) == 2


def test_model_push_converts_validates_and_publishes(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    """``model SOURCE --to T --push REPO``: one command from a Hub id to a certified repo."""
    repo_id = "ns/tiny-fp16-in-one-go"
    out = tmp_path / "one-go"
    done = CliRunner().invoke(
        app, ["model", SOURCE_REPO, "--to", "bf16-safe", "-o", str(out), "--push", repo_id]
    )
    assert done.exit_code == 0, done.output
    assert repo_id in done.stderr and "pushed" in done.stderr
    snapshot = _download(repo_id, tmp_path / "cache")
    pushed = _local_files(snapshot)
    pushed.pop(".gitattributes")
    assert pushed == _as_pushed(out, repo_id)
    _assert_no_secret(done.output, roots=(out,))

    refused = CliRunner().invoke(
        app, ["model", SOURCE_REPO, "--to", "bf16", "--no-validate", "--push", repo_id]
    )
    _one_line_error(refused, 2, "--push needs a certificate")


def test_model_push_of_a_variant_pr_prints_its_url(
    served: Served, hub: FakeHub, tmp_path: Path
) -> None:
    source = "ns/tiny-variant-source"
    hub.add_commit(source, served.source)
    args = ["model", source, "--to", "bf16", "--variant", VARIANT, "-o", str(tmp_path / "v")]
    done = CliRunner().invoke(app, [*args, "--push", source])
    assert done.exit_code == 0, done.output
    [pr] = hub.repos[source].discussions
    url = f"{hub.endpoint}/{source}/discussions/{pr.num}"
    assert f"opened variant pull request #{pr.num} on {source} (into main)" in done.stderr
    assert done.stderr.rstrip().endswith(url)


@pytest.mark.parametrize("kind", ["unet", "pipeline"])
def test_diffusers_variant_pr_loads_with_from_pretrained(
    hub: FakeHub, tmp_path: Path, kind: str
) -> None:
    """A diffusers model and a whole pipeline: ``model REPO --variant fp16 --push REPO`` opens a
    PR into REPO that diffusers' own ``from_pretrained(REPO, revision=PR, variant=)`` loads, and
    ``pc.load`` too, each giving what the fp32 source gives."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel

    import precision_convert as pc

    repo_id, source, out = f"ns/tiny-{kind}", tmp_path / "source", tmp_path / "out"
    if kind == "unet":
        _models.save("unet", source)
    else:
        _models.sd_pipeline(source)
    hub.add_commit(repo_id, source)
    source_files = hub.files(repo_id)
    command = ["model", repo_id, "--to", "fp16-safe", "--variant", "fp16", "-o", str(out)]
    done = CliRunner().invoke(app, [*command, "--coverage", "quick", "--push", repo_id])
    assert done.exit_code == 0, done.output
    (pr,) = [d for d in hub.repos[repo_id].discussions if d.is_pull_request]
    revision = f"refs/pr/{pr.num}"
    added = hub.files(repo_id, revision)
    assert {p: d for p, d in added.items() if p in source_files} == source_files
    new = sorted(set(added) - set(source_files))
    weights = "diffusion_pytorch_model.fp16.safetensors"
    if kind == "unet":
        assert new == [weights, "precision_certificate.fp16.json"]
    else:
        assert new == [
            "precision_certificate.fp16.json",
            "text_encoder/model.fp16.safetensors",
            f"unet/{weights}",
            f"vae/{weights}",
        ]
    for path in new:
        assert added[path] == (out / path).read_bytes()

    with torch.no_grad():
        if kind == "unet":
            sample = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
            context = torch.randn(1, 4, 24, generator=torch.Generator().manual_seed(1))

            def run(model: Any) -> torch.Tensor:
                dtype = next(model.parameters()).dtype
                return model(sample.to(dtype), 999, context.to(dtype)).sample.float()

            expected = run(UNet2DConditionModel.from_pretrained(source))
            plain = UNet2DConditionModel.from_pretrained(repo_id, revision=revision, variant="fp16")
            loaded = pc.load(repo_id, variant="fp16", revision=revision)
            for result in (run(plain), run(loaded)):
                assert torch.isfinite(result).all()
                similarity = torch.nn.functional.cosine_similarity(
                    result.flatten(), expected.flatten(), dim=0
                )
                assert similarity >= 0.999
        else:
            expected = _models.generate(DiffusionPipeline.from_pretrained(source))
            plain = DiffusionPipeline.from_pretrained(repo_id, revision=revision, variant="fp16")
            loaded = pc.load(repo_id, variant="fp16", revision=revision)
            for pipe in (plain, loaded):
                images = _models.generate(pipe).float()
                mse = (images - expected).pow(2).mean().item()
                assert mse == 0 or 10 * math.log10(1 / mse) >= 30
            assert loaded.unet.dtype == torch.float16  # pc.load keeps the memory saving


# --------------------------------------------------------------------------- what is published


def test_a_smoke_check_is_not_published(served: Served, hub: FakeHub, tmp_path: Path) -> None:
    """``model --no-validate`` → ``validate`` (no baseline) → ``push``: a comparison of the
    weights with themselves certifies nothing, and the refusal says how to certify."""
    out = tmp_path / "unvalidated"
    converted = CliRunner().invoke(
        app, ["model", str(served.source), "--to", "bf16-safe", "-o", str(out), "--no-validate"]
    )
    assert converted.exit_code == 0, converted.output
    line = _one_line_error(_push(str(out), "ns/smoke"), 1, "--baseline SOURCE", "missing")
    assert "precision-convert validate" in line
    smoke = CliRunner().invoke(app, ["validate", str(out), "--coverage", "quick"])
    assert smoke.exit_code == 1 and "--baseline SOURCE" in smoke.stderr, smoke.output
    card = (out / "README.md").read_text()
    assert "parity-certified" not in card and "against the source" not in card
    _one_line_error(_push(str(out), "ns/smoke"), 1, "smoke check", "--baseline SOURCE")
    assert hub.requests == []  # refused before anything talks to the Hub


def test_no_local_path_is_published(
    served: Served, hub: FakeHub, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Whatever is uploaded names the source by its Hub id or its directory's name only, and
    the card's loading snippet names the repo it was pushed to."""
    data = tmp_path / "calibration.jsonl"
    data.write_text(json.dumps({"input_ids": [[3, 14, 15, 92, 65]]}) + "\n")
    local = tmp_path / "local-bf16-safe"
    done = CliRunner().invoke(
        app,
        [
            *("model", str(served.source), "--to", "bf16-safe", "-o", str(local)),
            *("--calibration-data", str(data), "--coverage", "quick", "--push", "ns/from-local"),
        ],
    )
    assert done.exit_code == 0, done.output
    assert _push(str(served.output), "ns/from-hub").exit_code == 0

    stored: list[bytes] = list(hub.bodies)
    for repo in hub.repos.values():
        stored += [blob for files in repo.commits.values() for blob in files.values()]
        stored += [f"{t}\n{b}".encode() for t, b in repo.messages.values()]
    private = [str(tmp_path_factory.getbasetemp()), str(served.home), str(Path.home())]
    for text in private:
        assert not any(text.encode() in blob for blob in stored), f"{text} was published"
    local_card = hub.files("ns/from-local")["README.md"].decode()
    assert "# bf16-safe conversion of source\n" in local_card
    assert 'pc.load("ns/from-local")' in local_card and "<this repo or dir>" not in local_card
    certificate = json.loads(hub.files("ns/from-local")[CERTIFICATE_NAME])
    assert certificate["source"]["id"] == certificate["source"]["path"] == "source"
    from_hub = json.loads(hub.files("ns/from-hub")[CERTIFICATE_NAME])
    assert from_hub["source"]["path"] == SOURCE_REPO
