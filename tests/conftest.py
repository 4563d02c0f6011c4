"""Shared fixtures: tiny real models, built once per session."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import _models
import pytest

# Tests never reach a Hub; make any accidental attempt fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The skeleton-analysis cache lives in a fresh directory per run: tests never read entries left
# by earlier runs (or other code versions) and never write into the user's home.
os.environ.setdefault("PRECISION_CONVERT_CACHE", tempfile.mkdtemp(prefix="pc-test-cache-"))


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


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory: where the default ``./<source>-<target>`` would land."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work
