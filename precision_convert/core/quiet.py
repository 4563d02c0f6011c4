"""Third-party libraries kept quiet inside precision-convert's own stages.

transformers, diffusers and huggingface_hub log load reports, warn and draw tqdm bars for every
model they build or save. Inside a conversion those speak of our internal loads, not the
user's (a deliberately partial load reports "missing keys", a safety checker passed to a
pipeline prints its whole module), and they bury the command's progress and summary. Work
inside :func:`quiet_libraries` sends them to the sink a caller installs with
:func:`library_messages` (the CLI's ``--verbose`` prints them), or drops them, and every
switch it touched is put back when the last stage leaves: library calls leave no trace.

The switches are process-wide (logger handlers, ``warnings.showwarning`` and ``filters``, the
libraries' bar flags), so installing them is counted: the first stage in installs, the last
one out restores; nested and concurrent stages share one installation. Whether a message is
held back is decided per context (a :class:`~contextvars.ContextVar`): a thread outside every
stage (a user's code beside a conversion) logs and warns as it did. Our own messages (loggers
under ``precision_convert``, :class:`PrecisionConvertWarning`)
always pass.

Example:
    >>> heard = []
    >>> with library_messages(heard.append), quiet_libraries():
    ...     logging.getLogger("transformers.demo").warning("a load report")
    >>> heard
    ['transformers.demo: a load report']
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TextIO


class PrecisionConvertWarning(UserWarning):
    """A warning of precision-convert's own: it always reaches the user, also inside the
    stages that hold the libraries' warnings back."""


#: ``sink(text)``: one message of a library (``"<logger>: <message>"``, a warning as
#: ``warnings`` formats it), as it is said.
Sink = Callable[[str], None]

#: The loggers messages are held back on: the root (where libraries without a handler of
#: their own end) and the libraries that keep their own handler and do not propagate.
LOGGERS = ("", "transformers", "diffusers", "huggingface_hub", "torch")
#: Loggers whose records are ours: never held back.
OWN_LOGGER = "precision_convert"
#: The modules holding each library's bar switch (``is_progress_bar_enabled`` and
#: ``enable_``/``disable_progress_bar``). transformers' is imported at the first stage (most
#: stages use transformers) unless huggingface_hub's environment switch holds its bars off
#: anyway (the command sets it); diffusers' only when a stage asks for it or diffusers is
#: already imported, since its import costs seconds a transformers model never needs.
BAR_SWITCHES = {
    "transformers": "transformers.utils.logging",
    "diffusers": "diffusers.utils.logging",
}

#: The attribute that marks a record already sent to the sink.
_DELIVERED = "_precision_convert_delivered"

_QUIET: ContextVar[bool] = ContextVar("precision_convert_quiet", default=False)
_SINK: ContextVar[Sink | None] = ContextVar("precision_convert_library_sink", default=None)


@contextmanager
def library_messages(sink: Sink) -> Iterator[None]:
    """Send the library messages held back inside (in this context) to ``sink``."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def _held(name: str) -> bool:
    """Whether a message from logger ``name`` is held back here and now."""
    own = name == OWN_LOGGER or name.startswith(OWN_LOGGER + ".")
    return _QUIET.get() and not own


def _deliver(text: str) -> None:
    sink = _SINK.get()
    if sink is not None:
        sink(text)


class _Router(logging.Handler):
    """Stands in for a logger's handlers: held records go to the sink, the rest to the
    handlers it replaced. A handler the library adds meanwhile (diffusers configures its
    logger on import) is adopted the first time a record passes, so it never speaks past us."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.replaced = list(logger.handlers)
        for handler in self.replaced:
            logger.removeHandler(handler)
        logger.addHandler(self)

    def handle(self, record: logging.LogRecord) -> bool:
        # Whole records, not formatted lines: no lock of ours around the handlers it calls.
        for handler in [h for h in self.logger.handlers if h is not self]:
            self.logger.removeHandler(handler)
            self.replaced.append(handler)
        if _held(record.name):
            # A record held on a library's logger may propagate to the root's router too
            # (whoever turned the library's propagation on): it reaches the sink once.
            if not getattr(record, _DELIVERED, False):
                setattr(record, _DELIVERED, True)
                _deliver(f"{record.name}: {record.getMessage()}")
            return True
        for handler in self.replaced:
            if record.levelno >= handler.level:
                handler.handle(record)
        if not self.replaced and self.logger is logging.root and _unhandled(record):
            last = logging.lastResort
            if last is not None and record.levelno >= last.level:
                last.handle(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # pragma: no cover - handle() decides
        pass

    def restore(self) -> None:
        self.logger.removeHandler(self)
        for handler in self.replaced:
            self.logger.addHandler(handler)


def _unhandled(record: logging.LogRecord) -> bool:
    """Whether no logger between the record's and the root has a handler: where logging falls
    back to its last resort (stderr) for the record."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if logger.handlers:
            return False
        logger = logger.parent if logger.propagate else None
        if logger is None:
            return False
    return True


def _show(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` while stages run: a library's warning inside one is held."""
    if _QUIET.get() and not issubclass(category, PrecisionConvertWarning):
        _deliver(warnings.formatwarning(message, category, filename, lineno, line).rstrip())
    else:
        _installed.showwarning(message, category, filename, lineno, file, line)


class _Installed:
    """What the first stage in replaced, for the last one out to put back."""

    def __init__(self) -> None:
        self.depth = 0
        self.routers: list[_Router] = []
        self.showwarning: Callable[..., None] = warnings.showwarning
        self.filters: list[Any] = []
        self.bars: dict[str, bool] = {}  # library -> whether its bars were on

    def install(self) -> None:
        self.routers = [_Router(logging.getLogger(name)) for name in LOGGERS]
        self.showwarning = warnings.showwarning
        warnings.showwarning = _show
        self.filters = list(warnings.filters)

    def bars_off(self, libraries: tuple[str, ...]) -> None:
        """Turn off the bars of every library imported by now (or named), once each."""
        for library, module_name in BAR_SWITCHES.items():
            if library in self.bars:
                continue
            wanted = library in libraries or (
                library == "transformers" and not _hub_bars_off_by_environment()
            )
            if not wanted and module_name not in sys.modules:
                continue
            try:
                switch = importlib.import_module(module_name)
            except ImportError:
                continue
            self.bars[library] = bool(switch.is_progress_bar_enabled())
            switch.disable_progress_bar()

    def restore(self) -> None:
        for router in self.routers:
            router.restore()
        self.routers = []
        if warnings.showwarning is _show:
            warnings.showwarning = self.showwarning
        if warnings.filters != self.filters:  # a library imported meanwhile set its own
            warnings.filters[:] = self.filters  # type: ignore[index]  # a list at run time
            mutated = getattr(warnings, "_filters_mutated", None)
            if mutated is not None:
                mutated()  # the module caches which filter applies where
        for library, was_on in self.bars.items():
            if was_on:
                importlib.import_module(BAR_SWITCHES[library]).enable_progress_bar()
        self.bars = {}


def _hub_bars_off_by_environment() -> bool:
    """Whether ``HF_HUB_DISABLE_PROGRESS_BARS`` holds huggingface_hub's bars off: transformers
    imported under it starts with its own off and no call turns either on, so a stage need
    not import transformers (most of a second at the command's start) to switch them."""
    from huggingface_hub import constants

    return constants.HF_HUB_DISABLE_PROGRESS_BARS is True


_lock = threading.Lock()
_installed = _Installed()


@contextmanager
def quiet_libraries(*libraries: str) -> Iterator[None]:
    """Hold back the libraries' logging, warnings and bars for the work inside (a stage of
    the command); see the module's text. ``libraries`` names libraries of
    :data:`BAR_SWITCHES` whose bars to switch off even when not yet imported (``"diffusers"``
    for a stage that builds diffusers models). Usable as a decorator."""
    with _lock:
        if _installed.depth == 0:
            _installed.install()
        _installed.depth += 1
        _installed.bars_off(libraries)
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)
        with _lock:
            _installed.depth -= 1
            if _installed.depth == 0:
                _installed.restore()
