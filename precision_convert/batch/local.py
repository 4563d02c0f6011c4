"""The local executor: ``--jobs N`` warm worker processes on this machine.

Each worker is a spawned process that imports torch, transformers, diffusers and this
package's pipeline once (:func:`_warm`) and then takes job after job, so a family of small
models pays the start-up once per worker, not once per model. Conversions (mostly I/O) run in
every worker at once; validations (compute bound, and the memory-hungry part: an fp32 model
plus the candidate's outputs) each need a *validation slot*: one per GPU, or a single one on a
CPU-only machine, handed out through a queue shared by the workers.

Workers report their stages on an event queue; a thread in the driver forwards them to the
caller's listener (the CLI's progress display).

A worker that dies (killed for memory, a crash in native code) breaks the whole process pool.
The jobs that had not started are run again in a fresh pool; a job that was running is run
again once, and fails with "worker process died" if its worker dies again, so one bad
checkpoint cannot stop the batch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from functools import partial
from types import FrameType
from typing import Any

from precision_convert.batch.job import (
    FAILED,
    Outcome,
    Settings,
    convert_stage,
    own_process,
    push_stage,
    validate_stage,
)
from precision_convert.batch.manifest import Job
from precision_convert.core import interrupts

#: A listener of job stages: ``(job key, stage)``.
EventSink = Callable[[str, str], None]
#: Runs of a job whose worker died before it is given up.
_ATTEMPTS = 2
#: The event a worker sends first, with its process id.
_WORKER = "\0worker"
#: How often a worker without PR_SET_PDEATHSIG checks that its driver is alive: a second.
_WATCH_SECONDS = 1.0

_events: Any = None  # the worker's end of the event queue (set by _warm)
_slots: Any = None  # the worker's end of the validation-slot queue
_busy = False  # the worker is running a job (see _on_terminate)


@dataclass(frozen=True)
class Task:
    """A job to run; ``outcome`` is set when only its push is left (``--resume``)."""

    job: Job
    outcome: Outcome | None = None
    attempt: int = 1


def run_local(
    tasks: Sequence[Task], settings: Settings, jobs: int, on_event: EventSink
) -> Iterator[Outcome]:
    """Run ``tasks`` in ``jobs`` warm workers; yield each outcome as it completes.

    Workers ignore Ctrl-C: the driver owns the interruption. It cancels what has not started
    and terminates the workers (a job cut short leaves only a staging folder, removed by the
    next run), so an interrupted batch stops now rather than after the jobs in flight.
    """
    context = multiprocessing.get_context("spawn")  # fork would copy the driver's threads
    pending = list(tasks)
    while pending:
        events, slots = context.Queue(), context.Queue()
        # The first worker up fills the slots: the driver never has to import torch for it.
        filling = (context.Lock(), context.Value("b", 0))
        seen = _Seen()
        listener = threading.Thread(target=seen.forward, args=(events, on_event), daemon=True)
        listener.start()
        broken: list[Task] = []
        pool = ProcessPoolExecutor(
            max_workers=min(jobs, len(pending)),
            mp_context=context,
            initializer=_warm,
            initargs=(settings.threads, events, slots, filling, os.getpid()),
        )
        try:
            with _sigint_ignored_while_spawning():
                futures = {pool.submit(_run, task, settings): task for task in pending}
            for future in as_completed(futures):
                try:
                    yield future.result()
                except BrokenProcessPool:
                    broken.append(futures[future])
        except BaseException:  # Ctrl-C, or the caller stopped listening
            pool.shutdown(wait=False, cancel_futures=True)
            seen.terminate_workers()
            raise
        finally:
            pool.shutdown(wait=True)
            events.put(None)
            listener.join()
        pending = []
        for task in broken:
            if task.job.key not in seen.started:
                pending.append(task)
            elif task.attempt < _ATTEMPTS:
                pending.append(replace(task, attempt=task.attempt + 1))
            else:
                yield _died(task.job)


class _Seen:
    """What the workers reported: their process ids, and the jobs that started."""

    def __init__(self) -> None:
        self.workers: set[int] = set()
        self.started: set[str] = set()

    def forward(self, events: Any, on_event: EventSink) -> None:
        while (event := events.get()) is not None:
            key, stage = event
            if key == _WORKER:
                self.workers.add(int(stage))
                continue
            self.started.add(key)
            on_event(key, stage)

    def terminate_workers(self) -> None:
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


@contextlib.contextmanager
def _sigint_ignored_while_spawning() -> Iterator[None]:
    """Workers start with SIGINT ignored (an ignored signal stays ignored across exec), so a
    Ctrl-C while they import never prints their tracebacks: the driver handles it and stops
    them. Only the main thread may touch signal handlers; the old one is put back at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _die_with_the_driver(driver: int) -> None:
    """The worker ends when its driver does, even by SIGKILL, which gives the driver no chance
    to stop it (it would otherwise run on, reparented, writing an output nobody waits for).

    Linux: the kernel sends SIGKILL when the driver dies (``PR_SET_PDEATHSIG``). Elsewhere, a
    daemon thread watches the parent pid and exits within a second of it changing. A driver
    that died while this worker was still starting is gone already: then exit now.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    else:
        threading.Thread(target=_watch_the_driver, args=(driver,), daemon=True).start()
    if os.getppid() != driver:
        os._exit(1)


def _watch_the_driver(driver: int) -> None:
    while os.getppid() == driver:
        time.sleep(_WATCH_SECONDS)
    os._exit(1)


def _died(job: Job) -> Outcome:
    outcome = Outcome.start(job)
    outcome.status = FAILED
    outcome.reason = (
        "worker process died twice while running this job (out of memory?); the other jobs went on"
    )
    return outcome


# --------------------------------------------------------------------------- in the worker


def _warm(threads: int, events: Any, slots: Any, filling: tuple[Any, Any], driver: int) -> None:
    """Worker start-up: own the process, import the heavy libraries once, and (the first
    worker) put one validation slot per GPU, or one for the CPU, into the shared queue."""
    global _events, _slots
    _events, _slots = events, slots
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _on_terminate)
    _die_with_the_driver(driver)
    events.put((_WORKER, str(os.getpid())))
    own_process(threads)
    import torch

    lock, filled = filling
    with lock:
        if not filled.value:
            for device in [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]:
                slots.put(device)
            filled.value = 1
    import precision_convert.api.conversion
    import precision_convert.hub
    import precision_convert.validation.certify.runner  # noqa: F401


def _on_terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM or SIGHUP (the driver stopping its workers, or a scheduler): a job in progress
    unwinds like a Ctrl-C, so its staging directory and the target's lock go with it (see
    :func:`_run`); an idle worker holds nothing and ends at once, without a traceback."""
    if not _busy:
        os._exit(128 + signum)
    interrupts.on_signal(signum, frame)


def _run(task: Task, settings: Settings) -> Outcome:
    global _busy
    _busy = True
    try:
        return _stages(task, settings)
    except interrupts.Terminated as exc:
        # Everything the job held is cleaned up by now; the pool would hand this worker its
        # next job, so it ends here, as the signal asked.
        os._exit(interrupts.exit_code(exc))
    finally:
        _busy = False


def _stages(task: Task, settings: Settings) -> Outcome:
    job = task.job
    emit = partial(_emit, job.key)
    if task.outcome is not None:
        outcome = task.outcome
    else:
        outcome = convert_stage(job, settings, emit)
        if not outcome.failed:
            emit("waiting to validate")
            device = _slots.get()
            try:
                emit("validating")
                outcome = validate_stage(job, settings, outcome, device)
            finally:
                _slots.put(device)
    if job.push is not None and not outcome.failed:
        emit("pushing")
    return push_stage(job, settings, outcome)


def _emit(key: str, stage: str) -> None:
    _events.put((key, stage))
