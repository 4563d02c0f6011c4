"""Atomic output directories: build beside the target, fsync, rename into place.

An interrupted run (even SIGKILL) leaves only a hidden staging directory whose name carries the
owner's pid; the next run for the same target removes staging directories of dead owners. The
target path itself only ever holds a complete output.

Two runs writing one target at once would each build a complete staging directory and the
later rename would either fail obscurely or (with ``--overwrite``) silently replace the other's
output. So a run holds an exclusive lock on the target (``flock`` on a hidden ``.<name>.pc-lock``
beside it, released by the kernel even on SIGKILL) from the moment it starts writing until its
output is committed; a second run stops at once with a message naming the other's pid. The lock
is the ``filelock`` library's (the one huggingface_hub uses), held without blocking.

Every writer of an output takes that lock: ``model`` for its whole run, a batch job as it
moves its certified output into place (:func:`precision_convert.batch.job.into_place`), and
``validate`` while it certifies an output in place (:class:`TargetLock` directly).

Names beside the target stay within the file system's limits (:func:`_marker`): an output name
up to 255 bytes gets shortened staging and lock names, and a path that cannot hold an output's
files is refused before any work (:func:`check_path_length`).

Two rules keep a run from destroying what it did not write, both checked here for every caller
(``model``, ``validate``, ``batch``): an output never overlaps a source (:func:`check_apart`,
every path resolved, links included), and ``--overwrite`` replaces only an empty directory or
one this tool wrote (:func:`written_here`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from precision_convert.conversion.io.header import read_header
from precision_convert.conversion.io.source import check_text
from precision_convert.core import interrupts
from precision_convert.core.errors import (
    FileSystemError,
    InputError,
    OutputExistsError,
    PrecisionConvertError,
)
from precision_convert.core.patterns import CERTIFICATE_FILE

_STAGING = ".pc-staging-"
_TRASH = ".pc-trash-"
_LOCK = ".pc-lock"
#: Key of the precision-convert record in configs and shard metadata (docs/format.md).
RECORD_KEY = "precision_convert"


def real_path(path: str | Path) -> Path:
    """``path`` as the kernel resolves it: every link followed, ``..`` applied after the link
    it follows (``Path.absolute`` keeps links, so a link into a source passes a plain compare).
    The part that does not exist yet is kept as written."""
    return Path(os.path.realpath(path))


def overlap(output: str | Path, source: str | Path, what: str = "output") -> str | None:
    """Why ``output`` must not be written, given ``source``: it is the source, lies inside it
    or contains it (links resolved); None when they are apart."""
    out, src = real_path(output), real_path(source)
    if out == src or src in out.parents:
        return f"{what} must not be the source directory or inside it ({src})"
    if out in src.parents:
        return f"{what} must not contain the source directory ({src})"
    return None


def check_apart(output: str | Path, sources: Sequence[str | Path], what: str = "output") -> None:
    """Refuse an ``output`` that is, contains or lies inside one of ``sources``: writing (or
    ``--overwrite`` replacing) it would change the source.

    Raises:
        InputError: naming ``output`` as given.
    """
    for source in sources:
        problem = overlap(output, source, what)
        if problem is not None:
            raise InputError(problem, output)


def written_here(directory: Path) -> bool:
    """Whether precision-convert wrote ``directory``: a certificate at its top, or the record in
    the metadata of a safetensors file at its top or, for a pipeline (``model_index.json`` at
    its top), in a component's folder (every output's weights carry it, ``--no-validate`` and
    ``--variant`` outputs included). Only a pipeline's folders count: a folder that merely
    holds an output among the user's files (``-o ~ --overwrite``) is not one."""
    folders = [directory]
    if (directory / "model_index.json").is_file():
        folders += [d for d in directory.iterdir() if d.is_dir() and not d.is_symlink()]
    for folder in folders:
        for entry in folder.iterdir():
            if folder is directory and CERTIFICATE_FILE.fullmatch(entry.name) and entry.is_file():
                return True
            if entry.name.endswith(".safetensors") and entry.is_file() and not entry.is_symlink():
                with contextlib.suppress(InputError, OSError):  # unreadable: not ours
                    if RECORD_KEY in read_header(entry).metadata:
                        return True
    return False


def check_replaceable(target: Path) -> None:
    """Refuse to ``--overwrite`` anything but an empty directory or one this tool wrote: a
    file, a device node, a link, or a folder of the user's own is never removed.

    Raises:
        InputError: naming ``target``.
    """
    rule = "--overwrite replaces only an empty directory or one precision-convert wrote"
    if target.is_symlink():
        raise InputError(f"is a symbolic link; {rule} (give the directory itself)", target)
    if not target.is_dir():
        raise InputError(f"is not a directory; {rule}", target)
    try:
        empty = next(target.iterdir(), None) is None
        ours = empty or written_here(target)
    except OSError as exc:
        raise InputError(f"cannot read it ({exc.strerror or exc}); {rule}", target) from None
    if not ours:
        raise InputError(
            f"holds files precision-convert did not write; {rule}: remove it yourself or "
            "choose another -o",
            target,
        )


#: The longest file name most file systems take (ext4, xfs, btrfs, tmpfs: 255 bytes), and the
#: longest path the kernel resolves (Linux: 4096 bytes, the final NUL included).
NAME_MAX, PATH_MAX = 255, 4096
#: Room left after a marker for what follows it: ``<pid>-<8 hex>`` (a pid has at most 7 digits).
_SUFFIX_ROOM = 17
#: Room left under an output for the files it holds: the longest is a pipeline component's
#: sharded variant, ``text_encoder_2/model.fp16-00001-of-00002.safetensors`` (50 bytes).
_FILE_ROOM = 64


def _size(text: str) -> int:
    return len(os.fsencode(text))


def _marker(target: Path, kind: str) -> str:
    """The name this tool's hidden files for ``target`` start with: ``.<name><kind>``. For a
    name too long for that to fit NAME_MAX (a legal output name may take up to 255 bytes), or
    a path too long for its staging directory's files to fit PATH_MAX, the name's start and
    a digest of the whole, ``.<start>~<12 hex><kind>``, no longer than the name itself: still
    ours (``kind``), still found by :func:`clean_leftovers`, and a staging path no longer than
    the output's own, so whatever fits under one fits under the other."""
    name = target.name
    marker = f".{name}{kind}"
    room = _size(marker) + _SUFFIX_ROOM
    if room <= NAME_MAX and _size(str(target.parent)) + 1 + room + 1 + _FILE_ROOM < PATH_MAX:
        return marker
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    start = name
    while start and _size(f".{start}~{digest}{kind}") + _SUFFIX_ROOM > _size(name):
        start = start[:-1]
    return f".{start}~{digest}{kind}"


def check_path_length(target: Path, given: Path) -> None:
    """Refuse, before any work, an output whose path this system cannot hold: its name over
    NAME_MAX, or its path (or its staging directory's) without room under PATH_MAX for the
    files an output holds.

    Raises:
        InputError: naming ``given``.
    """
    if _size(target.name) > NAME_MAX:
        raise InputError(
            f"the output's name is {_size(target.name)} bytes, more than the {NAME_MAX} a "
            "file system takes: choose a shorter -o",
            given,
        )
    staging = target.parent / f"{_marker(target, _STAGING)}{'0' * _SUFFIX_ROOM}"
    longest = max(_size(str(target)), _size(str(staging)))
    if longest + 1 + _FILE_ROOM >= PATH_MAX:
        raise InputError(
            f"the output's path is {_size(str(target))} bytes: too long for this system's "
            f"{PATH_MAX}-byte paths once its staging folder and its files are added: choose "
            "a shorter -o",
            given,
        )


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(target: Path) -> list[Path]:
    """Remove staging/trash directories for ``target`` left by runs that are no longer alive,
    and the lock file of a run killed before it could remove it (one nobody holds)."""
    removed: list[Path] = []
    if not target.parent.is_dir():
        return removed
    lock = TargetLock(target)
    if lock.path.is_file():
        # Held (by this run too): it stays. Taken and released: the file is removed.
        with contextlib.suppress(InputError, OSError), lock:
            removed.append(lock.path)
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


class TargetLock:
    """An exclusive, non-blocking lock on writing ``target``: filelock's ``flock`` on a hidden
    file beside it, which holds the owner's pid (for the message another run prints).

    ``flock`` is released by the kernel when its holder dies, even by SIGKILL, so a killed run
    never leaves a stale lock (filelock's soft-lock fallback, a marker file a killed run would
    leave behind, is turned off). The file is removed while still locked, on release: a run
    that opened it just before then locks an unlinked file, which filelock detects; finding no
    file at the path, that run tries once more on a fresh one.
    """

    def __init__(self, target: Path) -> None:
        from filelock import FileLock

        self.target = target
        self.path = target.parent / _marker(target, _LOCK)
        self._lock = FileLock(
            self.path, blocking=False, fallback_to_soft=False, on_acquired=_write_pid
        )

    def acquire(self) -> None:
        from filelock import Timeout

        for _ in range(3):
            try:
                self._lock.acquire()
                return
            except Timeout:
                try:
                    owner = self.path.read_text(errors="replace").strip() or "?"
                except FileNotFoundError:  # its owner finished and removed it: try again
                    continue
            raise InputError(
                f"another precision-convert run (pid {owner}) is writing this output; "
                "wait for it to finish, or choose another output directory",
                self.target,
            )
        raise InputError("cannot lock the output: its lock file keeps vanishing", self.target)

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        # While still locked (see the class docstring). A folder that became unwritable keeps
        # the file: it locks nothing once released, and the next run takes it over.
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._lock.release()

    def __enter__(self) -> TargetLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _write_pid(fd: int) -> None:
    """filelock's ``on_acquired``: the holder's pid, for another run's message."""
    with contextlib.suppress(OSError):  # the pid only makes the other run's message nicer
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)


class StagedOutput:
    """Build an output in a hidden sibling directory; ``commit()`` renames it into place.

    ``sources`` are the directories the run reads: the target may not overlap any of them.
    Leaving the block without ``commit()`` (an exception) removes the staging directory.
    """

    def __init__(
        self, target: Path, *, overwrite: bool = False, sources: Sequence[Path] = ()
    ) -> None:
        # The folder it goes in, links resolved (its last component stays as given: a link
        # there is refused, never followed).
        self.given = target
        self.target = (
            real_path(target)
            if target.name in ("", ".", "..")
            else real_path(target.parent) / target.name
        )
        self.overwrite = overwrite
        self.sources = tuple(sources)
        self.path = self.target.parent / (
            f"{_marker(self.target, _STAGING)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._committed = False
        self._lock = TargetLock(self.target)

    def check(self) -> None:
        """Refuse a target that overlaps a source, an existing one (unless overwriting, and then
        anything but an empty directory or this tool's output), or one under a file; call
        early."""
        check_apart(self.given, self.sources)
        check_text(str(self.target), self.given)  # its card and certificate hold it as text
        check_path_length(self.target, self.given)
        if self.target.exists() or self.target.is_symlink():
            if not self.overwrite:
                raise OutputExistsError(self.given)
            check_replaceable(self.given)
        existing = next(p for p in self.target.parents if p.exists())
        if not existing.is_dir():
            raise InputError(f"cannot create the output: {existing} is not a directory", self.given)

    def __enter__(self) -> StagedOutput:
        self.check()
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except OSError as exc:
            raise InputError(
                f"cannot create the output: {exc.strerror or exc}", self.given
            ) from None
        try:
            self.check()  # another run may have committed this target while we planned
            clean_leftovers(self.target)
            self.path.mkdir()
        except OSError as exc:
            self._lock.release()
            raise InputError(
                f"cannot create the output: {exc.strerror or exc}", self.given
            ) from None
        except BaseException:
            self._lock.release()
            raise
        return self

    def commit(self) -> None:
        """Make the staged directory durable and move it to the target path.

        A Ctrl-C swallowed on its way up (see :mod:`precision_convert.core.interrupts`) stops it
        here, before the rename: the target keeps what it held.
        """
        _fsync_tree(self.path)
        interrupts.check()
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
        try:
            if not self._committed:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._lock.release()
        if isinstance(exc, OSError) and not isinstance(exc, PrecisionConvertError):
            exc = FileSystemError(exc, self.path)
        if isinstance(exc, FileSystemError):
            # A full disk, a folder made read-only, a name too long: one line naming what
            # failed and what to do. A file of the staging directory (gone now) is named as
            # the output it stood for.
            if exc.path is None:
                raise exc.at(self.given) from None
            inside = Path(exc.path)
            if inside == self.path or self.path in inside.parents:
                raise exc.at(self.given / inside.relative_to(self.path)) from None
            raise exc
