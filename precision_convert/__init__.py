"""precision-convert: rewrite PyTorch checkpoints to bf16/fp16 safely.

Example:
    >>> import precision_convert as pc
    >>> result = pc.convert("./t5-small", to="bf16-safe")
    >>> model = pc.load(result.output)
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

# The subpackages share names with the API functions below (``convert``, ``validate``).
# Importing them first means a later ``import precision_convert.convert.x`` finds them in
# sys.modules and never rebinds the package attribute over the function.
import precision_convert.convert
import precision_convert.validate  # noqa: F401

try:
    __version__ = version("precision-convert")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__", "convert", "inspect", "load", "validate"]


def convert(*args: Any, **kwargs: Any) -> Any:
    """Convert a checkpoint; see :func:`precision_convert.convert.api.convert`."""
    from precision_convert.convert.api import convert as _convert

    return _convert(*args, **kwargs)


def inspect(*args: Any, **kwargs: Any) -> Any:
    """Report dtypes and hazards; see :func:`precision_convert.convert.inspection.inspect_source`."""
    from precision_convert.convert.inspection import inspect_source

    return inspect_source(*args, **kwargs)


def load(*args: Any, **kwargs: Any) -> Any:
    """Load a converted model with its dtype map; see :func:`precision_convert.convert.loader.load`."""
    from precision_convert.convert.loader import load as _load

    return _load(*args, **kwargs)


def validate(*args: Any, **kwargs: Any) -> Any:
    """Certify parity against fp32; see :func:`precision_convert.validate.runner.validate`."""
    from precision_convert.validate.runner import validate as _validate

    return _validate(*args, **kwargs)
