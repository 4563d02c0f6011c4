"""precision-convert: rewrite PyTorch checkpoints to bf16/fp16 safely.

Example:
    >>> import precision_convert as pc
    >>> result = pc.convert("./tiny-t5", to="fp16-safe")
    >>> model = pc.load(result.output)

Heavy libraries (torch, transformers, diffusers) are imported only when a function needs them,
so ``import precision_convert`` and ``precision-convert --help`` stay fast.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

# ``convert`` and ``validate`` are both subpackages and API functions. Importing the
# subpackages first means the function names below win as package attributes, and later
# ``from precision_convert.convert import x`` imports still find the subpackage in sys.modules.
# (``import precision_convert.convert.x as y`` cannot work for that reason: use ``from``.)
import precision_convert.convert
import precision_convert.validate  # noqa: F401
from precision_convert.convert.api import convert
from precision_convert.convert.inspection import inspect_source as inspect
from precision_convert.convert.loader import load

if TYPE_CHECKING:
    from precision_convert.validate.certificate import Certificate

try:
    __version__ = version("precision-convert")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__", "convert", "inspect", "load", "validate"]


def validate(
    converted: str | Path,
    baseline: str | Path | None = None,
    device: str | None = None,
    *,
    inputs: str | Path | None = None,
    max_memory: str | int | None = None,
) -> Certificate:
    """Certify ``converted`` against its fp32 baseline; writes ``precision_certificate.json``.

    A wrapper rather than a re-export because the validation runner imports torch at once.
    See :func:`precision_convert.validate.runner.validate`.
    """
    from precision_convert.validate.runner import validate as _validate

    return _validate(converted, baseline, device, inputs=inputs, max_memory=max_memory)
