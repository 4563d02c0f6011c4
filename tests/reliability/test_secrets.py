"""A recognisable fake Hub token never appears in stdout, stderr, logs, certificates, cards,
batch reports and state, or anything the Hub received, on the error paths too.

``tests/test_push.py`` covers ``push`` itself (a new repo, a rejected token, a read-only
token, a killed push); the interruption trials check the interrupted pushes' output. Here:
``model --push`` with a rejected token, a refused source while a token is set, and a batch
that pushes, first with a wrong token, then resumed with the right one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import _harness
import pytest
from _fake_hub import FakeHub
from test_push import (
    TOKEN,
    USER,
    WRONG_TOKEN,
    _assert_hub_holds_no_secret,
    _assert_no_secret,
    _one_line_error,
    _online,
)

from precision_convert.validation.certify.certificate import Certificate


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        server.add_token(TOKEN, USER)
        yield server


def test_model_push_with_a_rejected_token(
    tmp_path: Path, sources: _harness.Sources, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converted and certified, then the Hub rejects the token: one line, exit 2, and the
    token is nowhere (output, messages, what the Hub stored)."""
    _online(monkeypatch, hub, tmp_path / "hf-home", token=WRONG_TOKEN)
    out = tmp_path / "out"
    done = _harness.run_in_process(
        ["model", str(sources.llama), *_harness.VALIDATE, "-o", str(out), "--push", "ns/rejected"]
    )
    # (in this process the libraries' own progress bars are not switched off: the last line)
    assert done.exit_code == 2 and "Traceback" not in done.output, done.output
    last = _harness.last_line(done.stderr)
    assert last.startswith("precision-convert: ") and "rejected the token" in last, last
    assert Certificate.read(out).passed  # the conversion itself is kept, certified
    _assert_no_secret(done.stdout, done.stderr, roots=(tmp_path,))
    _assert_hub_holds_no_secret(hub)


def test_refused_source_with_a_token_set(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from _corrupt import tiny_source
    from test_bad_input import overlapping_offsets

    _online(monkeypatch, hub, tmp_path / "hf-home")
    source = tiny_source(tmp_path / "src")
    overlapping_offsets(source)
    done = _harness.run_in_process(
        ["model", str(source), "--to", "bf16", "-o", str(tmp_path / "out"), "--push", "ns/x"]
    )
    _one_line_error(done, 2, "overlap")
    _assert_no_secret(done.stdout, done.stderr, roots=(tmp_path,))


def test_batch_push_with_a_wrong_then_the_right_token(
    tmp_path: Path,
    sources: _harness.Sources,
    hub: FakeHub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest that pushes has its token checked before anything runs: a wrong one stops the
    run (one line, exit 2, nothing converted); run again with the right one, it publishes.
    Neither run leaves the token in its output folder (outputs, report, job state, logs), its
    messages, or on the Hub."""
    manifest = tmp_path / "batch.toml"
    manifest.write_text(
        '[defaults]\nto = ["bf16"]\noutput_dir = "out"\ncoverage = "quick"\n'
        'push = "ns/{name}-{target}"\n\n'
        f'[[model]]\nsource = "{sources.llama}"\nname = "secret-test"\n'
    )
    env = _harness.hub_env(hub.endpoint, WRONG_TOKEN, tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _online(monkeypatch, hub, tmp_path / ".hf-home", token=WRONG_TOKEN)

    failed = _harness.run_in_process(["batch", str(manifest)])

    assert failed.exit_code == 2, failed.stderr
    assert "rejected the token" in failed.stderr and failed.stderr.count("\n") == 1
    assert not (tmp_path / "out" / "batch_report.json").exists()
    assert not (tmp_path / "out" / "secret-test-bf16").exists()
    assert "ns/secret-test-bf16" not in hub.repos

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    resumed = _harness.run_in_process(["batch", str(manifest), "--resume"])

    assert resumed.exit_code == 0, resumed.stderr
    assert "README.md" in hub.files("ns/secret-test-bf16")
    _assert_no_secret(
        failed.stdout, failed.stderr, resumed.stdout, resumed.stderr, roots=(tmp_path / "out",)
    )
    _assert_hub_holds_no_secret(hub)
