"""Progress of long work, reported without threading callbacks through every signature.

The library calls :func:`report` at its loop points (each probe run, each island-search
candidate, each block compared) and labels stretches of work with :func:`stage`. Both only
read and set a :class:`~contextvars.ContextVar`: with no reporter installed (the default, and
every library call made outside the CLI) a report costs one lookup and does nothing, so library
calls keep no process-wide state. The CLI installs a reporter with :func:`reporting` for the
duration of one command and draws it on stderr.

Example:
    >>> seen = []
    >>> with reporting(lambda label, done, total, at_most: seen.append((label, done, total))):
    ...     with stage("calibration"):
    ...         report("probe", 1, 3)
    >>> seen
    [('calibration › probe', 1, 3)]
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from precision_convert.core.units import duration

#: ``reporter(label, done, total, at_most)``: ``done`` of ``total`` steps of ``label`` are
#: finished (``total`` None when unknown; with ``at_most`` an upper bound the work may stop
#: short of, as the island search does).
Reporter = Callable[[str, int, int | None, bool], None]

#: ``say(line)``: one sentence about the work ahead (how many forwards, how long), for a line
#: of its own.
Sayer = Callable[[str], None]

_REPORTER: ContextVar[Reporter | None] = ContextVar("precision_convert_reporter", default=None)
_SAYER: ContextVar[Sayer | None] = ContextVar("precision_convert_sayer", default=None)
_STAGE: ContextVar[tuple[str, ...]] = ContextVar("precision_convert_stage", default=())
#: Joins nested stage names in a label.
SEPARATOR = " › "


def report(what: str, done: int, total: int | None = None, *, at_most: bool = False) -> None:
    """Tell the installed reporter (if any) that ``done`` of ``total`` steps of ``what`` are
    finished, labelled with the enclosing stages. Work that ends before an ``at_most`` total
    reports ``done == total`` last, so the reporter knows it is over."""
    reporter = _REPORTER.get()
    if reporter is not None:
        reporter(SEPARATOR.join((*_STAGE.get(), what)), done, total, at_most)


#: A file to which every probe run appends one JSON line (its stages, what ran, forwards,
#: seconds, of which in the forwards themselves) and every stretch of work outside forwards
#: (:func:`ledger_span`) one more: what a run cost stage by stage, for ``bench/certify.py``.
#: Unset: nothing written.
LEDGER_VARIABLE = "PRECISION_CONVERT_LEDGER"
_SPAN: ContextVar[bool] = ContextVar("precision_convert_span", default=False)


def record_forwards(
    what: str,
    forwards: int,
    seconds: float,
    forward_seconds: float | None = None,
    by_kind: Mapping[str, tuple[int, float]] | None = None,
) -> None:
    """Append one probe run to the ledger :data:`LEDGER_VARIABLE` names (if it names one):
    ``seconds`` in all, ``forward_seconds`` of them in the model's forwards, and ``by_kind``
    the forwards and seconds of each kind of probe (vocabulary, length, first-position...)."""
    path = os.environ.get(LEDGER_VARIABLE)
    if not path:
        return
    row: dict[str, Any] = {"stage": SEPARATOR.join(_STAGE.get()), "what": what}
    row.update(forwards=forwards, seconds=round(seconds, 3))
    if forward_seconds is not None:
        row["forward_seconds"] = round(forward_seconds, 3)
    if by_kind:
        row["kinds"] = {k: [n, round(t, 3)] for k, (n, t) in by_kind.items()}
    _append(path, row)


@contextmanager
def ledger_span(what: str) -> Iterator[None]:
    """Time the block as work outside forwards (loading, hashing, writing...) and append it
    to the ledger as a row with ``"outside": true`` (when :data:`LEDGER_VARIABLE` names one).
    A span inside another is part of the outer one, not written again."""
    path = os.environ.get(LEDGER_VARIABLE)
    if not path or _SPAN.get():
        yield
        return
    token = _SPAN.set(True)
    start = time.perf_counter()
    try:
        yield
    finally:
        _SPAN.reset(token)
        row = {"stage": SEPARATOR.join(_STAGE.get()), "what": what, "forwards": 0}
        _append(path, {**row, "seconds": round(time.perf_counter() - start, 3), "outside": True})


def _append(path: str, row: dict[str, Any]) -> None:
    """Write ``row`` with the process's CPU seconds so far (user, kernel): the difference
    between two rows is what the work between them cost, page faults showing as kernel time."""
    times = os.times()
    row["cpu_s"] = [round(times.user, 2), round(times.system, 2)]
    with open(path, "a", encoding="utf-8") as ledger:
        ledger.write(json.dumps(row) + "\n")


def shorten(label: str, width: int) -> str:
    """``label`` in at most ``width`` characters, for a line of its own: the enclosing stages
    go first (``validation › LlamaForCausalLM fp32 probes`` → ``…LlamaForCausalLM fp32
    probes``), then whole words from the end; a word is cut only when it alone is too long.
    A class name is never cut in the middle."""
    if len(label) <= width:
        return label
    parts = label.split(SEPARATOR)
    while len(parts) > 1 and len("…" + SEPARATOR.join(parts)) > width:
        parts.pop(0)
    text = ("…" if len(parts) < len(label.split(SEPARATOR)) else "") + SEPARATOR.join(parts)
    if len(text) <= width:
        return text
    words = text.split(" ")
    while len(words) > 1 and len(" ".join(words) + "…") > width:
        words.pop()
    kept = " ".join(words)
    return kept + "…" if len(kept) < width else kept[: width - 1] + "…"


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Label the reports made inside (nestable; also usable as a function decorator)."""
    token = _STAGE.set((*_STAGE.get(), name))
    try:
        yield
    finally:
        _STAGE.reset(token)


@contextmanager
def reporting(reporter: Reporter, sayer: Sayer | None = None) -> Iterator[None]:
    """Send the reports made inside to ``reporter`` (and :func:`say`'s lines to ``sayer``);
    the previous ones come back on exit."""
    token = _REPORTER.set(reporter)
    said = _SAYER.set(sayer)
    try:
        yield
    finally:
        _SAYER.reset(said)
        _REPORTER.reset(token)


def say(text: str) -> None:
    """Tell the user one thing about the work ahead (nothing happens outside the CLI)."""
    sayer = _SAYER.get()
    if sayer is not None:
        sayer(text)


#: An estimate past this many seconds suggests a cheaper coverage level.
LONG_RUN = 600.0
#: A new estimate may exceed the last one said by this factor at most without a line saying
#: why (a slower kind of probe started, more forwards were planned): an estimate that climbs
#: unexplained is one a user stops trusting, and stops the run over.
RISE_UNEXPLAINED = 1.2
#: A falling estimate is said again once it has fallen to this share of the last one said: a
#: few lines a run, each worth reading.
FALL_WORTH_SAYING = 2 / 3
#: A change of the estimate smaller than this is not said (a few seconds either way is noise).
CHANGE_WORTH_SECONDS = 10.0
#: The precision classes a forecast paces apart (a candidate's fp16 forward on a CPU can take
#: four times an fp32 one): ``fp32`` and every other precision, the candidate's.
FP32, CANDIDATE = "fp32", "candidate"
_FORECAST: ContextVar[Forecast | None] = ContextVar("precision_convert_forecast", default=None)


class Forecast:
    """The forwards a stretch of work will run, said before they start, and how long they
    should take: first said once a full-size probe of each precision still to run has been
    timed (the fp32 pace alone says nothing of an fp16 candidate's on a CPU, and the layout's
    own probe is a few tokens: it says nothing about the sweep's pace), then again when the
    figure has fallen well below the last one said, or when it has risen past
    :data:`RISE_UNEXPLAINED` times it, with why."""

    def __init__(self, what: str, hint: str) -> None:
        self.what = what
        self.hint = hint  # said with an estimate past LONG_RUN
        self.planned = {FP32: 0, CANDIDATE: 0}
        self.done = {FP32: 0, CANDIDATE: 0}
        self.timed = {FP32: 0.0, CANDIDATE: 0.0}  # seconds of the full-size probes run
        self.counted = {FP32: 0, CANDIDATE: 0}  # how many full-size probes those are
        self.named = {FP32: FP32, CANDIDATE: CANDIDATE}  # the precision a class last ran in
        self.kinds: set[tuple[str, str]] = set()  # (class, probe kind) timed so far
        self.said: float | None = None  # the last estimate said
        self.why: list[str] = []  # what changed since then that may raise the estimate

    def expect(self, forwards: int, detail: str, fp32: int = 0) -> None:
        """``forwards`` more to run (``detail``: of what; ``fp32`` of them in fp32, the rest
        in the candidate's precision), said now."""
        self.planned[FP32] += fp32
        self.planned[CANDIDATE] += forwards - fp32
        say(f"{self.what}: {forwards} forwards to run ({detail})")
        if self.said is not None:
            self.why.append(f"{forwards} more forwards planned ({detail})")

    def ran(self, precision: str, seconds: float, full: bool, kind: str = "") -> None:
        which = FP32 if precision == FP32 else CANDIDATE
        self.done[which] += 1
        self.named[which] = precision
        if full:
            self._timed(which, precision, seconds, kind)
        estimate = self.estimate()
        if estimate is None:
            return
        left = sum(max(0, self.planned[c] - self.done[c]) for c in self.planned)
        paces = ", ".join(
            f"{self.timed[c] / self.counted[c]:.2f} s per {self.named[c]} probe"
            for c in self.planned
            if self.counted[c] and self.planned[c] > self.done[c]
        )
        line = f"{self.what}: about {duration(estimate)} left ({left} forwards, {paces})"
        if self.said is None:
            say(f"{line}; {self.hint}" if estimate > LONG_RUN and self.hint else line)
        else:
            worth = (
                self.said * FALL_WORTH_SAYING >= estimate or estimate > self.said * RISE_UNEXPLAINED
            )
            if not worth or abs(estimate - self.said) < CHANGE_WORTH_SECONDS:
                return
            if estimate > self.said:
                why = "; ".join(self.why) or "the probes so far ran slower than the first ones"
                line = f"{line}: up from about {duration(self.said)}: {why}"
            say(line)
        self.said = estimate
        self.why.clear()

    def _timed(self, which: str, precision: str, seconds: float, kind: str) -> None:
        """Count a full-size probe's ``seconds`` into its class's pace; the first probe of a
        kind slower than the pace so far is a reason the estimate may rise."""
        before = self.timed[which] / self.counted[which] if self.counted[which] else None
        self.timed[which] += seconds
        self.counted[which] += 1
        if (which, kind) in self.kinds:
            return
        self.kinds.add((which, kind))
        if before is not None and seconds > before * RISE_UNEXPLAINED:
            self.why.append(
                f"a slower probe kind started: {kind or 'unnamed'} ({seconds:.2f} s per "
                f"{precision} probe against {before:.2f} s before)"
            )

    def estimate(self) -> float | None:
        """Seconds left: each precision class's forwards still to run at its pace so far;
        None until every class with forwards left has one, or when none are left."""
        seconds, left = 0.0, 0
        for which, planned in self.planned.items():
            remaining = max(0, planned - self.done[which])
            if not remaining:
                continue
            if not self.counted[which]:
                return None
            left += remaining
            seconds += remaining * self.timed[which] / self.counted[which]
        return seconds if left else None


@contextmanager
def forecasting(what: str, hint: str = "") -> Iterator[Forecast]:
    """A :class:`Forecast` that the forwards run inside count against."""
    ahead = Forecast(what, hint)
    token = _FORECAST.set(ahead)
    try:
        yield ahead
    finally:
        _FORECAST.reset(token)


def expect(forwards: int, detail: str, fp32: int = 0) -> None:
    """``forwards`` more to run (``detail``: of what; ``fp32`` of them in fp32, the rest in the
    candidate's precision), said now, when a forecast is installed."""
    ahead = _FORECAST.get()
    if ahead is not None:
        ahead.expect(forwards, detail, fp32)


def forward_ran(precision: str, seconds: float, full: bool, kind: str = "") -> None:
    """One probe ran (``full``: a sweep probe, sized like the rest; ``kind``: its sweep
    kind); counted by the forecast installed, if any."""
    ahead = _FORECAST.get()
    if ahead is not None:
        ahead.ran(precision, seconds, full, kind)


#: Seconds of silence after which a command's progress says it is still working.
HEARTBEAT_SECONDS = 10.0


class Heartbeat:
    """Calls ``beat(seconds)`` from a thread of its own each time ``interval`` seconds pass
    without :meth:`touch` (``seconds``: since the last touch), while it is entered.

    Some stretches of work report nothing for long (a model built and loaded, a Hub client
    resolving, the weights hashed): a command's progress display touches the heartbeat on every
    line it writes, and the beat writes a line of its own, so a log or a person watching never
    goes more than ``interval`` seconds without one.
    """

    def __init__(self, beat: Callable[[float], None], interval: float = HEARTBEAT_SECONDS) -> None:
        self.beat = beat
        self.interval = interval
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def touch(self) -> None:
        """A line was written: the silence starts again."""
        self.last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, self.last + self.interval - time.monotonic())):
            silent = time.monotonic() - self.last
            if silent >= self.interval:
                self.beat(silent)
                self.last = time.monotonic()

    def __enter__(self) -> Heartbeat:
        self.touch()
        self._thread = threading.Thread(target=self._run, name="precision-convert-heartbeat")
        self._thread.daemon = True  # never holds the process open past its command
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
