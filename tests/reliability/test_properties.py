"""Property tests (hypothesis) of two readers of untrusted text: the module-name matcher (its
patterns come from recipe files and ``--keep-fp32``) and the batch manifest parser.

The safetensors header reader has its own in ``tests/test_header_properties.py`` (round trips,
byte mutations, truncations, splices, structurally random headers); ``tests/test_names.py``
checks the matcher's meaning against a reference matcher. Here: the matcher's cost on hostile
patterns, and that any manifest either reads into jobs that stay inside the output folder or
is refused with an InputError naming the manifest, never another exception.
"""

from __future__ import annotations

import fnmatch
import json
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from precision_convert.batch.manifest import OPTION_KEYS, read_manifest
from precision_convert.core.errors import InputError
from precision_convert.core.names import matches
from precision_convert.recipes import TARGETS

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# -- the name matcher ----------------------------------------------------------------------

#: Pattern components over a small alphabet, so that stars have something to backtrack over.
glob_component = st.text(alphabet="ab*", min_size=1, max_size=40)
name_component = st.text(alphabet="ab", min_size=1, max_size=200)


@SETTINGS
@given(glob_component, name_component)
def test_a_component_glob_is_fnmatch_and_never_slow(pattern: str, name: str) -> None:
    """``*`` means what fnmatch means inside one component, and no pattern (however many
    stars) takes more than a few milliseconds: a backtracking regex would take exponential
    time on ``*a*a*a…*b``."""
    started = time.perf_counter()
    got = matches(pattern, name)
    assert time.perf_counter() - started < 0.05
    assert got == fnmatch.fnmatchcase(name, pattern)


def test_the_worst_case_pattern_is_instant() -> None:
    started = time.perf_counter()
    assert not matches("*a" * 40 + "*b", "a" * 500)
    assert not matches(".".join(["**"] * 30) + ".b", ".".join(["a"] * 200))
    assert time.perf_counter() - started < 0.5


# -- the manifest parser -------------------------------------------------------------------

#: Keys a hand-written manifest uses, plus some it must refuse.
KEYS = sorted(OPTION_KEYS | {"source", "name", "output_dir", "bogus", "to "})
#: Strings a manifest might hold: targets, paths, Hub ids, traversal, patterns, junk.
text_value = st.one_of(
    st.sampled_from(
        [
            *TARGETS,
            "./m",
            "m",
            "../m",
            "/etc",
            "ns/model",
            "a/b",
            "..",
            ".hidden",
            "a\\b",
            "ns/{name}-{target}",
            "{0}",
            "{name",
            "pr",
            "quick",
            "cpu",
            "fp16",
            "",
        ]
    ),
    st.text(max_size=12),
)
value = st.one_of(text_value, st.booleans(), st.integers(-2, 2), st.lists(text_value, max_size=3))
table = st.dictionaries(st.sampled_from(KEYS), value, max_size=5)


def _toml_value(item: Any) -> str:
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, list):
        return "[" + ", ".join(_toml_value(v) for v in item) + "]"
    if isinstance(item, int):
        return str(item)
    return json.dumps(item, ensure_ascii=False)  # TOML basic strings escape like JSON


def _toml(defaults: dict[str, Any] | None, models: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    if defaults is not None:
        lines.append("[defaults]")
        lines += [f'"{k}" = {_toml_value(v)}' for k, v in defaults.items()]
    for model in models:
        lines.append("[[model]]")
        lines += [f'"{k}" = {_toml_value(v)}' for k, v in model.items()]
    return "\n".join(lines) + "\n"


def _read(manifest: Path, text: str) -> Any:
    manifest.write_text(text, encoding="utf-8")
    try:
        return read_manifest(manifest)
    except InputError as exc:
        # One line per problem (a manifest's problems are reported all at once), each naming
        # the manifest.
        lines = str(exc).strip().splitlines()
        assert lines and all(str(manifest) in line for line in lines), exc
        return None


@SETTINGS
@given(st.one_of(st.none(), table), st.lists(table, max_size=3))
@example(None, [{"calibration_data": "~0"}])  # no user "0": expanduser raised RuntimeError
def test_any_manifest_reads_into_safe_jobs_or_is_refused(
    tmp_path_factory: Any, defaults: dict[str, Any] | None, models: list[dict[str, Any]]
) -> None:
    root = tmp_path_factory.mktemp("manifest")
    (root / "m").mkdir()
    manifest = root / "batch.toml"
    read = _read(manifest, _toml(defaults, models))
    if read is None:
        return
    keys = [job.key for job in read.jobs]
    assert len(keys) == len(set(keys))
    for job in read.jobs:
        assert job.output.parent == read.output_dir  # never outside, never nested
        assert job.target in TARGETS
        name = job.output.name
        assert "/" not in name and "\\" not in name and ".." not in name
        assert not name.startswith(".")
        if job.push is not None and not job.push.variant_pr:
            assert job.push.repo_id.count("/") == 1


@SETTINGS
@given(st.text(max_size=300))
def test_any_text_is_a_manifest_or_a_refusal(tmp_path_factory: Any, text: str) -> None:
    root = tmp_path_factory.mktemp("manifest")
    _read(root / "batch.toml", text)
