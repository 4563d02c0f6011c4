"""Benchmark: what ``precision_convert.load`` costs on a ~100M-parameter Llama, on CPU.

Builds (or reuses) a seeded fp32 Llama (hidden 768, 12 layers, tied 32k vocabulary: ~100M
parameters) under ``--workdir``, converts it to ``bf16-safe`` and ``bf16``, and measures in one
process:

* forward latency of the ``bf16-safe`` model from ``precision_convert.load`` (fp32 RMSNorm
  islands, boundary hooks) against the same fp32 weights plainly cast with ``.to(bfloat16)``;
  the two run back to back in ABBA order and the headline ratio is the median of the per-pair
  ratios, which stays honest on a machine other processes share. Each is timed twice: wall
  clock with all threads (the latency a user sees) and CPU time of a single-threaded forward
  (blind to time spent descheduled, so it shows the model's own cost on a busy machine);
* the same with one flowing island (``--keep-fp32`` on a layer-0 ``down_proj``), the case in
  which every compute-dtype Linear gets a cast guard, so its cost is on record too;
* the loaded model against itself with its hooks removed and its islands cast to bf16: what
  the boundaries alone cost;
* the plain model against a copy of itself: the noise floor of the machine, for judging the
  two figures above;
* load time of ``precision_convert.load`` against ``from_pretrained`` of the plain ``bf16``
  conversion (medians, alternated, after one warm-up load of each).

Usage::

    python bench/loader.py               # prints one JSON object
    python bench/loader.py --runs 30 --seq-len 256

Target: forward overhead of the loaded model ≤ 3 % over the plain cast.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
#: Bump when the model recipe changes so an old checkpoint is rebuilt, not reused.
CHECKPOINT_VERSION = 1
#: Llama-shaped, ~100M parameters with the embedding tied to the head (as small Llamas ship).
CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
FLOWING_ISLAND = "model.layers.0.mlp.down_proj"


def llama_100m() -> Any:
    """The ~100M Llama of :data:`CONFIG`, built by the tests' one definition of a Llama."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import _models

    return _models.llama(**CONFIG)


def _source(workdir: Path) -> Path:
    path = workdir / f"llama-100m-fp32-v{CHECKPOINT_VERSION}"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        llama_100m().save_pretrained(path)
    return path


def _converted(source: Path, target: str, name: str, **kwargs: Any) -> Path:
    from precision_convert.api.conversion import convert

    out = source.parent / f"{source.name}-{name}"
    if not (out / "config.json").is_file():
        convert(source, to=target, output=out, validate=False, overwrite=True, **kwargs)
    return out


def _alternate(
    a: Callable[[], object],
    b: Callable[[], object],
    runs: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[float], list[float]]:
    """Wall times of ``a`` and ``b`` run back to back, ABBA-ordered, after ``warmup`` rounds.

    Back-to-back pairs see the same machine load, and alternating which goes first cancels any
    advantage of running second (warm caches) or first (a cooler CPU).
    """
    times_a: list[float] = []
    times_b: list[float] = []
    for i in range(warmup + runs):
        pair = ((a, times_a), (b, times_b))
        for fn, times in pair if i % 2 == 0 else pair[::-1]:
            start = clock()
            fn()
            elapsed = clock() - start
            if i >= warmup:
                times.append(elapsed)
    return times_a, times_b


def _ratios(baseline: list[float], candidate: list[float]) -> dict[str, float]:
    """Median of per-pair ratios (robust to load from other processes) and of raw medians."""
    pairs = [c / b for b, c in zip(baseline, candidate, strict=True)]
    return {
        "ratio": round(statistics.median(pairs), 4),
        "ratio_of_medians": round(statistics.median(candidate) / statistics.median(baseline), 4),
        "ratio_of_minima": round(min(candidate) / min(baseline), 4),
    }


def _timed(
    plain: torch.nn.Module,
    loaded: torch.nn.Module,
    ids: torch.Tensor,
    runs: int,
    warmup: int,
    clock: Callable[[], float],
) -> dict[str, float]:
    t_plain, t_loaded = _alternate(lambda: plain(ids), lambda: loaded(ids), runs, warmup, clock)
    ratios = _ratios(t_plain, t_loaded)
    return {
        "baseline_ms": round(statistics.median(t_plain) * 1e3, 3),
        "loaded_ms": round(statistics.median(t_loaded) * 1e3, 3),
        **ratios,
        "overhead_pct": round((ratios["ratio"] - 1) * 100, 2),
    }


def _forward(
    baseline: str,
    plain: torch.nn.Module,
    loaded: torch.nn.Module,
    ids: torch.Tensor,
    runs: int,
    warmup: int,
) -> dict[str, Any]:
    """Latency (wall clock, all threads) and CPU time of one thread, ``plain`` vs ``loaded``.

    On a machine shared with other work, wall time moves by several percent from run to run;
    the CPU time of a single-threaded forward does not count time spent descheduled, so it
    isolates what the loaded model itself costs.
    """
    with torch.inference_mode():
        cos = torch.nn.functional.cosine_similarity(
            plain(ids).logits.double().flatten(), loaded(ids).logits.double().flatten(), dim=0
        ).item()
        wall = _timed(plain, loaded, ids, runs, warmup, time.perf_counter)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cpu = _timed(plain, loaded, ids, runs, warmup, time.thread_time)
        finally:
            torch.set_num_threads(threads)
    return {
        "baseline": baseline,
        "wall": wall,
        "cpu_time_1_thread": cpu,
        "logits_cosine_vs_baseline": round(cos, 6),
    }


def _without_boundaries(model: torch.nn.Module) -> torch.nn.Module:
    """The loaded model with its hooks removed and its islands cast to bf16.

    Same weights, same memory: timed against the loaded model it isolates what the boundary
    hooks and the fp32 islands cost, apart from where the weights came from.
    """
    from precision_convert.conversion.runtime.boundaries import remove

    remove(model)
    return model.to(torch.bfloat16)


def _hooks(model: torch.nn.Module) -> dict[str, int]:
    from precision_convert.conversion.runtime.boundaries import hooked_modules

    hooked = hooked_modules(model)
    return {
        "hooked_modules": len(hooked),
        "torch_hooks": sum(
            len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()
        ),
        "modules": sum(1 for _ in model.modules()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=HERE / "_work" / "loader")
    parser.add_argument("--runs", type=int, default=40, help="timed forwards per model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--load-runs", type=int, default=5, help="timed loads per method")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)

    import transformers
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import precision_convert as pc

    hf_logging.disable_progress_bar()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = _source(args.workdir)
    safe = _converted(source, "bf16-safe", "bf16-safe")
    plain_dir = _converted(source, "bf16", "bf16")
    flowing_dir = _converted(source, "bf16-safe", "bf16-safe-flowing", keep_fp32=[FLOWING_ISLAND])

    ids = torch.randint(
        0,
        CONFIG["vocab_size"],
        (args.batch, args.seq_len),
        generator=torch.Generator().manual_seed(0),
    )
    plain = LlamaForCausalLM.from_pretrained(source).to(torch.bfloat16).eval()
    # The same plain model timed against itself: how far apart two identical models measure.
    cast = "fp32 weights cast with .to(bfloat16)"
    noise = _forward(cast + " (a copy)", plain, copy.deepcopy(plain), ids, args.runs, args.warmup)
    loaded = pc.load(safe)
    forward = _forward(cast, plain, loaded, ids, args.runs, args.warmup)
    hooks = _hooks(loaded)
    boundary_cost = _forward(
        "the loaded model without hooks, islands cast to bf16",
        _without_boundaries(pc.load(safe)),
        loaded,
        ids,
        args.runs,
        args.warmup,
    )
    del loaded
    flowing = pc.load(flowing_dir)
    forward_flowing = _forward(cast, plain, flowing, ids, args.runs, args.warmup)
    hooks_flowing = _hooks(flowing)
    del flowing, plain

    # One warm-up load of each (imports, page cache), then alternated timed loads.
    pc.load(safe)
    LlamaForCausalLM.from_pretrained(plain_dir)
    t_pc, t_hf = _alternate(
        lambda: pc.load(safe),
        lambda: LlamaForCausalLM.from_pretrained(plain_dir),
        args.load_runs,
        0,
    )

    result = {
        "benchmark": "loader",
        "model": {
            "shape": "LlamaForCausalLM",
            "parameters": sum(
                p.numel() for p in LlamaForCausalLM.from_pretrained(plain_dir).parameters()
            ),
            **CONFIG,
        },
        "input": {"batch": args.batch, "seq_len": args.seq_len},
        "runs": args.runs,
        "forward_noise_floor_plain_vs_plain": noise,
        "forward_bf16_safe": {**forward, **hooks},
        "forward_bf16_safe_vs_same_weights_without_boundaries": boundary_cost,
        "forward_bf16_safe_with_flowing_island": {
            "island": FLOWING_ISLAND,
            **forward_flowing,
            **hooks_flowing,
        },
        "load": {
            "precision_convert_load_s": round(statistics.median(t_pc), 3),
            "from_pretrained_plain_bf16_s": round(statistics.median(t_hf), 3),
            **_ratios(t_hf, t_pc),
            "runs": args.load_runs,
        },
        "target": {
            "forward_overhead_max_pct": 3.0,
            "met_wall": forward["wall"]["overhead_pct"] <= 3.0,
            "met_cpu_time": forward["cpu_time_1_thread"]["overhead_pct"] <= 3.0,
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
        },
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
