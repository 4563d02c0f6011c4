"""The upload stream: what is sent to the Hub is exactly what the certificate gate hashed."""

from __future__ import annotations

import hashlib
import io
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from precision_convert.conversion.io.hashing import BLOCK_BYTES, HashedFile
from precision_convert.core.errors import ChangedSinceCertified

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd


def addition(file: HashedFile, readers: ExitStack) -> CommitOperationAdd:
    """The commit operation for ``file``: its bytes as the gate read them, with the certified
    sha256 as the LFS object id (the client never hashes the file again)."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.lfs import UploadInfo

    if file.data is not None:  # small: the very bytes that were hashed
        return CommitOperationAdd(file.path, file.data)
    # Built on the path (which reads nothing), then given the certified stream and upload info:
    # a file object passed in directly would be read whole once more just to hash it.
    add = CommitOperationAdd(file.path, file.location)
    # A binary file to the client; typeshed's BinaryIO is a class, not the protocol it reads.
    add.path_or_fileobj = cast(BinaryIO, readers.enter_context(CertifiedReader(file)))
    # The sample (read from the path) only tells text from binary; it is not uploaded.
    add.upload_info = UploadInfo(file.size, add.upload_info.sample, bytes.fromhex(file.sha256))
    return add


class CertifiedReader(io.BufferedIOBase):
    """A large file as the gate hashed it: every block read to upload is checked against the
    digest the gate took of it before any byte of it is handed out, so what is sent is exactly
    what was certified. A changed block raises :class:`ChangedSinceCertified` instead (the
    upload fails, the commit is never made). Reads may come in any order and more than once
    (multipart uploads, retries): each is checked. At most one block is kept in memory, and
    none once the client seeks elsewhere (it rewinds the stream when its upload ends)."""

    def __init__(self, file: HashedFile) -> None:
        super().__init__()
        self.file = file
        self._handle: BinaryIO | None = None
        self._position = 0
        self._index = -1  # the block in memory
        self._block = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.file.size}[whence]
        self._position = max(0, base + offset)
        if self._position // BLOCK_BYTES != self._index:  # the client rewinds after an upload:
            self._block, self._index = b"", -1  # the block is not kept while others upload
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        left = self.file.size - self._position if size is None or size < 0 else size
        pieces = []
        while left > 0 and self._position < self.file.size:
            index, offset = divmod(self._position, BLOCK_BYTES)
            piece = self._load(index)[offset : offset + left]
            pieces.append(piece)
            self._position += len(piece)
            left -= len(piece)
        return b"".join(pieces)

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def _load(self, index: int) -> bytes:
        if index != self._index:
            if self._handle is None:
                self._handle = self.file.location.open("rb")
            self._handle.seek(index * BLOCK_BYTES)
            block = self._handle.read(BLOCK_BYTES)
            expected = self.file.blocks[index] if index < len(self.file.blocks) else b""
            if hashlib.sha256(block).digest() != expected:
                raise ChangedSinceCertified(self.file.path)
            self._block, self._index = block, index
        return self._block

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._block = b""
        super().close()


def changed_file(exc: BaseException) -> str | None:
    """The file named by a :class:`ChangedSinceCertified` somewhere in ``exc``'s chain (the
    client wraps what a read raises: "Error while uploading ...")."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ChangedSinceCertified):
            return current.path
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def same_content(file: HashedFile, remote: Any) -> bool:
    """Whether a local file equals a Hub tree entry (LFS: sha256; git: blob sha1)."""
    lfs = getattr(remote, "lfs", None)
    if lfs is not None:
        return bool(lfs.sha256 == file.sha256)
    data = file.data if file.data is not None else file.location.read_bytes()
    return bool(remote.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
