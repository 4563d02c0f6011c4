"""``precision_certificate.json``: what was compared, how it went, and which files it covers.

A certificate is data: a :class:`Certificate` dataclass written as JSON by :func:`write` and
read back by :meth:`Certificate.read`. It lists every metric with its threshold, the inputs,
device and library versions, the source (id, revision, weight-file hashes) and the sha256 of
every converted file, so ``push``, ``batch --resume`` and ``validate --verify`` can check that
the files on disk are the ones that were certified (the one verifier,
:func:`precision_convert.validation.certify.verify.verify`, which also hashes them).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from precision_convert.validation.probe.metrics import Measurement

CERTIFICATE_NAME = "precision_certificate.json"
#: ``precision_certificate.json``, or ``precision_certificate.<variant>.json`` for an output
#: written with ``--variant`` (it sits beside the source repo's files, under its own name).
CERTIFICATE_FILE = re.compile(r"precision_certificate(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json")
CARD_NAME = "README.md"
#: Bumped when a field changes meaning, so readers can refuse what they do not understand.
SCHEMA = "precision-convert/certificate/1"


@dataclass
class ComponentRecord:
    """How one model (or pipeline component) was validated."""

    name: str  # "" for a single model
    class_name: str | None
    library: str
    task: str
    mode: str  # "whole", "blockwise" or "pipeline" (the end-to-end run)
    recipe: str | None = None
    plan_sha256: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    blocks: int | None = None  # blocks compared one at a time (blockwise mode)


#: Verdicts of one way of loading (see :mod:`.load_paths`).
LOAD_VERDICTS = ("pass", "fail", "not-checked")


@dataclass
class LoadPath:
    """One way users load the converted files, and what it gave on the validation probes.

    ``way`` is ``pc.load`` (precision-convert's loader), ``plain`` (the library's own
    ``from_pretrained`` with default arguments), ``auto`` (``dtype="auto"``) or ``compute``
    (the compute dtype passed explicitly). ``decides``: whether the way's verdict is part of
    the certificate's (``pc.load`` and ``plain``).
    """

    component: str  # "" for a single model, a pipeline component, or "pipeline" (end to end)
    way: str
    call: str  # the call a user writes
    verdict: str  # one of LOAD_VERDICTS
    decides: bool
    dtypes: dict[str, int] = field(default_factory=dict)  # parameter elements per dtype
    detail: str | None = None  # the error, why it was not checked, or a note
    metrics: list[Measurement] = field(default_factory=list)  # each metric's worst value
    failures: list[str] = field(default_factory=list)  # the first failed metrics, worst first

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadPath:
        values = dict(data)
        values["metrics"] = [Measurement(**m) for m in values.get("metrics", [])]
        return cls(**values)


@dataclass
class Certificate:
    verdict: str  # "pass" or "fail"
    target: str | None
    compute_dtype: str | None
    source: dict[str, Any]  # {"id", "revision", "path", "files": {name: sha256}}
    baseline: dict[str, Any]  # {"dtype": "float32", "kind": "source" | "converted-upcast"}
    device: dict[str, Any]
    versions: dict[str, str]
    components: list[ComponentRecord]
    metrics: list[Measurement]
    failures: list[str]  # one line per failed metric or error, worst first
    files: dict[str, str]  # converted file (relative path) -> sha256
    notes: list[str] = field(default_factory=list)
    tool: dict[str, str] = field(default_factory=dict)
    #: Every way of loading, checked or not (absent in certificates written before it existed).
    load_paths: list[LoadPath] = field(default_factory=list)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    schema: str = SCHEMA

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["metrics"] = [m.to_dict() for m in self.metrics]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Certificate:
        values = dict(data)
        values["components"] = [ComponentRecord(**c) for c in values.get("components", [])]
        values["metrics"] = [Measurement(**m) for m in values.get("metrics", [])]
        values["load_paths"] = [LoadPath.from_dict(p) for p in values.get("load_paths", [])]
        return cls(**values)

    def load_path(self, way: str, component: str | None = None) -> LoadPath | None:
        """The record of ``way`` for ``component`` (default: the model, or the whole pipeline
        when there is one), or None when it was not recorded."""
        if component is None:
            names = {p.component for p in self.load_paths}
            component = "pipeline" if "pipeline" in names else ""
        return next((p for p in self.load_paths if p.way == way and p.component == component), None)

    @property
    def file_name(self) -> str:
        """The name it is stored under: the variant's certificate for a ``--variant`` output."""
        return certificate_name(self.source.get("variant"))

    @classmethod
    def read(cls, directory: str | Path) -> Certificate:
        """The certificate stored in ``directory`` (FileNotFoundError when there is none)."""
        found = certificate_files(directory)
        if not found:
            raise FileNotFoundError(Path(directory) / CERTIFICATE_NAME)
        path = Path(directory) / found[0]
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


def certificate_name(variant: str | None) -> str:
    return f"precision_certificate.{variant}.json" if variant else CERTIFICATE_NAME


def certificate_files(directory: str | Path) -> list[str]:
    """The certificates in ``directory`` (normally one), sorted."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if CERTIFICATE_FILE.fullmatch(p.name))


def write(certificate: Certificate, directory: str | Path) -> Path:
    """Write the certificate atomically (a crash never leaves half a file), replacing any
    other certificate in ``directory`` (a re-validation under another variant name)."""
    path = Path(directory) / certificate.file_name
    for stale in certificate_files(directory):
        if stale != path.name:
            (Path(directory) / stale).unlink()
    write_atomically(path, json.dumps(certificate.to_dict(), indent=2) + "\n")
    return path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: through a hidden temporary file (hidden,
    so a run killed mid-write leaves nothing a hash check would count as an extra file)."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
