"""What every command shares: the two consoles, error reporting and the progress display."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.segment import Segment

from precision_convert.core.errors import InputError, printable
from precision_convert.core.progress import shorten

#: Columns of a line written off a terminal (a log, a file, a pipe) when ``COLUMNS`` does not
#: say: as wide as the line is, so nothing is wrapped, split or elided for a screen that is
#: not there.
UNBOUNDED_WIDTH = 10_000


def literal(value: object) -> str:
    """``value`` (a name, a path, a config string, a message) as rich markup that prints it
    as it is: its control characters shown as escapes by :func:`printable`, the one escaping
    of text for a terminal, and its ``[`` taken literally, never as markup. Every piece of
    data a command prints inside markup goes through here; a line printed without markup goes
    through :func:`printable` itself."""
    return escape(printable(str(value)))


#: The reports' own symbols, spelled in ASCII for a stream that cannot encode them (a
#: ``LANG=C`` terminal or log): ``a -> b``, ``<= 0.01``, not ``\u2192`` nor a crash.
ASCII_SPELLINGS = str.maketrans(
    {
        "→": "->",
        "—": "-",
        "–": "-",
        "…": "...",
        "›": ">",
        "≤": "<=",
        "≥": ">=",
        "±": "+/-",
        "×": "x",
        "✓": "ok",
        "✗": "x",
        "█": "#",
        "·": ".",
    }
)


def encodable(text: str, encoding: str) -> str:
    """``text`` as a stream of ``encoding`` can take it: unchanged where it can, else with the
    reports' symbols in ASCII (:data:`ASCII_SPELLINGS`) and whatever else it cannot encode (a
    name's letters) as Python's backslash escapes."""
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        spelled = text.translate(ASCII_SPELLINGS)
        return spelled.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:  # an encoding Python does not know: ASCII is read by every one
        return encodable(text, "ascii")
    return text


def reader_gone(stream: IO[str]) -> None:
    """``stream``'s reader has gone (``| head -1`` read what it wanted): point its file
    descriptor at the null device, so what the command still writes there is dropped and the
    interpreter's last flush at exit has nothing to fail on. The command goes on with its
    work and exits as it would have (0, or 1 when its check failed): a reader that stops
    reading is no error of the run."""
    with contextlib.suppress(OSError, ValueError):  # a stream with no descriptor (a test's)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


class _Console(Console):
    """A rich console as wide as its lines when it writes to no terminal (rich would wrap at
    80 columns, or at the width of whatever terminal its other streams reach, splitting words
    and URLs); ``COLUMNS`` still sets a width, and a terminal keeps its own.

    What it writes is :func:`encodable` on its stream (rich already draws tables in ASCII on
    a stream that is not UTF-8), and a stream whose reader has gone silences it
    (:func:`reader_gone`) where rich would exit 1."""

    def _size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        if self._width is None and not self.is_terminal and "COLUMNS" not in os.environ:
            return ConsoleDimensions(UNBOUNDED_WIDTH, size.height)
        return size

    size = property(_size, Console.size.fset)  # type: ignore[attr-defined]

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return encodable(super()._render_buffer(buffer), self.encoding)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        reader_gone(self.file)


#: Progress, warnings and notes: stderr, so they never mix into a report or ``--json`` output.
console = _Console(stderr=True)
#: A command's human-readable report is its output: stdout, so ``| less`` and ``> file`` work.
#: Commands with ``--json`` print either the report or the JSON there, never both. Rich
#: honours ``NO_COLOR`` and writes no escape codes when stdout is not a terminal.
out = _Console()
#: Set to 1 to see tracebacks; off by default because they may hold tokens and paths.
DEBUG_VARIABLE = "PRECISION_CONVERT_DEBUG"


def elide(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters by dropping its middle (``model.lay…q_proj``).

    A cut would rather not split a folded index range: ``model.layers.{0..79}…_layernorm``
    keeps which layers, while the tail keeps what the module is (at least :data:`MIN_TAIL`).
    """
    if len(text) <= width:
        return text
    if width < 2:
        return text[:width]
    head = (width - 1) // 2
    if text.rfind("{", 0, head) > text.rfind("}", 0, head):
        closed = text.find("}", head)
        if closed != -1 and width - 1 - (closed + 1) >= MIN_TAIL:
            head = closed + 1
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


#: The fewest characters an elided name keeps of its end.
MIN_TAIL = 8


#: What an interrupted command says when it wrote nothing.
NOTHING_WRITTEN = "nothing was written"


@contextmanager
def reported_errors(on_disk: Callable[[], str] = lambda: NOTHING_WRITTEN) -> Iterator[None]:
    """Turn library errors into one line on stderr (a line per problem when the error holds
    several) and the error's exit code; an ``OSError`` too (exit 2, its file and what to do).

    Ctrl-C exits 130 with ``on_disk()``: what the interrupted command left on disk, looked up
    then (a conversion may have committed its output before validation was interrupted);
    SIGTERM and SIGHUP likewise, exit 143 and 129 (see :mod:`precision_convert.core.interrupts`).
    """
    from precision_convert.core import interrupts
    from precision_convert.core.errors import FileSystemError, PrecisionConvertError

    try:
        try:
            yield
        except OSError as exc:
            # The file system refused something no library call turned into an error of ours
            # (a report, a certificate written in place): one line, like every other error.
            raise FileSystemError(exc) from exc
    except PrecisionConvertError as exc:
        if os.environ.get(DEBUG_VARIABLE):
            raise
        for line in str(exc).splitlines() or [""]:  # several problems (a manifest's): a line each
            say(line)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt as exc:
        say(f"{interrupts.stopped_by(exc)}; {on_disk()}")
        raise typer.Exit(interrupts.exit_code(exc)) from None


def existing_directory(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a directory (``what``: the directory the command takes).
    Checked before a command's heavy imports (torch, transformers: seconds), so a mistyped
    path is said at once."""
    if not path.is_dir():
        problem = "not a directory" if path.exists() else "no such directory"
        raise InputError(f"{problem}: {what}", path)


def say(line: str) -> None:
    """One ``precision-convert: ...`` line on stderr, :func:`printable` (a name in it cannot
    write to the terminal). A stderr that is gone (the terminal of a SIGHUP) loses the line;
    the exit code still says what happened."""
    with contextlib.suppress(OSError):
        print(f"precision-convert: {printable(line)}", file=sys.stderr, flush=True)


def write_out(text: str) -> None:
    """``text`` on stdout, outside the report console (a JSON document, a URL, a line of
    ``--verify``), written as that console writes: :func:`encodable`, and dropped once the
    reader has gone (:func:`reader_gone`)."""
    try:
        sys.stdout.write(encodable(text, sys.stdout.encoding or "utf-8"))
        sys.stdout.flush()
    except BrokenPipeError:
        reader_gone(sys.stdout)


def out_line(line: str) -> None:
    """One line of a command's result on stdout outside a report (a URL, ``--verify``'s
    lines): :func:`printable`, then as :func:`write_out` writes."""
    write_out(f"{printable(line)}\n")


def emit_json(payload: Any) -> None:
    """The one machine-readable result of a command, on stdout: ASCII whatever the stream's
    encoding (``json.dumps`` escapes the rest), so it parses on any terminal or pipe."""
    write_out(json.dumps(payload, indent=2, default=str) + "\n")


@contextmanager
def byte_progress(
    description: str, enabled: bool, verbose: bool = False
) -> Iterator[Callable[[str, int], None]]:
    """Progress on stderr for one command: a bar fed with (label, bytes) callbacks, plus one
    line per stage the library reports (probe k of n, candidate k of at most m) with an ETA.

    Off a terminal (a log, a pipe) the stages are plain lines instead (:class:`_PlainSteps`):
    no bar, nothing redrawn, no escape codes. A no-op when disabled.

    ``verbose``: what transformers, diffusers and huggingface_hub say inside the stages (held
    back otherwise, see :mod:`precision_convert.core.quiet`) is printed on stderr too, above
    the progress display.
    """
    from precision_convert.core.progress import reporting

    with _library_lines(verbose):
        if not enabled:
            yield lambda label, n: None
            return
        if not console.is_terminal:
            plain = _PlainSteps(description)
            with plain.heartbeat, reporting(plain.report, plain.write):
                yield lambda label, n: None
            return
        with _progress_display(description) as advance:
            yield advance


@contextmanager
def _library_lines(verbose: bool) -> Iterator[None]:
    """With ``verbose``, the libraries' held-back messages as lines on stderr (through the
    console, so a progress display on a terminal is redrawn below them)."""
    if not verbose:
        yield
        return
    from precision_convert.core.quiet import library_messages

    with library_messages(_print_line):
        yield


def _print_line(text: str) -> None:
    """``text`` through the console as one line: taken literally (no markup, control
    characters escaped) and left to the terminal to wrap, so a long line is still one line to
    a log or a reader of the stream."""
    console.print(printable(text), markup=False, highlight=False, emoji=False, soft_wrap=True)


@contextmanager
def _progress_display(description: str) -> Iterator[Callable[[str, int], None]]:
    """The terminal's display of :func:`byte_progress`: a byte bar and a line per stage."""
    from rich.filesize import decimal
    from rich.progress import (
        BarColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    from precision_convert.core.progress import reporting

    class Amount(ProgressColumn):
        """Bytes so far and speed on the byte bar (its total is not known: no "1.8/? MB");
        "k of n" on a stage's line."""

        def __init__(self) -> None:
            super().__init__()
            self.speed = TransferSpeedColumn()

        def render(self, task: Any) -> Text:
            count = task.fields.get("count")
            if count is not None:
                return Text(count)
            done = Text(decimal(int(task.completed)), style="progress.download")
            if task.finished_speed is None and task.speed is None:
                return done  # no "?" before there is a speed to show
            return Text.assemble(done, " ", self.speed.render(task))

    class Remaining(TimeRemainingColumn):
        """The ETA once there is one; nothing before ("-:--:--" says nothing)."""

        def render(self, task: Any) -> Text:
            if task.time_remaining is None and not task.finished:
                return Text("")
            return super().render(task)

    columns = (
        TextColumn("{task.description}"),
        BarColumn(bar_width=12),
        Amount(),
        Remaining(),
        # A clock that moves while a stage reports nothing for a while: the run is alive.
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)
        steps = _StepDisplay(progress)

        def advance(label: str, n: int) -> None:
            shown = shorten(f"{description} {label}", max(20, console.width - LABEL_MARGIN))
            progress.update(task, advance=n, description=literal(shown))

        with reporting(steps.report, _print_line):
            yield advance


@contextmanager
def step_progress(description: str, enabled: bool, verbose: bool = False) -> Iterator[None]:
    """:func:`byte_progress` for commands that move no bytes worth counting (validate)."""
    with byte_progress(description, enabled, verbose):
        yield


#: What starts a progress line off a terminal: a log reader (or a script) tells progress from
#: the ``precision-convert: ...`` lines of errors and warnings.
PROGRESS_PREFIX = "progress: "


class _PlainSteps:
    """The library's stage reports as plain lines on stderr: one when a stretch of work
    starts, one at each tenth of it, one when it ends, with its time. A log of a long run shows
    where it is while it runs, not only at the end; where the work reports nothing for a while
    (a model loaded, weights hashed) the heartbeat says what is still running."""

    def __init__(self, description: str) -> None:
        from precision_convert.core.progress import Heartbeat

        self.description = description
        self.began = time.monotonic()
        self.last: dict[str, int] = {}
        self.started: dict[str, float] = {}
        # No line until the work reports or the heartbeat beats: input refused before any
        # work gets its one error line on stderr, nothing else.
        self.heartbeat = Heartbeat(self._still)

    def write(self, line: str) -> None:
        with contextlib.suppress(OSError):  # a closed stderr loses the line, not the run
            print(f"{PROGRESS_PREFIX}{printable(line)}", file=sys.stderr, flush=True)
        self.heartbeat.touch()

    def _still(self, silent: float) -> None:
        """The heartbeat: the stretch of work most recently started is still running."""
        label, since = next(reversed(self.started.items()), (self.description, self.began))
        self.write(f"{label}: still running ({time.monotonic() - since:.0f} s so far)")

    def report(self, label: str, done: int, total: int | None, at_most: bool) -> None:
        now = time.monotonic()
        previous = self.last.get(label)
        bound = "at most " if at_most else ""
        if previous is None or done < previous:
            self.started[label] = now
            self.write(f"{label}: started" + (f" ({bound}{total})" if total else ""))
            previous = 0
        self.last[label] = done
        if total is None:
            return
        if done >= total:
            self.write(f"{label}: {done} done in {now - self.started.pop(label):.1f} s")
            del self.last[label]
            return
        step = max(1, -(-total // 10))
        if done // step > previous // step:
            self.write(f"{label}: {done} of {bound}{total}")


#: Columns a stage line's label leaves for the bar, counts, speed, ETA and clock: a line
#: never wraps (a wrapped row would be redrawn as two).
LABEL_MARGIN = 50


class _StepDisplay:
    """The library's stage reports as rich tasks: one line per label, gone when finished.

    A label reported again from a lower count (the next model's probes, a new search round)
    restarts its line, so the ETA is measured on the current run only.
    """

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}
        self.last: dict[str, int] = {}

    def report(self, label: str, done: int, total: int | None, at_most: bool) -> None:
        task = self.tasks.get(label)
        if task is None or done < self.last[label]:
            if task is not None:
                self.progress.remove_task(task)
            # The stages before the model go first, then the words after its class name.
            short = shorten(label, max(20, console.width - LABEL_MARGIN))
            task = self.progress.add_task(literal(short), total=total, count="")
            self.tasks[label] = task
        self.last[label] = done
        if total is not None and done >= total:
            self.progress.remove_task(task)
            del self.tasks[label], self.last[label]
            return
        bound = "at most " if at_most else ""
        count = f"{done} of {bound}{total}" if total is not None else str(done)
        if total == 1 and not at_most:
            count = ""  # "0 of 1" says nothing the line itself does not
        self.progress.update(task, completed=done, total=total, count=count)


#: Options shared by the commands that run probes (model, validate, inspect --calibrate).
CoverageOption = Annotated[
    str | None,
    typer.Option(
        "--coverage",
        metavar="LEVEL",
        help="Probe budget of calibration and validation: quick, standard (default) or thorough.",
        show_default=False,
    ),
]
#: The certificate's time budget (model, validate): parsed by the library, which refuses a
#: bad value in one line before any work.
BudgetOption = Annotated[
    str | None,
    typer.Option(
        "--budget",
        metavar="DURATION",
        help="Bound the certificate's wall time (90s, 10m, 1h30m): probes are ordered by "
        "what each kind has caught, and those the budget cannot afford are not run and are "
        "listed as not covered.",
        show_default=False,
    ),
]
#: Where validation (and calibration) run: the same words for every command that has it.
DeviceOption = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="DEVICE",
        help="Where the models run: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N.",
    ),
]
CalibrationDataOption = Annotated[
    Path | None,
    typer.Option(
        "--calibration-data",
        metavar="FILE",
        help="Text lines (each cut to the model's position limit, with a warning) or JSONL "
        "of model inputs (a row longer than the limit is refused), added to the probes.",
    ),
]


class ReportLevel(StrEnum):
    """How much of a result ``model`` and ``validate`` print: a screenful, or every table."""

    summary = "summary"
    full = "full"


AllowNonfiniteSourceOption = Annotated[
    bool,
    typer.Option(
        "--allow-nonfinite-source",
        help="Go on when the source's own weights hold NaN or ±inf (refused otherwise); "
        "the certificate then fails, naming the tensors.",
    ),
]

AllowUnexercisedOption = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-unexercised",
        metavar="MODULE",
        help="Record modules matching MODULE that no probe ran as not covered instead of "
        "failing the certificate (repeatable; pipelines: COMPONENT/MODULE; the card says so).",
    ),
]

#: The libraries' own messages, held back inside the command's stages (see
#: :mod:`precision_convert.core.quiet`), shown.
VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        help="Also show what transformers, diffusers and huggingface_hub log and warn while "
        "the command loads and saves models (hidden by default: it speaks of the command's "
        "own internal loads).",
    ),
]

ReportOption = Annotated[
    ReportLevel,
    typer.Option(
        "--report",
        metavar="LEVEL",
        help="summary (default: the verdict, what was judged, the metrics nearest their "
        "bounds, where the files are) or full (every island, metric and probe; the "
        "certificate always holds them all).",
    ),
]
