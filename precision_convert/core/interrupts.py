"""Ctrl-C, SIGTERM and SIGHUP stop a run the same way: every cleanup runs, one line, an exit code.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread happens to be; SIGTERM
(what ``kill``, ``timeout``, Slurm, Kubernetes and systemd send) and SIGHUP (a closed terminal
or SSH session) would kill the process outright, leaving its lock and staging directory beside
the target. So the command installs a handler (:func:`watch`) that turns all three into a
``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM and SIGHUP), which unwinds through
every ``finally`` and context manager like a Ctrl-C. The exit code is ``128 + signal``
(:func:`exit_code`: 130, 143, 129), as a shell reports a process the signal killed.

Code that catches ``BaseException`` can swallow the exception: it was seen once in 50 trials
while torch imported numpy, and the command then ran on as if nothing had been asked. So the
handler also records each signal, and the two steps that cannot be taken back, renaming an
output into place and the Hub commit, call :func:`check` first; so do long loops (each chunk
the writer casts, each probe the bookkeeping of what probes reached reads), so that a run
stops within a step of the signal. The handler runs between Python bytecodes only: one long
torch op delays it, which is why no probe is sized by a declared number a config may blow
up (positions, sides, frames), only by what runs. Installing a signal handler
changes the process, so only code that owns its process (the command, a batch worker) calls
:func:`watch`; for a library caller nothing is recorded and :func:`check` never fires.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType
from typing import Any, NoReturn

#: The signals :func:`watch` handles: Ctrl-C, and the two that end a run as it does.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: Every signal received since :func:`watch`, first first; never cleared: the process is on
#: its way out. A list append is atomic, and handlers run on the main thread only.
_received: list[int] = []


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is, like Ctrl-C's ``KeyboardInterrupt``
    (a subclass, so everything that cleans up after a Ctrl-C does so after these too)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def watch() -> None:
    """Handle SIGINT, SIGTERM and SIGHUP: record each, then raise (:func:`on_signal`).

    A second SIGTERM or SIGHUP while the first one's cleanup runs is recorded but not raised,
    so it cannot cut that cleanup short (a scheduler follows up with SIGKILL if it must).

    A ``KeyboardInterrupt`` raised inside a finalizer (``__del__``, a weakref callback, a
    garbage collection) cannot propagate: Python prints it with a traceback as "Exception
    ignored" and runs on. The record keeps it, so that print is dropped: the command's own
    one line says it was interrupted, at the next :func:`check`.
    """
    for signum in SIGNALS:
        signal.signal(signum, on_signal)
    previous = sys.unraisablehook

    def unraisable(report: Any) -> None:
        if not isinstance(report.exc_value, KeyboardInterrupt):
            previous(report)

    sys.unraisablehook = unraisable


def on_signal(signum: int, frame: FrameType | None) -> None:
    """The handler :func:`watch` installs (and a batch worker calls for a job in progress):
    record the signal, raise its exception."""
    already = terminating()
    _received.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    if not already:
        raise Terminated(signum)


def check() -> None:
    """Raise the first signal's exception when one arrived since :func:`watch`, even one
    that some code caught and dropped."""
    if _received:
        first = _received[0]
        raise KeyboardInterrupt if first == signal.SIGINT else Terminated(first)


def terminating() -> bool:
    """Whether a SIGTERM or SIGHUP arrived since :func:`watch`."""
    return any(s != signal.SIGINT for s in _received)


def exit_now(code: object) -> NoReturn:
    """End the process with ``code`` (an int, as ``SystemExit`` carries it) at once: the
    output streams flushed, the interpreter's teardown skipped."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream loses what is left
            stream.flush()
    os._exit(code if isinstance(code, int) else 1)


def exit_code(exc: KeyboardInterrupt) -> int:
    """The exit code of a run that ``exc`` stopped: ``128 + the signal``, as a shell reports
    a process the signal killed (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + _signum(exc)


def stopped_by(exc: KeyboardInterrupt) -> str:
    """The words a command's one line starts with: ``interrupted``, or ``interrupted by
    SIGTERM`` (a log then says which signal stopped it)."""
    signum = _signum(exc)
    if signum == signal.SIGINT:
        return "interrupted"
    return f"interrupted by {signal.Signals(signum).name}"


def _signum(exc: KeyboardInterrupt) -> int:
    return exc.signum if isinstance(exc, Terminated) else int(signal.SIGINT)
