"""The libraries' own output held back inside a stage, and every switch put back after.

``quiet_libraries`` routes what transformers (and any library logging to the root) log, what
``warnings`` shows and the bars tqdm draws, for the work inside it only: our own messages
pass, another thread outside the stage is untouched, and the loggers, ``showwarning``, the
warning filters and the bar switches read as before once the last stage is left.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from transformers.utils import logging as transformers_logging

from precision_convert.core.quiet import (
    LOGGERS,
    PrecisionConvertWarning,
    library_messages,
    quiet_libraries,
)


def _switches() -> dict[str, Any]:
    return {
        "handlers": {name: list(logging.getLogger(name).handlers) for name in LOGGERS},
        "showwarning": warnings.showwarning,
        "filters": list(warnings.filters),
        "bars": transformers_logging.is_progress_bar_enabled(),
    }


@pytest.fixture
def bars_on() -> Iterator[None]:
    """transformers' bars on (as a user's process has them) and its logger set up, so the
    stage has something to turn off and hand back."""
    transformers_logging.get_logger("transformers")
    was = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        yield
    finally:
        if not was:
            transformers_logging.disable_progress_bar()


def _speak() -> None:
    """What libraries say while they load: a logged load report, a propagated warning of a
    library without a handler of its own, a Python warning and a tqdm bar."""
    logging.getLogger("transformers.modeling_utils").warning("MISSING keys: lm_head.weight")
    logging.getLogger("accelerate.utils").warning("offloading to disk")
    warnings.warn("`torch_dtype` is deprecated", FutureWarning, stacklevel=1)
    for _ in transformers_logging.tqdm(range(3), desc="Writing model shards"):
        pass


def test_a_stage_holds_library_output_back_and_hands_every_switch_back(
    bars_on: None, capfd: pytest.CaptureFixture[str]
) -> None:
    before = _switches()
    heard: list[str] = []
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = _switches()
        with library_messages(heard.append), quiet_libraries():
            _speak()
            assert not transformers_logging.is_progress_bar_enabled()
            warnings.filterwarnings("ignore", message="a library's own filter")
        after = _switches()
    assert after == before
    said = capfd.readouterr()
    assert said.err == "" and said.out == "", said
    assert heard[:2] == [
        "transformers.modeling_utils: MISSING keys: lm_head.weight",
        "accelerate.utils: offloading to disk",
    ]
    assert "FutureWarning: `torch_dtype` is deprecated" in heard[2]
    assert len(heard) == 3  # the bar drew nothing


def test_without_a_sink_held_output_is_dropped_and_our_own_passes(
    bars_on: None, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Our loggers reach the root's handlers (pytest's capture here; logging's last resort
    on stderr in the command) and our warnings are shown; the libraries' are not."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_libraries():
            _speak()
            logging.getLogger("precision_convert.conversion.runtime").warning("island cast")
            warnings.warn("saved without its record", PrecisionConvertWarning, stacklevel=1)
    assert capfd.readouterr().err == ""
    assert [r.getMessage() for r in caplog.records] == ["island cast"]
    assert [str(w.message) for w in shown] == ["saved without its record"]
    logging.getLogger("accelerate.utils").warning("outside a stage")  # the capture hears it
    assert caplog.records[-1].getMessage() == "outside a stage"


def test_a_thread_outside_the_stage_logs_as_before(
    bars_on: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The switches are process-wide, the holding back is not: a user's thread beside a
    conversion keeps its messages."""
    inside, outside = threading.Event(), threading.Event()

    def user() -> None:
        inside.wait(10)
        logging.getLogger("transformers.generation").warning("user's own warning")
        outside.set()

    thread = threading.Thread(target=user)
    thread.start()
    with quiet_libraries():
        inside.set()
        assert outside.wait(10)
        logging.getLogger("transformers.generation").warning("held back")
    thread.join(10)
    assert [r.getMessage() for r in caplog.records] == ["user's own warning"]


def test_a_handler_a_library_adds_meanwhile_is_kept_and_held_back(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """diffusers configures its logger when first imported, which may be inside a stage: its
    handler stays the library's afterwards and says nothing inside."""
    logger = logging.getLogger("diffusers")
    before = list(logger.handlers)
    handler = logging.StreamHandler()
    capfd.readouterr()
    try:
        with quiet_libraries():
            logger.addHandler(handler)  # as diffusers' import does
            logging.getLogger("diffusers.pipelines").warning("non-standard module")
        assert logger.handlers == [*before, handler]
        assert "non-standard module" not in capfd.readouterr().err
        logging.getLogger("diffusers.pipelines").warning("after the stage")
        assert "after the stage" in capfd.readouterr().err
    finally:
        logger.removeHandler(handler)


def test_nested_and_concurrent_stages_restore_once_the_last_one_leaves(bars_on: None) -> None:
    before = _switches()
    entered, release = threading.Barrier(2), threading.Event()

    def other_stage() -> None:
        with quiet_libraries():
            entered.wait(10)
            release.wait(10)

    thread = threading.Thread(target=other_stage)
    with quiet_libraries():
        thread.start()
        entered.wait(10)
        with quiet_libraries():
            pass
        assert not transformers_logging.is_progress_bar_enabled()
    assert not transformers_logging.is_progress_bar_enabled()  # the other stage still runs
    release.set()
    thread.join(10)
    assert _switches() == before


def test_verbose_shows_the_held_messages_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--verbose``: the command prints what the libraries said, each as it comes, on stderr
    (nothing on stdout, where the report goes); without it, nothing."""
    from rich.console import Console

    from precision_convert.cli import _common

    monkeypatch.setattr(_common, "console", Console(stderr=True, width=200))
    for verbose in (True, False):
        with _common.byte_progress("converting", False, verbose), quiet_libraries():
            logging.getLogger("transformers.modeling_utils").warning("UNEXPECTED: concept_embeds")
        said = capsys.readouterr()
        assert said.out == ""
        shown = "transformers.modeling_utils: UNEXPECTED: concept_embeds\n"
        assert said.err == (shown if verbose else "")


def test_a_library_that_propagates_to_the_root_is_heard_once(bars_on: None) -> None:
    """A user's process may turn transformers' propagation on (``enable_propagation``): a
    record then passes both transformers' handlers and the root's, and is still held once."""
    transformers_logging.enable_propagation()
    heard: list[str] = []
    try:
        with library_messages(heard.append), quiet_libraries():
            logging.getLogger("transformers.modeling_utils").warning("MISSING keys: lm_head")
    finally:
        transformers_logging.disable_propagation()
    assert heard == ["transformers.modeling_utils: MISSING keys: lm_head"]


_BARS_UNDER_THE_ENVIRONMENT = """
import sys, warnings
warnings.simplefilter("error")  # huggingface_hub warns when a call fights its environment
from precision_convert.core.quiet import quiet_libraries
with quiet_libraries():
    imported_at_entry = "transformers" in sys.modules
    from transformers.utils import logging as transformers_logging  # imported inside the stage
    inside = transformers_logging.is_progress_bar_enabled()
print(imported_at_entry, inside, transformers_logging.is_progress_bar_enabled())
"""


def test_bars_held_off_by_the_hub_environment_need_no_transformers_import() -> None:
    """Under ``HF_HUB_DISABLE_PROGRESS_BARS=1`` (the command sets it) a stage leaves
    transformers unimported, and transformers imported inside it draws no bars."""
    done = subprocess.run(
        [sys.executable, "-c", _BARS_UNDER_THE_ENVIRONMENT],
        env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False"]
