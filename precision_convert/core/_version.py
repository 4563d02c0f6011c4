"""The installed version, read once from the package metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("precision-convert")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0"
