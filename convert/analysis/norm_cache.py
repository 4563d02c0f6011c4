"""A user-level cache of what skeleton analysis found: which modules of a class are norms,
which share a parameter (tied weights), and the names of its state dict.

Building a skeleton imports the model's library (transformers alone takes seconds to import)
to learn a handful of module names that depend only on the class, its config and the installed
code. The names are kept as JSON under ``$XDG_CACHE_HOME/precision-convert/norms`` (default
``~/.cache/precision-convert``); :data:`CACHE_VARIABLE` relocates the cache to another
directory, or disables it with ``0``/``off``.

An entry is keyed by a hash of everything the skeleton depends on: the library, the versions
of the installed libraries, the class name, the whole config minus a few fields that never
change module structure (:data:`IGNORED_CONFIG_KEYS`) and a fingerprint of the code that builds
and reads the skeleton. Entries hold the skeleton's own names; mapping them onto a
checkpoint's names happens on every call. Models whose code ships with the checkpoint
(``auto_map``) are never cached. A cache that cannot be read or written is ignored: an
unreadable or corrupt entry is recomputed, a failed write only means the next run recomputes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from precision_convert.conversion.plan import DIFFUSERS_RECORD_KEY, RECORD_KEY
from precision_convert.core._version import __version__
from precision_convert.core.errors import InputError, home_expanded

logger = logging.getLogger(__name__)

#: A directory to keep the cache in, or one of :data:`_DISABLED` to turn it off.
CACHE_VARIABLE = "PRECISION_CONVERT_CACHE"
_DISABLED = frozenset({"0", "off", "false", "no", "none", "disable", "disabled"})
#: Bump when the layout of an entry or the meaning of its key changes.
SCHEMA = 4  # 3: the state dict's keys kept; 4: tied groups name parameters, not modules
#: Top-level config fields that name, date or type a checkpoint without shaping its modules
#: (and our own record, written into converted configs under either name).
IGNORED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "_diffusers_version",
        "torch_dtype",
        "dtype",
        RECORD_KEY,
        DIFFUSERS_RECORD_KEY,
    }
)
#: The distribution of each library a skeleton is built by.
_LIBRARIES = {
    "transformers": "transformers",
    "diffusers": "diffusers",
    "open_clip": "open_clip_torch",
}
#: Distributions whose code can shape a skeleton's modules, whichever library builds it
#: (diffusers and OpenCLIP models may hold transformers or timm modules).
_DISTRIBUTIONS = ("torch", "accelerate", "transformers", "diffusers", "open_clip_torch", "timm")
#: Entries larger than this are not ours (a norm list of a huge model is a few hundred KB).
_MAX_ENTRY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SkeletonNorms:
    """What a skeleton says: its normalization modules, its base-model prefix, the groups of
    parameter names that are one parameter (a head's weight tied to the embedding's), and the
    keys of its state dict (the names its tensors load under)."""

    modules: frozenset[str]
    prefix: str
    tied: tuple[tuple[str, ...], ...] = ()
    state_keys: frozenset[str] = frozenset()


def cache_dir() -> Path | None:
    """Where entries are kept, or None when the cache is disabled or its folder names the
    home of a user this system does not know: the cache only saves time, so a location it
    cannot use turns it off, as an unwritable one does, instead of failing the conversion."""
    chosen = os.environ.get(CACHE_VARIABLE, "").strip()
    if chosen.lower() in _DISABLED:
        return None
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    try:
        if chosen:
            return home_expanded(chosen)
        return (home_expanded(base) if base else Path.home() / ".cache") / "precision-convert"
    except (InputError, RuntimeError) as exc:  # RuntimeError: Path.home() without a home
        logger.debug("norm cache off: %s", exc)
        return None


def cache_key(
    library: str, class_name: str | None, config: Mapping[str, Any], code: Iterable[Path]
) -> dict[str, Any] | None:
    """The key of a skeleton built by ``library`` for ``class_name`` from ``config`` by the
    files ``code``; None when there is none (a library is not installed, a file unreadable,
    the config not plain JSON)."""
    if library not in _LIBRARIES:
        return None
    installed = _installed_versions()
    if installed is None:  # a broken installation: build the skeleton instead
        return None
    versions = dict(installed)
    if versions[_LIBRARIES[library]] is None:  # the library is missing: nothing to cache
        return None
    try:
        fingerprint = _fingerprint(tuple(str(p) for p in code))
        structural = {k: v for k, v in config.items() if k not in IGNORED_CONFIG_KEYS}
        config_hash = hashlib.sha256(_canonical(structural)).hexdigest()
    except (OSError, TypeError, ValueError):
        return None
    return {
        "schema": SCHEMA,
        "precision_convert": __version__,
        "code": fingerprint,
        "library": library,
        "versions": versions,
        "class": class_name,
        "config": config_hash,
    }


@cache
def _installed_versions() -> tuple[tuple[str, str | None], ...] | None:
    """The version of each of :data:`_DISTRIBUTIONS` (None: not installed), read once per
    process (each read searches the installed distributions); None for a broken
    installation."""
    from importlib.metadata import PackageNotFoundError, version

    versions: list[tuple[str, str | None]] = []
    for name in _DISTRIBUTIONS:
        try:
            versions.append((name, version(name)))
        except PackageNotFoundError:
            versions.append((name, None))
        except Exception:
            return None
    return tuple(versions)


def load(key: Mapping[str, Any]) -> SkeletonNorms | None:
    """The entry stored under ``key``; None when absent, unreadable or not what was stored."""
    path = _entry_path(key)
    if path is None:
        return None
    try:
        with path.open("rb") as file:
            raw = file.read(_MAX_ENTRY_BYTES + 1)
        if len(raw) > _MAX_ENTRY_BYTES:
            return None
        entry = json.loads(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        logger.debug("ignoring unreadable norm cache entry %s (%s)", path, exc)
        return None
    if (
        not isinstance(entry, dict)
        or entry.get("key") != json.loads(_canonical(key))
        or not isinstance(entry.get("prefix"), str)
        or not isinstance(entry.get("modules"), list)
        or not all(isinstance(m, str) for m in entry["modules"])
        or not isinstance(entry.get("tied"), list)
        or not all(
            isinstance(g, list) and all(isinstance(m, str) for m in g) for g in entry["tied"]
        )
        or not isinstance(entry.get("state_keys"), list)
        or not all(isinstance(k, str) for k in entry["state_keys"])
    ):
        logger.debug("ignoring a norm cache entry that does not match its key: %s", path)
        return None
    tied = tuple(tuple(group) for group in entry["tied"])
    return SkeletonNorms(
        frozenset(entry["modules"]), entry["prefix"], tied, frozenset(entry["state_keys"])
    )


def store(key: Mapping[str, Any], found: SkeletonNorms) -> None:
    """Keep ``found`` under ``key``, atomically (temporary file + rename); never raises."""
    path = _entry_path(key)
    if path is None:
        return
    payload = _canonical(
        {
            "key": key,
            "modules": sorted(found.modules),
            "prefix": found.prefix,
            "tied": [list(group) for group in found.tied],
            "state_keys": sorted(found.state_keys),
        }
    )
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.stem[:16]}-", suffix=".tmp"
        )
        with os.fdopen(descriptor, "wb") as file:
            file.write(payload)
        os.replace(temporary, path)
        temporary = None
    except Exception as exc:  # a read-only or full disk: the next run recomputes
        logger.debug("could not write norm cache entry %s (%s)", path, exc)
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def _entry_path(key: Mapping[str, Any]) -> Path | None:
    directory = cache_dir()
    if directory is None:
        return None
    digest = hashlib.sha256(_canonical(key)).hexdigest()
    return directory / "norms" / f"{digest}.json"


def _canonical(value: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no whitespace, NaN rejected."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


@cache
def _fingerprint(paths: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()
