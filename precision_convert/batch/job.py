"""One job's stages — download → convert → validate → push — as plain functions.

Both executors run these: the local one calls them in sequence in a warm worker process
(holding a validation slot around :func:`validate_stage`), the Ray one makes each a task. Each
stage takes and returns the job's :class:`Outcome`, records its time, and never raises: an
error becomes the outcome's ``failed`` status and one-line reason (prefixed by the stage), and
the later stages pass a failed outcome through untouched. So a broken checkpoint, a Hub id
that does not exist or a push the Hub refuses costs that job only.

A job converts and validates in its own staging directory inside the output folder's hidden
state folder, and its output is renamed into place only with its certificate, so a job's
target holds what it held before or a certified output, whenever the run is stopped. After
each stage that changes the output the job's state file is updated (see
:mod:`precision_convert.batch.state`), which is what ``--resume`` reads.

Nothing here changes process-wide state; a worker that owns its process sets its thread
count itself (see :func:`own_process`).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.batch.etiquette import Etiquette, push_politely
from precision_convert.batch.manifest import Job
from precision_convert.batch.state import STATE_DIR, JobState, Start, StateStore
from precision_convert.core.errors import CheckFailed, one_line

if TYPE_CHECKING:
    from precision_convert.api.conversion import ConvertedComponent
    from precision_convert.validation.certify.certificate import Certificate

#: Outcome statuses: certified (and pushed, when configured); kept by --resume; failed.
DONE, SKIPPED, FAILED, RUNNING = "done", "skipped", "failed", "running"


@dataclass(frozen=True)
class Settings:
    """What every job of one run shares (picklable: it travels to worker processes)."""

    output_dir: Path
    threads: int  # torch intra-op threads per job: fixed, so metrics repeat bit for bit
    etiquette: Etiquette
    #: The outputs a job may replace: those that existed when the run started and that the
    #: run was asked to redo (``--overwrite``, ``--resume``). Any other output found at the
    #: target when a job moves into place was written meanwhile by another run: it is kept.
    replaceable: frozenset[Path] = frozenset()

    @classmethod
    def for_run(cls, output_dir: Path, threads: int, **etiquette: Any) -> Settings:
        lock_dir = output_dir / STATE_DIR / "hub"
        return cls(output_dir, threads, Etiquette(lock_dir, **etiquette))

    @property
    def store(self) -> StateStore:
        return StateStore(self.output_dir)

    @property
    def staging(self) -> Path:
        """Where jobs convert and validate before their output is renamed into place: hidden
        in the state folder (so never hashed or pushed), on the outputs' filesystem (so the
        rename is atomic), and emptied by the driver when a run starts."""
        return self.output_dir / STATE_DIR / "staging"

    def scratch(self, job: Job) -> Path:
        """The job's directory in :attr:`staging`."""
        return self.staging / job.key


@dataclass
class Outcome:
    """What happened to one job, as the table and the JSON report show it."""

    key: str
    name: str
    target: str
    source: str
    output: str
    status: str = RUNNING
    reason: str | None = None  # why it failed: "<stage>: <one line>"
    verdict: str | None = None
    fp32_share: float | None = None
    key_metric: dict[str, Any] | None = None
    push: dict[str, Any] | None = None  # repo_id, url, pull_request, shape, changed
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    baseline: str | None = None  # the resolved source directory (not reported)

    @classmethod
    def start(cls, job: Job) -> Outcome:
        return cls(job.key, job.name, job.target, job.source, str(job.output))

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @property
    def seconds(self) -> float:
        return round(sum(self.timings.values()), 3)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("baseline")
        data["seconds"] = self.seconds
        return data


@contextmanager
def _stage(outcome: Outcome, stage: str) -> Iterator[None]:
    """Time ``stage``; turn any error into the outcome's failure (one line, stage first)."""
    began = time.perf_counter()
    try:
        yield
    except Exception as exc:  # a job's failure, whatever it is, must not reach the others
        outcome.status, outcome.reason = FAILED, f"{stage}: {one_line(exc)}"
    finally:
        outcome.timings[stage] = round(time.perf_counter() - began, 3)


def _ignore(stage: str) -> None:
    """The default stage listener."""


def convert_stage(
    job: Job, settings: Settings, on_stage: Callable[[str], None] = _ignore
) -> Outcome:
    """Download (or find) the source and write the converted output, unvalidated, into the
    job's staging directory (:meth:`Settings.scratch`); :func:`validate_stage` certifies it
    there and renames it into place."""
    from precision_convert.api.conversion import convert
    from precision_convert.conversion.io.source import resolve

    outcome = Outcome.start(job)
    options = job.options
    on_stage("downloading")
    with _stage(outcome, "download"):
        outcome.baseline = str(resolve(job.source, options.revision))
    if outcome.failed:
        return outcome
    on_stage("converting")
    scratch = settings.scratch(job)
    with _stage(outcome, "convert"):
        shutil.rmtree(scratch, ignore_errors=True)  # an earlier try whose worker died
        # The source is downloaded already (its revision resolved); validation comes later.
        unvalidated = replace(options, revision=None, device=None)
        result = convert(outcome.baseline, job.target, scratch, False, options=unvalidated)
        outcome.fp32_share = fp32_share(result.components)
        previous = settings.store.read(job.key)
        settings.store.write(
            JobState(
                job.key,
                job.digest,
                fp32_share=outcome.fp32_share,
                push=previous.push if previous else None,  # its PR is updated, not duplicated
            )
        )
    return outcome


def validate_stage(job: Job, settings: Settings, outcome: Outcome, device: str | None) -> Outcome:
    """Certify the staged output against the source in fp32 (on ``device``; None: CUDA if
    present), then rename it into place with its certificate and card, as ``model`` does: the
    target holds what it held before or a certified output, however the run is stopped. A
    failing certificate is kept like ``model`` keeps it (it says why); an error that leaves
    none removes the staged output and leaves the target as it was."""
    if outcome.failed:
        return outcome
    from precision_convert.core.errors import CannotValidateError
    from precision_convert.validation.certify.runner import validate
    from precision_convert.validation.certify.verify import verify
    from precision_convert.validation.probe.inputs.budgets import DEFAULT_LEVEL

    options = job.options
    scratch = settings.scratch(job)
    replaceable = job.output in settings.replaceable
    with _stage(outcome, "validate"):
        try:
            certificate = validate(
                scratch,
                baseline=outcome.baseline,
                device=options.device or device,
                inputs=options.inputs,
                coverage=options.coverage or DEFAULT_LEVEL,
                calibration_data=options.calibration_data,
                budget=options.budget,
                trust_remote_code=options.trust_remote_code,
                allow_nonfinite_source=options.allow_nonfinite_source,
                allow_unexercised=options.allow_unexercised,
            )
        except CannotValidateError:
            # With the failing certificate saying what is missing.
            into_place(scratch, job.output, replaceable)
            raise
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        into_place(scratch, job.output, replaceable)
        describe(outcome, certificate)
        if not certificate.passed:
            first = certificate.failures[0] if certificate.failures else "no metric was judged"
            raise CheckFailed(f"not certified ({len(certificate.failures)} problems): {first}")
        checked = verify(job.output)  # what --resume and push will check: it must pass now
        state = settings.store.read(job.key) or JobState(job.key, job.digest)
        state.certificate = checked.files[checked.certificate_name].sha256
        settings.store.write(state)
    return outcome


def into_place(staged: Path, target: Path, replaceable: bool) -> None:
    """Rename the certified ``staged`` directory to ``target`` the way ``model`` commits its
    output: under the target's lock (a ``model`` run writing it now makes this job fail at
    once), made durable first, an old output moved aside and removed only once the new one is
    in place. An output is replaced only when ``replaceable`` (see
    :attr:`Settings.replaceable`); one that another run wrote meanwhile is kept, and the job
    fails saying so. ``staged`` is gone either way."""
    from precision_convert.conversion.io.staging import StagedOutput
    from precision_convert.core.errors import InputError, OutputExistsError

    try:
        with StagedOutput(target, overwrite=replaceable) as place:
            os.replace(staged, place.path)  # onto the empty directory it made for the output
            place.commit()
    except OutputExistsError:
        raise InputError(
            "another run wrote this output while the job ran; it is kept as it is (run the "
            "batch with --overwrite to replace it)",
            target,
        ) from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def push_stage(job: Job, settings: Settings, outcome: Outcome) -> Outcome:
    """Publish a certified output where the manifest says (nothing to do without ``push``)."""
    if outcome.failed:
        return outcome
    if job.push is not None:
        spec = job.push
        with _stage(outcome, "push"):
            result = push_politely(
                job.output,
                spec.repo_id,
                create_pr=spec.create_pr,
                private=spec.private,
                etiquette=settings.etiquette,
            )
            outcome.push = {
                "repo_id": result.repo_id,
                "url": result.url,
                "pull_request": result.pull_request,
                "shape": result.shape,
                "changed": result.changed,
            }
            state = settings.store.read(job.key) or JobState(job.key, job.digest)
            state.push = {**outcome.push, "certificate": state.certificate}
            settings.store.write(state)
        if outcome.failed:
            return outcome
    outcome.status = DONE
    return outcome


def recorded(job: Job, start: Start, status: str) -> Outcome:
    """The outcome of a job whose certified output ``--resume`` keeps (``start`` says what
    it found: the certificate, and the state with the fp32 share and the push)."""
    outcome = Outcome.start(job)
    outcome.status = status
    if start.certificate is not None:
        describe(outcome, start.certificate)
    if start.state is not None:
        outcome.fp32_share = start.state.fp32_share
        if status == SKIPPED and start.state.push is not None:
            outcome.push = {k: v for k, v in start.state.push.items() if k != "certificate"}
            outcome.push["changed"] = False
    return outcome


def describe(outcome: Outcome, certificate: Certificate) -> None:
    """Copy the verdict and the key metric from a certificate into the outcome."""
    outcome.verdict = certificate.verdict
    outcome.key_metric = key_metric(certificate)


def key_metric(certificate: Certificate) -> dict[str, Any] | None:
    """The one metric a table row shows: the first that failed, else the worst relative L2."""
    judged = [m for m in certificate.metrics if m.threshold is not None]
    failed = [m for m in judged if not m.passed]
    rel_l2 = [m for m in judged if m.metric == "rel_l2" and m.value is not None]
    chosen = failed[0] if failed else max(rel_l2, key=lambda m: m.value or 0.0, default=None)
    if chosen is None:
        return None
    return {
        "where": chosen.where,
        "metric": chosen.metric,
        "value": chosen.value,
        "threshold": chosen.threshold,
        "bound": chosen.bound,
    }


def fp32_share(components: list[ConvertedComponent]) -> float:
    """Share of floating-point parameters kept in fp32, over every component."""
    total = kept = 0.0
    for component in components:
        elements = sum(math.prod(t.shape) for t in component.plan.tensors if t.source.is_float)
        total += elements
        kept += component.plan.fp32_share * elements
    return round(kept / total, 6) if total else 0.0


def own_process(threads: int) -> None:
    """For a worker that owns its process: a fixed torch thread count (the same on every
    executor, so validation metrics repeat bit for bit), quiet libraries, no progress bars,
    the command's bounded Hub client (a silent Hub fails the job instead of hanging it), and
    the command's heap (memory that follows what is live, see ``own_heap``).

    Workers share the terminal with the driver's progress display, and everything a job has
    to say reaches the report through its outcome; library warnings and bars would only
    garble the display."""
    import warnings

    from precision_convert.conversion.runtime.memory import own_heap
    from precision_convert.core.hub_client import bound_hub_requests

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore")
    bound_hub_requests()
    own_heap()
    import torch

    torch.set_num_threads(threads)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
