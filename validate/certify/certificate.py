"""``precision_certificate.json``: what was compared, how it went, and which files it covers.

A certificate is data: a :class:`Certificate` dataclass written as JSON by :func:`write` and
read back by :meth:`Certificate.read`, checked against its JSON Schema
(docs/schema/certificate.schema.json, installed as ``precision_convert.schema``) with
``jsonschema`` before it is trusted: the format is described once, for the docs, the tests and
the reader. It lists every metric with its threshold, the inputs,
device and library versions, the source (id, revision, weight-file hashes) and the sha256 of
every converted file, so ``push``, ``batch --resume`` and ``validate --verify`` can check that
the files on disk are the ones that were certified (the one verifier,
:func:`precision_convert.validation.certify.verify.verify`, which also hashes them).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from precision_convert.core.errors import CertificateError, FileSystemError
from precision_convert.core.patterns import (
    CERTIFICATE_FILE,
    CERTIFICATE_NAME,
    SIGNATURE_FILE,
    certificate_name,
)
from precision_convert.validation.probe.run.metrics import METRICS, Measurement

CARD_NAME = "README.md"
#: The JSON Schema certificates are read back against (docs/schema/, installed as
#: ``precision_convert.schema``).
SCHEMA_FILE = "certificate.schema.json"
#: Bumped when a field changes meaning, so readers can refuse what they do not understand.
#: 2: ``verdict`` gained ``smoke-pass`` (a self-comparison never reads ``pass``) and
#: ``source.id``/``source.path`` name the source by its Hub id or directory name, never a path.
#: 3: ``metrics`` is grouped into series (one per component, output, metric and bound, a row
#: per probe): a row names only what changes from probe to probe.
SCHEMA = "precision-convert/certificate/3"
#: The earlier versions, still read. 1: self-comparisons were written with verdict ``pass``;
#: 1 and 2: ``metrics`` a flat list of measurements.
SCHEMA_1 = "precision-convert/certificate/1"
SCHEMA_2 = "precision-convert/certificate/2"
#: What every measurement of a metric series shares.
SERIES_KEY = ("component", "output", "metric", "threshold", "bound")
#: A series' columns, one entry per measurement: the probe (an index into ``metrics.probes``),
#: the value (None for NaN/Inf) and whether it passed.
SERIES_COLUMNS = ("probe", "value", "passed")
#: What the baseline was: the source (or a baseline the user named), or the converted weights
#: themselves upcast to fp32 (``validate DIR`` without ``--baseline``).
SOURCE_BASELINE = "source"
SELF_BASELINE = "converted-upcast"
#: The verdicts. Only a comparison with the source earns ``pass``; a comparison of the
#: converted weights with themselves upcast finds overflow and compute-precision loss but not
#: the rounding of the weights, so at best it is a smoke check: ``smoke-pass``.
PASS, SMOKE_PASS, FAIL = "pass", "smoke-pass", "fail"
VERDICTS = (PASS, SMOKE_PASS, FAIL)


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
    #: The attention implementations judged (``{"default", "judged", "not_judged"}``); None
    #: for a model without a choice of attention, or a certificate from before it was recorded.
    attention: dict[str, Any] | None = None
    #: What the fp32 sweep bounds and the search for the worst context found
    #: (``{"bounds": [...], "context_search": {...}}``); None where no fp32 session ran whole.
    calibration: dict[str, Any] | None = None
    #: Each module owning a cast parameter by status (``exercised``, ``unused``,
    #: ``not_covered``, ``unreached``; see :mod:`.modules`); None in certificates from before.
    modules: dict[str, Any] | None = None


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
    #: The attention implementation the way ran under when not the model's default (users
    #: pick ``eager`` for ``output_attentions``): judged as a way of its own.
    attention: str | None = None

    @property
    def label(self) -> str:
        """The way's name, with its attention implementation when not the default."""
        return f"{self.way}+{self.attention}" if self.attention else self.way

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadPath:
        values = dict(data)
        values["metrics"] = [Measurement(**m) for m in values.get("metrics", [])]
        return cls(**values)


@dataclass
class Certificate:
    verdict: str  # one of VERDICTS
    target: str | None
    compute_dtype: str | None
    #: {"id", "revision", "path", "files": {name: sha256}, "card", "variant"}; the id and path
    #: are a Hub id or a directory's name, never a local path (the certificate is published).
    source: dict[str, Any]
    baseline: dict[str, Any]  # {"dtype": "float32", "kind": SOURCE_BASELINE | SELF_BASELINE}
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
    #: What ``validate --sign`` signed this certificate and the files it covers with:
    #: ``{"file": "precision_certificate.sig", "public_key_sha256": <hex>}`` (the signature
    #: file beside it, and the sha256 of the signer's public key as DER SubjectPublicKeyInfo);
    #: None: unsigned. The signature is written after the certificate, so ``files`` cannot hold
    #: its hash: it is the one file checked by its own means
    #: (:mod:`~precision_convert.validation.certify.signing`).
    signature: dict[str, str] | None = None
    #: What the verdict does not cover (``{"what", "why"}`` each: deciding ways of loading not
    #: checked, probes not judged); None in certificates written before it existed (the
    #: consistency rule derives it from the records then).
    not_covered: list[dict[str, str]] | None = None
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    schema: str = SCHEMA

    @property
    def passed(self) -> bool:
        """The verdict is ``pass``: compared with the source, every check passed. What a
        reader believes also needs the records to agree (see
        :func:`~precision_convert.validation.certify.consistency.contradiction`)."""
        return self.verdict == PASS

    @property
    def against_source(self) -> bool:
        """Whether the baseline was the source (or one the user named), not the converted
        weights themselves."""
        return self.baseline.get("kind") == SOURCE_BASELINE

    def failures_beside_metrics(self) -> list[str]:
        """The failures a table of the metrics does not show: errors, load paths, and what
        to do about coverage (a failed measurement's own line repeats its table row)."""
        shown = {
            line for m in self.metrics if m.metric != "coverage" for line in metric_failures([m])
        }
        return [line for line in self.failures if line not in shown]

    def why_not_certified(self, directory: str | Path) -> str | None:
        """Why the files in ``directory`` are not certified by this certificate (None: they
        are), with the command that would certify them: one clause for a refusal message."""
        if self.passed:
            return None
        first = self.failures[0] if self.failures else "no reason recorded"
        if self.against_source:
            return f"verdict {self.verdict!r} ({len(self.failures)} problems, first: {first})"
        outcome = "passed" if self.verdict == SMOKE_PASS else f"failed ({first})"
        return (
            f"a smoke check that {outcome}: the converted weights were compared with "
            "themselves upcast to fp32, never with the source; certify against the source: "
            f"precision-convert validate {directory} --baseline SOURCE"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["metrics"] = metric_series(self.metrics)
        if self.not_covered is None:  # read from a certificate written before it existed
            del data["not_covered"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check: bool = True) -> Certificate:
        """The certificate ``data`` describes, checked against its JSON Schema first.

        ``check=False`` only for fields this process has just made (the tests hold those to
        the schema): a certificate being written is written, and its reader says what is wrong.

        Raises:
            CertificateError: ``data`` is not a certificate this version reads (another
                format version, a field missing, unknown or of the wrong type).
        """
        values = _upgraded(data)
        if check:
            check_schema(values)
        values["components"] = [ComponentRecord(**c) for c in values.get("components", [])]
        values["metrics"] = measurements(values.get("metrics") or {})
        values["load_paths"] = [LoadPath.from_dict(p) for p in values.get("load_paths", [])]
        return cls(**values)

    def load_path(self, way: str, component: str | None = None) -> LoadPath | None:
        """The record of ``way`` for ``component`` (default: the model, or the whole pipeline
        when there is one), or None when it was not recorded."""
        if component is None:
            names = {p.component for p in self.load_paths}
            component = "pipeline" if "pipeline" in names else ""
        return next(
            (
                p
                for p in self.load_paths
                if p.way == way and p.component == component and p.attention is None
            ),
            None,
        )

    @property
    def file_name(self) -> str:
        """The name it is stored under: the variant's certificate for a ``--variant`` output."""
        return certificate_name(self.source.get("variant"))

    @classmethod
    def read(cls, directory: str | Path) -> Certificate:
        """The certificate stored in ``directory``.

        Raises:
            FileNotFoundError: there is none.
            CertificateError: there are several (the verifier refuses them too: which one
                speaks for the files cannot be told), or the one is not in this version's format.
        """
        found = certificate_files(directory)
        if not found:
            raise FileNotFoundError(Path(directory) / CERTIFICATE_NAME)
        if len(found) > 1:
            raise CertificateError(f"more than one certificate ({', '.join(found)})", directory)
        path = Path(directory) / found[0]
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


@cache
def _validator() -> Any:
    from jsonschema import Draft202012Validator

    text = resources.files("precision_convert.schema").joinpath(SCHEMA_FILE).read_text("utf-8")
    return Draft202012Validator(json.loads(text))


def check_schema(data: Mapping[str, Any]) -> None:
    """Check ``data`` against docs/schema/certificate.schema.json (installed with the package),
    naming the first field at fault.

    Raises:
        CertificateError: another format version, or a field missing, unknown or mistyped.
    """
    if data.get("schema") != SCHEMA:
        raise CertificateError(
            f"format {data.get('schema')!r}, not {SCHEMA!r}: written by another version of "
            "precision-convert; validate the output again with this one"
        )
    error = min(_validator().iter_errors(data), key=lambda e: list(e.absolute_path), default=None)
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path) or "the top level"
        raise CertificateError(f"{where}: {error.message}")


def metric_failures(metrics: Iterable[Measurement]) -> list[str]:
    """One failure line per failed deciding measurement, fatal ones (NaN/Inf, black frames)
    first: a reported-only one (``deciding: false``) never fails the verdict, as
    :func:`~.consistency.contradiction` reads it."""
    failed = [m for m in metrics if deciding(m) and not m.passed]
    fatal = [m for m in failed if METRICS[m.metric].fatal_threshold is not None]
    return [failure_line(m) for m in fatal + [m for m in failed if m not in fatal]]


def failure_line(m: Measurement) -> str:
    """A failed measurement in the certificate's words: the comparison's failures and the
    failures of each way of loading read alike."""
    if m.metric == "nonfinite":
        what = "output missing or reshaped" if m.value is None else f"{int(m.value)} NaN/Inf values"
        return f"{m.where}: {what}"
    if m.metric == "coverage":
        return (
            f"{m.component or 'model'}: coverage {m.value or 0:.0%} (modules owning cast "
            f"parameters that ran in a judged probe; must be >= {m.threshold:.0%})"
        )
    if m.metric == "constant_frames":
        return f"{m.where}: {int(m.value or 0)} constant (black) frame planes"
    return f"{m.where}: {measured(m)}"


def measured(m: Measurement) -> str:
    """A measurement's metric, value and bound: ``cosine 0.97 (must be >= 0.99)``."""
    value = "NaN" if m.value is None else f"{m.value:.4g}"
    sign = "<=" if m.bound == "max" else ">="
    bound = "" if m.threshold is None else f" (must be {sign} {m.threshold:g})"
    return f"{m.metric} {value}{bound}"


def deciding(m: Measurement) -> bool:
    """Whether ``m`` decides the verdict: it is judged against a threshold (a metric without
    one is reported only, and always passes). Its series is marked so (``deciding``)."""
    return m.threshold is not None


def _upgraded(data: Mapping[str, Any]) -> dict[str, Any]:
    """A certificate's fields in the current schema's meaning: a version-1 self-comparison
    that passed reads ``smoke-pass``, as it would be written now; the flat ``metrics`` list of
    versions 1 and 2 is grouped into series."""
    values = dict(data)
    if values.get("schema") == SCHEMA_1:
        values["schema"] = SCHEMA_2
        baseline = values.get("baseline") or {}
        if values.get("verdict") == PASS and baseline.get("kind") == SELF_BASELINE:
            values["verdict"] = SMOKE_PASS
    if values.get("schema") == SCHEMA_2:
        values["schema"] = SCHEMA
        flat = values.get("metrics")
        if isinstance(flat, list) and all(isinstance(m, Mapping) for m in flat):
            with contextlib.suppress(TypeError):  # malformed rows: the schema check names them
                values["metrics"] = metric_series([Measurement(**m) for m in flat])
    return values


def in_series_order(metrics: Iterable[Measurement]) -> list[Measurement]:
    """``metrics`` in the order the certificate stores them: series by series (in the order
    each first appears), each series' rows in their order. Assembled certificates are put in
    this order, so one read back from its file equals the one written (its card too)."""
    groups: dict[tuple[Any, ...], list[Measurement]] = {}
    for m in metrics:
        groups.setdefault(tuple(getattr(m, k) for k in SERIES_KEY), []).append(m)
    return [m for group in groups.values() for m in group]


def metric_series(metrics: Iterable[Measurement]) -> dict[str, Any]:
    """The certificate's ``metrics``: every probe named once (``probes``), and a series per
    component, output, metric, threshold and bound, marked ``deciding`` when its threshold
    makes the verdict depend on it, holding, per measurement, the probe's index, the value
    and whether it passed (columns: a list each)."""
    probes: dict[str, int] = {}
    series: dict[tuple[Any, ...], dict[str, Any]] = {}
    for m in metrics:
        key = tuple(getattr(m, k) for k in SERIES_KEY)
        if key not in series:
            series[key] = {**dict(zip(SERIES_KEY, key, strict=True)), "deciding": deciding(m)}
            series[key].update((column, []) for column in SERIES_COLUMNS)
        columns = series[key]
        columns["probe"].append(probes.setdefault(m.probe, len(probes)))
        columns["value"].append(m.value)
        columns["passed"].append(m.passed)
    return {"probes": list(probes), "series": list(series.values())}


def measurements(data: Mapping[str, Any]) -> list[Measurement]:
    """The measurements :func:`metric_series` stored, in the order it stores them.

    Raises:
        CertificateError: a series whose columns differ in length or name a probe not listed,
            or whose ``deciding`` mark disagrees with its threshold (a series without the
            mark, written before it existed, gets it from the threshold).
    """
    probes = data.get("probes", [])
    found = []
    for n, s in enumerate(data.get("series", [])):
        columns = [s[c] for c in SERIES_COLUMNS]
        if len({len(c) for c in columns}) != 1 or not all(0 <= i < len(probes) for i in s["probe"]):
            raise CertificateError(f"metrics/series: {s['metric']} of {s['output']} is malformed")
        shared = {k: s[k] for k in SERIES_KEY}
        rows = [
            Measurement(**shared, probe=probes[i], value=value, passed=passed)
            for i, value, passed in zip(*columns, strict=True)
        ]
        if rows and s.get("deciding", deciding(rows[0])) != deciding(rows[0]):
            raise CertificateError(
                f"metrics/series/{n}: {s['metric']} of {s['output'] or 'the model'} is marked "
                f"deciding: {str(s['deciding']).lower()}, but "
                + ("its threshold decides" if deciding(rows[0]) else "it has no threshold")
            )
        found += rows
    return found


def certificate_files(directory: str | Path) -> list[str]:
    """The certificates in ``directory`` (normally one), sorted."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if CERTIFICATE_FILE.fullmatch(p.name))


def write(
    certificate: Certificate, directory: str | Path, with_files: Mapping[str, str] | None = None
) -> Path:
    """Write the certificate, and ``with_files`` (name: text; the card), all or none of them
    (see :func:`write_atomically`), replacing any other certificate in ``directory`` (a
    re-validation under another variant name) and any signature but the one ``certificate``
    records (a signature of the certificate replaced signs nothing here)."""
    root = Path(directory)
    path = root / certificate.file_name
    files = {path: compact_json(certificate.to_dict()) + "\n"}
    files.update((root / name, text) for name, text in (with_files or {}).items())
    write_atomically(files)
    for stale in certificate_files(root):
        if stale != path.name:
            (root / stale).unlink()
    signature = (certificate.signature or {}).get("file")
    for entry in root.iterdir():
        if SIGNATURE_FILE.fullmatch(entry.name) and entry.name != signature:
            entry.unlink()
    return path


#: The longest object written on one line (when it holds only plain values and lists of them).
ONE_LINE = 240


def compact_json(value: Any, indent: int = 0) -> str:
    """``value`` as indented JSON whose lists of plain values (a metric row, a probe's token
    ids, a shape) and short objects of them (a tensor's shape, dtype and digest) stay on one
    line: ``json.dumps(indent=2)`` gives every number a line of its own, and a sweep of
    hundreds of probes repeats such records hundreds of times."""
    if _flat(value):
        text = json.dumps(value)
        if not isinstance(value, Mapping) or len(text) <= ONE_LINE:
            return text
    pad = " " * (indent + 2)
    if isinstance(value, Mapping):
        items = (f"{pad}{json.dumps(k)}: {compact_json(v, indent + 2)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = (f"{pad}{compact_json(v, indent + 2)}" for v in value)
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _flat(value: Any) -> bool:
    """Whether ``value`` is a plain value, or a list or object of plain values and lists of
    them (nothing nested deeper): what :func:`compact_json` may write on one line."""
    if isinstance(value, Mapping):
        return all(_plain_or_list(v) for v in value.values())
    return _plain_or_list(value)


def _plain_or_list(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return not any(isinstance(v, Mapping | list | tuple) and v for v in value)
    return not isinstance(value, Mapping) or not value


def write_atomically(files: Mapping[Path, str]) -> None:
    """Write every file whole, or none of them: each through a hidden temporary file (hidden,
    so a run killed mid-write leaves nothing a hash check would count as an extra file), all
    written before any is moved into place, so a full disk leaves the files that were there
    (never a new certificate beside an old card).

    Raises:
        FileSystemError: the file system refused a write, naming the file.
    """
    temporary: dict[Path, Path] = {}
    path = next(iter(files), Path())
    try:
        for path, text in files.items():
            temporary[path] = path.parent / f".{path.name}.tmp"
            temporary[path].write_text(text, encoding="utf-8")
    except OSError as exc:
        for tmp in temporary.values():
            with contextlib.suppress(OSError):  # a folder made read-only keeps it: hidden
                tmp.unlink(missing_ok=True)
        raise FileSystemError(exc).at(path) from None  # the file, not its hidden temporary
    for path, tmp in temporary.items():
        os.replace(tmp, path)
