"""Where models run: one reading of ``--device`` for the loader, validation and analysis."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from precision_convert.core.errors import InputError

if TYPE_CHECKING:
    import torch


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"``: CUDA when present, else the CPU; otherwise the device named.

    Raises:
        InputError: the name is not a device, or CUDA was asked for and there is none.
    """
    import torch

    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if found.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for but no CUDA device is available")
    return found


def move(model: Any, device: torch.device) -> Any:
    """``model.to(device)``; for a diffusers pipeline without its warning that fp16 "cannot run
    with cpu": a converted pipeline runs there (validation runs it), and the warning would
    repeat on every load."""
    diffusers = sys.modules.get("diffusers")  # a pipeline was built by it, so it is imported
    if diffusers is not None and isinstance(model, diffusers.DiffusionPipeline):
        return model.to(device, silence_dtype_warnings=True)
    return model.to(device)
