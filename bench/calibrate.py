"""Benchmark: what activation analysis costs on a ~100M-parameter Llama, on CPU.

Builds (or reuses) a seeded fp32 Llama (hidden 768, 12 layers, tied 32k vocabulary, ~100M
parameters) under ``--workdir`` with two real fp16 overflows planted in it:

* layer 4's ``o_proj`` is scaled so its output exceeds 65504 (calibration sees it directly);
* layer 8's ``gate_proj`` and ``up_proj`` are scaled so their *product* — computed between
  modules, inside the MLP's own forward — exceeds 65504 while each output stays below half of
  it: only the candidate check and the search can find that one.

Then, in one process, on the validation inputs of the model:

* one plain fp32 forward (median of ``--runs``) against one calibration pass (recording hooks
  on every module, same inputs, median of ``--runs``): the calibration ratio;
* the whole calibrated ``fp16-safe`` plan (calibration, candidate checks, bisection search):
  wall time, number of candidate evaluations, and which islands it found.

Usage::

    python bench/calibrate.py          # prints one JSON object

Target: calibration ≤ 2x a plain forward; report the search's evaluations.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from loader import CONFIG, llama_100m  # the same ~100M Llama as bench/loader.py

HERE = Path(__file__).resolve().parent
#: Planted overflows: module weight -> scale. Chosen from fp32 calibration runs of this seed.
SCALES = {
    "model.layers.4.self_attn.o_proj.weight": 8e4,  # output peaks near 8e4
    "model.layers.8.mlp.gate_proj.weight": 200.0,  # outputs near 450, their product near 8.5e4
    "model.layers.8.mlp.up_proj.weight": 200.0,
}
CHECKPOINT_VERSION = 2


def build(directory: Path) -> Path:
    """The seeded checkpoint with its planted overflows (reused when already built)."""
    marker = directory / f".complete-v{CHECKPOINT_VERSION}"
    if marker.exists():
        return directory
    torch.manual_seed(0)
    model = llama_100m()
    state = model.state_dict()
    with torch.no_grad():
        for name, scale in SCALES.items():
            state[name].mul_(scale)
    model.save_pretrained(directory)
    marker.touch()
    return directory


def median_seconds(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=HERE / "_work" / "calibrate")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    from precision_convert.api.conversion import plan_model
    from precision_convert.conversion.analysis.activations import calibrate
    from precision_convert.conversion.io.source import open_source
    from precision_convert.conversion.runtime.baseline import load_fp32
    from precision_convert.validation.probe.run.execute import build_inputs, run_probes

    checkpoint = build(args.workdir / "llama-100m-overflowing")

    def measure_pass() -> tuple[int, Any, float, float, int]:
        model = load_fp32(checkpoint).eval()
        inputs = build_inputs(model, seed=0)

        def forward() -> Any:
            return run_probes(model, inputs, "cpu", torch.float32)

        forward_s = median_seconds(forward, args.runs)
        calibrate_s = median_seconds(lambda: calibrate(model, forward), args.runs)
        recorded = len(calibrate(model, forward)[0])
        return sum(p.numel() for p in model.parameters()), inputs, forward_s, calibrate_s, recorded

    parameters, inputs, forward_s, calibrate_s, recorded = measure_pass()  # model freed here
    start = time.perf_counter()
    plan, calibration = plan_model(open_source(checkpoint), "fp16-safe", calibrate=True)
    plan_s = time.perf_counter() - start
    assert calibration is not None
    added = {i.name: i.reason for i in calibration.islands}
    print(
        json.dumps(
            {
                "model": {"parameters": parameters, "config": CONFIG, "planted": SCALES},
                "inputs": inputs.describe(),
                "plain_forward_s": round(forward_s, 4),
                "calibration_pass_s": round(calibrate_s, 4),
                "calibration_over_forward": round(calibrate_s / forward_s, 3),
                "target_calibration_over_forward": 2.0,
                "modules_recorded": recorded,
                "fp16_safe_plan_s": round(plan_s, 2),
                "fp16_safe_plan_over_forward": round(plan_s / forward_s, 1),
                "search_evaluations": calibration.evaluations,
                "candidate_matched_fp32": calibration.passed,
                "islands_added": added,
                "fp32_share": round(plan.fp32_share, 4),
                "machine": {
                    "cpus": torch.get_num_threads(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
