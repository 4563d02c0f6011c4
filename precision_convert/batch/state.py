"""What a batch keeps in ``<output_dir>/.precision-convert-batch/``: per-job state and the lock.

Each job's state file records what its output is known to be: the digest of the job that
wrote it, the sha256 of its passing certificate, and what was pushed (repo, URL, the pull
request's number) for which certificate. ``--resume`` trusts none of it on its own: an output
is finished only when the one verifier
(:func:`precision_convert.validation.certify.verify.verify`, the push's gate) passes on the files
as they are now *and* the state says the same certificate was produced (and pushed) by
the same job. Anything less is redone: a push alone when only the push is missing.

The folder is hidden, so neither the certificate's hashing nor ``push`` ever sees it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.batch.manifest import Job
from precision_convert.core.errors import InputError

if TYPE_CHECKING:
    from precision_convert.validation.certify.certificate import Certificate

STATE_DIR = ".precision-convert-batch"
_LOCK_NAME = "lock"


@dataclass
class JobState:
    """The last known state of one job's output."""

    key: str
    digest: str  # Job.digest of the run that wrote the output
    certificate: str | None = None  # sha256 of the passing certificate file
    fp32_share: float | None = None
    push: dict[str, Any] | None = None  # repo_id, url, pull_request, shape, certificate
    updated: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))


class StateStore:
    """Per-job state files, written atomically (a killed run leaves the old one or the new)."""

    def __init__(self, output_dir: Path) -> None:
        self.root = output_dir / STATE_DIR / "jobs"

    def read(self, key: str) -> JobState | None:
        try:
            data = json.loads((self.root / f"{key}.json").read_text(encoding="utf-8"))
            return JobState(**data)
        except (OSError, ValueError, TypeError):
            return None

    def write(self, state: JobState) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        state.updated = datetime.now(UTC).isoformat(timespec="seconds")
        path = self.root / f"{state.key}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)


class Resume(Enum):
    """Where a job starts: from the beginning, at its push, or not at all."""

    CONVERT = "convert"
    PUSH = "push"
    DONE = "done"


@dataclass(frozen=True)
class Start:
    """Where a job starts, with what ``--resume`` found kept (certificate and state)."""

    point: Resume
    certificate: Certificate | None = None
    state: JobState | None = None


def resume_point(job: Job, store: StateStore) -> Start:
    """How much of ``job`` a ``--resume`` run can keep (see the module docstring)."""
    from precision_convert.core.errors import PrecisionConvertError
    from precision_convert.validation.certify.verify import verify

    state = store.read(job.key)
    if state is None or state.digest != job.digest or state.certificate is None:
        return Start(Resume.CONVERT)
    try:
        checked = verify(job.output)
    except PrecisionConvertError:
        return Start(Resume.CONVERT)
    if checked.files[checked.certificate_name].sha256 != state.certificate:
        return Start(Resume.CONVERT)
    pushed = state.push or {}
    done = job.push is None or (
        pushed.get("repo_id") == job.push.repo_id and pushed.get("certificate") == state.certificate
    )
    return Start(Resume.DONE if done else Resume.PUSH, checked.certificate, state)


@contextlib.contextmanager
def exclusive(output_dir: Path) -> Iterator[None]:
    """Hold ``output_dir`` for one batch run; a second run on it stops with :class:`InputError`
    naming the holder (its pid and start, which the lock file holds while it runs).

    filelock's ``flock``, taken without waiting: the kernel drops it when the holder exits,
    however it exits, so a killed run never leaves a stale lock behind (no soft-lock fallback:
    a filesystem without ``flock`` is an error, not a marker file a killed run would leave).
    """
    from filelock import FileLock, Timeout

    folder = output_dir / STATE_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        message = f"cannot create the output folder ({exc.strerror or exc})"
        raise InputError(message, output_dir) from None
    path = folder / _LOCK_NAME
    lock = FileLock(path, blocking=False, fallback_to_soft=False, on_acquired=_write_holder)
    try:
        lock.acquire()
    except Timeout:
        holder = path.read_text(encoding="utf-8", errors="replace").strip() or "another process"
        raise InputError(
            f"another batch run ({holder}) is writing here; wait for it to finish, or use "
            "another output_dir",
            output_dir,
        ) from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.truncate(path, 0)  # still held: nobody reads a stale holder
        lock.release()


def _write_holder(fd: int) -> None:
    """filelock's ``on_acquired``: who holds the folder, for another run's message."""
    since = datetime.now(UTC).isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, since {since}".encode(), 0)
