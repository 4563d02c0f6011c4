"""``run_batch``: a checked manifest through an executor, under the output folder's lock.

The driver decides, per job, where it starts (``--resume``: not at all, at its push, or from
the beginning), hands the rest to the local or the Ray executor, collects the outcomes in
manifest order and writes ``batch_report.json`` into ``output_dir``. Every text in the report
passes :func:`_scrub` first: whatever a library put into an error message, the Hub token is
not written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from precision_convert.batch.job import DONE, FAILED, RUNNING, SKIPPED, Outcome, Settings, recorded
from precision_convert.batch.local import EventSink, Task, run_local
from precision_convert.batch.manifest import Job, Manifest
from precision_convert.batch.state import Resume, Start, exclusive, resume_point
from precision_convert.conversion.io.staging import clean_leftovers
from precision_convert.core._version import __version__
from precision_convert.core.errors import InputError

REPORT_NAME = "batch_report.json"
#: Every run's own report, named by when it started (REPORT_NAME is the latest run's).
REPORTS_DIR = "batch_reports"
REPORT_SCHEMA = "precision-convert/batch-report/1"
EXECUTORS = ("local", "ray")


@dataclass
class BatchReport:
    """What a run did, job by job (in manifest order)."""

    manifest: Path
    output_dir: Path
    executor: str
    jobs: int
    threads_per_job: int
    resume: bool
    started: str
    overwrite: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    finished: str | None = None
    seconds: float = 0.0
    file: Path | None = None  # where this run's report was written (not in the report)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == FAILED]

    def counts(self) -> dict[str, int]:
        return {s: sum(o.status == s for o in self.outcomes) for s in (DONE, SKIPPED, FAILED)}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "tool": {"name": "precision-convert", "version": __version__},
            "manifest": str(self.manifest),
            "output_dir": str(self.output_dir),
            "executor": self.executor,
            "jobs": self.jobs,
            "threads_per_job": self.threads_per_job,
            "resume": self.resume,
            "overwrite": self.overwrite,
            "started": self.started,
            "finished": self.finished,
            "seconds": self.seconds,
            "summary": self.counts(),
            "results": [o.to_json() for o in self.outcomes],
        }


def run_batch(
    manifest: Manifest,
    *,
    jobs: int = 1,
    executor: str = "local",
    ray_address: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    on_event: EventSink | None = None,
    etiquette: dict[str, float] | None = None,
) -> BatchReport:
    """Run every job of ``manifest``; the report is also written to ``output_dir``.

    Args:
        jobs: concurrent jobs (local: warm worker processes). Each job's torch threads are the
            machine's CPUs divided by ``jobs`` (or by the number of jobs, when fewer), the same
            on either executor.
        executor: ``local`` or ``ray``.
        ray_address: the Ray cluster to use (default: the one this process is connected to,
            else a new local one).
        resume: keep finished jobs (see :mod:`precision_convert.batch.state`) and redo the
            rest, replacing their outputs.
        overwrite: redo every job, replacing the outputs that exist. Without it or ``resume``
            an existing output is never replaced: the run stops before anything runs.
        on_event: called with ``(job key, stage)`` as jobs move on, and with the outcome's
            status when one ends.
        etiquette: overrides of :class:`~precision_convert.batch.etiquette.Etiquette`
            (``interval``, ``retries``, ``backoff``).

    Raises:
        InputError: a bad executor or job count, ray missing, another run holding
            ``output_dir``, or outputs that exist without ``resume`` or ``overwrite``.
        HubAuthError, HubPermissionError: the manifest pushes, and the token is missing,
            rejected, read-only or cannot write where a push goes. Nothing has run then.
        Job failures are never raised: they are in the report.
    """
    _check_run(executor, jobs, resume=resume, overwrite=overwrite)
    listener = on_event or _ignore
    threads = max(1, (os.cpu_count() or 1) // min(jobs, len(manifest.jobs)))
    settings = Settings.for_run(manifest.output_dir, threads, **(etiquette or {}))
    began = time.perf_counter()
    report = BatchReport(
        manifest.path,
        manifest.output_dir,
        executor,
        jobs,
        threads,
        resume,
        datetime.now(UTC).isoformat(timespec="seconds"),
        overwrite,
    )
    with exclusive(manifest.output_dir):
        starts = _starts(manifest, settings, resume=resume, overwrite=overwrite)
        if resume or overwrite:  # what it was asked to redo, as it stands now
            existing = [job.output for job in manifest.jobs if _exists(job.output)]
            settings = replace(settings, replaceable=frozenset(existing))
        tasks = []
        for job in manifest.jobs:  # kept jobs are reported now, the others run
            start = starts[job.key]
            if start.point is Resume.DONE:
                _finish(report, recorded(job, start, SKIPPED), listener)
            else:
                ran = recorded(job, start, RUNNING) if start.point is Resume.PUSH else None
                tasks.append(Task(job, ran))
        if executor == "ray":
            from precision_convert.batch.ray_cluster import run_ray

            outcomes = run_ray(tasks, settings, ray_address, listener)
        else:
            outcomes = run_local(tasks, settings, jobs, listener)
        try:
            for outcome in outcomes:
                _finish(report, outcome, listener)
        except KeyboardInterrupt:
            # The workers are stopped (local: waited for; Ray: cancelled, killed): what one
            # killed mid-move left beside a target goes now, not at the next run.
            for job in manifest.jobs:
                clean_leftovers(job.output)
            raise
        order = {job.key: job.index for job in manifest.jobs}
        report.outcomes.sort(key=lambda o: order[o.key])
        report.finished = datetime.now(UTC).isoformat(timespec="seconds")
        report.seconds = round(time.perf_counter() - began, 3)
        report.file = write_report(report)
    return report


def _check_run(executor: str, jobs: int, *, resume: bool, overwrite: bool) -> None:
    """The run's own arguments, before anything else."""
    if executor not in EXECUTORS:
        raise InputError(f"--executor {executor!r}: choose local or ray")
    if jobs < 1:
        raise InputError(f"--jobs {jobs}: at least 1")
    if resume and overwrite:
        raise InputError("--resume keeps finished jobs, --overwrite redoes them: choose one")
    if executor == "ray":
        from precision_convert.batch.ray_cluster import require_ray

        require_ray()


def _starts(
    manifest: Manifest, settings: Settings, *, resume: bool, overwrite: bool
) -> dict[str, Start]:
    """Where each job starts; refused before anything runs: outputs that would be replaced
    unasked, and pushes the token could not make. Then what a killed run left is cleared."""
    starts = {
        job.key: resume_point(job, settings.store) if resume else Start(Resume.CONVERT)
        for job in manifest.jobs
    }
    if not (resume or overwrite):
        _refuse_existing([job for job in manifest.jobs if starts[job.key].point is Resume.CONVERT])
    pushes = [
        job.push
        for job in manifest.jobs
        if job.push is not None and starts[job.key].point is not Resume.DONE
    ]
    if pushes:
        from precision_convert.hub import check_write_access
        from precision_convert.hub.errors import retry_wait_limit

        retry_wait_limit()  # a bad value is refused before anything runs, not in each push
        check_write_access([(push.repo_id, push.create_pr) for push in pushes])
    _clear_leftovers(settings, manifest.jobs)
    return starts


def _refuse_existing(jobs: list[Job]) -> None:
    """The rule ``model`` keeps with ``--overwrite``: an existing output is replaced only when
    asked. Every job in the way is named; nothing has run."""
    existing = [job.output for job in jobs if _exists(job.output)]
    if not existing:
        return
    shown = ", ".join(str(path) for path in existing[:3])
    more = f" and {len(existing) - 3} more" if len(existing) > 3 else ""
    what = "an output exists" if len(existing) == 1 else f"{len(existing)} outputs exist"
    raise InputError(
        f"{what} already ({shown}{more}): --resume keeps finished jobs and redoes the rest, "
        "--overwrite redoes every job"
    )


def _exists(path: Path) -> bool:
    """Something is at ``path``: a folder, a file, or a link (a broken one included)."""
    return path.exists() or path.is_symlink()


def _clear_leftovers(settings: Settings, jobs: tuple[Job, ...]) -> None:
    """What a run killed before this one left: its staging folder (the run holds the output
    folder's lock, so no other run uses it) and any half-renamed output beside a target."""
    shutil.rmtree(settings.staging, ignore_errors=True)
    for job in jobs:
        clean_leftovers(job.output)


def _finish(report: BatchReport, outcome: Outcome, listener: EventSink) -> None:
    if outcome.reason is not None:
        outcome.reason = _scrub(outcome.reason)
    report.outcomes.append(outcome)
    listener(outcome.key, outcome.status)


def write_report(report: BatchReport) -> Path:
    """This run's report, kept beside every earlier run's: ``<output_dir>/batch_reports/
    <started>.json``; and ``<output_dir>/batch_report.json``, the latest run's. Each is
    written atomically and token-free. Returns the run's own."""
    text = _scrub(json.dumps(report.to_json(), indent=2)) + "\n"
    folder = report.output_dir / REPORTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.fromisoformat(report.started).strftime("%Y%m%dT%H%M%SZ")
    path, count = folder / f"{stamp}.json", 1
    while path.exists():  # two runs within one second
        count += 1
        path = folder / f"{stamp}-{count}.json"
    for target in (path, report.output_dir / REPORT_NAME):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    return path


def _scrub(text: str) -> str:
    for secret in _secrets():
        text = text.replace(secret, "***")
    return text


def _secrets() -> list[str]:
    found = [os.environ.get(v, "") for v in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")]
    try:
        from huggingface_hub import get_token

        found.append(get_token() or "")
    except ImportError:
        pass
    return [s for s in found if len(s) >= 8]


def _ignore(key: str, stage: str) -> None:
    """The default listener."""
