"""A Ctrl-C that was swallowed on its way up still stops the run before its points of no return.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread happens to be, and code
that catches ``BaseException`` there can swallow it: it was seen once in 50 trials while torch
imported numpy, and the command then ran on as if nothing had been asked. So the command
installs a handler (:func:`watch`) that records each SIGINT before raising, and the two steps
that cannot be taken back, renaming an output into place and the Hub commit, call
:func:`check` first. Installing a signal handler changes the process, so only the command (which
owns its process) calls :func:`watch`; for a library caller nothing is recorded and
:func:`check` never fires.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

#: Set by the handler on every SIGINT; never cleared: the process is on its way out.
_interrupted = threading.Event()


def watch() -> None:
    """Record every SIGINT of this process, then raise ``KeyboardInterrupt`` as Python would.

    A ``KeyboardInterrupt`` raised inside a finalizer (``__del__``, a weakref callback, a
    garbage collection) cannot propagate: Python prints it with a traceback as "Exception
    ignored" and runs on. The flag keeps it, so that print is dropped: the command's own
    one line says it was interrupted, at the next :func:`check`.
    """
    signal.signal(signal.SIGINT, _on_sigint)
    previous = sys.unraisablehook

    def unraisable(report: Any) -> None:
        if not isinstance(report.exc_value, KeyboardInterrupt):
            previous(report)

    sys.unraisablehook = unraisable


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def check() -> None:
    """Raise ``KeyboardInterrupt`` when a SIGINT arrived since :func:`watch`, even one that
    some code caught and dropped."""
    if _interrupted.is_set():
        raise KeyboardInterrupt
