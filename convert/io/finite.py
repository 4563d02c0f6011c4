"""The source's weight files read once: each hashed, and every floating tensor in it checked
for NaN and ±inf in the same read.

A source whose own weights are not finite cannot be certified against: its fp32 baseline
answers NaN where the weight is used, so the probes there judge nothing. The check rides on
the read that hashes the source for the certificate, so it costs no second pass over the
data: a safetensors file is read front to back in blocks of at most ``BLOCK_BYTES`` (memory
stays flat whatever the tensor sizes), each block fed to the hash and, where it holds a
floating tensor's values, to the check. A pickle checkpoint's tensors are already in memory
(``torch.load(mmap=True)``): they are checked as they are, the file hashed beside them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from precision_convert.conversion.io.hashing import BLOCK_BYTES, HASH_THREADS
from precision_convert.conversion.io.source import ModelSource
from precision_convert.conversion.io.tensors import FileTensor, LazyTensor
from precision_convert.core.errors import InputError
from precision_convert.core.progress import ledger_span

if TYPE_CHECKING:
    from hashlib import _Hash

    import torch

#: A Hub cache blob is named by its sha256: taken as it is, not hashed again.
_BLOB = re.compile(r"[0-9a-f]{64}")
#: Tensors named in the certificate's error line before "and N more".
NAMED = 5


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


@ledger_span("read and hash the source")
def read_source(root: Path, models: Mapping[str, ModelSource]) -> SourceRead:
    """Hash every weight file of ``models`` (by component; "" for a single model) and check
    their floating tensors, files in parallel, each in one read."""
    jobs = [(c, f.path, f.tensors) for c, model in models.items() for f in model.files]

    def one(job: tuple[str, Path, Sequence[LazyTensor]]) -> tuple[str, list[NonFinite]]:
        try:
            return _read_file(job[1], job[2])
        except OSError as exc:  # gone, unreadable or cut short since its header was read
            raise InputError(f"cannot read the weights: {exc.strerror or exc}", job[1]) from None

    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        results = list(pool.map(one, jobs))
    files: dict[str, str] = {}
    found: dict[str, list[NonFinite]] = {c: [] for c in models}
    for (component, path, _), (digest, in_file) in zip(jobs, results, strict=True):
        files[path.relative_to(root).as_posix()] = digest
        found[component] += in_file
    broken = {c: tuple(f) for c, f in found.items() if f}
    return SourceRead(dict(sorted(files.items())), broken)


def _read_file(path: Path, tensors: Sequence[LazyTensor]) -> tuple[str, list[NonFinite]]:
    """``path``'s sha256 and its non-finite floating tensors, from one read of its bytes."""
    resolved = path.resolve()
    blob = resolved.parent.name == "blobs" and _BLOB.fullmatch(resolved.name)
    stored = [t for t in tensors if isinstance(t, FileTensor) and t.path == path]
    if len(stored) != len(tensors):  # a pickle's tensors, already in memory
        found = [f for t in tensors if t.dtype.is_float for f in _check(t.name, t.chunks())]
        if blob:
            return resolved.name, found
        with resolved.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest(), found
    digest = None if blob else hashlib.sha256()
    found = _stream(resolved, sorted(stored, key=lambda t: t.begin), digest)
    return (resolved.name if digest is None else digest.hexdigest()), found


def _stream(path: Path, tensors: Sequence[FileTensor], digest: _Hash | None) -> list[NonFinite]:
    """Read ``path`` front to back in blocks into ``digest``, checking each floating tensor's
    blocks (aligned to its element size) as they pass."""
    import torch

    buffer = bytearray(BLOCK_BYTES)
    found: list[NonFinite] = []
    with path.open("rb") as f:
        position = 0

        def feed(end: int, itemsize: int = 1) -> Iterable[memoryview]:
            nonlocal position
            step = BLOCK_BYTES - BLOCK_BYTES % itemsize
            while position < end:
                view = memoryview(buffer)[: min(step, end - position)]
                if f.readinto(view) != len(view):
                    raise OSError("unexpected end of file (the file changed since it was opened)")
                if digest is not None:
                    digest.update(view)
                position += len(view)
                yield view

        def skip(end: int) -> None:
            for _ in feed(end):
                pass

        for t in tensors:
            skip(t.begin)  # the header, and any padding between tensors
            if t.dtype.is_float:
                views = feed(t.end, t.dtype.itemsize)
                found += _check(t.name, (torch.frombuffer(v, dtype=t.dtype.torch) for v in views))
            else:
                skip(t.end)
        if digest is not None:
            while block := f.readinto(buffer):
                digest.update(memoryview(buffer)[:block])
    return found


def _check(name: str, blocks: Iterable[torch.Tensor]) -> list[NonFinite]:
    """NaN and ±inf counted over one tensor's ``blocks``. The common all-finite block costs
    one sum (a NaN or ±inf anywhere makes it non-finite; a finite block whose sum overflows
    is only counted, and found clean): several times faster than ``isfinite`` on each value."""
    import torch

    nan = inf = 0
    for block in blocks:
        wide = torch.float64 if block.dtype == torch.float64 else torch.float32
        if not bool(torch.isfinite(block.sum(dtype=wide))):
            nan += int(torch.isnan(block).sum())
            inf += int(torch.isinf(block).sum())
    return [NonFinite(name, nan, inf)] if nan or inf else []
