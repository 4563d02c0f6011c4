"""Run the command as a person does, on a terminal or into a pipe, and time what it prints.

:func:`run_command` starts ``precision-convert`` in a child process with stdout and stderr
each on a pseudo-terminal of their own (``terminal=True``: the command sees a terminal and
draws its progress display) or each into a pipe, and timestamps every line as it arrives. A
terminal's display is redrawn in place: a "line" there is each new text between carriage
returns and newlines, escape codes stripped, never seen before: a display redrawn unchanged
adds nothing.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Escape sequences (colours, cursor moves, erase-line) a terminal display is drawn with.
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")
#: The size the pseudo-terminals report: a common window.
ROWS, COLUMNS = 40, 100


@dataclass
class Stream:
    """What arrived on one stream: each new line with the second it arrived at. On a terminal
    (``redrawn``) a line seen before is a display redrawn unchanged; in a pipe every line is
    one the command wrote again (the same probes run under another attention implementation)."""

    redrawn: bool = False
    lines: list[tuple[float, str]] = field(default_factory=list)
    raw: bytearray = field(default_factory=bytearray)
    _partial: str = ""
    _seen: set[str] = field(default_factory=set)

    def take(self, at: float, data: bytes) -> None:
        self.raw += data
        text = self._partial + data.decode("utf-8", "replace")
        *complete, self._partial = re.split(r"[\r\n]", text)
        for piece in complete:
            line = ANSI.sub("", piece).rstrip()
            if not line or line in self._seen:
                continue
            self.lines.append((at, line))
            if self.redrawn:  # only a redrawn display shows a line again unchanged
                self._seen.add(line)

    def finish(self, at: float) -> None:
        self.take(at, b"\n")

    @property
    def text(self) -> list[str]:
        return [line for _, line in self.lines]


@dataclass
class Run:
    returncode: int
    seconds: float
    stdout: Stream
    stderr: Stream

    def report_lines(self) -> list[str]:
        """stdout as a reader sees it: every line, blank ones included (a terminal's newlines
        arrive as ``\\r\\n``)."""
        text = ANSI.sub("", self.stdout.raw.decode("utf-8", "replace")).replace("\r\n", "\n")
        return text.splitlines()

    def longest_silence(self) -> tuple[float, str]:
        """The longest stretch with no new line on either stream (from the start to the exit
        included), and the line that ended it."""
        arrived = sorted([*self.stdout.lines, *self.stderr.lines])
        marks = [(0.0, "(start)"), *arrived, (self.seconds, "(exit)")]
        gaps = [(b[0] - a[0], b[1]) for a, b in itertools.pairwise(marks)]
        return max(gaps)


def _window(fd: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))


def run_command(args: list[str], *, terminal: bool, cwd: Path, timeout: float = 900.0) -> Run:
    """``precision-convert ARGS`` run to its end in ``cwd``, its output timed line by line."""
    command = [sys.executable, "-c", "from precision_convert.cli.main import run; run()", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    if terminal:
        masters, slaves = zip(*(pty.openpty() for _ in range(2)), strict=True)
        for fd in slaves:
            _window(fd)
        child = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=slaves[0], stderr=slaves[1], start_new_session=True,
        )  # fmt: skip
        for fd in slaves:
            os.close(fd)
        fds = list(masters)
    else:
        child = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert child.stdout is not None and child.stderr is not None
        fds = [child.stdout.fileno(), child.stderr.fileno()]
    streams = {fds[0]: Stream(redrawn=terminal), fds[1]: Stream(redrawn=terminal)}
    start = time.monotonic()
    open_fds = set(fds)
    try:
        while open_fds:
            if time.monotonic() - start > timeout:
                child.kill()
                raise TimeoutError(f"{' '.join(args)} ran past {timeout:.0f} s")
            ready, _, _ = select.select(list(open_fds), [], [], 1.0)
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # a pseudo-terminal whose other end closed: EIO
                    data = b""
                if data:
                    streams[fd].take(time.monotonic() - start, data)
                else:
                    open_fds.discard(fd)
        code = child.wait(timeout=60)
    finally:
        if terminal:
            for fd in fds:
                os.close(fd)
    seconds = time.monotonic() - start
    for stream in streams.values():
        stream.finish(seconds)
    return Run(code, seconds, streams[fds[0]], streams[fds[1]])
