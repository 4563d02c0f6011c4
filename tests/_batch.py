"""What the batch tests share: manifests, running the command, and the one family run.

The family run (two tiny models × two targets plus a broken entry, ``--jobs 2``) is the most
expensive thing these tests do; :func:`family_run` runs it once per session and both
``test_batch.py`` and ``test_batch_ray.py`` (which compares the Ray executor against it) use
it. Every run is the installed console script in a child process, as a user runs it: exit
codes, stderr and worker processes are real.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The family every run converts: manifest entries by tiny-model name, and the targets.
FAMILY = ("llama", "t5-encoder")
TARGETS = ("bf16-safe", "bf16")
GOOD_JOBS = tuple(f"{name}-{target}" for name in ("llama", "t5") for target in TARGETS)
BROKEN_JOB = "broken-bf16"


@dataclass(frozen=True)
class Run:
    """One finished ``precision-convert batch`` run."""

    root: Path  # the manifest's folder
    output_dir: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.output_dir / "batch_report.json").read_text())

    def results(self) -> dict[str, dict[str, Any]]:
        return {r["key"]: r for r in self.report["results"]}


def command() -> list[str]:
    script = Path(sys.executable).with_name("precision-convert")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from precision_convert.cli.main import run; run()"]


def spawn(root: Path, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``precision-convert batch batch.toml ARGS`` in ``root``, in a session of its own (so a
    test can kill it with its workers)."""
    return subprocess.Popen(
        [*command(), "batch", "batch.toml", *args],
        cwd=root,
        # Wide enough that the table never folds a URL or a job name.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "250", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run(root: Path, *args: str, env: Mapping[str, str] | None = None) -> Run:
    process = spawn(root, *args, env=env)
    stdout, stderr = process.communicate(timeout=300)
    output_dir = root / "out"
    return Run(root, output_dir, process.returncode, stdout, stderr)


def broken_model(path: Path) -> Path:
    """A checkpoint that cannot be read: a config and a weight file cut to a few bytes."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    return path


def family_manifest(root: Path, tiny_model: Callable[[str], Path], extra: str = "") -> Path:
    """The family's manifest in ``root`` (outputs in ``root/out``)."""
    broken_model(root / "broken")
    llama, t5 = (tiny_model(name) for name in FAMILY)
    text = f"""
[defaults]
to = {json.dumps(list(TARGETS))}
output_dir = "out"
coverage = "quick"
{extra}
[[model]]
source = "{llama}"

[[model]]
source = "{t5}"
name = "t5"

[[model]]
source = "./broken"
to = ["bf16"]
"""
    path = root / "batch.toml"
    path.write_text(text)
    return path


_FAMILY_RUNS: dict[str, Run] = {}


def family_run(factory: pytest.TempPathFactory, tiny_model: Callable[[str], Path]) -> Run:
    """The family through the local executor with ``--jobs 2``, once per session."""
    if "local" not in _FAMILY_RUNS:
        root = factory.mktemp("batch-family")
        family_manifest(root, tiny_model)
        _FAMILY_RUNS["local"] = run(root, "--jobs", "2")
    return _FAMILY_RUNS["local"]


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` (relative paths), hidden ones included."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def stamps(directory: Path) -> dict[str, tuple[str, int]]:
    """(sha256, mtime in ns) of every file under ``directory``: proof it was not rewritten."""
    hashes = digests(directory)
    return {
        name: (digest, (directory / name).stat().st_mtime_ns) for name, digest in hashes.items()
    }
