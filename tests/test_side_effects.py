"""Library calls leave no process-wide side effects, so conversions can share a process.

Two conversions run at once in two threads write exactly what they write one at a time; and
afterwards torch's thread count, matplotlib's backend, other libraries' loggers, the warning
filters and ``showwarning``, transformers' bar switch, the environment and huggingface_hub's
client factory are as they were, and no prefetch thread is left running, whether ``convert()``
returned or raised.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import matplotlib
import pytest
import torch

from precision_convert.api.conversion import convert
from precision_convert.conversion.io import context as context_module
from precision_convert.conversion.io import writer
from precision_convert.conversion.io.context import PREFETCH_THREAD, IOContext
from precision_convert.core.errors import InputError

#: (tiny model, target, calibrate): a calibrated fp16-safe T5 (it writes a chart too) and an
#: uncalibrated fp16-safe Llama (a range scan, no model run).
JOBS: list[tuple[str, str, bool]] = [
    ("t5-encoder", "fp16-safe", True),
    ("llama", "fp16-safe", False),
]
#: Loggers of the libraries a conversion drives.
LOGGERS = ("", "transformers", "diffusers", "huggingface_hub", "matplotlib", "torch")
#: A backend the library would never pick: if any code switches backends, it shows.
SENTINEL_BACKEND = "svg"


def _logger_state() -> dict[str, Any]:
    state = {}
    for name in LOGGERS:
        logger = logging.getLogger(name)
        state[name] = (
            list(logger.handlers),
            list(logger.filters),
            logger.level,
            logger.propagate,
            logger.disabled,
            [list(h.filters) for h in logger.handlers],
            [h.level for h in logger.handlers],
        )
    return state


def _hub_client_factory() -> object:
    try:
        from huggingface_hub.utils import _http
    except ImportError:
        return None
    return getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)


def _process_state() -> dict[str, Any]:
    from transformers.utils import logging as transformers_logging

    return {
        "warning_filters": list(warnings.filters),
        "showwarning": warnings.showwarning,
        "transformers_bars": transformers_logging.is_progress_bar_enabled(),
        "environment": dict(os.environ),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "matplotlib_backend": matplotlib.get_backend(),
        "loggers": _logger_state(),
        "hub_client_factory": _hub_client_factory(),
        "hub_progress_bars": os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"),
    }


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PREFETCH_THREAD)]


@pytest.fixture
def quiet_process() -> Iterator[None]:
    """The libraries imported and their loggers set up the way using them does, and a
    sentinel matplotlib backend (restored after). Tests take their "before" in their own body:
    pytest swaps its log-capture handlers on the root logger between setup and call."""
    # transformers and huggingface_hub give their loggers handlers on first use; diffusers
    # would on import, which these conversions never do (nor this fixture: it is slow).
    import huggingface_hub.utils.logging as hub_logging
    import transformers.utils.logging as transformers_logging

    transformers_logging.get_logger("transformers")
    hub_logging.get_logger("huggingface_hub")
    previous = matplotlib.get_backend()
    matplotlib.use(SENTINEL_BACKEND)
    # The bars on, as in a user's process: the stages turn them off and must hand them back.
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        yield
    finally:
        matplotlib.use(previous)
        if not bars:
            transformers_logging.disable_progress_bar()


def _outputs(directory: Path) -> dict[str, bytes]:
    """Weights and configs, byte for byte (the chart's PNG is only checked for presence)."""
    files = {p.relative_to(directory).as_posix(): p for p in directory.rglob("*") if p.is_file()}
    assert "precision_activations.png" in files or not any(name.endswith(".png") for name in files)
    return {n: p.read_bytes() for n, p in files.items() if n.endswith((".safetensors", ".json"))}


def _run(source: Path, target: str, calibrate: bool, out: Path) -> dict[str, bytes]:
    result = convert(source, to=target, output=out, validate=False, calibrate=calibrate)
    assert result.output == out
    return _outputs(out)


def test_concurrent_conversions_match_sequential_and_change_nothing_global(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    quiet_process: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sources = {name: tiny_model(name) for name, _, _ in JOBS}
    before = _process_state()
    assert before["matplotlib_backend"] == SENTINEL_BACKEND
    # Torch's thread count is process-wide: even a save-and-restore around a call would
    # change it under a concurrent conversion, so the library must never set it at all.
    set_threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_threads.append)

    sequential = [
        _run(sources[name], target, calibrate, tmp_path / f"seq-{i}")
        for i, (name, target, calibrate) in enumerate(JOBS)
    ]
    assert (tmp_path / "seq-0" / "precision_activations.png").is_file()  # a chart was drawn
    assert _process_state() == before
    assert _prefetch_threads() == []

    barrier = threading.Barrier(len(JOBS))
    concurrent: list[dict[str, bytes] | None] = [None] * len(JOBS)
    errors: list[BaseException] = []

    def job(i: int) -> None:
        name, target, calibrate = JOBS[i]
        try:
            barrier.wait(timeout=30)
            concurrent[i] = _run(sources[name], target, calibrate, tmp_path / f"par-{i}")
        except BaseException as exc:  # re-raised below, in the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(len(JOBS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]

    for i, expected in enumerate(sequential):
        got = concurrent[i]
        assert got is not None
        assert got.keys() == expected.keys(), JOBS[i]
        for name in expected:
            assert got[name] == expected[name], (JOBS[i], name)
    assert _process_state() == before
    assert _prefetch_threads() == []
    assert set_threads == []


@pytest.fixture
def endless_prefetch(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Prefetch threads that read until told to stop (a source far larger than memory would):
    only a stop *and* a join ends them. Returns an event set once one has started."""
    started = threading.Event()

    def prefetch(spans: object, budget: int, stop: threading.Event) -> None:
        started.set()
        stop.wait(60)

    monkeypatch.setattr(context_module, "_prefetch", prefetch)
    return started


def test_prefetch_is_stopped_and_joined_when_convert_returns(
    tiny_model: Callable[[str], Path], tmp_path: Path, endless_prefetch: threading.Event
) -> None:
    convert(tiny_model("llama"), to="bf16", output=tmp_path / "out", validate=False)
    assert endless_prefetch.is_set()
    assert _prefetch_threads() == []


def test_prefetch_is_stopped_and_joined_when_writing_fails(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    endless_prefetch: threading.Event,
    monkeypatch: pytest.MonkeyPatch,
    quiet_process: None,
) -> None:
    before = _process_state()

    def disk_full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer.os, "pwrite", disk_full)
    with pytest.raises(InputError, match="No space left"):
        convert(tiny_model("llama"), to="bf16", output=tmp_path / "out", validate=False)
    assert endless_prefetch.is_set()
    assert _prefetch_threads() == []
    assert not (tmp_path / "out").exists()
    assert _process_state() == before


def test_prefetch_is_stopped_and_joined_when_planning_fails(
    tiny_model: Callable[[str], Path], tmp_path: Path, endless_prefetch: threading.Event
) -> None:
    with pytest.raises(InputError):
        convert(
            tiny_model("llama"),
            to="bf16-safe",
            output=tmp_path / "out",
            validate=False,
            recipe="no-such-recipe",
        )
    assert endless_prefetch.is_set()
    assert _prefetch_threads() == []


def test_a_corrupt_shard_fails_with_no_thread_left(tmp_path: Path) -> None:
    """The real prefetch, on a source whose data ends early: the conversion fails, and no
    thread of it outlives the call."""
    from _corrupt import tiny_source

    source = tiny_source(tmp_path / "src")
    weights = source / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 8)  # the last tensor's data is cut short
    with pytest.raises(InputError):
        convert(source, to="bf16", output=tmp_path / "out", validate=False)
    assert _prefetch_threads() == []
    assert not (tmp_path / "out").exists()


def test_io_context_reuses_its_buffers_and_drops_them_on_close() -> None:
    with IOContext() as io:
        first = io.take_staging(2, 8192)
        io.give_back_staging(first)
        again = io.take_staging(2, 8192)
        assert [id(b) for b in again] == [id(b) for b in first]  # the same, already faulted in
        io.give_back_staging(again)
        other = io.take_staging(2, 4096)  # another size: new buffers
        assert not {id(b) for b in other} & {id(b) for b in first}
        io.give_back_staging(other)
    fresh = io.take_staging(2, 4096)  # closed: nothing was kept
    assert not {id(b) for b in fresh} & {id(b) for b in other}
    with pytest.raises(RuntimeError):
        io.prefetch([])
