"""precision-convert: rewrite PyTorch checkpoints to bf16/fp16 safely.

Example:
    >>> import precision_convert as pc
    >>> result = pc.convert("./tiny-t5", to="fp16-safe")
    >>> model = pc.load(result.output)

Heavy libraries (torch, transformers, diffusers) are imported only when a function needs them,
so ``import precision_convert`` and ``precision-convert --help`` stay fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The subpackages share names with the API functions below (``convert``, ``validate``).
# Importing them first means a later ``import precision_convert.convert.x`` finds them in
# sys.modules and never rebinds the package attribute over the function.
import precision_convert.convert
import precision_convert.validate  # noqa: F401

if TYPE_CHECKING:
    from precision_convert.convert.api import ConversionResult
    from precision_convert.convert.inspection import InspectReport
    from precision_convert.validate.certificate import Certificate

try:
    __version__ = version("precision-convert")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__", "convert", "inspect", "load", "validate"]


def convert(
    source: str | Path,
    to: str = "bf16-safe",
    output: str | Path | None = None,
    validate: bool = True,
    device: str | None = None,
    *,
    revision: str | None = None,
    recipe: str | None = None,
    keep_fp32: Sequence[str] = (),
    calibrate: bool | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> ConversionResult:
    """Convert a checkpoint to ``to`` and, by default, certify it against fp32.

    See :func:`precision_convert.convert.api.convert` for every argument.
    """
    from precision_convert.convert.api import convert as _convert

    return _convert(
        source,
        to,
        output,
        validate=validate,
        device=device,
        revision=revision,
        recipe=recipe,
        keep_fp32=keep_fp32,
        calibrate=calibrate,
        overwrite=overwrite,
        trust_remote_code=trust_remote_code,
    )


def inspect(
    source: str | Path,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    calibrate: bool = False,
    chart: str | Path | None = None,
) -> InspectReport:
    """Real tensor dtypes per module, the matching recipe, planned islands and hazards.

    See :func:`precision_convert.convert.inspection.inspect_source`.
    """
    from precision_convert.convert.inspection import inspect_source

    return inspect_source(
        source,
        revision=revision,
        trust_remote_code=trust_remote_code,
        calibrate=calibrate,
        chart=chart,
    )


def load(path: str | Path, device: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """A converted model or pipeline with its dtype map applied and dtype boundaries made safe.

    See :func:`precision_convert.convert.loader.load`.
    """
    from precision_convert.convert.loader import load as _load

    return _load(path, device, trust_remote_code=trust_remote_code)


def validate(
    converted: str | Path,
    baseline: str | Path | None = None,
    device: str | None = None,
    *,
    inputs: str | Path | None = None,
    max_memory: str | int | None = None,
) -> Certificate:
    """Certify ``converted`` against its fp32 baseline; writes ``precision_certificate.json``.

    See :func:`precision_convert.validate.runner.validate`.
    """
    from precision_convert.validate.runner import validate as _validate

    return _validate(converted, baseline, device, inputs=inputs, max_memory=max_memory)
