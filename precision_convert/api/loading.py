"""``pc.load``: the converted files loaded, and their certificate read on the way.

The loading itself is :func:`~precision_convert.conversion.runtime.loader.load` (the loader
validation certifies). A directory's certificate is checked here, where it is read by a user:
one that its own records contradict (a ``pass`` whose measurements failed, a required record
missing: :func:`~precision_convert.validation.certify.consistency.contradiction`),
or that cannot be read, is said in one warning line; the weights are loaded all the same
(the certificate describes them, it does not gate loading them).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_convert.conversion.io.source import resolve
from precision_convert.conversion.runtime import loader
from precision_convert.core.errors import CertificateError, printable
from precision_convert.core.patterns import certificate_name
from precision_convert.core.quiet import PrecisionConvertWarning
from precision_convert.validation.certify.certificate import Certificate, certificate_files
from precision_convert.validation.certify.consistency import refusal

if TYPE_CHECKING:
    import torch

__all__ = ["load"]


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    variant: str | None = None,
    revision: str | None = None,
    *,
    trust_remote_code: bool = False,
) -> Any:
    """Load a converted model or pipeline with its per-module dtypes and safe boundaries;
    arguments, result and errors as :func:`~precision_convert.conversion.runtime.loader.load`.

    Warns (:class:`~precision_convert.core.quiet.PrecisionConvertWarning`, one line) when the
    directory's certificate contradicts itself or cannot be read; the model is loaded anyway.
    """
    root = resolve(path, revision, variant=variant)  # a Hub repo: downloaded once, here
    loaded = loader.load(root, device, variant, trust_remote_code=trust_remote_code)
    doubt = certificate_doubt(root, variant)
    if doubt is not None:
        warnings.warn(doubt, PrecisionConvertWarning, stacklevel=2)
    return loaded


def certificate_doubt(root: Path, variant: str | None) -> str | None:
    """Why the certificate of ``root`` (the variant's, or the only one) is not to be believed,
    in one line; None when it agrees with itself, or there is none."""
    found = certificate_files(root)
    name = certificate_name(variant)
    if name not in found:
        if variant is not None or len(found) != 1:
            return None
        name = found[0]
    where = printable(str(root / name))
    try:
        certificate = Certificate.from_dict(json.loads((root / name).read_text("utf-8")))
    except (CertificateError, ValueError) as exc:
        return f"{where}: cannot be read ({printable(str(exc))}); the weights were loaded anyway"
    refused = refusal(certificate, printable(str(root)))
    return None if refused is None else f"{where}: {printable(refused)} (loaded anyway)"
