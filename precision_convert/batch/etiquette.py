"""Hub etiquette for many pushes: one commit at a time per repo, spaced, and 429 backed off.

A batch may point many jobs at one repo (variant PRs into one source repo). The Hub rate-limits
commits per repo and answers 429 when pushed too hard; huggingface_hub retries some requests
itself, but not every call of a commit. So each push here:

- takes the repo's turn: an ``flock`` on a file per repo in the batch's state folder, shared by
  every worker process (and every Ray worker on a shared filesystem), and waits until
  ``interval`` seconds have passed since that repo's last commit;
- retries what may pass later — 429 (after its ``Retry-After`` when the Hub sends one), 5xx,
  a branch that moved meanwhile (409/412), a lost connection — with exponential backoff, and
  gives up at once on anything else (a refused gate, a bad token, a 4xx).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from precision_convert.errors import PushFailed

if TYPE_CHECKING:
    from precision_convert.hub import PushResult


@dataclass(frozen=True)
class Etiquette:
    """How politely to push: seconds between commits to one repo, and the retry schedule."""

    lock_dir: Path
    interval: float = 1.0
    retries: int = 4
    backoff: float = 2.0  # first retry delay; doubled each time


def publish_politely(
    converted: Path,
    repo_id: str,
    *,
    create_pr: bool,
    private: bool | None,
    etiquette: Etiquette,
    sleep: Callable[[float], None] = time.sleep,
) -> PushResult:
    """:func:`precision_convert.hub.publish` within the repo's turn, retried as above."""
    from precision_convert.hub import publish

    attempt = 0
    while True:
        with _turn(etiquette, repo_id, sleep):
            try:
                return publish(converted, repo_id, create_pr=create_pr, private=private)
            except PushFailed as exc:
                delay = retry_delay(exc, attempt, etiquette.backoff)
                if delay is None or attempt >= etiquette.retries:
                    raise
        sleep(delay)
        attempt += 1


def retry_delay(exc: PushFailed, attempt: int, backoff: float) -> float | None:
    """Seconds to wait before trying ``exc``'s push again, or None when waiting cannot help."""
    status = exc.status
    if status is None:  # the connection failed: transient
        return backoff * 2**attempt
    if status == 429:
        return exc.retry_after if exc.retry_after is not None else backoff * 2**attempt
    if status >= 500 or status in (409, 412):
        return backoff * 2**attempt
    return None


@contextlib.contextmanager
def _turn(etiquette: Etiquette, repo_id: str, sleep: Callable[[float], None]) -> Iterator[None]:
    """Exclusive use of ``repo_id`` across processes, ``interval`` after its last commit."""
    etiquette.lock_dir.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(repo_id.encode()).hexdigest()[:16]
    with (etiquette.lock_dir / f"{name}.lock").open("a+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        try:
            last = float(handle.read().strip() or 0)
        except ValueError:  # a file cut short by a killed run: no turn to wait for
            last = 0.0
        wait = last + etiquette.interval - time.time()
        if wait > 0:
            sleep(wait)
        try:
            yield
        finally:
            handle.truncate(0)
            handle.write(f"{time.time():.3f}")
            handle.flush()
