"""The output lock (filelock's ``flock``): non-blocking, names its holder, dies with it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from precision_convert.conversion.io.staging import StagedOutput, TargetLock, clean_leftovers
from precision_convert.core.errors import InputError

_HOLD = """
import sys, time
from pathlib import Path
from precision_convert.conversion.io.staging import TargetLock
lock = TargetLock(Path(sys.argv[1]))
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    target = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(target)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(
            InputError, match=rf"another precision-convert run \(pid {holder.pid}\)"
        ):
            TargetLock(target).acquire()
    finally:
        holder.kill()
        holder.wait()

    lock = TargetLock(target)
    lock.acquire()  # the kernel released the dead holder's flock
    lock.release()
    assert list(tmp_path.iterdir()) == []  # the lock file goes with its release


def test_two_threads_of_one_process_exclude_each_other(tmp_path: Path) -> None:
    """``pc.convert`` may run in several threads: one lock per target, not per process."""
    target = tmp_path / "out"
    first = TargetLock(target)
    first.acquire()
    refused: list[BaseException] = []

    def second() -> None:
        try:
            TargetLock(target).acquire()
        except InputError as exc:
            refused.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(10)
    first.release()

    assert len(refused) == 1 and f"pid {os.getpid()}" in str(refused[0])


def test_a_lock_file_nobody_holds_is_swept_and_a_held_one_kept(tmp_path: Path) -> None:
    """A run killed between taking the lock and removing its file (a Ray worker cancelled
    mid-move) leaves the file, locking nothing: the sweep after an interrupted batch, and the
    next run, remove it; a lock another run holds stays."""
    target = tmp_path / "out"
    lock = tmp_path / ".out.pc-lock"
    lock.write_text("12345")

    assert clean_leftovers(target) == [lock]
    assert not lock.exists()
    with TargetLock(target):
        assert clean_leftovers(target) == []
        assert lock.is_file()
    assert not lock.exists()


def test_a_250_byte_output_name_gets_lock_and_staging_names_that_fit(tmp_path: Path) -> None:
    target = tmp_path / ("n" * 250)
    staged = StagedOutput(target)
    with staged:
        beside = sorted(p.name for p in tmp_path.iterdir())
        assert all(len(name.encode()) <= 255 for name in beside), beside
        assert any(".pc-staging-" in name for name in beside)
        assert any(name.endswith(".pc-lock") for name in beside)
    assert list(tmp_path.iterdir()) == []
