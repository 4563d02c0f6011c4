"""Exceptions raised by precision-convert.

The library raises; only the CLI decides exit codes and hides tracebacks. Every message is one
line that names the file or thing at fault and, where there is one, the fix.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable
from pathlib import Path


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known word closest to a misspelled one, or ``""``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class PrecisionConvertError(Exception):
    """Base class of every error precision-convert raises on purpose."""

    #: Exit code the CLI uses for this class of error (2: bad input or usage).
    exit_code: int = 2


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped as Python writes it: a
    newline in a Hub id the user typed cannot break a one-line message, and a name that is not
    UTF-8 shows its escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def first_line(text: str) -> str:
    """The first line of ``text`` that is not blank, stripped; with the next one when it only
    introduces it (ends in ``:``). ``""`` when there is none."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""


def one_line(exc: BaseException) -> str:
    """``exc`` as one line for a message or a report: the :func:`first_line` of its text, after
    its class name unless it is one of ours (their messages already say what and where); the
    class name alone when it has no text. Every exception shown in one line goes through here."""
    text = first_line(str(exc))
    if isinstance(exc, PrecisionConvertError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class InputError(PrecisionConvertError, ValueError):
    """The source, a flag or a file given by the user is unusable. Nothing was written.

    ``path`` is kept as given; the message shows it :func:`printable`.
    """

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = str(path) if path is not None else None
        super().__init__(f"{printable(self.path)}: {message}" if self.path else message)


class FileSystemError(InputError):
    """The file system refused a read or write (no space, read-only, permission, a name or
    path too long): one line naming the path and what to do. ``path``: the file the error
    names, else ``fallback`` (``write()`` on a full disk names no file). ``cause`` keeps the
    error, so a caller may name another path for it (:meth:`at`)."""

    def __init__(self, exc: OSError, fallback: str | Path | None = None) -> None:
        self.cause = exc
        path = exc.filename if exc.filename is not None else fallback
        reason = exc.strerror or str(exc) or type(exc).__name__
        advice = _ADVICE.get(exc.errno or 0)
        super().__init__(f"{reason}: {advice}" if advice else reason, path)

    def at(self, path: str | Path) -> FileSystemError:
        """The same error, naming ``path`` (the output a staging directory stood for)."""
        return FileSystemError(OSError(self.cause.errno, self.cause.strerror), path)


#: What to do about each file-system error a run may meet, by errno.
_ADVICE = {
    errno.ENOSPC: "free space on that file system, or write elsewhere, then run again",
    errno.EDQUOT: "your disk quota is used up: free space, or write elsewhere, then run again",
    errno.EFBIG: "a file size limit was reached: raise it (ulimit -f), or write elsewhere",
    errno.EROFS: "the file system is read-only: choose an output on a writable one",
    errno.EACCES: "check its permissions (and its folder's), or choose another output",
    errno.EPERM: "check its permissions (and its folder's), or choose another output",
    errno.ENAMETOOLONG: "a name or path is too long for this file system: choose a shorter -o",
}


class UnsafeCheckpointError(InputError):
    """A pickle checkpoint that needs more than plain tensors to load (it could run code)."""


class OutputExistsError(InputError, FileExistsError):
    """The output directory already exists and overwriting was not asked for."""

    def __init__(self, path: str | Path) -> None:
        super().__init__("output already exists; pass --overwrite or choose another -o", path)


class CannotBuildModel(InputError):
    """The model's library cannot build it from its config (a value it rejects, a class that
    is not a model). ``field`` is the config key at fault, when it could be told."""

    def __init__(self, message: str, path: str | Path, field: str | None = None) -> None:
        self.field = field
        super().__init__(message, path)


class WeightsDoNotMap(InputError):
    """The stored tensors do not map one-to-one onto the model's (a library that fuses or
    renames them on load): the model must be built by the library's ``from_pretrained``."""


class CertificateError(InputError):
    """A certificate that this version cannot take as its own: another format version, a field
    missing, unknown or mistyped, or several certificates where one belongs. The verifier
    (push, ``batch --resume``, ``validate --verify``) reports it as :class:`NotAsCertified`."""


class CheckFailed(PrecisionConvertError):
    """A check did not pass: parity not met, push refused. The CLI exits 1."""

    exit_code = 1


class CannotValidateError(CheckFailed):
    """No input builder can feed this architecture; the user must supply inputs."""


class NotAsCertified(CheckFailed):
    """A converted directory is not what its certificate certified: no ``pass`` certificate,
    or files (card included) changed, missing or added since. ``problems`` has one line per
    file at fault."""

    prefix = "not as certified"

    def __init__(self, directory: str | Path, problems: list[str]) -> None:
        self.path = str(directory)
        self.problems = list(problems)
        super().__init__(f"{self.path}: {self.prefix}: " + "; ".join(problems))


class ChangedSinceCertified(CheckFailed):
    """A file's bytes changed between the push's gate and their upload: raised inside the Hub
    client by the upload stream, and turned into :class:`PushRefused` by ``push``. ``path`` is
    the file's path in the repo."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"{path}: changed since certification")


class PushRefused(NotAsCertified):
    """``push``'s certificate gate refused (see :class:`NotAsCertified`); nothing was
    uploaded."""

    prefix = "push refused, nothing uploaded"


class HubAuthError(InputError):
    """No Hugging Face token was found, or the Hub rejected it."""


class HubPermissionError(InputError):
    """The token may not write to the repo (the Hub answered 403)."""


class PushFailed(PrecisionConvertError):
    """The Hub did not complete a push: the connection was lost, server errors outlasted the
    client's retries, the branch moved meanwhile, or the Hub refused the card's metadata. The
    commit was not confirmed; running ``push`` again resumes, and what the Hub already holds is
    not uploaded twice.

    ``status`` is the Hub's HTTP answer (None: no answer, the connection failed) and
    ``retry_after`` its ``Retry-After`` seconds, so a caller that retries (batch) can tell a
    busy Hub from a refusal without reading the message.
    """

    def __init__(
        self, message: str, *, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def home_expanded(raw: str | Path) -> Path:
    """``raw`` with a leading ``~`` or ``~user`` expanded; a user this system does not know
    is an :class:`InputError` (pathlib raises RuntimeError)."""
    try:
        return Path(raw).expanduser()
    except RuntimeError:
        raise InputError("no user's home folder matches its '~'", raw) from None
