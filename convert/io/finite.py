"""The source's weight files read once: each hashed, and every floating tensor in it checked
for NaN and ±inf in the same read.

A source whose own weights are not finite cannot be certified against: its fp32 baseline
answers NaN where the weight is used, so the probes there judge nothing. The check rides on
the read that hashes the source for the certificate, so it costs no second pass over the
data: a safetensors file's tensors are read in order in bounded chunks (memory stays flat
whatever the tensor sizes), each chunk fed to the hash and, for a floating tensor, to the
check; the bytes between tensors (the header, any padding) are read for the hash in blocks of
at most ``BLOCK_BYTES``. A conversion does not read its source for this: the writer's own
reads of the tensors it converts are watched (:class:`SourceWatch`). A pickle checkpoint's
tensors are already in memory (``torch.load(mmap=True)``): they are checked as they are, the
file hashed beside them, before anything is written.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from precision_convert.conversion.io.hashing import BLOCK_BYTES, HASH_THREADS
from precision_convert.conversion.io.source import ModelSource, WeightFile
from precision_convert.conversion.io.tensors import (
    SERIAL_ELEMENTS,
    BufferPool,
    FileTensor,
    LazyTensor,
)
from precision_convert.core.dtypes import DType
from precision_convert.core.errors import InputError
from precision_convert.core.progress import ledger_span

if TYPE_CHECKING:
    import torch

#: A Hub cache blob is named by its sha256: taken as it is, not hashed again.
_BLOB = re.compile(r"[0-9a-f]{64}")
#: Tensors named in the certificate's error line before "and N more".
NAMED = 5
#: Sees each floating chunk the writer reads: (component, tensor name, chunk).
Observer = Callable[[str, str, "torch.Tensor"], None]


@dataclass(frozen=True)
class NonFinite:
    """One stored tensor holding NaN or ±inf values."""

    tensor: str
    nan: int
    inf: int

    @property
    def by_design(self) -> bool:
        """An attention mask stored as ±inf on purpose: "never attend here" is written as
        -inf (a causal-mask buffer), and a model adds it to scores rather than multiplying, so
        it is harmless. Only a tensor whose own name says mask (its last name component holds
        "mask") and that holds no NaN counts: NaN is never by design, and an ordinary weight
        holding ±inf makes every output it feeds ±inf or NaN."""
        return self.nan == 0 and "mask" in self.tensor.rsplit(".", 1)[-1].lower()

    def describe(self) -> str:
        counts = [f"{n} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "±inf")) if n]
        return f"{self.tensor} ({', '.join(counts)})"

    def to_json(self) -> dict[str, object]:
        return {
            "tensor": self.tensor,
            "nan": self.nan,
            "inf": self.inf,
            "by_design": self.by_design,
        }


@dataclass(frozen=True)
class SourceRead:
    """What one read of a source's weight files found: each file's sha256 (keyed by path
    relative to the source root), and its stored tensors holding NaN or ±inf, per component
    ("" for a single model)."""

    files: dict[str, str]
    nonfinite: dict[str, tuple[NonFinite, ...]]

    def broken(self) -> list[tuple[str, NonFinite]]:
        """The non-finite tensors that are not masks stored as ±inf by design."""
        return [(c, t) for c, found in self.nonfinite.items() for t in found if not t.by_design]

    def broken_line(self) -> str | None:
        """One line naming the broken tensors (the first few and how many), or None."""
        broken = self.broken()
        if not broken:
            return None
        named = [f"{c}/{t.describe()}" if c else t.describe() for c, t in broken[:NAMED]]
        more = f" and {len(broken) - NAMED} more" if len(broken) > NAMED else ""
        tensors = "1 tensor" if len(broken) == 1 else f"{len(broken)} tensors"
        return f"the source's own weights are not finite ({tensors}): {', '.join(named)}{more}"

    def refuse_broken(self, where: Path, allow: bool) -> None:
        """Refuse a source whose own weights are not finite, unless ``allow`` (its certificate
        then fails, saying so): against it, every probe that reaches such a weight judges
        nothing, and a conversion of it only carries the fault along.

        Raises:
            InputError: naming the first tensors and how many, and the flag that goes on.
        """
        line = self.broken_line()
        if line is not None and not allow:
            raise InputError(
                f"{line}; nothing can be certified against it: fix the source, or pass "
                "--allow-nonfinite-source to go on with a failing certificate",
                where,
            )


def read_source(root: Path, models: Mapping[str, ModelSource]) -> SourceRead:
    """Hash every weight file of ``models`` (by component; "" for a single model) and check
    their floating tensors, files in parallel, each in one read. Nothing is refused here:
    the caller decides (:meth:`SourceRead.refuse_broken`)."""
    watch = SourceWatch(root, models, allow_nonfinite=True)
    watch.read_ahead(everything=True)
    return watch.result()


class SourceWatch:
    """A conversion's one read of its source's weight files, riding on the writer's reads.

    :meth:`watched` hands the writer a file's tensors wrapped so that each chunk it reads is
    fed to the file's sha256 (in file order; the bytes it does not read, the header and any
    padding, are read here in between) and each floating tensor's chunks are checked for NaN
    and ±inf as they pass. A broken tensor stops the write at once, unless
    ``allow_nonfinite``: the tensors not read yet are checked, so the refusal names them all,
    as a read before the write would (the output is staged, so nothing reaches the target).

    :meth:`read_ahead` reads now the files the writer cannot watch (a pickle checkpoint's
    tensors are in memory, not read in file order), or every file when the weights are used
    before the write (calibration runs the model on them), and refuses a broken source then.
    Without ``hashed`` (nothing will certify the output), the files are only checked.
    ``observe`` is called with (component, tensor name, chunk) for each chunk of a floating
    tensor the writer reads, for whatever else wants to see the data on the same read; it is
    dropped (None) once a file is read ahead, which the writer then does not see.
    """

    def __init__(
        self,
        root: Path,
        models: Mapping[str, ModelSource],
        *,
        allow_nonfinite: bool,
        hashed: bool = True,
        observe: Observer | None = None,
    ) -> None:
        self.root = root
        self.allow_nonfinite = allow_nonfinite
        self.observe = observe
        self._files = [
            _FileCheck(component, f.path, f.tensors, hashed)
            for component, model in models.items()
            for f in model.files
        ]
        self._by_path = {f.path: f for f in self._files}

    def read_ahead(self, *, everything: bool = False) -> None:
        """Read the files the writer cannot watch (with ``everything``, all of them) now, in
        parallel, and refuse a broken source unless ``allow_nonfinite``.

        Raises:
            InputError: a file that cannot be read, or broken weights (see
                :meth:`SourceRead.refuse_broken`).
        """
        ahead = [f for f in self._files if everything or not f.streamed]
        if not ahead:
            return
        self.observe = None  # the writer no longer sees every read
        with ledger_span("read and hash the source"), ThreadPoolExecutor(HASH_THREADS) as pool:
            list(pool.map(_FileCheck.read, ahead))
        self._read().refuse_broken(self.root, self.allow_nonfinite)

    def watched(self, weight_file: WeightFile) -> tuple[LazyTensor, ...]:
        """``weight_file``'s tensors for the writer, in file order: hashed and checked as
        they are read (as they are, when the file was read ahead)."""
        check = self._by_path[weight_file.path]
        if check.done:
            return weight_file.tensors
        stop = None if self.allow_nonfinite else self._refuse
        return tuple(_Watched(t, check, stop, self.observe) for t in check.stored)

    def result(self) -> SourceRead:
        """What the read found, once the writer has read every file: each file's sha256 (the
        bytes after its last tensor hashed here) and its broken tensors."""
        for check in self._files:
            check.finish()
        return self._read()

    def _refuse(self) -> None:
        """A tensor the writer read is broken and not allowed: check the tensors not read yet
        (not hashed: nothing will be certified) and refuse, naming them all."""
        for check in self._files:
            check.check_the_rest()
        self._read().refuse_broken(self.root, self.allow_nonfinite)

    def _read(self) -> SourceRead:
        files: dict[str, str] = {}
        found: dict[str, list[NonFinite]] = {}
        for check in self._files:
            if check.sha256 is not None:
                files[check.path.relative_to(self.root).as_posix()] = check.sha256
            found.setdefault(check.component, []).extend(check.nonfinite())
        broken = {c: tuple(f) for c, f in found.items() if f}
        return SourceRead(dict(sorted(files.items())), broken)


class _FileCheck:
    """One weight file read once: its sha256 fed in file order from the pieces its reader
    reads (the bytes between them read here), and its floating tensors' NaN and ±inf counted
    as their chunks pass."""

    def __init__(
        self, component: str, path: Path, tensors: Sequence[LazyTensor], hashed: bool
    ) -> None:
        self.component = component
        self.path = path
        self.resolved = path.resolve()
        blob = self.resolved.parent.name == "blobs" and _BLOB.fullmatch(self.resolved.name)
        self.tensors = tensors
        stored = [t for t in tensors if isinstance(t, FileTensor) and t.path == path]
        #: Every tensor read from the file itself: the writer's reads can feed its digest.
        self.streamed = len(stored) == len(tensors)
        self.stored = sorted(stored, key=lambda t: (t.begin, t.end))
        self.sha256: str | None = self.resolved.name if blob and hashed else None
        self.digest = hashlib.sha256() if hashed and not blob else None
        self.position = 0  # bytes fed to the digest
        self.found: dict[str, NonFinite] = {}
        self.checked: set[str] = set()
        self.done = False

    def read(self) -> None:
        """Read the whole file now, not as the writer goes."""
        with _reading(self.path):
            if self.streamed:
                for tensor in self.stored:
                    for _ in _Watched(tensor, self, None, None).chunks():
                        pass
            else:  # a pickle's tensors, already in memory: checked as they are, file hashed
                self.check_the_rest()
                if self.digest is not None:
                    with self.resolved.open("rb") as f:
                        self.sha256 = hashlib.file_digest(f, "sha256").hexdigest()
                    self.digest = None
            self.finish()

    def feed(self, offset: int, data: memoryview) -> None:
        """Hash ``data``, the file's bytes from ``offset`` on (the bytes before it that were
        not fed yet are read here first)."""
        if self.digest is None:
            return
        if offset < self.position:
            raise ValueError(f"{self.path}: bytes from {offset} fed after {self.position}")
        self._feed_gap(offset)
        self.digest.update(data)
        self.position += len(data)

    def checked_tensor(self, name: str, nan: int, inf: int) -> NonFinite | None:
        """Record ``name``'s counts; the tensor when it holds NaN or ±inf."""
        self.checked.add(name)
        if not (nan or inf):
            return None
        self.found[name] = NonFinite(name, nan, inf)
        return self.found[name]

    def check_the_rest(self) -> None:
        """Check the floating tensors no reader has checked yet (their bytes not hashed)."""
        for tensor in self.tensors:
            if tensor.name not in self.checked:
                nan, inf = _count_all(tensor.chunks()) if tensor.dtype.is_float else (0, 0)
                self.checked_tensor(tensor.name, nan, inf)

    def finish(self) -> None:
        """Complete the read: the file's bytes not fed yet hashed, its tensors no reader
        checked checked. Idempotent."""
        if self.done:
            return
        self.check_the_rest()
        if self.digest is not None:
            self._feed_gap(None)
            self.sha256 = self.digest.hexdigest()
        self.done = True

    def nonfinite(self) -> list[NonFinite]:
        """The broken tensors found so far, in file order."""
        return [self.found[t.name] for t in self.tensors if t.name in self.found]

    def _feed_gap(self, end: int | None) -> None:
        """Hash the file's bytes from what was fed so far to ``end`` (None: its end), in
        blocks of at most ``BLOCK_BYTES``."""
        assert self.digest is not None
        if end == self.position:
            return
        with _reading(self.path), self.resolved.open("rb", buffering=0) as f:
            end = os.fstat(f.fileno()).st_size if end is None else end
            buffer = memoryview(bytearray(max(0, min(BLOCK_BYTES, end - self.position))))
            f.seek(self.position)
            while self.position < end:
                got = f.readinto(buffer[: end - self.position])
                if not got:
                    raise OSError("unexpected end of file (the file changed since it was opened)")
                self.digest.update(buffer[:got])
                self.position += got


@dataclass(frozen=True)
class _Watched:
    """``tensor`` whose chunks feed its file's digest and its NaN/±inf count as they are
    read; ``stop`` is called when it turns out to hold them."""

    tensor: FileTensor
    file: _FileCheck
    stop: Callable[[], None] | None
    observe: Observer | None

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def dtype(self) -> DType:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    def chunks(self, pool: BufferPool | None = None) -> Iterator[torch.Tensor]:
        import torch

        offset, nan, inf = self.tensor.begin, 0, 0
        for chunk in self.tensor.chunks(pool):
            raw = chunk.view(torch.uint8)
            self.file.feed(offset, raw.numpy().data)
            offset += raw.numel()
            if self.dtype.is_float:
                counted = _count(chunk)
                nan, inf = nan + counted[0], inf + counted[1]
                if self.observe is not None:
                    self.observe(self.file.component, self.name, chunk)
            del raw
            yield chunk
            # Not held while the next chunk is read: its read buffer is then free to reuse
            # (a chunk still alive makes the tensor fault in a fresh buffer for every chunk).
            del chunk
        found = self.file.checked_tensor(self.name, nan, inf)
        if found is not None and not found.by_design and self.stop is not None:
            self.stop()


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A weight file that cannot be read (gone, unreadable or cut short since its header was
    read): one line naming it."""
    try:
        yield
    except OSError as exc:
        raise InputError(f"cannot read the weights: {exc.strerror or exc}", path) from None


def _count_all(blocks: Iterable[torch.Tensor]) -> tuple[int, int]:
    """NaN and ±inf counted over one tensor's ``blocks``."""
    nan = inf = 0
    for block in blocks:
        counted = _count(block)
        nan, inf = nan + counted[0], inf + counted[1]
    return nan, inf


def _count(block: torch.Tensor) -> tuple[int, int]:
    """NaN and ±inf in ``block``. The common all-finite block costs one sum (a NaN or ±inf
    anywhere makes it non-finite; a finite block whose sum overflows is only counted, and
    found clean): several times faster than ``isfinite`` on each value. The sum runs on this
    thread, in pieces that never wake torch's intra-op pool."""
    import torch

    wide = torch.float64 if block.dtype == torch.float64 else torch.float32
    if all(bool(torch.isfinite(piece.sum(dtype=wide))) for piece in block.split(SERIAL_ELEMENTS)):
        return 0, 0
    return int(torch.isnan(block).sum()), int(torch.isinf(block).sum())
