"""Benchmark validation: peak memory against the fp32 model size, and time against forwards.

    python bench/validate.py [--hidden 768 --layers 12] [--keep DIR]

Builds a Llama-style model (about 390 MB in fp32 by default), converts it to bf16-safe without
validation, then measures in fresh processes (so each peak is that run's own):

* ``whole``: ``validate()`` with memory to spare, once per coverage level (quick, standard,
  thorough: each level's probes, load paths included). Peak RSS growth ÷ fp32 size should
  stay near 1 (baseline and candidate run one after the other, never both resident; loading
  both at once would be ≥ 1.5).
* ``blockwise``: ``validate(max_memory=fp32 size / 2)``: peak growth ÷ the budget (< 1).
* time: ``validate()`` ÷ two plain steady-state forwards (fp32 model + converted model on the
  same inputs), and ÷ two loads plus two first forwards (which pay the same page faults and
  kernel set-up validation pays): what comparing the two models by hand costs.

Each child first validates a tiny model, so imports and kernel set-up are not counted. Prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any


def _build(root: Path, hidden: int, layers: int, source_dtype: str) -> int:
    """Save a model and its bf16-safe conversion; return its fp32 size in bytes."""
    import torch

    from precision_convert.api.conversion import convert

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import _models  # the tests' tiny models: one definition of each

    torch.manual_seed(0)
    model = _models.llama(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ).eval()
    fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
    model.to(getattr(torch, source_dtype)).save_pretrained(root / "src")
    convert(root / "src", to="bf16-safe", output=root / "out", validate=False)
    _models.make("llama").save_pretrained(root / "warm-src")
    convert(root / "warm-src", to="bf16-safe", output=root / "warm-out", validate=False)
    return fp32_bytes


class _Peak:
    """Samples this process's RSS every millisecond; ``growth`` is peak minus the start."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.start = self._proc.memory_info().rss
        self.peak = self.start
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak - self.start


def _child(root: Path, mode: str, budget: int | None, coverage: str) -> dict[str, Any]:
    """One measurement, run in its own process."""
    import gc

    import torch

    from precision_convert.conversion.runtime.baseline import load_fp32
    from precision_convert.conversion.runtime.loader import load
    from precision_convert.validation.certify import runner
    from precision_convert.validation.probe.run.execute import build_inputs, run_probes

    runner.validate(root / "warm-out", baseline=root / "warm-src")  # imports, kernels
    gc.collect()
    if mode == "forwards":
        timings: dict[str, float] = {}
        loaders = {
            "fp32": (lambda: load_fp32(root / "src").eval(), torch.float32),
            "candidate": (
                lambda: load(root / "out", device="cpu"),
                torch.bfloat16,
            ),
        }
        inputs = None
        for name, (build, dtype) in loaders.items():
            start = time.perf_counter()
            model = build()
            timings[f"load_{name}"] = time.perf_counter() - start
            inputs = inputs or build_inputs(model, seed=0)
            for run in ("first", "steady"):  # the first pays page faults and kernel set-up
                start = time.perf_counter()
                run_probes(model, inputs, "cpu", dtype)
                timings[f"forward_{name}_{run}"] = time.perf_counter() - start
            del model
            gc.collect()
        return timings
    peak = _Peak()
    start = time.perf_counter()
    certificate = runner.validate(
        root / "out", baseline=root / "src", max_memory=budget, coverage=coverage
    )
    seconds = time.perf_counter() - start
    return {
        "growth": peak.stop(),
        "seconds": seconds,
        "verdict": certificate.verdict,
        "mode": certificate.components[0].mode,
        "blocks": certificate.components[0].blocks,
        "probes": len(certificate.components[0].inputs.get("probes", [])),
        "load_paths_checked": sum(p.verdict != "not-checked" for p in certificate.load_paths),
    }


def _run_child(
    root: Path, mode: str, budget: int | None, coverage: str = "standard"
) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", mode, "--root", str(root)]
    command += ["--coverage", coverage]
    if budget is not None:
        command += ["--budget", str(budget)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--source-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--keep", type=Path, help="build here and keep the models")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coverage", default="standard", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.child:
        print(json.dumps(_child(args.root, args.child, args.budget, args.coverage)))
        return
    from precision_convert.validation.probe.inputs.budgets import LEVELS

    with tempfile.TemporaryDirectory(prefix="bench-validate-") as scratch:
        root = args.keep or Path(scratch)
        fp32_bytes = _build(root, args.hidden, args.layers, args.source_dtype)
        forwards = _run_child(root, "forwards", None)
        levels = {level: _run_child(root, "whole", None, level) for level in LEVELS}
        whole = levels["standard"]
        budget = fp32_bytes // 2
        blockwise = _run_child(root, "blockwise", budget)
    two_forwards = forwards["forward_fp32_steady"] + forwards["forward_candidate_steady"]
    by_hand = sum(
        forwards[f"{k}_{n}"]
        for k in ("load", "forward")
        for n in ("fp32", "candidate")
        if f"{k}_{n}" in forwards
    )
    by_hand += forwards["forward_fp32_first"] + forwards["forward_candidate_first"]
    print(
        json.dumps(
            {
                "model": {
                    "fp32_mb": round(fp32_bytes / 1e6, 1),
                    "source_dtype": args.source_dtype,
                    "hidden": args.hidden,
                    "layers": args.layers,
                },
                "whole": {
                    level: {
                        "probes": run["probes"],
                        "load_paths_checked": run["load_paths_checked"],
                        "peak_rss_over_fp32_size": round(run["growth"] / fp32_bytes, 3),
                        "seconds": round(run["seconds"], 2),
                        "seconds_over_two_forwards": round(run["seconds"] / two_forwards, 1),
                        "seconds_over_two_loads_and_first_forwards": round(
                            run["seconds"] / by_hand, 2
                        ),
                        "verdict": run["verdict"],
                    }
                    for level, run in levels.items()
                },
                "blockwise": {
                    "max_memory_mb": round(budget / 1e6, 1),
                    "peak_rss_over_max_memory": round(blockwise["growth"] / budget, 3),
                    "peak_rss_over_fp32_size": round(blockwise["growth"] / fp32_bytes, 3),
                    "blocks": blockwise["blocks"],
                    "seconds": round(blockwise["seconds"], 2),
                    "seconds_over_whole": round(blockwise["seconds"] / whole["seconds"], 2),
                    "verdict": blockwise["verdict"],
                },
                "reference_seconds": {k: round(v, 3) for k, v in forwards.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
