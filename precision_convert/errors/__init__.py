"""``precision_convert.errors``, where callers have always caught this tool's exceptions.

The classes live in :mod:`precision_convert.core.errors` with the rest of the ground floor;
this package re-exports them so ``from precision_convert.errors import InputError`` keeps
working. It is a package rather than an ``errors.py`` so that the move of the module into
``core/`` stays a pure rename in git's history.
"""

from precision_convert.core.errors import (
    CannotBuildModel,
    CannotValidateError,
    CertificateError,
    ChangedSinceCertified,
    CheckFailed,
    FileSystemError,
    HubAuthError,
    HubPermissionError,
    InputError,
    NotAsCertified,
    OutputExistsError,
    PrecisionConvertError,
    PushFailed,
    PushRefused,
    UnsafeCheckpointError,
    WeightsDoNotMap,
    printable,
)
from precision_convert.core.quiet import PrecisionConvertWarning

__all__ = [
    "CannotBuildModel",
    "CannotValidateError",
    "CertificateError",
    "ChangedSinceCertified",
    "CheckFailed",
    "FileSystemError",
    "HubAuthError",
    "HubPermissionError",
    "InputError",
    "NotAsCertified",
    "OutputExistsError",
    "PrecisionConvertError",
    "PrecisionConvertWarning",
    "PushFailed",
    "PushRefused",
    "UnsafeCheckpointError",
    "WeightsDoNotMap",
    "printable",
]
