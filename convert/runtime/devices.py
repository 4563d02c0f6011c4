"""Where models run: one reading of ``--device`` for the loader, validation and analysis."""

from __future__ import annotations

from typing import TYPE_CHECKING

from precision_convert.errors import InputError

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
