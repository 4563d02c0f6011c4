"""Two runs on one output at once: one wins, the other stops with a clear message (exit 2),
and what is left is one run's complete output, never a mix of both. A batch job and a
``model`` run on one path likewise: the job fails instead of replacing the other's output.

The runs are real processes (forked warm, see ``_harness``) with slowed source reads, so the
first is still writing when the second reaches the output.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import _harness
import pytest
from _corrupt import assert_one_error_line, leftovers, tree_digest

from precision_convert.batch.job import Outcome, Settings, convert_stage, validate_stage
from precision_convert.batch.manifest import Job, read_manifest
from precision_convert.conversion.io.staging import TargetLock

#: What the refused run may say: the lock of a run still writing, or the output it committed.
_REFUSALS = ("another precision-convert run (pid", "output already exists")


def _convert(source: Path, target: Path, work: Path, name: str, *extra: str) -> _harness.Child:
    args = ["model", str(source), "--to", "bf16", "--no-validate", "-o", str(target), *extra]
    return _harness.fork_cli(args, work, work / name)


def _wait_for(condition: object, child: _harness.Child, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert child.poll() is None, child.stderr
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "both-overwrite"])
def test_second_conversion_into_a_busy_output_stops(
    overwrite: bool, tmp_path: Path, sources: _harness.Sources
) -> None:
    """The second run reaches the output while the first writes it: refused at once, even
    with ``--overwrite`` (replacing a half-written output of another run is never wanted)."""
    target = tmp_path / "out"
    extra = ["--overwrite"] if overwrite else []
    first = _convert(sources.plain, target, tmp_path, "first", *extra)
    _wait_for(_harness._staging_exists(tmp_path, target), first)
    second = _convert(sources.plain, target, tmp_path, "second", *extra)

    assert second.wait() == 2, second.stderr
    assert first.poll() is None, "the first run must still be writing: the test proves nothing"
    assert_one_error_line(second.stderr, str(target), f"(pid {first.pid})", "is writing")
    assert first.wait() == 0, first.stderr
    _assert_one_complete_output(tmp_path, target, sources)


def test_two_conversions_started_together(tmp_path: Path, sources: _harness.Sources) -> None:
    """Started at the same moment: whichever reaches the output first wins."""
    target = tmp_path / "out"
    children = [_convert(sources.plain, target, tmp_path, name) for name in ("a", "b")]
    codes = sorted(child.wait() for child in children)

    assert codes == [0, 2], [c.stderr for c in children]
    loser = next(c for c in children if c.poll() == 2)
    line = assert_one_error_line(loser.stderr, str(target))
    assert any(refusal in line for refusal in _REFUSALS), line
    _assert_one_complete_output(tmp_path, target, sources)


def _assert_one_complete_output(parent: Path, target: Path, sources: _harness.Sources) -> None:
    assert tree_digest(target) == tree_digest(sources.plain_reference)
    assert leftovers(parent) == []
    assert not (parent / f".{target.name}.pc-lock").exists()


def test_second_batch_on_a_busy_output_dir_stops(tmp_path: Path, sources: _harness.Sources) -> None:
    """A batch run holds its output folder: a second one stops at once, writing nothing, while
    the first (another process) goes on."""
    manifest = _harness._write_manifest(tmp_path, sources.llama)
    lock = tmp_path / "out" / ".precision-convert-batch" / "lock"
    first = _harness.fork_cli(["batch", str(manifest), "--jobs", "1"], tmp_path, tmp_path / "a")
    try:
        _wait_for(lock.exists, first)
        time.sleep(0.5)  # the lock file exists just before it is locked
        second = _harness.run_in_process(["batch", str(manifest)])
        assert second.exit_code == 2, second.stderr
        assert_one_error_line(second.stderr, "another batch run", "is writing here")
        assert first.poll() is None, first.stderr
    finally:
        first.signal(_harness.SIGNALS["SIGKILL"])
        first.wait()
    assert not (tmp_path / "out" / "batch_report.json").exists()  # the second wrote nothing


# --------------------------------------------------------------------------- batch and model


@pytest.fixture
def staged_job(tmp_path: Path, sources: _harness.Sources) -> tuple[Job, Settings, Outcome]:
    """A batch job with its output converted into its staging folder: next it validates, then
    moves into place (the stages a worker runs, here in this process, one at a time)."""
    manifest = tmp_path / "batch.toml"
    manifest.write_text(
        f'[defaults]\nto = ["bf16"]\noutput_dir = "out"\ncoverage = "quick"\n\n'
        f'[[model]]\nsource = "{sources.llama}"\n'
    )
    plan = read_manifest(manifest)
    [job] = plan.jobs
    settings = Settings.for_run(plan.output_dir, threads=1)
    outcome = convert_stage(job, settings)
    assert not outcome.failed, outcome.reason
    return job, settings, outcome


def test_a_model_run_that_finishes_while_a_batch_job_validates_is_kept(
    staged_job: tuple[Job, Settings, Outcome], sources: _harness.Sources
) -> None:
    """The batch job validates while ``model`` finishes into the same path: the job's move
    into place finds an output it did not write and was not asked to replace; it fails
    saying so, and the model run's output is kept whole."""
    job, settings, outcome = staged_job
    args = ["model", str(sources.llama), "--to", "bf16", "--coverage", "quick"]
    assert _harness.run_in_process([*args, "-o", str(job.output)]).exit_code == 0
    before = tree_digest(job.output)

    outcome = validate_stage(job, settings, outcome, "cpu")

    assert outcome.failed and outcome.reason is not None
    assert outcome.reason.startswith(f"validate: {job.output}: another run wrote this output")
    assert "--overwrite" in outcome.reason
    assert tree_digest(job.output) == before
    _harness.verify(job.output)
    assert not settings.scratch(job).exists()
    assert leftovers(job.output.parent) == []
    assert not (job.output.parent / f".{job.output.name}.pc-lock").exists()


def test_a_batch_job_moving_into_place_while_a_model_run_writes_there_fails_at_once(
    staged_job: tuple[Job, Settings, Outcome],
) -> None:
    """A ``model`` run holds the target's lock while it writes: the batch job's move into place
    stops at once, naming it, and leaves the target to it (nothing there, nothing beside)."""
    job, settings, outcome = staged_job
    writing = TargetLock(job.output)  # what a model run holds from its start to its commit
    writing.acquire()
    try:
        outcome = validate_stage(job, settings, outcome, "cpu")
    finally:
        writing.release()

    assert outcome.failed and outcome.reason is not None
    assert f"(pid {os.getpid()}) is writing this output" in outcome.reason
    assert not job.output.exists()
    assert leftovers(job.output.parent) == []
    assert not settings.scratch(job).exists()


def test_validate_into_an_output_another_run_is_writing_stops(
    tmp_path: Path, sources: _harness.Sources
) -> None:
    """``validate`` writes its certificate and card into the output: under the same lock as
    ``model`` and batch, so while another run holds the output it stops at once, naming that
    run, and writes nothing."""
    target = tmp_path / "out"
    shutil.copytree(sources.certified_reference, target)
    before = tree_digest(target)
    args = ["validate", str(target), "--baseline", str(sources.llama), "--coverage", "quick"]

    with TargetLock(target):  # a `model --overwrite` replacing it now
        done = _harness.run_in_process(args)

    assert done.exit_code == 2, done.stderr
    assert_one_error_line(done.stderr, str(target), f"(pid {os.getpid()}) is writing")
    assert tree_digest(target) == before
    assert _harness.run_in_process(args).exit_code == 0  # once it is free
    assert [p.name for p in tmp_path.iterdir() if ".pc-" in p.name] == []
