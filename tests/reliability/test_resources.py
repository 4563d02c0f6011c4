"""Running out of resources: a file system that fills up mid-write, a memory budget far
below the model, and configs that declare sizes no probe can run (10^9 positions, a 10^6
sample side, 10^6 frames), which must size nothing: a certificate or a one-line refusal
within 2 GiB and 2 minutes of CPU, and a SIGTERM honoured within 10 s.

``test_interruptions.py`` fakes ENOSPC inside the process (a patched ``pwrite``); here the
kernel refuses the write: the command runs with ``RLIMIT_FSIZE`` below the size of its output
file (and SIGXFSZ ignored, so that ``write`` fails with EFBIG the way a full disk fails with
ENOSPC), in a real process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import _harness
import pytest
import torch
from _corrupt import assert_one_error_line, leftovers, tree_digest


def test_output_file_system_full_mid_write(tmp_path: Path, sources: _harness.Sources) -> None:
    """One line naming the output, exit 2, nothing partial left beside it."""
    before = tree_digest(sources.plain)
    target = tmp_path / "out"
    args = ["model", str(sources.plain), "--to", "bf16", "--no-validate", "-o", str(target)]
    child = _harness.fork_cli(args, tmp_path, tmp_path / "logs", max_file_size=1024 * 1024)

    assert child.wait() == 2, child.stderr
    assert_one_error_line(child.stderr, str(target), "cannot write output", "File too large")
    assert child.stdout == ""
    assert not target.exists()
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # no lock, no staging
    assert tree_digest(sources.plain) == before


def test_memory_budget_far_below_the_model_validates_block_by_block(
    tmp_path: Path, sources: _harness.Sources
) -> None:
    """``--max-memory`` a small fraction of the fp32 model: validation compares one block at
    a time, certifies, and the certificate says so."""
    output = tmp_path / "out"
    shutil.copytree(sources.certified_reference, output)
    model_bytes = (sources.llama / "model.safetensors").stat().st_size
    budget = 16 * 1024
    assert budget * 20 < model_bytes

    done = _harness.run_in_process(
        [
            "validate",
            str(output),
            "--baseline",
            str(sources.llama),
            "--max-memory",
            f"{budget // 1024}KB",
            *_harness.QUICK,
        ]
    )

    assert done.exit_code == 0, done.stderr
    certificate = json.loads((output / "precision_certificate.json").read_text())
    assert certificate["verdict"] == "pass"
    [component] = certificate["components"]
    assert component["mode"] == "blockwise" and component["blocks"] > 2
    assert certificate["device"]["max_memory"] == f"{budget // 1024}KB"
    _harness.verify(output)


# -- a declared size that would eat the host -------------------------------------------------

#: What a command given a hostile config may take: its peak resident memory and its CPU time
#: (its wall time on a machine shared with other work says more about the others' load).
MEMORY_CAP = 2 << 30
TIME_CAP = 120.0
#: Wall seconds after which a command that never finished is killed.
WALL_CAP = 900.0
#: Declared sizes no probe can run, on tiny models: the positions of a 2-layer, hidden-32
#: Llama (2^31-1 appears in published configs), a UNet's and a PixArt transformer's sample
#: side and a CogVideoX-shaped transformer's frame count; each with the config keys set.
SMALL_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_key_value_heads": 4}
ROPE = {"use_rotary_positional_embeddings": True}
HOSTILE_SIZES = [
    ("positions", "llama", {**SMALL_LLAMA, "max_position_embeddings": 10**9}),
    ("image-side", "unet", {"sample_size": 10**6}),
    # 10^4 latents a side: a 1.6 GB sincos position table the library builds from it.
    ("patch-grid", "pixart-transformer", {"sample_size": 10**4}),
    # sincos positions: a position table for 250000 latent frames, built from the config
    ("frames", "cogvideox-transformer", {"sample_frames": 10**6}),
    # rotary positions (as CogVideoX-5B): nothing is built from it; only a probe could be
    ("frames-rope", "cogvideox-transformer", {**ROPE, "sample_frames": 10**6}),
]


def _hostile(name: str, settings: dict[str, object], tiny: Path, root: Path) -> Path:
    """A copy of ``tiny`` whose config says ``settings``; a Llama is rebuilt at the smaller
    width ``SMALL_LLAMA`` asks for (its weights must match the config)."""
    import _models

    source = root / "hostile"
    if name == "llama":
        torch.manual_seed(0)
        config = {k: v for k, v in settings.items() if k in SMALL_LLAMA}
        _models.llama(**config).eval().save_pretrained(source)
    else:
        shutil.copytree(tiny, source)
    config_file = source / "config.json"
    config = json.loads(config_file.read_text())
    config.update(settings)
    config_file.write_text(json.dumps(config))
    return source


def _usage(pid: int) -> tuple[int, float]:
    """A running process's peak resident memory so far (``VmHWM``, bytes) and CPU seconds."""
    status = Path(f"/proc/{pid}/status").read_text()
    peak = next(int(line.split()[1]) * 1024 for line in status.splitlines() if "VmHWM" in line)
    # utime and stime, the 14th and 15th fields, counted after the parenthesised name
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return peak, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _watched(child: _harness.Child, seconds: float) -> tuple[int | None, int, float]:
    """Wait up to ``seconds`` for ``child`` to exit, polling its peak memory and CPU time,
    and return its exit (None: still running, or killed once past :data:`MEMORY_CAP` or
    :data:`TIME_CAP`), that peak and that CPU time."""
    peak, cpu, until = 0, 0.0, time.monotonic() + seconds
    while (code := child.poll()) is None and time.monotonic() < until:
        with contextlib.suppress(OSError, ValueError, StopIteration):  # it may have exited
            peak, cpu = _usage(child.pid)
        if peak > MEMORY_CAP or cpu > TIME_CAP:
            child.signal(signal.SIGKILL)
            child.wait(30)
            return None, peak, cpu
        time.sleep(0.05)
    return code, peak, cpu


def _hostile_run(
    tmp_path: Path, tiny_model: Callable[[str], Path], case: int
) -> tuple[Path, Path, _harness.Child]:
    """``model --to bf16-safe --coverage quick`` of :data:`HOSTILE_SIZES`' ``case``, forked:
    the source, the target and the running command."""
    _, model, settings = HOSTILE_SIZES[case]
    source = _hostile(model, settings, tiny_model(model), tmp_path)
    target = tmp_path / "out"
    args = ["model", str(source), "--to", "bf16-safe", *_harness.QUICK, "-o", str(target)]
    return source, target, _harness.fork_cli(args, tmp_path, tmp_path / "logs")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("case", range(len(HOSTILE_SIZES)), ids=[c[0] for c in HOSTILE_SIZES])
def test_a_declared_size_no_probe_runs_is_bounded(
    case: int, tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """A certificate that records the declared size as not run, or a one-line refusal (exit
    2, nothing written): within 2 GiB and 2 minutes, no traceback."""
    source, target, child = _hostile_run(tmp_path, tiny_model, case)
    before = tree_digest(source)

    code, peak, cpu = _watched(child, WALL_CAP)

    if code is None:
        child.signal(signal.SIGKILL)
        child.wait(30)
    assert code is not None, f"stopped at {peak >> 20} MiB, {cpu:.0f} s: {child.stderr[-500:]}"
    assert peak <= MEMORY_CAP and cpu <= TIME_CAP, (peak, cpu)
    assert "Traceback" not in child.stderr, child.stderr
    assert tree_digest(source) == before
    if code == 2:
        assert_one_error_line(child.stderr, str(source / "config.json"), "out of range")
        assert not target.exists() and leftovers(tmp_path) == []
        return
    assert code == 0, child.stderr
    certificate = json.loads((target / "precision_certificate.json").read_text())
    inputs = certificate["components"][0]["inputs"]
    if HOSTILE_SIZES[case][0] == "positions":
        assert inputs["reach"]["positions"]["limit"] == 10**9
        assert inputs["reach"]["positions"]["untested"][-1][-1] == 10**9 - 1
    else:
        [size] = [s for s in inputs["sizes"].values() if (s.get("declared") or 0) >= 10**4]
        assert size["run"] < size["declared"] and size["not_run"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_sigterm_while_probing_a_million_declared_frames_ends_the_run_within_10_s(
    tmp_path: Path, tiny_model: Callable[[str], Path]
) -> None:
    """The worst stage of the 10^6-frame rotary CogVideoX is its fp32 baseline's probes,
    where one probe once ran all 250000 declared latent frames in a single forward that no
    signal could interrupt: SIGTERM as they begin exits 143 within 10 s, with one line and
    nothing left behind."""
    _, target, child = _hostile_run(tmp_path, tiny_model, len(HOSTILE_SIZES) - 1)
    deadline = time.monotonic() + WALL_CAP
    while not (child.started and _baseline_probing(child.stderr)):
        code, peak, _ = _watched(child, 0.05)
        assert code is None and peak <= MEMORY_CAP, (code, peak >> 20, child.stderr[-500:])
        assert time.monotonic() < deadline, "the baseline's probes never began"
    # At once: on a quiet machine the tiny model's probes take fractions of a second now that
    # no declared size makes one huge, and the run ends a few seconds later.
    child.signal(signal.SIGTERM)
    signalled = time.monotonic()
    code, peak, _ = _watched(child, 10.0)
    took = time.monotonic() - signalled

    if code is None:
        child.signal(signal.SIGKILL)
        child.wait(30)
    assert code == _harness.exit_code("SIGTERM"), (code, took, peak >> 20, child.stderr[-500:])
    assert peak <= MEMORY_CAP, peak
    assert "Traceback" not in child.stderr
    assert _harness.last_line(child.stderr).startswith("precision-convert: interrupted by SIGTERM")
    assert not target.exists() and leftovers(tmp_path) == []


def _baseline_probing(stderr: str) -> bool:
    """The progress lines say the fp32 baseline began the sweep's probes (more than the one
    probe that first tries the layout)."""
    started = re.compile(r"› baseline › .*probes: started \((\d+)\)")
    return any(int(m[1]) > 1 for m in map(started.search, stderr.splitlines()) if m)
