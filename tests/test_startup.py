"""A command starts at little more than the cost of importing torch: once the norm cache holds a
dense model's skeleton, ``model --no-validate`` imports neither transformers nor its loading
machinery (``transformers.conversion_mapping``, ``torch.distributed.tensor``: seconds at every
start), nor the Hub's HTTP client (httpx2) for a local source; and the garbage collector does
not walk torch's import heap again at each full collection and at exit (it is frozen).

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
from typing import Any

import _moe
import pytest
from _corrupt import assert_one_error_line, cli_env

from precision_convert.conversion.analysis import norm_cache
from precision_convert.conversion.analysis.norms import skeleton_norms
from precision_convert.conversion.io.source import ModelSource, open_source

#: The loading machinery a conversion of stored-as-run names has no use for.
LOADING = ("transformers.conversion_mapping", "torch.distributed.tensor")
#: The Hub's HTTP client: a run whose source and output are local has no use for it.
HTTP_CLIENT = ("httpx2", "httpx", "huggingface_hub.utils._http")
#: The command's entry point, run as the console script runs it; the modules imported by its
#: end, and the objects the garbage collector holds frozen and still walks, go to the file
#: named by the first argument.
_COMMAND = """
import gc, json, sys
state_file, sys.argv = sys.argv[1], ["precision-convert", *sys.argv[2:]]
from precision_convert.cli.main import run
try:
    run()
finally:
    with open(state_file, "w") as file:
        state = {"frozen": gc.get_freeze_count(), "walked": len(gc.get_objects())}
        json.dump({**state, "modules": sorted(sys.modules)}, file)
"""


def _modules_of_a_cached_conversion(
    model: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> set[str]:
    """The modules a ``--no-validate`` conversion of ``model`` imports, its skeleton cached."""
    return set(_cached_conversion(model, cache, tmp_path, monkeypatch)["modules"])


def _cached_conversion(
    model: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """What a ``--no-validate`` conversion of ``model``, its skeleton cached, left at its end:
    ``modules`` (imported), ``frozen`` and ``walked`` (the garbage collector's objects)."""
    monkeypatch.setenv(norm_cache.CACHE_VARIABLE, str(cache))
    source = open_source(model)
    assert isinstance(source, ModelSource)
    assert skeleton_norms(source) is not None  # builds and stores, as a first run does
    state_file = tmp_path / "state.json"
    command = ["model", str(model), "--to", "bf16-safe", "--no-validate"]
    done = subprocess.run(
        [sys.executable, "-c", _COMMAND, str(state_file), *command, "-o", str(tmp_path / "out")],
        env={**cli_env(), norm_cache.CACHE_VARIABLE: str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    state: dict[str, Any] = json.loads(state_file.read_text())
    return state


#: Bad input a command can tell without torch: the arguments, what it says, in one line.
CHEAP_REFUSALS = (
    (["validate", "missing", "--verify"], "missing: no such directory: validate takes a "),
    (["validate", "missing", "--baseline", "gpt2"], "missing: no such directory"),
    (["push", "missing", "ns/name"], "missing: no such directory: expected a converted model"),
    (["model", "./missing", "--to", "fp16-safe"], "missing: no such directory"),
    (["model", ".", "--to", "fp17"], "unknown target 'fp17' (did you mean 'fp16'?)"),
    (["inspect", "a-file"], "a-file: not a directory: a source is a model directory"),
)


@pytest.mark.parametrize(
    ("args", "says"), CHEAP_REFUSALS, ids=[" ".join(a) for a, _ in CHEAP_REFUSALS]
)
def test_bad_input_is_refused_before_the_heavy_imports(
    args: list[str], says: str, tmp_path: Path
) -> None:
    """A missing folder, a file given for one or an unknown target is said in one line, exit
    2, before torch (and so transformers) is imported: at once, not after seconds of imports."""
    (tmp_path / "a-file").write_text("not a model")
    state_file = tmp_path / "state.json"
    done = subprocess.run(
        [sys.executable, "-c", _COMMAND, str(state_file), *args],
        env=cli_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert_one_error_line(done.stderr, says)
    assert "torch" not in json.loads(state_file.read_text())["modules"]


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
    # Nor the Hub's HTTP client: the command's bounds for it wait for its import.
    assert "precision_convert.core.hub_client" in modules
    assert not [m for m in HTTP_CLIENT if m in modules]


def test_torch_heap_is_frozen_once_imported(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The objects torch's import leaves live as long as the process: the command freezes
    them, so no full collection (nor the one at exit) walks them again."""
    state = _cached_conversion(tiny_model("llama"), tmp_path / "cache", tmp_path, monkeypatch)
    assert "torch" in state["modules"]
    assert state["frozen"] > 10 * state["walked"], state


def test_hub_bounds_are_set_when_the_hub_client_is_first_imported() -> None:
    """The command's Hub client bounds (timeout, paced retries) are installed at the import of
    huggingface_hub's HTTP module, not by importing it at start; the module keeps its own
    loader."""
    pytest.importorskip("httpx2", reason="another huggingface_hub generation: no bounds")
    check = """
import sys
from precision_convert.core.hub_client import bound_hub_requests, pace
bound_hub_requests()
assert "huggingface_hub.utils._http" not in sys.modules
assert "httpx2" not in sys.modules
from importlib.machinery import SourceFileLoader
from huggingface_hub.utils import _http
assert isinstance(_http.__loader__, SourceFileLoader), _http.__loader__
assert _http.__spec__.loader is _http.__loader__
client = _http.get_session()
assert pace in client.event_hooks["response"], client.event_hooks
request = client.build_request("GET", "http://127.0.0.1:9/")
for hook in client.event_hooks["request"]:
    hook(request)
assert request.extensions["timeout"]["read"] == 7.0, request.extensions
"""
    done = subprocess.run(
        [sys.executable, "-c", check],
        # Online only so that huggingface_hub's own request hook lets the request be built:
        # nothing is sent.
        env={**cli_env(), "PRECISION_CONVERT_HUB_TIMEOUT": "7", "HF_HUB_OFFLINE": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_stored_expert_names_still_ask_transformers_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers.conversion_mapping", reason="transformers 4.x renames none")
    mixtral = _moe.mixtral(tmp_path / "mixtral")
    modules = _modules_of_a_cached_conversion(mixtral, tmp_path / "cache", tmp_path, monkeypatch)
    assert "transformers.conversion_mapping" in modules
