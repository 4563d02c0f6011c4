"""Hub etiquette for many pushes: one commit at a time per repo, spaced, and 429 backed off.

A batch may point many jobs at one repo (variant PRs into one source repo). The Hub rate-limits
commits per repo and answers 429 when pushed too hard; huggingface_hub retries some requests
itself, but not every call of a commit. So each push here:

- takes the repo's turn: a lock on a file per repo in the batch's state folder (filelock's
  ``flock``, which the kernel drops when its holder dies, so a killed worker never leaves a
  stale turn), shared by every worker process (and every Ray worker on a shared filesystem),
  and waits until ``interval`` seconds have passed since that repo's last commit;
- retries what may pass later — 429 (after its ``Retry-After``, seconds or an HTTP date, when
  the Hub sends one), 5xx, a branch that moved meanwhile (409/412), a lost connection — with
  exponential backoff plus jitter (tenacity), so workers that failed together do not come back
  together; anything else (a refused gate, a bad token, a 4xx) is raised at once. A wait the
  Hub asks for beyond ``PRECISION_CONVERT_MAX_RETRY_WAIT`` is not waited: the push fails at
  once with a line saying when to run it again (``batch --resume`` pushes it then). A wait
  longer than a few seconds is announced on stderr: the worker's Hub client announces those
  the Hub asks for, the backoff its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from precision_convert.core.errors import PushFailed
from precision_convert.core.hub_client import announce_wait, max_retry_wait

if TYPE_CHECKING:
    from tenacity import RetryCallState

    from precision_convert.hub import PushResult

#: The longest a backoff waits before one retry, whatever the attempt (a Retry-After is obeyed).
_MAX_BACKOFF = 120.0


@dataclass(frozen=True)
class Etiquette:
    """How politely to push: seconds between commits to one repo, and the retry schedule."""

    lock_dir: Path
    interval: float = 1.0
    retries: int = 4
    backoff: float = 2.0  # first retry delay, doubled each time, plus up to as much jitter


def push_politely(
    converted: Path,
    repo_id: str,
    *,
    create_pr: bool,
    private: bool | None,
    etiquette: Etiquette,
    sleep: Callable[[float], None] = time.sleep,
) -> PushResult:
    """:func:`precision_convert.hub.push_with_result` within the repo's turn, retried as above."""
    from tenacity import Retrying, retry_if_exception, stop_after_attempt

    from precision_convert.hub import push_with_result

    def attempt() -> PushResult:
        with _turn(etiquette, repo_id, sleep):
            return push_with_result(converted, repo_id, create_pr=create_pr, private=private)

    def announce(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if not isinstance(exc, PushFailed) or state.next_action is None:
            return
        if exc.retry_after is None:  # one the Hub asked for was said as it answered
            answer = exc.status or "no answer"
            announce_wait(f"{repo_id}: push failed ({answer}), retrying", state.next_action.sleep)

    retrying = Retrying(
        retry=retry_if_exception(transient),
        wait=_Wait(etiquette.backoff),
        stop=stop_after_attempt(etiquette.retries + 1),
        sleep=sleep,
        before_sleep=announce,
        reraise=True,  # the last PushFailed itself, not tenacity's RetryError
    )
    return retrying(attempt)


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a push that may pass if tried again later, and soon enough: a wait
    the Hub asks for beyond ``PRECISION_CONVERT_MAX_RETRY_WAIT`` is not waited."""
    if not isinstance(exc, PushFailed):
        return False
    if exc.retry_after is not None and exc.retry_after > max_retry_wait():
        return False
    status = exc.status
    return status is None or status == 429 or status >= 500 or status in (409, 412)


class _Wait:
    """tenacity's wait: the Hub's ``Retry-After`` for an answer that sends one (a 429 or a
    5xx), else exponential backoff with jitter."""

    def __init__(self, backoff: float) -> None:
        from tenacity import wait_exponential, wait_random

        self.backoff = wait_exponential(multiplier=backoff, max=_MAX_BACKOFF) + wait_random(
            0, backoff
        )

    def __call__(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, PushFailed) and exc.retry_after is not None:
            return exc.retry_after
        return float(self.backoff(state))


@contextlib.contextmanager
def _turn(etiquette: Etiquette, repo_id: str, sleep: Callable[[float], None]) -> Iterator[None]:
    """Exclusive use of ``repo_id`` across processes, ``interval`` after its last commit (the
    time of which the lock file holds)."""
    from filelock import FileLock

    etiquette.lock_dir.mkdir(parents=True, exist_ok=True)
    path = etiquette.lock_dir / f"{hashlib.sha256(repo_id.encode()).hexdigest()[:16]}.lock"
    # fallback_to_soft=False: on a filesystem without flock, fail rather than leave a marker
    # file that a killed worker would never remove.
    with FileLock(path, fallback_to_soft=False):
        try:
            last = float(path.read_text(encoding="utf-8").strip() or 0)
        except ValueError:  # a file cut short by a killed run: no turn to wait for
            last = 0.0
        wait = last + etiquette.interval - time.time()
        if wait > 0:
            sleep(wait)
        try:
            yield
        finally:
            # Exact: rounded to milliseconds, the time read back could lie up to 0.5 ms
            # ahead of the clock, and the next turn waited for it with no interval set.
            path.write_text(repr(time.time()), encoding="utf-8")
