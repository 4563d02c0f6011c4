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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: ``reporter(label, done, total, at_most)``: ``done`` of ``total`` steps of ``label`` are
#: finished (``total`` None when unknown; with ``at_most`` an upper bound the work may stop
#: short of, as the island search does).
Reporter = Callable[[str, int, int | None, bool], None]

_REPORTER: ContextVar[Reporter | None] = ContextVar("precision_convert_reporter", default=None)
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
#: seconds): what a run cost stage by stage, for ``bench/certify.py``. Unset: nothing written.
LEDGER_VARIABLE = "PRECISION_CONVERT_LEDGER"


def record_forwards(what: str, forwards: int, seconds: float) -> None:
    """Append one probe run to the ledger :data:`LEDGER_VARIABLE` names (if it names one)."""
    path = os.environ.get(LEDGER_VARIABLE)
    if not path:
        return
    row = {"stage": SEPARATOR.join(_STAGE.get()), "what": what, "forwards": forwards}
    with open(path, "a", encoding="utf-8") as ledger:
        ledger.write(json.dumps({**row, "seconds": round(seconds, 3)}) + "\n")


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
def reporting(reporter: Reporter) -> Iterator[None]:
    """Send the reports made inside to ``reporter``; the previous one comes back on exit."""
    token = _REPORTER.set(reporter)
    try:
        yield
    finally:
        _REPORTER.reset(token)


_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_restore = False


@contextmanager
def diffusers_bars_off() -> Iterator[None]:
    """Turn off the bars diffusers draws while it builds a pipeline ("Loading pipeline
    components...") for the duration of our own loads: a validation builds a dozen, and their
    bars would bury ours. (transformers' follow huggingface_hub's switch, which the command
    sets; the bar of a pipeline's denoising loop is switched per pipeline.)

    The switch is diffusers' and process-wide, so it is counted: the first caller in turns the
    bars off, the last one out puts back what was there, nested and concurrent calls included.
    Without diffusers installed it does nothing.
    """
    global _quiet_depth, _quiet_restore
    try:
        from diffusers.utils import logging
    except ImportError:
        yield
        return
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_restore = logging.is_progress_bar_enabled()
            logging.disable_progress_bar()
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0 and _quiet_restore:
                logging.enable_progress_bar()
