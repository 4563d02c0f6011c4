"""Benchmark: what a tiny conversion and ``inspect`` cost at the command line, against the bare
``python -c "import torch, safetensors"`` every run of the tool pays anyway.

Builds (or reuses) a tiny seeded Llama (or T5 encoder) under ``--workdir`` with transformers'
own ``save_pretrained``, then times, each in a fresh child process of this interpreter's venv:

* ``python -c "import torch, safetensors"`` — the floor;
* ``precision-convert model TINY --to bf16-safe --no-validate -o OUT --overwrite``, first run
  against an empty norm cache (``PRECISION_CONVERT_CACHE`` pointed at a fresh directory: the
  skeleton is built, importing transformers) and second run (the cache hit);
* ``precision-convert inspect TINY``, first and second run alike, with a cache of its own.

One round runs the five back to back, so a round shares the host's mood; the medians over
``--repeat`` rounds are reported, and the ratios both of those medians and as the median of
the per-round ratios. A warm-up round first puts the libraries in the page cache and writes
their bytecode. One more second run under ``-X importtime`` lists which heavy libraries
(transformers, diffusers, accelerate, huggingface_hub, httpx, matplotlib) a cache hit still
imports, and whether it imports transformers' model-loading machinery
(``transformers.conversion_mapping``, ``torch.distributed.tensor``).

Usage::

    python bench/startup.py                 # prints one JSON object
    python bench/startup.py --repeat 9 --model t5

Targets: the second ``model`` run ≤ 1.2× the bare import, the second ``inspect`` ≤ 1.5×.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
#: Bump when the model recipes change so that an old checkpoint is rebuilt, not reused.
CHECKPOINT_VERSION = 1
#: The most a second run (cache hit) may cost, in bare imports, per command.
TARGET_RATIOS = {"model": 1.2, "inspect": 1.5}
CACHE_VARIABLE = "PRECISION_CONVERT_CACHE"
#: Libraries a cache hit on a local model has no use for.
HEAVY = ("transformers", "diffusers", "accelerate", "huggingface_hub", "httpx", "matplotlib")
#: transformers' model-loading machinery (seconds): only a model it renames on load needs it.
LOADING = ("transformers.conversion_mapping", "torch.distributed.tensor")


def _tiny(workdir: Path, name: str) -> Path:
    path = workdir / f"tiny-{name}-v{CHECKPOINT_VERSION}"
    if (path / "config.json").is_file():
        return path
    from transformers.utils import logging as hf_logging

    sys.path.insert(0, str(HERE.parent / "tests"))
    import _models  # the tests' tiny models: one definition of each

    hf_logging.disable_progress_bar()
    _models.make({"llama": "llama", "t5": "t5-encoder"}[name]).save_pretrained(path)
    return path


def _cli() -> list[str]:
    script = VENV_BIN / "precision-convert"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from precision_convert.cli.main import run; run()"]


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The warm-up round writes the bytecode of this checkout's modules, as every install has
    # it: where the environment forbids writing it, each timed run would compile them anew.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env[CACHE_VARIABLE] = str(cache)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    return env


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, from ``os.wait4``) of one child."""
    with tempfile.TemporaryFile() as output:
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            output.seek(0)
            tail = output.read().decode(errors="replace").strip().splitlines()[-5:]
            raise SystemExit(
                f"{' '.join(command)} failed ({child.returncode}):\n" + "\n".join(tail)
            )
    return wall, usage.ru_utime + usage.ru_stime


def _round(tiny: Path, out: Path, scratch: Path) -> dict[str, tuple[float, float]]:
    """One pass over the five commands; each command pair gets a fresh cache directory."""
    base = [sys.executable, "-c", "import torch, safetensors"]
    model = [*_cli(), "model", str(tiny), "--to", "bf16-safe", "--no-validate"]
    model += ["-o", str(out), "--overwrite"]
    inspect = [*_cli(), "inspect", str(tiny)]
    model_cache = Path(tempfile.mkdtemp(prefix="cache-model-", dir=scratch))
    inspect_cache = Path(tempfile.mkdtemp(prefix="cache-inspect-", dir=scratch))
    return {
        "import_torch_safetensors": _timed(base, _env(scratch / "unused")),
        "model_first": _timed(model, _env(model_cache)),
        "model_second": _timed(model, _env(model_cache)),
        "inspect_first": _timed(inspect, _env(inspect_cache)),
        "inspect_second": _timed(inspect, _env(inspect_cache)),
    }


def _heavy_imports(tiny: Path, out: Path, cache: Path) -> dict[str, list[str]]:
    """The heavy libraries and the loading machinery a second run still imports, per command
    (``-X importtime``)."""
    found: dict[str, list[str]] = {}
    model = ["model", str(tiny), "--to", "bf16-safe", "--no-validate", "-o", str(out)]
    commands = {
        "model": [*model, "--overwrite"],
        "inspect": ["inspect", str(tiny)],
    }
    for name, args in commands.items():
        code = (
            f"import sys; sys.argv = ['precision-convert', *{args!r}]\n"
            "from precision_convert.cli.main import run\nrun()"
        )
        for _ in range(2):  # the first fills the cache
            done = subprocess.run(
                [sys.executable, "-X", "importtime", "-c", code],
                env=_env(cache),
                capture_output=True,
                text=True,
            )
        modules = {
            line.rpartition("|")[2].strip()
            for line in done.stderr.splitlines()
            if line.startswith("import time:")
        }
        found[name] = sorted(h for h in HEAVY if any(m == h or m.startswith(h) for m in modules))
        found[name] += [m for m in LOADING if m in modules]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=HERE / "_work" / "startup")
    parser.add_argument("--model", choices=("llama", "t5"), default="llama")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds")
    args = parser.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    tiny = _tiny(args.workdir, args.model)
    with tempfile.TemporaryDirectory(prefix="startup-", dir=args.workdir) as scratch_dir:
        scratch = Path(scratch_dir)
        out = scratch / "out"
        _round(tiny, out, scratch)  # warm-up: page cache and bytecode, not timed
        rounds = [_round(tiny, out, scratch) for _ in range(args.repeat)]
        heavy = _heavy_imports(tiny, out, scratch / "cache-importtime")

    walls = [{k: wall for k, (wall, _) in r.items()} for r in rounds]
    cpus = [{k: cpu for k, (_, cpu) in r.items()} for r in rounds]
    medians = {k: statistics.median(r[k] for r in walls) for k in walls[0]}
    cpu_medians = {k: statistics.median(r[k] for r in cpus) for k in cpus[0]}
    base = "import_torch_safetensors"
    ratios: dict[str, float] = {}
    cpu_ratios: dict[str, float] = {}
    for command in ("model", "inspect"):
        for run in ("first", "second"):
            key = f"{command}_{run}"
            ratios[f"{key}_over_import"] = medians[key] / medians[base]
            ratios[f"{key}_over_import_median_of_rounds"] = statistics.median(
                r[key] / r[base] for r in walls
            )
            cpu_ratios[f"{key}_over_import"] = cpu_medians[key] / cpu_medians[base]
    report: dict[str, Any] = {
        "model": {"name": args.model, "path": str(tiny)},
        "commands": {
            "import": f'{Path(sys.executable).name} -c "import torch, safetensors"',
            "model": "precision-convert model TINY --to bf16-safe --no-validate -o OUT --overwrite",
            "inspect": "precision-convert inspect TINY",
            "first": f"{CACHE_VARIABLE} pointed at an empty directory",
            "second": "the same command again (norm cache filled by the first)",
        },
        "repeat": args.repeat,
        "median_wall_s": {k: round(v, 3) for k, v in medians.items()},
        "median_cpu_s": {k: round(v, 3) for k, v in cpu_medians.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        # CPU time (user + system) is blind to time spent descheduled on a shared host.
        "cpu_ratios": {k: round(v, 3) for k, v in cpu_ratios.items()},
        "targets_met": {
            f"{c}_second_le_{target}x_import": ratios[f"{c}_second_over_import"] <= target
            for c, target in TARGET_RATIOS.items()
        },
        "heavy_imports_on_second_run": heavy,
        "rounds_wall_s": [{k: round(v, 3) for k, v in r.items()} for r in walls],
        "host": {
            "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
