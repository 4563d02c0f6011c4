"""Start-up hook of every Python process a reliability trial starts (its folder is put on
``PYTHONPATH``), batch workers included: with ``PC_TEST_READ_DELAY`` set, source reads are
cut into 256 KiB chunks with that many seconds of sleep each, so that writing a few MB takes
long enough for a signal sent at a random moment to land while data is being written.
Without the variable it does nothing (and imports nothing).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

#: Seconds of sleep per source chunk read.
DELAY_VARIABLE = "PC_TEST_READ_DELAY"


def throttle(delay: float) -> None:
    """Slow down every source read of this process by ``delay`` seconds per 256 KiB."""
    from precision_convert.conversion.io import tensors

    tensors.CHUNK_BYTES = 256 * 1024
    chunks = tensors.FileTensor.chunks

    def slow_chunks(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for chunk in chunks(self, *args, **kwargs):
            time.sleep(delay)
            yield chunk

    tensors.FileTensor.chunks = slow_chunks  # type: ignore[method-assign]


if os.environ.get(DELAY_VARIABLE):
    throttle(float(os.environ[DELAY_VARIABLE]))
