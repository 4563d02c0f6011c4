"""Running out of resources: a file system that fills up mid-write, and a memory budget far
below the model.

``test_interruptions.py`` fakes ENOSPC inside the process (a patched ``pwrite``); here the
kernel refuses the write: the command runs with ``RLIMIT_FSIZE`` below the size of its output
file (and SIGXFSZ ignored, so that ``write`` fails with EFBIG the way a full disk fails with
ENOSPC), in a real process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _harness
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
