"""The batch manifest (TOML): read it, check all of it, and expand it into jobs.

Every check runs before anything else does, so a manifest with a typo never converts half a
model family: the first problem is raised as one :class:`~precision_convert.errors.InputError`
that names ``manifest.toml:LINE`` and the entry at fault (tomllib reports no line numbers for
values, so :class:`_Lines` finds them in the text). What can only be known by trying (a Hub id
that does not exist, a checkpoint that does not load) is left to the job, where it fails alone.

Relative paths (local sources, ``output_dir``, ``calibration_data``, ``inputs``, recipe files)
are read relative to the manifest's folder, so a manifest means the same from any directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from precision_convert._version import __version__
from precision_convert.conversion.io.staging import overlap
from precision_convert.errors import InputError
from precision_convert.recipes import TARGETS

#: ``[[model]]`` keys that only an entry can have.
ENTRY_KEYS = frozenset({"source", "name"})
#: Options of ``precision-convert model`` that an entry or ``[defaults]`` may set.
OPTION_KEYS = frozenset(
    {
        "to",
        "revision",
        "recipe",
        "keep_fp32",
        "calibrate",
        "calibration_data",
        "inputs",
        "coverage",
        "device",
        "trust_remote_code",
        "variant",
        "push",
        "create_pr",
        "private",
    }
)
_BOOL_KEYS = frozenset({"calibrate", "trust_remote_code", "create_pr", "private"})
_LIST_KEYS = frozenset({"to", "keep_fp32"})  # a string or a list of strings
_PATH_KEYS = frozenset({"calibration_data", "inputs"})
#: ``push = "pr"``: a variant pull request into the source repo.
PUSH_PR = "pr"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DEVICES = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class Options:
    """What ``convert`` and ``validate`` are given for one job (paths made absolute)."""

    revision: str | None = None
    recipe: str | None = None
    keep_fp32: tuple[str, ...] = ()
    calibrate: bool | None = None
    calibration_data: str | None = None
    inputs: str | None = None
    coverage: str | None = None
    device: str | None = None  # None: the validation slot's device (CUDA when present)
    trust_remote_code: bool = False
    variant: str | None = None


@dataclass(frozen=True)
class PushSpec:
    """Where a certified output goes: a repo of its own, or a variant PR into the source."""

    repo_id: str
    create_pr: bool
    private: bool | None
    variant_pr: bool


@dataclass(frozen=True)
class Job:
    """One (model, target) pair: download → convert → validate → push."""

    index: int  # position in the manifest's expansion: the report's order
    entry: int  # which ``[[model]]`` (from 0)
    name: str
    target: str
    source: str  # an absolute local directory or a Hub repo id
    output: Path
    options: Options
    push: PushSpec | None
    line: int  # the ``[[model]]`` line it comes from

    @property
    def key(self) -> str:
        """``<name>-<target>``: the output folder's name, unique within a manifest."""
        return self.output.name

    @property
    def digest(self) -> str:
        """What the output depends on: a resumed run reuses an output only with the same."""
        payload = {
            "source": self.source,
            "target": self.target,
            "options": asdict(self.options),
            "version": __version__,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    path: Path
    output_dir: Path
    jobs: tuple[Job, ...]


class _Lines:
    """Line numbers of tables and keys in the manifest text, for messages.

    ``tables[("model", 2)]`` is the line of the third ``[[model]]``; ``keys[("model", 2,
    "to")]`` the line of its ``to =``. Good enough for a hand-written manifest; a key it cannot
    place points at its table.
    """

    _ARRAY = re.compile(r"^\s*\[\[\s*([\w.-]+)\s*\]\]")
    _TABLE = re.compile(r"^\s*\[\s*([\w.-]+)\s*\]")
    _KEY = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")

    def __init__(self, text: str) -> None:
        self.tables: dict[tuple[str, int], int] = {}
        self.keys: dict[tuple[str, int, str], int] = {}
        counts: dict[str, int] = {}
        current = ("", 0)
        for number, line in enumerate(text.splitlines(), 1):
            if match := self._ARRAY.match(line):
                name = match[1]
                current = (name, counts.get(name, 0))
                counts[name] = current[1] + 1
                self.tables[current] = number
            elif match := self._TABLE.match(line):
                current = (match[1], 0)
                self.tables[current] = number
            elif match := self._KEY.match(line):
                self.keys.setdefault((*current, match[1]), number)

    def of(self, table: str, index: int, key: str | None = None) -> int:
        found = self.keys.get((table, index, key)) if key is not None else None
        return found or self.tables.get((table, index), 1)


class _Reader:
    """Checks one manifest; :meth:`fail` raises the error naming the line at fault."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.base = path.parent
        self.lines = _Lines(text)

    def fail(self, message: str, table: str, index: int = 0, key: str | None = None) -> InputError:
        where = "[defaults]" if table == "defaults" else f"[[model]] #{index + 1}"
        line = self.lines.of(table, index, key)
        return InputError(f"{where}: {message}", f"{self.path}:{line}")

    def options(self, raw: Mapping[str, Any], table: str, index: int) -> dict[str, Any]:
        """The typed option values of one table (unknown keys refused)."""
        allowed = OPTION_KEYS | (ENTRY_KEYS if table == "model" else {"output_dir"})
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in allowed:
                known = ", ".join(sorted(allowed))
                raise self.fail(f"unknown key {key!r} (known: {known})", table, index, key)
            if key in _BOOL_KEYS:
                if not isinstance(value, bool):
                    raise self.fail(f"{key} must be true or false", table, index, key)
            elif key in _LIST_KEYS:
                value = [value] if isinstance(value, str) else value
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise self.fail(
                        f"{key} must be a string or a list of strings", table, index, key
                    )
                value = tuple(value)
            elif key == "push" and value is False:
                value = None
            elif not isinstance(value, str):
                raise self.fail(f"{key} must be a string", table, index, key)
            values[key] = value
        return values

    def check_option_values(self, values: Mapping[str, Any], table: str, index: int) -> None:
        """Targets, coverage, recipe, variant, device and files: checked as ``model`` would."""
        for target in values.get("to", ()):
            if target not in TARGETS:
                raise self.fail(
                    f"unknown target {target!r}; choose one of {', '.join(TARGETS)}",
                    table,
                    index,
                    "to",
                )
        for key in _PATH_KEYS & values.keys():
            if not Path(values[key]).is_file():
                raise self.fail(f"{key}: no such file {values[key]}", table, index, key)
        device = values.get("device")
        if device is not None and not _DEVICES.match(device):
            raise self.fail(f"device {device!r}: use auto, cpu, cuda or cuda:N", table, index)
        try:
            self._library_checks(values)
        except InputError as exc:
            key = next((k for k in ("recipe", "variant", "calibration_data") if k in values), None)
            raise self.fail(str(exc), table, index, key or "coverage") from None

    @staticmethod
    def _library_checks(values: Mapping[str, Any]) -> None:
        from precision_convert.api.conversion import check_variant, read_user_data

        if values.get("recipe"):
            from precision_convert.recipes import get as get_recipe

            get_recipe(values["recipe"])
        check_variant(values.get("variant"))
        if values.get("coverage") is not None or values.get("calibration_data") is not None:
            read_user_data(values.get("calibration_data"), values.get("coverage"))

    def absolute(self, values: dict[str, Any]) -> dict[str, Any]:
        """Paths relative to the manifest's folder; a recipe that is a file, too."""
        for key in _PATH_KEYS & values.keys():
            values[key] = str((self.base / Path(values[key]).expanduser()).absolute())
        recipe = values.get("recipe")
        if recipe is not None and (recipe.endswith(".toml") or (self.base / recipe).exists()):
            values["recipe"] = str((self.base / Path(recipe).expanduser()).absolute())
        return values

    def source(self, raw: Any, index: int) -> tuple[str, bool]:
        """(an absolute directory or a Hub id, whether it is a Hub id)."""
        if not isinstance(raw, str) or not raw.strip():
            raise self.fail("source must be a directory or a Hub repo id", "model", index, "source")
        local = self.base / Path(raw).expanduser()
        if local.exists() or raw.startswith((".", "/", "~")):
            if not local.is_dir():
                raise self.fail(f"source {raw!r}: no such directory", "model", index, "source")
            return str(local.resolve()), False
        if not _HUB_ID.match(raw):
            raise self.fail(
                f"source {raw!r} is neither a directory nor a Hub repo id", "model", index, "source"
            )
        return raw, True


def read_manifest(path: str | Path) -> Manifest:
    """Read and check a manifest; every job it describes, in order.

    Raises:
        InputError: the first problem, as ``<manifest>:<line>: <entry>: <what is wrong>``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read the manifest ({exc.strerror or exc})", path) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"not valid TOML: {exc}", path) from None
    except RecursionError:  # tomllib recurses per nesting level
        raise InputError("not valid TOML: values nested too deeply", path) from None
    reader = _Reader(path, text)
    for key in data:
        if key not in ("defaults", "model"):
            line = reader.lines.keys.get(("", 0, key)) or reader.lines.of(key, 0)
            raise InputError(
                f"unknown table or key {key!r} (a manifest has [defaults] and [[model]] entries)",
                f"{path}:{line}",
            )
    raw_defaults = data.get("defaults", {})
    entries = data.get("model", [])
    if not isinstance(raw_defaults, dict) or not isinstance(entries, list) or not entries:
        raise InputError("a manifest needs [defaults] and at least one [[model]] entry", path)
    defaults = reader.absolute(reader.options(raw_defaults, "defaults", 0))
    reader.check_option_values(defaults, "defaults", 0)
    output_dir = reader.base / Path(defaults.pop("output_dir", "converted")).expanduser()
    jobs: list[Job] = []
    for index, entry in enumerate(entries):
        jobs += _jobs(reader, defaults, entry, index, output_dir.absolute(), len(jobs))
    _check_unique(reader, jobs)
    _check_apart(reader, output_dir, jobs)
    return Manifest(path.absolute(), output_dir.absolute(), tuple(jobs))


def _jobs(
    reader: _Reader,
    defaults: Mapping[str, Any],
    entry: Mapping[str, Any],
    index: int,
    output_dir: Path,
    first: int,
) -> list[Job]:
    own = reader.absolute(reader.options(entry, "model", index))
    reader.check_option_values(own, "model", index)
    if "source" not in own:
        raise reader.fail("source is missing", "model", index)
    source, on_hub = reader.source(own.pop("source"), index)
    name = own.pop("name", None) or Path(source.rstrip("/")).name
    if "/" in name or "\\" in name or ".." in name or name.startswith("."):
        raise reader.fail(
            f"name {name!r} must be a plain folder name (no '/', no '..', not hidden)",
            "model",
            index,
            "name" if "name" in entry else "source",
        )
    values = {**defaults, **own}
    targets = values.pop("to", ())
    if not targets:
        raise reader.fail("no target: set to = [...] here or in [defaults]", "model", index)
    if values.get("revision") is not None and not on_hub:
        raise reader.fail("revision applies to Hub repo ids only", "model", index, "revision")
    push_value = values.pop("push", None)
    create_pr = values.pop("create_pr", False)
    private = values.pop("private", None)
    options = Options(**values)
    jobs = []
    for target in dict.fromkeys(targets):
        push = None
        if push_value is not None:
            repo_id = _push(reader, push_value, index, name, target, source, on_hub, options)
            variant_pr = push_value == PUSH_PR
            push = PushSpec(repo_id, create_pr or variant_pr, private, variant_pr)
        output = output_dir / f"{name}-{target}"
        line = reader.lines.of("model", index)
        jobs.append(
            Job(first + len(jobs), index, name, target, source, output, options, push, line)
        )
    return jobs


def _push(
    reader: _Reader,
    pattern: str,
    index: int,
    name: str,
    target: str,
    source: str,
    on_hub: bool,
    options: Options,
) -> str:
    """The repo id a job pushes to: the pattern filled in, or the source repo for ``"pr"``."""
    if pattern == PUSH_PR:
        if not on_hub:
            raise reader.fail(
                'push = "pr" opens a pull request on the source repo: the source must be a Hub '
                "repo id, not a local directory",
                "model",
                index,
                "push",
            )
        if options.variant is None:
            raise reader.fail(
                'push = "pr" needs a variant (e.g. variant = "bf16"): the PR adds variant files',
                "model",
                index,
                "push",
            )
        return source
    try:
        repo_id = pattern.format(name=name, target=target, variant=options.variant or "")
    except (KeyError, IndexError, ValueError) as exc:
        raise reader.fail(
            f"push pattern {pattern!r}: {exc} (use {{name}}, {{target}}, {{variant}})",
            "model",
            index,
            "push",
        ) from None
    if not _REPO_ID.match(repo_id):
        raise reader.fail(f"push: {repo_id!r} is not a Hub repo id", "model", index, "push")
    return repo_id


def _check_apart(reader: _Reader, output_dir: Path, jobs: list[Job]) -> None:
    """``output_dir`` (the outputs, the report, the resume state) never overlaps a local
    source, links resolved."""
    for job in jobs:
        local = Path(job.source).is_absolute()  # else a Hub id
        problem = overlap(output_dir, job.source, "output_dir") if local else None
        if problem is not None:
            raise reader.fail(problem, "defaults", 0, "output_dir")


def _check_unique(reader: _Reader, jobs: list[Job]) -> None:
    """No two jobs write one folder, push one repo, or add one variant to one source."""
    seen: dict[tuple[str, ...], Job] = {}
    for job in jobs:
        keys = [("output", job.key)]
        if job.push is not None and not job.push.variant_pr:
            keys.append(("repo", job.push.repo_id))
        if job.push is not None and job.push.variant_pr:
            keys.append(("variant", job.source, job.options.variant or ""))
        for key in keys:
            other = seen.setdefault(key, job)
            if other is job:
                continue
            what = {
                "output": f"output name {job.key!r}",
                "repo": f"push repo {key[-1]!r}",
                "variant": f"variant {job.options.variant!r} of {job.source}",
            }[key[0]]
            raise reader.fail(
                f"{what} is also used by [[model]] #{other.entry + 1} (line {other.line}); "
                "give one entry another name or target",
                "model",
                job.entry,
            )
