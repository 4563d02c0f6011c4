"""A Ctrl-C that something swallowed still stops the run before its points of no return.

SIGINT raises ``KeyboardInterrupt`` wherever the main thread is, and code catching
``BaseException`` there drops it (seen once in 50 trials while torch imported numpy). The
command records every SIGINT (``precision_convert.core.interrupts``), so a run that went on anyway
stops before it renames its output into place or commits to the Hub.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _corrupt import cli_env, leftovers, tiny_source
from test_push import Served, _writes, hub, served  # noqa: F401 (fixtures)
from typer.testing import CliRunner

from precision_convert.cli.main import app
from precision_convert.core import interrupts

#: A real SIGINT to the real handler, swallowed as a careless import would, then the command.
_SWALLOWED = """
import os, signal, sys, time
from precision_convert.core import interrupts
interrupts.watch()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    pass
sys.argv = ["precision-convert", *sys.argv[1:]]
from precision_convert.cli.main import run
run()
"""


def test_a_swallowed_ctrl_c_stops_the_conversion_before_its_rename(tmp_path: Path) -> None:
    src = tiny_source(tmp_path / "src")
    target = tmp_path / "out"

    args = ["model", str(src), "--to", "bf16", "--no-validate", "-o", str(target)]

    done = subprocess.run(
        [sys.executable, "-c", _SWALLOWED, *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"precision-convert: interrupted; nothing was written ({target} does not exist)"
    ]
    assert not target.exists() and leftovers(tmp_path) == []


def test_a_swallowed_ctrl_c_stops_the_push_before_its_commit(
    served: Served,  # noqa: F811
    hub: object,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the handler leaves behind when its KeyboardInterrupt was swallowed.
    monkeypatch.setattr(interrupts, "_received", [signal.SIGINT])

    done = CliRunner().invoke(app, ["push", str(served.output), "ns/never-committed"])

    assert done.exit_code == 130, done.output
    assert "interrupted" in done.stderr
    assert not [path for _, path in _writes(served.hub) if "/commit/" in path]


#: A SIGINT that lands in a finalizer: Python cannot raise it there and prints it as ignored.
_IN_A_FINALIZER = """
import gc, os, signal
from precision_convert.core import interrupts
interrupts.watch()

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)

Finalized()
gc.collect()
try:
    interrupts.check()
except KeyboardInterrupt:
    print("stopped at the check")
"""


def test_a_ctrl_c_in_a_finalizer_prints_no_traceback_and_still_stops_the_run() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IN_A_FINALIZER], capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.strip() == "stopped at the check"


def test_a_ctrl_c_before_a_command_sets_up_its_handler_still_gets_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from precision_convert.cli import model

    def interrupted(path: Path) -> None:
        raise KeyboardInterrupt

    # model looks up its target before it writes anything: the earliest point of its own
    monkeypatch.setattr(model, "_inode", interrupted)
    src = tiny_source(tmp_path / "src")

    done = CliRunner().invoke(app, ["model", str(src), "--to", "bf16", "-o", str(tmp_path / "o")])

    assert done.exit_code == 130, done.output
    assert done.stderr.strip().splitlines() == [
        "precision-convert: interrupted; nothing was written"
    ]
    assert not (tmp_path / "o").exists()
