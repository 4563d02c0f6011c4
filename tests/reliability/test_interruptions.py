"""SIGKILL and SIGINT at seeded random points of conversion, calibration, validation, batch
and push (see ``_harness`` for what each trial checks).

The bounded sample (one trial per kind, the signals alternating) runs with every test run; the
full mode, ``pytest -m slow tests/reliability``, runs five of each signal for each kind, and
``bench/reliability.py`` runs the same trials and prints their counts as JSON.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import _harness
import pytest
from _corrupt import tiny_source
from _fake_hub import FakeHub
from test_push import TOKEN, USER, _assert_no_secret, _online

from precision_convert.cli._common import PROGRESS_PREFIX

#: One trial per kind in every run: each signal on some kinds, the defect-prone ones on SIGINT.
SAMPLE = [
    ("conversion", "SIGKILL"),
    ("calibration", "SIGINT"),
    ("validation", "SIGINT"),
    ("batch", "SIGKILL"),
    ("push", "SIGINT"),
]
#: Seeds of the full mode: five per (kind, signal), ten per kind.
FULL_SEEDS = range(1, 6)


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        server.add_token(TOKEN, USER)
        yield server


def _run(
    kind: str, sig: str, seed: int, tmp_path: Path, sources: _harness.Sources, hub: FakeHub
) -> _harness.Trial:
    trial = _harness.Trial(kind, sig, seed)
    if kind == "push":
        env = _harness.hub_env(hub.endpoint, TOKEN, tmp_path)
        with pytest.MonkeyPatch.context() as mp:
            _online(mp, hub, tmp_path / "hf-home")
            _harness.push(trial, tmp_path, sources, hub, env, _harness.run_in_process)
        _assert_no_secret(trial.stderr, (tmp_path / "logs" / "stdout").read_text())
    else:
        getattr(_harness, kind)(trial, tmp_path, sources)
    if trial.defects:
        pytest.xfail("; ".join(trial.defects))
    return trial


@pytest.mark.parametrize(("kind", "sig"), SAMPLE, ids=[f"{k}-{s}" for k, s in SAMPLE])
def test_interrupted_once(
    kind: str, sig: str, tmp_path: Path, sources: _harness.Sources, hub: FakeHub
) -> None:
    trial = _run(kind, sig, 0, tmp_path, sources, hub)
    assert trial.left


@pytest.mark.slow
@pytest.mark.parametrize("seed", FULL_SEEDS)
@pytest.mark.parametrize("sig", list(_harness.SIGNALS))
@pytest.mark.parametrize("kind", _harness.KINDS)
def test_interrupted_at_random(
    kind: str, sig: str, seed: int, tmp_path: Path, sources: _harness.Sources, hub: FakeHub
) -> None:
    _run(kind, sig, seed, tmp_path, sources, hub)


# --------------------------------------------------------------------------- the message


def test_ctrl_c_during_validation_leaves_nothing_and_says_so(
    sources: _harness.Sources, tmp_path: Path
) -> None:
    """The defect issue 12 opened with: Ctrl-C while ``model`` validated printed "no output
    was written" although the converted weights were already committed. Now ``model``
    validates in the staging directory and renames the output into place with its
    certificate, so a Ctrl-C then leaves nothing at the target, and the line says so."""
    target = tmp_path / "out"
    child = _harness.fork_cli(
        ["model", str(sources.llama), *_harness.VALIDATE, "-o", str(target)],
        tmp_path,
        tmp_path / "logs",
    )
    trial = _harness.Trial("validation", "SIGINT", 0)
    _harness.interrupt(trial, child, _harness.staged_weights(tmp_path, target), window=0.0)
    assert trial.interrupted and trial.returncode == 130, trial.stderr
    said = [line for line in trial.stderr.splitlines() if line.strip()]
    lines = [line for line in said if not line.startswith(PROGRESS_PREFIX)]  # progress aside
    assert "Traceback" not in trial.stderr and len(lines) == 1, trial.stderr
    assert not target.exists() and _harness.leftovers(tmp_path) == []
    assert lines[0] == (
        f"precision-convert: interrupted; nothing was written ({target} does not exist)"
    )


def test_ctrl_c_before_anything_is_written_says_so(tmp_path: Path) -> None:
    """Interrupted while writing the staging directory: nothing at the target, and the line
    says nothing was written."""
    source = tiny_source(tmp_path / "src", _harness._PLAIN_STATE)
    target = tmp_path / "out"
    child = _harness.fork_cli(
        ["model", str(source), "--to", "bf16", "--no-validate", "-o", str(target)],
        tmp_path,
        tmp_path / "logs",
    )
    trial = _harness.Trial("conversion", "SIGINT", 0)
    _harness.interrupt(trial, child, _harness._staging_exists(tmp_path, target), window=0.5)
    assert trial.interrupted
    _harness.check_signal_exit(trial, False, lambda line: True)
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["logs", "src"]


def test_the_forked_command_is_a_real_process(tmp_path: Path) -> None:
    """The warm forkserver runs the real entry point: exit codes and streams as a user sees
    them (a bad flag: exit 2, one line on stderr)."""
    child = _harness.fork_cli(["model", str(tmp_path), "--to", "int4"], tmp_path, tmp_path / "l")
    assert child.wait() == 2
    assert "unknown target 'int4'" in child.stderr and child.stdout == ""


def _workers_of(session: int) -> list[int]:
    """Live batch worker processes in ``session`` (the forked driver's own session)."""
    import subprocess

    # -ww: whole command lines (ps cuts them at 80 columns off a terminal, "spawn_main" too).
    table = subprocess.run(
        ["ps", "-wweo", "pid=,sid=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    return [
        int(row.split()[0])
        for row in table.splitlines()
        if row.split()[1] == str(session) and "Z" not in row.split()[2] and "spawn_main" in row
    ]


@pytest.mark.slow
def test_batch_workers_die_with_their_driver(tmp_path: Path, sources: _harness.Sources) -> None:
    """``kill -9`` of the batch command alone (not its process group): its worker processes
    must not live on, holding memory and, mid-job, writing an output nobody waits for. They
    go within seconds (the kernel kills them with their parent)."""
    manifest = _harness._write_manifest(tmp_path, sources.llama)
    driver = _harness.fork_cli(["batch", str(manifest), "--jobs", "1"], tmp_path, tmp_path / "l")
    deadline = time.monotonic() + 120
    while not _workers_of(driver.pid):
        assert driver.poll() is None and time.monotonic() < deadline, driver.stderr
        time.sleep(0.2)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    try:
        deadline = time.monotonic() + 5
        while _workers_of(driver.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _workers_of(driver.pid) == [], "the worker outlived its driver"
    finally:
        for pid in _workers_of(driver.pid):
            os.kill(pid, signal.SIGKILL)
