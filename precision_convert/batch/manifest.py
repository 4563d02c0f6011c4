"""The batch manifest (TOML): read it, check all of it, and expand it into jobs.

Every check runs before anything else does, so a manifest with a typo never converts half a
model family: every problem found is raised together as one :class:`ManifestError`, a line
each, naming ``manifest.toml:LINE`` and the entry at fault (tomllib reports no line numbers for
values, so :class:`_Lines` finds them in the text), with the likely intended word when a key,
target or table is misspelled (``calbrate``: did you mean ``calibrate``?). What can only be
known by trying (a Hub id that does not exist, a checkpoint that does not load) is left to the
job, where it fails alone.

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

from precision_convert.api.options import OPTION_NAMES, ConversionOptions
from precision_convert.conversion.io.staging import overlap
from precision_convert.core._version import __version__
from precision_convert.core.dtypes import Target
from precision_convert.core.errors import InputError, did_you_mean, home_expanded, printable
from precision_convert.core.patterns import HUB_ID, REPO_ID
from precision_convert.recipes import TARGETS

#: ``[[model]]`` keys that only an entry can have.
ENTRY_KEYS = frozenset({"source", "name"})
#: Options of ``precision-convert model`` that an entry or ``[defaults]`` may set: the
#: targets, every conversion option, and where to push.
OPTION_KEYS = frozenset(
    {
        "to",
        *OPTION_NAMES,
        "push",
        "create_pr",
        "private",
    }
)
_BOOL_KEYS = frozenset(
    {"calibrate", "trust_remote_code", "allow_nonfinite_source", "create_pr", "private"}
)
_LIST_KEYS = frozenset({"to", "keep_fp32", "allow_unexercised"})  # a string or a list of strings
_PATH_KEYS = frozenset({"calibration_data", "inputs"})
#: ``push = "pr"``: a variant pull request into the source repo.
PUSH_PR = "pr"
_DEVICES = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class ManifestError(InputError):
    """A manifest with problems: ``problems`` holds one line per problem
    (``manifest.toml:LINE: [[model]] #N: what is wrong``), all of them, in the text's order."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


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
    options: ConversionOptions  # paths made absolute; device None: the validation slot's
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
    """Checks one manifest, collecting every problem: :meth:`note` records one and the check
    goes on; :meth:`fail` records one and returns the error naming all so far (for a problem
    after which nothing more can be checked); :meth:`done` raises them, if any."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.base = path.parent
        self.lines = _Lines(text)
        self.problems: list[tuple[int, str]] = []  # (line, text)
        self.dropped: set[str] = set()  # keys whose value was refused (noted already)

    def note(self, message: str, table: str, index: int = 0, key: str | None = None) -> None:
        where = "[defaults]" if table == "defaults" else f"[[model]] #{index + 1}"
        self.at(self.lines.of(table, index, key), f"{where}: {message}")

    def at(self, line: int, message: str) -> None:
        # One line per problem: a control character in a value the user wrote is escaped.
        problem = (line, printable(f"{self.path}:{line}: {message}"))
        if problem not in self.problems:  # an entry's targets share its problems
            self.problems.append(problem)

    def fail(self, message: str, table: str, index: int = 0, key: str | None = None) -> InputError:
        self.note(message, table, index, key)
        return self.error()

    def error(self) -> ManifestError:
        return ManifestError([text for _, text in sorted(self.problems, key=lambda p: p[0])])

    def done(self) -> None:
        if self.problems:
            raise self.error()

    def options(self, raw: Mapping[str, Any], table: str, index: int) -> dict[str, Any]:
        """The typed option values of one table (unknown keys refused)."""
        allowed = OPTION_KEYS | (ENTRY_KEYS if table == "model" else {"output_dir"})
        values: dict[str, Any] = {}
        for key, value in raw.items():
            problem = None
            if key not in allowed:
                known = ", ".join(sorted(allowed))
                problem = f"unknown key {key!r}{did_you_mean(key, allowed)} (known: {known})"
            elif key in _BOOL_KEYS:
                if not isinstance(value, bool):
                    problem = f"{key} must be true or false"
            elif key in _LIST_KEYS:
                value = [value] if isinstance(value, str) else value
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    problem = f"{key} must be a string or a list of strings"
                else:
                    value = tuple(value)
            elif key == "push" and value is False:
                value = None
            elif not isinstance(value, str):
                problem = f"{key} must be a string"
            if problem is None:
                values[key] = value
            else:
                self.dropped.add(key)
                self.note(problem, table, index, key)
        return values

    def check_option_values(self, values: Mapping[str, Any], table: str, index: int) -> None:
        """Targets, coverage, recipe, variant, device and files: checked as ``model`` would."""
        for target in values.get("to", ()):
            if target not in TARGETS:
                choose = f"choose one of {', '.join(TARGETS)}"
                self.note(
                    f"unknown target {target!r}{did_you_mean(target, TARGETS)}; {choose}",
                    table,
                    index,
                    "to",
                )
        for key in sorted(_PATH_KEYS & values.keys()):
            if not Path(values[key]).is_file():
                self.note(f"{key}: no such file {values[key]}", table, index, key)
        device = values.get("device")
        if device is not None and not _DEVICES.match(device):
            self.note(f"device {device!r}: use auto, cpu, cuda or cuda:N", table, index, "device")
        if values.get("budget") is not None:
            from precision_convert.api.conversion import budget_seconds

            try:
                budget_seconds(values["budget"])
            except InputError as exc:
                self.note(str(exc), table, index, "budget")
        try:
            self._library_checks(values)
        except InputError as exc:
            at = next((k for k in ("recipe", "variant", "calibration_data") if k in values), None)
            self.note(str(exc), table, index, at or "coverage")

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
            values[key] = str(self.local(values[key]).absolute())
        recipe = values.get("recipe")
        if recipe is not None and (recipe.endswith(".toml") or self.local(recipe).exists()):
            values["recipe"] = str(self.local(recipe).absolute())
        return values

    def local(self, raw: str) -> Path:
        """A path the manifest names: ``~`` expanded (TOML strings reach no shell, and a folder
        literally named ``~`` is never meant), then relative to the manifest's folder."""
        try:
            return self.base / home_expanded(raw)
        except InputError as exc:  # named in the manifest, like its other problems
            raise InputError(str(exc), self.path) from None

    def source(self, raw: Any, index: int) -> tuple[str, bool] | None:
        """(an absolute directory or a Hub id, whether it is a Hub id); None: a problem."""
        problem = None
        if not isinstance(raw, str) or not raw.strip():
            problem = "source must be a directory or a Hub repo id"
        else:
            local = self.local(raw)
            if local.exists() or raw.startswith((".", "/", "~")):
                if local.is_dir():
                    return str(local.resolve()), False
                problem = f"source {raw!r}: no such directory"
            elif HUB_ID.fullmatch(raw):
                return raw, True
            else:
                problem = f"source {raw!r} is neither a directory nor a Hub repo id"
        self.note(problem, "model", index, "source")
        return None


def read_manifest(path: str | Path) -> Manifest:
    """Read and check a manifest; every job it describes, in order.

    Raises:
        InputError: the manifest cannot be read, or is not TOML.
        ManifestError: every problem found, a line each:
            ``<manifest>:<line>: <entry>: <what is wrong>``.
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
            hint = did_you_mean(key, ("defaults", "model"))
            reader.at(
                line,
                f"unknown table or key {key!r}{hint} (a manifest has [defaults] and [[model]] "
                "entries)",
            )
    raw_defaults = data.get("defaults", {})
    entries = data.get("model", [])
    if not isinstance(raw_defaults, dict) or not isinstance(entries, list) or not entries:
        reader.at(1, "a manifest needs [defaults] and at least one [[model]] entry")
        raise reader.error()
    defaults = reader.absolute(reader.options(raw_defaults, "defaults", 0))
    reader.check_option_values(defaults, "defaults", 0)
    output_dir = reader.local(defaults.pop("output_dir", "converted"))
    jobs: list[Job] = []
    for index, entry in enumerate(entries):
        jobs += _jobs(reader, defaults, entry, index, output_dir.absolute(), len(jobs))
    _check_unique(reader, jobs)
    _check_apart(reader, output_dir, jobs)
    reader.done()
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
        if "source" not in entry:  # a source of the wrong type is noted already
            reader.note("source is missing", "model", index)
        return []
    found = reader.source(own.pop("source"), index)
    if found is None:
        return []
    source, on_hub = found
    name = own.pop("name", None) or Path(source.rstrip("/")).name
    if "/" in name or "\\" in name or ".." in name or name.startswith("."):
        reader.note(
            f"name {name!r} must be a plain folder name (no '/', no '..', not hidden)",
            "model",
            index,
            "name" if "name" in entry else "source",
        )
        return []
    values = {**defaults, **own}
    targets = values.pop("to", ())
    if not targets:
        if "to" not in reader.dropped:  # else its own problem says why
            reader.note("no target: set to = [...] here or in [defaults]", "model", index)
        return []
    if values.get("revision") is not None and not on_hub:
        reader.note("revision applies to Hub repo ids only", "model", index, "revision")
    push_value = values.pop("push", None)
    create_pr = values.pop("create_pr", False)
    private = values.pop("private", None)
    options = ConversionOptions(**values)
    jobs: list[Job] = []
    for target in dict.fromkeys(targets):
        push = None
        if push_value is not None:
            repo_id = _push(reader, push_value, index, name, target, source, on_hub, options)
            variant_pr = push_value == PUSH_PR
            if repo_id is not None:
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
    options: ConversionOptions,
) -> str | None:
    """The repo id a job pushes to: the pattern filled in, or the source repo for ``"pr"``;
    None when it cannot be (the problem is noted)."""
    if pattern == PUSH_PR:
        if not on_hub:
            problem = (
                'push = "pr" opens a pull request on the source repo: the source must be a Hub '
                "repo id, not a local directory"
            )
        elif options.variant is None:
            known = Target.lookup(target)
            usual = f' (e.g. variant = "{known.row.variant}")' if known is not None else ""
            problem = f'push = "pr" needs a variant{usual}: the PR adds variant files'
        else:
            return source
        reader.note(problem, "model", index, "push")
        return None
    try:
        repo_id = pattern.format(name=name, target=target, variant=options.variant or "")
    except (KeyError, IndexError, ValueError) as exc:
        usage = "use {name}, {target}, {variant}"
        reader.note(f"push pattern {pattern!r}: {exc} ({usage})", "model", index, "push")
        return None
    if not REPO_ID.fullmatch(repo_id):
        reader.note(f"push: {repo_id!r} is not a Hub repo id", "model", index, "push")
        return None
    return repo_id


def _check_apart(reader: _Reader, output_dir: Path, jobs: list[Job]) -> None:
    """``output_dir`` (the outputs, the report, the resume state) never overlaps a local
    source, links resolved."""
    for job in jobs:
        local = Path(job.source).is_absolute()  # else a Hub id
        problem = overlap(output_dir, job.source, "output_dir") if local else None
        if problem is not None:
            reader.note(problem, "defaults", 0, "output_dir")


def _check_unique(reader: _Reader, jobs: list[Job]) -> None:
    """No two jobs write one folder, push one repo, or add one variant to one source."""
    seen: dict[tuple[str, ...], Job] = {}
    for job in jobs:
        keys: list[tuple[str, ...]] = [("output", job.key)]
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
            reader.note(
                f"{what} is also used by [[model]] #{other.entry + 1} (line {other.line}); "
                "give one entry another name or target",
                "model",
                job.entry,
            )
