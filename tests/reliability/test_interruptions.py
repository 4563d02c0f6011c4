"""Interrupted runs: what a SIGKILL or a Ctrl-C leaves, and what the next run makes of it.

- **At seeded random points** of conversion, calibration, validation, batch and push (see
  ``_harness`` for what each trial checks). The bounded sample (one trial per kind, the
  signals alternating) runs with every test run; the full mode, ``pytest -m slow
  tests/reliability``, runs five of each signal for each kind, and ``bench/reliability.py``
  runs the same trials and prints their counts as JSON.
- **Mid-write, deterministically**: the conversion runs in a real subprocess of the installed
  package that reads its source in 256 KiB chunks with a short pause per chunk (patched in
  before the CLI starts; nothing else changes), so the write of an 8 MiB source spans about a
  second and the test can signal it once data has reached the staging file. A killed
  conversion never leaves a partial output at the target path, and the next run cleans up
  what it left; a write that cannot finish (a full disk, a target that is not ours) leaves
  nothing either.
- **The message**: the one line an interrupted command prints says what is on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _harness
import pytest
import torch
from _corrupt import cli_env, leftovers, tiny_source, tree_digest
from _fake_hub import FakeHub
from safetensors.torch import load_file
from test_push import TOKEN, USER, _assert_no_secret, _online
from typer.testing import CliRunner

from precision_convert.cli._common import PROGRESS_PREFIX
from precision_convert.cli.main import app

#: One trial per kind in every run: each signal on some kinds, the defect-prone ones on SIGINT.
SAMPLE = [
    ("conversion", "SIGKILL"),
    ("calibration", "SIGINT"),
    ("validation", "SIGINT"),
    ("batch", "SIGKILL"),
    ("push", "SIGINT"),
]
#: SIGTERM (what ``kill``, ``timeout`` and schedulers send) at each stage, and SIGHUP once: the
#: run unwinds as a Ctrl-C does, and exits 143 (129).
TERMINATED = [
    ("conversion", "SIGTERM"),
    ("calibration", "SIGTERM"),
    ("validation", "SIGTERM"),
    ("batch", "SIGTERM"),
    ("push", "SIGTERM"),
    ("conversion", "SIGHUP"),
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


@pytest.mark.parametrize(
    ("kind", "sig"), SAMPLE + TERMINATED, ids=[f"{k}-{s}" for k, s in SAMPLE + TERMINATED]
)
def test_interrupted_once(
    kind: str, sig: str, tmp_path: Path, sources: _harness.Sources, hub: FakeHub
) -> None:
    trial = _run(kind, sig, 0, tmp_path, sources, hub)
    assert trial.left


@pytest.mark.slow
@pytest.mark.parametrize("seed", FULL_SEEDS)
@pytest.mark.parametrize("sig", _harness.FULL_SIGNALS)
@pytest.mark.parametrize("kind", _harness.KINDS)
def test_interrupted_at_random(
    kind: str, sig: str, seed: int, tmp_path: Path, sources: _harness.Sources, hub: FakeHub
) -> None:
    _run(kind, sig, seed, tmp_path, sources, hub)


# --------------------------------------------------------------------------- the message


def test_ctrl_c_during_validation_leaves_nothing_and_says_so(
    sources: _harness.Sources, tmp_path: Path
) -> None:
    """A defect once shipped: Ctrl-C while ``model`` validated printed "no output was
    written" although the converted weights were already committed. Now ``model``
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


def test_interrupt_message_says_what_is_on_disk(tmp_path: Path) -> None:
    """The three states an interrupted ``model`` run can leave (the staged output is renamed
    into place whole): nothing, the earlier output untouched, or this run's output not yet
    certified, with the command that certifies it."""
    from precision_convert.cli.model import interrupted_output

    target = tmp_path / "out"
    assert interrupted_output(target, None, "src", None) == (
        f"nothing was written ({target} does not exist)"
    )
    target.mkdir()
    earlier = target.stat().st_ino
    assert interrupted_output(target, earlier, "src", None) == (
        f"{target} is as it was: nothing of this run was kept"
    )
    replaced = tmp_path / "staged"
    replaced.mkdir()
    (replaced / "model.safetensors").write_bytes(b"")
    target.rmdir()
    replaced.rename(target)
    message = interrupted_output(target, earlier, "src", None)
    assert message.startswith(f"{target} holds the converted weights, not certified")
    assert message.endswith(f"precision-convert validate {target} --baseline src")


# --------------------------------------------------------------------------- mid-write

runner = CliRunner()

#: Runs the CLI with throttled source reads (sys.argv[1:] are its arguments).
_SLOW_CLI = """
import signal, sys, time
# A terminal's Ctrl-C reaches a process whose SIGINT is at its default; a child inherits an
# ignored SIGINT from its parent (Python then installs no KeyboardInterrupt handler), and
# something in a long test session may have left it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
from precision_convert.conversion.io import tensors
tensors.CHUNK_BYTES = 256 * 1024
_chunks = tensors.FileTensor.chunks
def _slow_chunks(self, *args, **kwargs):
    for chunk in _chunks(self, *args, **kwargs):
        time.sleep(0.1)  # ~3 s per 8 MiB: a signal sent mid-write lands mid-write
        yield chunk
tensors.FileTensor.chunks = _slow_chunks
from precision_convert.cli.main import app
app(sys.argv[1:], prog_name="precision-convert")
"""

#: 8 MiB of fp32 in four tensors, plus an integer buffer that must pass through uncast.
_STATE = {
    **{
        f"layers.{i}.weight": torch.randn(512, 1024, generator=torch.Generator().manual_seed(i))
        for i in range(4)
    },
    "position_ids": torch.arange(64, dtype=torch.int64),
}


@pytest.fixture(scope="module")
def big_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory.mktemp("interrupt") / "src", _STATE)


def _start_slow(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, *args],
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_mid_write(proc: subprocess.Popen[str], parent: Path, target: Path) -> Path:
    """The staging weight file once tensor data (not only its header) has reached it."""
    prefix = f".{target.name}.pc-staging-{proc.pid}-"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for staging in parent.glob(f"{prefix}*"):
            weights = staging / "model.safetensors"
            if weights.is_file() and weights.stat().st_size > 1024 * 1024:
                return weights
        time.sleep(0.01)
    raise AssertionError("the conversion never started writing tensor data")


def _kill_mid_write(proc: subprocess.Popen[str], parent: Path, target: Path, sig: int) -> int:
    """Send ``sig`` while data is being written; return how many bytes the partial file had."""
    weights = _wait_mid_write(proc, parent, target)
    partial = weights.stat().st_size
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    return partial


def _assert_converted(source: Path, output: Path) -> None:
    original = load_file(source / "model.safetensors")
    converted = load_file(output / "model.safetensors")
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert converted[name].dtype == expected.dtype, name
        assert torch.equal(converted[name], expected), name


def _convert(args: list[str]) -> None:
    result = runner.invoke(app, ["model", *args, "--to", "bf16", "--no-validate"])
    assert result.exit_code == 0, (result.stderr, result.exception)


def test_sigkill_mid_write_leaves_no_output_and_rerun_cleans_up(
    big_source: Path, tmp_path: Path
) -> None:
    before = tree_digest(big_source)
    target = tmp_path / "out"
    proc = _start_slow(
        ["model", str(big_source), "--to", "bf16", "--no-validate", "-o", str(target)], tmp_path
    )

    partial = _kill_mid_write(proc, tmp_path, target, signal.SIGKILL)

    assert proc.returncode == -signal.SIGKILL
    assert partial < 8 * 1024 * 1024  # really killed before the file was complete
    assert not target.exists() and not target.is_symlink()
    assert len(leftovers(tmp_path)) == 1  # only the dead run's hidden staging directory

    _convert([str(big_source), "-o", str(target)])

    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    _assert_converted(big_source, target)
    assert tree_digest(big_source) == before


def test_sigkill_during_overwrite_keeps_the_previous_output(
    big_source: Path, tmp_path: Path
) -> None:
    before = tree_digest(big_source)
    target = tmp_path / "out"
    _convert([str(big_source), "-o", str(target)])
    previous = tree_digest(target)
    proc = _start_slow(
        [
            "model",
            str(big_source),
            "--to",
            "fp16",
            "--no-validate",
            "-o",
            str(target),
            "--overwrite",
        ],
        tmp_path,
    )

    _kill_mid_write(proc, tmp_path, target, signal.SIGKILL)

    assert proc.returncode == -signal.SIGKILL
    assert tree_digest(target) == previous  # the complete earlier output, untouched

    _convert([str(big_source), "-o", str(target), "--overwrite"])

    assert leftovers(tmp_path) == []
    _assert_converted(big_source, target)
    assert tree_digest(big_source) == before


def test_ctrl_c_mid_write_exits_130_and_removes_its_staging(
    big_source: Path, tmp_path: Path
) -> None:
    target = tmp_path / "out"
    proc = _start_slow(
        ["model", str(big_source), "--to", "bf16", "--no-validate", "-o", str(target)], tmp_path
    )
    weights = _wait_mid_write(proc, tmp_path, target)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)

    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        f"precision-convert: interrupted; nothing was written ({target} does not exist)"
    ]
    assert not weights.exists()
    assert list(tmp_path.iterdir()) == []


def test_next_run_removes_only_dead_runs_leftovers(big_source: Path, tmp_path: Path) -> None:
    target = tmp_path / "out"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    stale_staging = tmp_path / f".out.pc-staging-{dead_pid}-0badf00d"
    stale_staging.mkdir()
    (stale_staging / "model.safetensors").write_bytes(b"partial")
    stale_trash = tmp_path / f".out.pc-trash-{dead_pid}"
    stale_trash.write_text("an overwritten file")  # a file, not a directory
    live = tmp_path / f".out.pc-staging-{os.getpid()}-1ive1ive"  # a run still going
    live.mkdir()
    unrelated = tmp_path / f".other.pc-staging-{dead_pid}-0badf00d"  # another target's
    unrelated.mkdir()

    _convert([str(big_source), "-o", str(target)])

    assert not stale_staging.exists() and not stale_trash.exists()
    assert live.is_dir() and unrelated.is_dir()
    _assert_converted(big_source, target)


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_overwrite_of_a_file_or_symlink_is_refused(
    kind: str, big_source: Path, tmp_path: Path
) -> None:
    """``--overwrite`` replaces only an empty directory or this tool's output: a file or a
    link stays as it was, and nothing is left beside it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not ours")
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("not a model")
    else:
        target.symlink_to(elsewhere, target_is_directory=True)
    before = tree_digest(tmp_path)

    result = runner.invoke(
        app,
        [
            "model",
            str(big_source),
            "--to",
            "bf16",
            "--no-validate",
            "-o",
            str(target),
            "--overwrite",
        ],
    )

    assert result.exit_code == 2, result.output
    assert "--overwrite replaces only" in result.stderr
    assert tree_digest(tmp_path) == before
    assert leftovers(tmp_path) == []


def test_disk_full_mid_write_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up while a shard is written (the staging directory and the file exist):
    exit 2 with one line, and the staging directory is removed."""
    import errno

    from _corrupt import assert_one_error_line

    from precision_convert.conversion.io import writer

    source = tiny_source(tmp_path / "src")
    before = tree_digest(source)
    staged: list[str] = []

    def disk_full(fd: int, data: bytes, offset: int) -> int:
        staged.extend(leftovers(tmp_path))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer.os, "pwrite", disk_full)
    output = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["model", str(source), "--to", "bf16", "--no-validate", "-o", str(output)]
    )
    assert result.exit_code == 2, result.output
    assert_one_error_line(result.stderr, str(output), "cannot write output", "No space left")
    assert staged, "the failure must come while the staging directory exists"
    assert not output.exists() and leftovers(tmp_path) == []
    assert tree_digest(source) == before
