"""Files hashed from their bytes, in parallel.

One hashing serves every digest of a directory's files: the certificate's (and every check
against it: push, ``batch --resume``, ``validate --verify``) and the digest of a calibration's
candidate weights that lets validation reuse that candidate's outputs. A source's weight
files are hashed by :mod:`.finite`, which checks their values in the same read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from precision_convert.core.progress import ledger_span

#: Files hashed at once: enough to keep a few cores and a fast disk busy (hashlib releases the
#: GIL, so shards hash on every core).
HASH_THREADS = min(8, os.cpu_count() or 1)
#: Files up to one block are read whole and kept, so a push sends the very bytes it hashed;
#: larger ones can keep a digest per block, which the push checks each block against as it
#: reads it again to upload (8 MiB: a handful of blocks in memory at once, per upload thread).
BLOCK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class HashedFile:
    """One file of a directory, hashed from its bytes."""

    path: str  # relative POSIX path (the path in a Hub repo)
    location: Path
    sha256: str
    size: int
    data: bytes | None  # the content, for files up to BLOCK_BYTES: what was hashed
    blocks: tuple[bytes, ...] = ()  # sha256 of each BLOCK_BYTES block (larger files, on request)


@ledger_span("hash")
def hash_paths(root: Path, paths: Iterable[str], *, blocks: bool = False) -> dict[str, HashedFile]:
    """Each of ``paths`` (relative to ``root``) hashed from its bytes, in parallel."""

    def one(path: str) -> HashedFile:
        location = root / path
        with location.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= BLOCK_BYTES:
                data = f.read()
                return HashedFile(path, location, hashlib.sha256(data).hexdigest(), len(data), data)
            if not blocks:
                # file_digest reads into one small reused buffer: a multi-GB shard costs no memory.
                return HashedFile(
                    path, location, hashlib.file_digest(f, "sha256").hexdigest(), size, None
                )
            whole, digests, read = hashlib.sha256(), [], 0
            while block := f.read(BLOCK_BYTES):
                whole.update(block)
                digests.append(hashlib.sha256(block).digest())
                read += len(block)
        return HashedFile(path, location, whole.hexdigest(), read, None, tuple(digests))

    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        return {f.path: f for f in pool.map(one, list(paths))}
