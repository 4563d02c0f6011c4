"""The Ray executor: each job's stages as Ray tasks, on a running cluster or a local one.

A job is three chained tasks — convert (``threads`` CPUs), validate (one GPU where the cluster
has GPUs, else ``threads`` CPUs), push (no CPU reserved: it waits on the network) — so
conversions of many jobs overlap while validations queue for GPUs. Ray reuses its worker
processes, which keeps the heavy imports warm from one task to the next. Every task sets the
same torch thread count the local executor's workers use, so the metrics in the certificates
are the same bit for bit whichever executor ran them.

Workers must see ``output_dir`` (a shared filesystem on a multi-node cluster) and have
precision-convert installed; each node's Hub token (``HF_TOKEN`` or a login) is used for
pushes: the driver never ships its token to the cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
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
from precision_convert.batch.local import EventSink, Task
from precision_convert.batch.manifest import Job
from precision_convert.core.errors import InputError, one_line

_DONE = "done"


def require_ray() -> None:
    """Fail early (exit 2) when ray is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise InputError("--executor ray needs ray: pip install 'precision-convert[ray]'") from None


def run_ray(
    tasks: Sequence[Task], settings: Settings, address: str | None, on_event: EventSink
) -> Iterator[Outcome]:
    """Run ``tasks`` on the cluster at ``address`` (or the one this process is connected to,
    or a new local one); yield each outcome as it completes."""
    if not tasks:  # everything kept by --resume: no cluster needed
        return
    import ray

    owned = not ray.is_initialized()
    if owned:
        # Ray's start-up notes would break into the progress display; errors still show.
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    try:
        yield from _run(ray, tasks, settings, on_event)
    finally:
        if owned:
            ray.shutdown()


def _run(
    ray: Any, tasks: Sequence[Task], settings: Settings, on_event: EventSink
) -> Iterator[Outcome]:
    gpus = ray.cluster_resources().get("GPU", 0)
    # Torch runs ``threads`` threads whatever is reserved; a reservation larger than any node
    # would never be scheduled.
    largest = max((n["Resources"].get("CPU", 1) for n in ray.nodes() if n["Alive"]), default=1)
    cpus = min(settings.threads, largest)
    convert = ray.remote(_convert).options(num_cpus=cpus)
    validate = ray.remote(_validate).options(
        **({"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": cpus})
    )
    push = ray.remote(_push).options(num_cpus=0)
    # ref -> (task, the stage that follows it; None: nothing to show; _DONE: the outcome)
    watched: dict[Any, tuple[Task, str | None]] = {}
    for task in tasks:
        job = task.job
        if task.outcome is None:
            converted = convert.remote(job, settings)
            validated = validate.remote(job, settings, converted)
            watched[converted] = (task, "validating")
            watched[validated] = (task, "pushing" if job.push else None)
            on_event(job.key, "converting")
        else:
            validated = task.outcome
            on_event(job.key, "pushing")
        watched[push.remote(job, settings, validated)] = (task, _DONE)
    try:
        while watched:
            ready, _ = ray.wait(list(watched), num_returns=1)
            for ref in ready:
                task, following = watched.pop(ref)
                if following == _DONE:
                    yield _result(ray, ref, task)
                elif following is not None:
                    on_event(task.job.key, following)
    except BaseException:  # Ctrl-C: nothing of this run goes on on the cluster
        for ref in watched:
            ray.cancel(ref, force=True)
        raise


def _result(ray: Any, ref: Any, task: Task) -> Outcome:
    try:
        return ray.get(ref)
    except Exception as exc:  # the task's worker died for good (Ray retried it already)
        outcome = Outcome.start(task.job)
        outcome.status = FAILED
        outcome.reason = f"ray: {one_line(exc)}"
        return outcome


# --------------------------------------------------------------------------- the tasks


def _convert(job: Job, settings: Settings) -> Outcome:
    own_process(settings.threads)
    return convert_stage(job, settings)


def _validate(job: Job, settings: Settings, outcome: Outcome) -> Outcome:
    own_process(settings.threads)
    return validate_stage(job, settings, outcome, None)


def _push(job: Job, settings: Settings, outcome: Outcome) -> Outcome:
    return push_stage(job, settings, outcome)
