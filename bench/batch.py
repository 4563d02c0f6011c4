"""Benchmark: 8 small conversions through ``batch`` against 8 ``model`` runs one after another.

Builds (or reuses) eight tiny seeded checkpoints under ``--workdir`` (four Llamas and four T5
encoders of the test zoo, ``tests/_models.py``), then times, each a fresh child process of
this interpreter's venv, converting and certifying all eight to ``--target``:

* ``precision-convert model SRC --to TARGET -o OUT`` eight times, one after another: every run
  pays the interpreter, torch and transformers start-up;
* ``precision-convert batch MANIFEST --jobs 2``: two warm workers take the eight jobs;
* ``precision-convert batch MANIFEST --jobs 1``: one warm worker takes them all.

A warm-up round first converts one model of each kind, so the libraries sit in the page cache,
their bytecode is written and the skeleton-norm cache (``PRECISION_CONVERT_CACHE``, one fresh
folder for the whole benchmark) is filled for every mode alike. Each mode runs ``--repeat``
times; medians are reported, with the ratios:

* ``batch_jobs2_over_sequential``: how much of the per-model start-up the warm workers remove
  (lower is better);
* ``jobs2_over_jobs1``: what a second worker adds on this machine (below 1: faster).

Usage::

    python bench/batch.py                   # prints one JSON object
    python bench/batch.py --repeat 3 --target fp16-safe
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMAND = Path(sys.executable).with_name("precision-convert")
#: Bump when the model recipes change so that old checkpoints are rebuilt, not reused.
CHECKPOINT_VERSION = 1
MODELS = 8


def _tiny(workdir: Path, kind: str, seed: int) -> Path:
    """A tiny seeded model of the test zoo (``tests/_models.py``), saved once."""
    path = workdir / f"tiny-{kind}-{seed}-v{CHECKPOINT_VERSION}"
    if not (path / "config.json").is_file():
        sys.path.insert(0, str(HERE.parent / "tests"))
        import _models

        _models.make(kind, seed).save_pretrained(path)
    return path


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(
        [str(COMMAND), *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def _sequential(sources: list[Path], target: str, out: Path, env: dict[str, str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return sum(
        _run(["model", str(src), "--to", target, "-o", str(out / src.name)], out, env)
        for src in sources
    )


def _batch(sources: list[Path], target: str, out: Path, jobs: int, env: dict[str, str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    entries = "".join(f'\n[[model]]\nsource = "{src}"\n' for src in sources)
    (out / "batch.toml").write_text(
        f'[defaults]\nto = ["{target}"]\noutput_dir = "converted"\n{entries}'
    )
    return _run(["batch", "batch.toml", "--jobs", str(jobs)], out, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=HERE / "_work" / "batch")
    parser.add_argument("--target", default="bf16-safe")
    parser.add_argument("--repeat", type=int, default=1)
    options = parser.parse_args()
    workdir: Path = options.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    sources = [_tiny(workdir, kind, seed) for kind in ("llama", "t5-encoder") for seed in range(4)]
    assert len(sources) == MODELS
    env = {
        **os.environ,
        "PRECISION_CONVERT_CACHE": tempfile.mkdtemp(prefix="pc-bench-cache-"),
        "HF_HUB_OFFLINE": "1",
    }
    runs = workdir / "runs"
    _sequential([sources[0], sources[-1]], options.target, runs / "warm-up", env)

    timings: dict[str, list[float]] = {"sequential": [], "jobs2": [], "jobs1": []}
    for _ in range(options.repeat):
        timings["sequential"].append(_sequential(sources, options.target, runs / "seq", env))
        timings["jobs2"].append(_batch(sources, options.target, runs / "jobs2", 2, env))
        timings["jobs1"].append(_batch(sources, options.target, runs / "jobs1", 1, env))
    median = {mode: statistics.median(values) for mode, values in timings.items()}
    print(
        json.dumps(
            {
                "conversions": MODELS,
                "target": options.target,
                "repeat": options.repeat,
                "sequential_model_runs_s": round(median["sequential"], 2),
                "batch_jobs2_s": round(median["jobs2"], 2),
                "batch_jobs1_s": round(median["jobs1"], 2),
                "batch_jobs2_over_sequential": round(median["jobs2"] / median["sequential"], 3),
                "jobs2_over_jobs1": round(median["jobs2"] / median["jobs1"], 3),
                "all_s": {mode: [round(v, 2) for v in values] for mode, values in timings.items()},
                "cpus": os.cpu_count(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "python": platform.python_version(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
