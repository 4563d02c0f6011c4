"""Atomic output directories: build beside the target, fsync, rename into place.

An interrupted run (even SIGKILL) leaves only a hidden staging directory whose name carries the
owner's pid; the next run for the same target removes staging directories of dead owners. The
target path itself only ever holds a complete output.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from types import TracebackType

from precision_convert.errors import InputError, OutputExistsError

_STAGING = ".pc-staging-"
_TRASH = ".pc-trash-"


def _marker(target: Path, kind: str) -> str:
    return f".{target.name}{kind}"


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(target: Path) -> list[Path]:
    """Remove staging/trash directories for ``target`` left by runs that are no longer alive."""
    removed: list[Path] = []
    if not target.parent.is_dir():
        return removed
    for kind in (_STAGING, _TRASH):
        prefix = _marker(target, kind)
        for entry in target.parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            pid_text = entry.name[len(prefix) :].split("-", 1)[0]
            if pid_text.isdigit() and not _owner_alive(int(pid_text)):
                _remove(entry)
                removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    """Delete a leftover: a directory tree, or the file or symlink an ``--overwrite`` replaced."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StagedOutput:
    """Build an output in a hidden sibling directory; ``commit()`` renames it into place.

    Leaving the block without ``commit()`` (an exception) removes the staging directory.
    """

    def __init__(self, target: Path, *, overwrite: bool = False) -> None:
        self.target = target.absolute()
        self.overwrite = overwrite
        self.path = self.target.parent / (
            f"{_marker(self.target, _STAGING)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._committed = False

    def check(self) -> None:
        """Refuse an existing target (unless overwriting) or one under a file; call early."""
        if (self.target.exists() or self.target.is_symlink()) and not self.overwrite:
            raise OutputExistsError(self.target)
        existing = next(p for p in self.target.parents if p.exists())
        if not existing.is_dir():
            raise InputError(
                f"cannot create the output: {existing} is not a directory", self.target
            )

    def __enter__(self) -> StagedOutput:
        self.check()
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(self.target)
            self.path.mkdir()
        except OSError as exc:
            raise InputError(
                f"cannot create the output: {exc.strerror or exc}", self.target
            ) from None
        return self

    def commit(self) -> None:
        """Make the staged directory durable and move it to the target path."""
        _fsync_tree(self.path)
        if self.target.exists() or self.target.is_symlink():
            self.check()
            trash = self.target.parent / f"{_marker(self.target, _TRASH)}{os.getpid()}"
            os.rename(self.target, trash)
            os.rename(self.path, self.target)
            _remove(trash)
        else:
            os.rename(self.path, self.target)
        _fsync_dir(self.target.parent)
        self._committed = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._committed:
            shutil.rmtree(self.path, ignore_errors=True)
