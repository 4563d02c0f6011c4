"""Shared fixtures: tiny real models, built once per session."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each xdist worker owns one core: torch's default of one thread per core would run two
    # workers' thread pools on the same cores and make both slower than one worker alone.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A worker is given COLUMNS=80 and LINES=24, which a terminal would set: the reports'
    # tests check the width of output written to no terminal, as the command runs in a pipe.
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)

import _models  # after the thread setting: it imports torch

# Tests never reach a Hub; make any accidental attempt fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The skeleton-analysis cache lives in a fresh directory per run: tests never read entries left
# by earlier runs (or other code versions) and never write into the user's home.
os.environ.setdefault("PRECISION_CONVERT_CACHE", tempfile.mkdtemp(prefix="pc-test-cache-"))


#: Files whose tests share most of ``zoo_converted``'s conversions: run on one xdist worker,
#: so that each conversion is made once (a session fixture is built once per worker).
SHARING_ZOO = frozenset({"test_zoo.py", "test_zoo_usage.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each file's tests go to one xdist worker (``--dist loadgroup``), those of
    :data:`SHARING_ZOO` to the same one. Tests marked ``slow`` (the zoo at standard coverage)
    run only when asked for with ``pytest -m slow``; tests/reliability decides for its own."""
    for item in items:
        group = "zoo" if item.path.name in SHARING_ZOO else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long: run with pytest -m slow")
    for item in items:
        if "slow" in item.keywords and "reliability" not in item.path.parts:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model("t5")`` → a saved tiny model directory (built on first use, then reused).

    Names: the keys of ``_models.ZOO``, ``"openclip"``, ``"sd-pipeline"`` and the real-config
    families of ``zoo.FAMILIES`` (e.g. ``"llama-3.2-1b"``).
    Treat the returned directory as read-only: other tests share it.
    """
    builders: dict[str, Callable[[Path], Path]] = {
        **_models.zoo.FAMILIES,
        "openclip": _models.open_clip_model,
        "sd-pipeline": _models.sd_pipeline,
    }
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            if name == "openclip":
                pytest.importorskip("open_clip", reason="open_clip_torch is not installed")
            build = builders.get(name) or (lambda path: _models.save(name, path))
            built[name] = build(root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def zoo_converted(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Any]:
    """``zoo_converted("gpt2", "fp16-safe")`` → the zoo family converted and certified at
    ``quick`` coverage (a ``ConversionResult``), once per session: the certificate tests and
    the tests of what users run after loading share one conversion."""
    from precision_convert.api.conversion import convert

    root = tmp_path_factory.mktemp("zoo-converted")
    done: dict[tuple[str, str], Any] = {}

    def get(name: str, target: str) -> Any:
        if (name, target) not in done:
            out = root / f"{name}-{target}"
            done[name, target] = convert(tiny_model(name), to=target, output=out, coverage="quick")
        return done[name, target]

    return get


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory: where the default ``./<source>-<target>`` would land."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work
