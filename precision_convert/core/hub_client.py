"""A bounded Hub client for a process that owns itself: the command and batch workers.

huggingface_hub's HTTP client waits forever (``timeout=None``, passed on every request): a Hub
that accepts the connection and never answers would hang a download, a listing or a push. It
also sleeps for as long as a busy Hub asks (``Retry-After``, or a rate-limit reset, on 429 and
5xx answers) before each of its retries, silently: ``Retry-After: 86400`` on a preupload holds
a push for a day. It offers no per-call bound for either, only a process-wide client factory
(``huggingface_hub.set_client_factory``). So only code that owns its process installs the
bounds, through :func:`bound_hub_requests`: the ``precision-convert`` command (from
``cli.main.run``) and the batch worker processes it starts (``batch.job.own_process``). A
library call (``pc.convert``, ``pc.push``) never does: library users configure their own
client, and ``resolve(timeout=...)`` bounds what can be bounded per call.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from types import ModuleType
from typing import Any

from precision_convert.core.imports import when_imported
from precision_convert.core.units import duration

#: Seconds a Hub request may go without receiving a byte before it fails (default 60).
HUB_TIMEOUT_VARIABLE = "PRECISION_CONVERT_HUB_TIMEOUT"
#: Long enough for a slow Hub to answer a listing, short enough that a silent one is noticed.
_DEFAULT_SECONDS = 60.0
#: The longest wait before one retry that a busy Hub may ask for (seconds, default 300); a
#: longer one stops the command with a line saying when to run it again.
MAX_RETRY_WAIT_VARIABLE = "PRECISION_CONVERT_MAX_RETRY_WAIT"
#: A few minutes: a rate limit's window, not a day.
DEFAULT_MAX_RETRY_WAIT = 300.0
#: A wait longer than this (seconds) is announced on stderr: never a silent sleep.
ANNOUNCED_WAIT = 5.0
#: huggingface_hub's HTTP module: its client factory, and the one way its requests go out.
_HTTP_MODULE = "huggingface_hub.utils._http"
#: The answers huggingface_hub retries, after the wait they ask for.
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class WaitTooLong(Exception):
    """The Hub answered ``status`` to ``request`` asking to wait ``seconds`` before a retry,
    more than ``maximum`` (:data:`MAX_RETRY_WAIT_VARIABLE`): raised instead of sleeping."""

    def __init__(self, status: int, request: str, seconds: float, maximum: float) -> None:
        self.status = status
        self.request = request
        self.seconds = seconds
        self.maximum = maximum
        super().__init__(
            f"the Hub answered {status} to {request} asking to wait {duration(seconds)}, "
            f"more than {MAX_RETRY_WAIT_VARIABLE} allows ({maximum:g} s); try again after "
            f"{clock(seconds)}"
        )


def max_retry_wait() -> float:
    """:data:`MAX_RETRY_WAIT_VARIABLE` in seconds (default :data:`DEFAULT_MAX_RETRY_WAIT`);
    ``ValueError`` when it is not a number of seconds (see
    :func:`precision_convert.hub.errors.retry_wait_limit`, which commands call first)."""
    value = os.environ.get(MAX_RETRY_WAIT_VARIABLE, "").strip()
    if not value:
        return DEFAULT_MAX_RETRY_WAIT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(
            f"{MAX_RETRY_WAIT_VARIABLE}={value!r}: give the longest wait in seconds (e.g. 300)"
        )
    return seconds


def requested_wait(status: int, headers: Mapping[str, str]) -> float | None:
    """Seconds a Hub answer asks to wait before a retry, as huggingface_hub reads them: for a
    429 with no request left the rate limit's reset, else ``Retry-After`` (seconds, or an HTTP
    date); None when it names none."""
    if status == 429:
        from huggingface_hub.utils import parse_ratelimit_headers

        limit = parse_ratelimit_headers(headers)
        if limit is not None and limit.remaining == 0:
            return float(limit.reset_in_seconds)
    return retry_after(headers.get("Retry-After"))


def retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: a number of seconds or an HTTP date."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def clock(seconds: float) -> str:
    """The time ``seconds`` from now, in UTC (with the date when it is not today)."""
    now = datetime.now(UTC)
    when = now + timedelta(seconds=seconds)
    return when.strftime("%H:%M:%S UTC" if when.date() == now.date() else "%Y-%m-%d %H:%M UTC")


def announce_wait(what: str, seconds: float) -> None:
    """One line on stderr for a wait longer than :data:`ANNOUNCED_WAIT` (shorter ones pass
    unsaid): ``what`` the wait is for."""
    if seconds > ANNOUNCED_WAIT:
        print(
            f"precision-convert: {what}: waiting {duration(seconds)}, until {clock(seconds)}",
            file=sys.stderr,
            flush=True,
        )


def bound_hub_requests() -> None:
    """Give huggingface_hub's HTTP client a timeout, for this process (call it only from code
    that owns the process; see the module docstring).

    A request hook replaces a missing timeout with one that bounds each wait for data, not a
    whole transfer, so large files are unaffected; a timeout a caller set is kept. The value
    comes from ``PRECISION_CONVERT_HUB_TIMEOUT`` (seconds; default 60), read now, so worker
    processes inherit the command's. A response hook, :func:`pace`, bounds and announces the
    waits a busy Hub asks for.

    The client is set up when huggingface_hub's HTTP module is first imported (now, if it
    already is): every request goes through it, and a run that never reaches the Hub (a local
    source, ``--no-validate``) never imports it nor httpx2.
    """
    seconds = float(os.environ.get(HUB_TIMEOUT_VARIABLE) or _DEFAULT_SECONDS)
    when_imported(_HTTP_MODULE, lambda http: _bound_client(http, seconds))


def _bound_client(http: ModuleType, seconds: float) -> None:
    """Install the bounded client factory in ``http`` (:data:`_HTTP_MODULE`, just imported)."""
    try:
        import httpx2  # imported already by this generation's http module

        set_client_factory = http.set_client_factory
        default_client_factory = http.default_client_factory
    except (ImportError, AttributeError):  # another generation: keep its own behaviour
        return
    bounded = httpx2.Timeout(seconds).as_dict()

    def bound(request: httpx2.Request) -> None:
        if not any(request.extensions.get("timeout", {}).values()):
            request.extensions["timeout"] = bounded

    def bounded_client() -> httpx2.Client:
        client: httpx2.Client = default_client_factory()
        client.event_hooks["request"].append(bound)
        client.event_hooks["response"].append(pace)
        return client

    set_client_factory(bounded_client)


def pace(response: Any) -> None:
    """For an answer huggingface_hub retries after the wait it asks for: raise
    :class:`WaitTooLong` (before the client sleeps) when the wait is longer than
    :func:`max_retry_wait`, else announce it (:func:`announce_wait`); the client, or the
    caller that retries a call the client does not (a commit), then waits."""
    if response.status_code not in RETRIED_STATUSES:
        return
    seconds = requested_wait(response.status_code, response.headers)
    if seconds is None:
        return
    request = f"{response.request.method} {response.request.url.path}"
    maximum = max_retry_wait()
    if seconds > maximum:
        raise WaitTooLong(response.status_code, request, seconds, maximum)
    announce_wait(f"the Hub answered {response.status_code} to {request}", seconds)
