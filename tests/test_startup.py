"""A command starts at little more than the cost of importing torch: once the norm cache holds a
dense model's skeleton, ``model --no-validate`` imports neither transformers nor its loading
machinery (``transformers.conversion_mapping``, ``torch.distributed.tensor``: seconds at every
start).

A checkpoint stored under names transformers renames on load (Mixtral's per-expert weights)
still asks transformers' rules, so its fused experts stay islands whole (test_moe_experts.py).
``bench/startup.py`` measures the time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import _moe
import pytest
from _corrupt import cli_env

from precision_convert.conversion.analysis import norm_cache
from precision_convert.conversion.analysis.norms import skeleton_norms
from precision_convert.conversion.io.source import ModelSource, open_source

#: The loading machinery a conversion of stored-as-run names has no use for.
LOADING = ("transformers.conversion_mapping", "torch.distributed.tensor")
#: The command's entry point, run as the console script runs it; the modules imported by its
#: end go to the file named by the first argument.
_COMMAND = """
import json, sys
modules_file, sys.argv = sys.argv[1], ["precision-convert", *sys.argv[2:]]
from precision_convert.cli.main import run
try:
    run()
finally:
    with open(modules_file, "w") as file:
        json.dump(sorted(sys.modules), file)
"""


def _modules_of_a_cached_conversion(
    model: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> set[str]:
    """The modules a ``--no-validate`` conversion of ``model`` imports, its skeleton cached."""
    monkeypatch.setenv(norm_cache.CACHE_VARIABLE, str(cache))
    source = open_source(model)
    assert isinstance(source, ModelSource)
    assert skeleton_norms(source) is not None  # builds and stores, as a first run does
    modules_file = tmp_path / "modules.json"
    command = ["model", str(model), "--to", "bf16-safe", "--no-validate"]
    done = subprocess.run(
        [sys.executable, "-c", _COMMAND, str(modules_file), *command, "-o", str(tmp_path / "out")],
        env={**cli_env(), norm_cache.CACHE_VARIABLE: str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    return set(json.loads(modules_file.read_text()))


def test_a_dense_model_converts_without_the_loading_machinery(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules = _modules_of_a_cached_conversion(
        tiny_model("llama"), tmp_path / "cache", tmp_path, monkeypatch
    )
    assert "precision_convert.conversion.analysis.runtime_names" in modules  # it was asked
    assert not [m for m in LOADING if m in modules]
    # Nor transformers at all: the cache answers for the skeleton, and the command's
    # HF_HUB_DISABLE_PROGRESS_BARS holds transformers' bars off without switching them.
    assert "transformers" not in modules


def test_stored_expert_names_still_ask_transformers_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers.conversion_mapping", reason="transformers 4.x renames none")
    mixtral = _moe.mixtral(tmp_path / "mixtral")
    modules = _modules_of_a_cached_conversion(mixtral, tmp_path / "cache", tmp_path, monkeypatch)
    assert "transformers.conversion_mapping" in modules
