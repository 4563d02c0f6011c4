"""Benchmark a certified conversion end to end, against the floor of comparing by hand.

    python bench/certify.py --size 55m --target bf16-safe [--threads N] [--keep DIR] [--device cpu]
    python bench/certify.py --reference     # every row of REFERENCE_ROWS: a JSON list

Builds a Llama-shaped model with random weights (one of :data:`SIZES`), then runs the command a
user runs, ``precision-convert model SRC --to TARGET``, as a child process, polling its RSS,
at the machine's default thread count (``--threads N``: pinned to N threads, the floor too).
Its user and system CPU seconds come from the kernel's accounting of the child. Forwards by
stage come from the child's ledger (``PRECISION_CONVERT_LEDGER``: a JSON line per probe run,
labelled with its stage and the seconds in the forwards themselves, and one per stretch of
work outside forwards: loading, hashing, writing, spilling outputs, re-saving); the time
outside forwards is the wall time less the forwards'. Then, in this process, the floor: what
a user comparing the two models by hand runs over the certificate's own recorded probes, with
plain code: the fp32 source loaded and swept once under its default attention, the output
loaded with ``precision_convert.load`` and swept under every attention implementation the
certificate judged (eager attention's fp16 masking is a different computation from sdpa's;
in fp32 the two compute one function). Wall time is reported as a ratio of that floor and of
its default-attention part alone, measured in the same run (the machine's load changes
between runs; the ratio stays comparable), with absolute seconds and the probes' tokens.

Memory: the child's peak RSS, and the RSS a process holds after importing what the command
imports (the import baseline, measured in a process of its own): the certificate should need
at most the fp32 model plus 1 GiB above that baseline. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

#: Llama shapes (vocabulary, hidden, layers) and the coverage each is certified at.
SIZES: dict[str, dict[str, Any]] = {
    "55m": {"vocab": 32000, "hidden": 512, "layers": 8, "coverage": "standard"},
    "265m": {"vocab": 32000, "hidden": 1024, "layers": 16, "coverage": "standard"},
    "265m-128k": {"vocab": 128256, "hidden": 1024, "layers": 16, "coverage": "standard"},
    "1b": {"vocab": 32000, "hidden": 2048, "layers": 16, "coverage": "quick"},
}
#: The models users meet first, as the tests build them (the README's demo and the zoo's real
#: configs, scaled down in depth and width only), certified at the default coverage.
REFERENCE: dict[str, dict[str, Any]] = {
    "demo": {"builder": "make_tiny_t5", "coverage": "standard"},
    "zoo:llama-3.2-1b": {"zoo": "llama-3.2-1b", "coverage": "standard"},
    "zoo:bert-base-uncased": {"zoo": "bert-base-uncased", "coverage": "standard"},
    "zoo:stable-diffusion-1.5": {"zoo": "stable-diffusion-1.5", "coverage": "standard"},
    "zoo:stable-diffusion-xl": {"zoo": "stable-diffusion-xl", "coverage": "standard"},
}
#: The reference rows ``--reference`` runs: (model, target), as the certificate's cost
#: targets name them.
REFERENCE_ROWS = (
    ("demo", "fp16-safe"),
    ("zoo:llama-3.2-1b", "bf16-safe"),
    ("zoo:llama-3.2-1b", "fp16-safe"),
    ("zoo:bert-base-uncased", "fp16-safe"),
    ("zoo:stable-diffusion-1.5", "fp16-safe"),
    ("55m", "bf16-safe"),
    ("55m", "fp16-safe"),
)
TARGETS = ("bf16-safe", "fp16-safe")
#: Ledger variable the command reads (see precision_convert.core.progress).
LEDGER = "PRECISION_CONVERT_LEDGER"
#: What the command imports before it runs a probe: the import baseline imports the same.
IMPORTS = (
    "import torch, transformers, safetensors, psutil\n"
    "from transformers import LlamaForCausalLM\n"
    "import precision_convert.cli.main, precision_convert.api.conversion\n"
    "import precision_convert.validation.certify.runner\n"
    "import precision_convert.validation.calibration.plans\n"
    "print(psutil.Process().memory_info().rss)\n"
)


#: The hot model (``--hot``): layer 1's ``down_proj`` scaled until its outputs pass fp16's
#: 65504 (about 1.1e5 on the 55M model; its weights stay inside fp16), which calibration's
#: analysis makes a range island, and the head's weights put among fp16's subnormals (about
#: 2e-7: fp16 rounds them to a few steps, every logit is off by 10-20%, and fewer than half
#: flush to zero, so the plan's weight check passes them), which only the island search finds.
HOT_SCALES = {"model.layers.1.mlp.down_proj": 3e5, "lm_head": 1e-5}


def build(root: Path, size: str, hot: bool = False) -> tuple[Path, int]:
    """The source model of ``size`` saved in fp32 under ``root`` (kept if already there), hot
    with ``hot`` (:data:`HOT_SCALES`); returns its directory and its fp32 bytes."""
    if size in REFERENCE:
        return _build_reference(root, size)
    shape = SIZES[size]
    directory = root / f"src-{size}{'-hot' if hot else ''}"
    marker = directory / "config.json"
    if not marker.is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        hidden = shape["hidden"]
        config = LlamaConfig(
            vocab_size=shape["vocab"],
            hidden_size=hidden,
            intermediate_size=int(hidden * 2.6875),  # Llama's 11008 / 4096
            num_hidden_layers=shape["layers"],
            num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 64,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config).eval()
        if hot:
            with torch.no_grad():
                for name, scale in HOT_SCALES.items():
                    model.get_submodule(name).weight.mul_(scale)
        model.save_pretrained(directory, safe_serialization=True)
        del model
    size_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return directory, size_bytes


def _build_reference(root: Path, name: str) -> tuple[Path, int]:
    """A :data:`REFERENCE` model saved under ``root`` (kept if already there) by the code the
    tests and examples use, and its weights' bytes."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    sys.path.insert(0, str(examples))
    directory = root / f"src-{name.replace(':', '-')}"
    if not directory.is_dir():
        how = REFERENCE[name]
        if "zoo" in how:
            import zoo

            zoo.FAMILIES[how["zoo"]](directory)
        else:  # the example prints its directory: stdout carries the bench's JSON only
            with contextlib.redirect_stdout(sys.stderr):
                __import__(how["builder"]).main(directory)
    size_bytes = sum(f.stat().st_size for f in directory.rglob("*.safetensors"))
    return directory, size_bytes


class PeakRSS:
    """Polls a child's RSS (its own children included) until it exits."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._done.is_set():
            try:
                rss = self.proc.memory_info().rss
                rss += sum(c.memory_info().rss for c in self.proc.children(recursive=True))
            except psutil.Error:
                break
            self.peak = max(self.peak, rss)
            time.sleep(0.02)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def import_baseline() -> int:
    """RSS of a fresh process after the command's imports."""
    # Elsewhere than the repository: ``-c`` puts the working directory first on the path.
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return int(done.stdout.strip().splitlines()[-1])


def cpu_seconds(who: int) -> tuple[float, float]:
    """User and system CPU seconds of ``who`` (``resource.RUSAGE_SELF`` or ``_CHILDREN``)."""
    usage = resource.getrusage(who)
    return usage.ru_utime, usage.ru_stime


def run_command(
    source: Path, output: Path, target: str, coverage: str, device: str, threads: int | None
) -> dict[str, Any]:
    """``precision-convert model`` in a child process (``threads``: pinned to that many):
    wall seconds, user and system CPU seconds, peak RSS, its ledger and the last lines it
    wrote on stderr."""
    command = shutil.which("precision-convert", path=str(Path(sys.executable).parent))
    if command is None:
        raise SystemExit("bench: precision-convert is not installed next to this python")
    ledger = output.parent / f"{output.name}.ledger.jsonl"
    ledger.unlink(missing_ok=True)
    argv = [command, "model", str(source), "--to", target, "-o", str(output), "--overwrite"]
    argv += ["--coverage", coverage, "--device", device]
    env = {**os.environ, LEDGER: str(ledger), **pinned(threads)}
    user, system = cpu_seconds(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, text=True)
        peak = PeakRSS(child.pid)
        code = child.wait()
        seconds = time.perf_counter() - start
        err.seek(0)
        stderr = err.read()
    user_after, system_after = cpu_seconds(resource.RUSAGE_CHILDREN)
    rows = [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []
    return {
        "exit_code": code,
        "seconds": seconds,
        "user_s": user_after - user,
        "sys_s": system_after - system,
        "peak_rss": peak.stop(),
        "ledger": rows,
        "stderr_tail": stderr.strip().splitlines()[-12:],
    }


def pinned(threads: int | None) -> dict[str, str]:
    """The environment that pins a process's torch to ``threads`` (None: the default)."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def forwards_by_stage(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The ledger's probe runs summed by stage label: forwards, and seconds in the forwards
    themselves (a run's seconds beside them also keep, spill and compare outputs)."""
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        if row.get("outside"):
            continue
        label = re.sub(r" candidate \d+", " candidates", row["stage"]) or "(none)"
        entry = out.setdefault(label, {"forwards": 0, "seconds": 0.0})
        entry["forwards"] += row["forwards"]
        entry["seconds"] = round(entry["seconds"] + row.get("forward_seconds", row["seconds"]), 2)
    return out


def forwards_by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The ledger's forwards summed by probe kind (vocabulary, length, first-position...)
    across every stage and load path: forwards and seconds in them, costliest first."""
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        for kind, (forwards, seconds) in row.get("kinds", {}).items():
            entry = out.setdefault(kind, {"forwards": 0, "seconds": 0.0})
            entry["forwards"] += forwards
            entry["seconds"] = round(entry["seconds"] + seconds, 2)
    return dict(sorted(out.items(), key=lambda item: -item[1]["seconds"]))


def cpu_by_stage(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """User and kernel CPU seconds by stage label (loads and other stretches by what they did):
    each ledger row carries the process's CPU seconds so far, so the difference from the row
    before is what the work it records (and anything between the two) cost."""
    out: dict[str, dict[str, float]] = {}
    before = [0.0, 0.0]
    for row in rows:
        if "cpu_s" not in row:
            continue
        stage = re.sub(r" candidate \d+", " candidates", row["stage"]) or "(none)"
        label = f"{row['what']} ({stage})" if row.get("outside") else stage
        entry = out.setdefault(label, {"user_s": 0.0, "sys_s": 0.0})
        entry["user_s"] = round(entry["user_s"] + row["cpu_s"][0] - before[0], 2)
        entry["sys_s"] = round(entry["sys_s"] + row["cpu_s"][1] - before[1], 2)
        before = row["cpu_s"]
    return dict(sorted(out.items(), key=lambda item: -item[1]["sys_s"]))


def outside_forwards(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Where the time outside forwards went: the wall time less the forwards', and the
    ledger's stretches outside forwards summed by what they did (loads by stage too: the
    plain load, the re-save round trip's...); ``other`` is the rest (imports, planning,
    comparing, the process's start and end)."""
    forwards = sum(r.get("forward_seconds", r["seconds"]) for r in rows if not r.get("outside"))
    spans: dict[str, float] = {}
    for row in rows:
        if row.get("outside"):
            stage = re.sub(r" candidate \d+", " candidates", row["stage"])
            key = f"{row['what']} ({stage})" if row["what"] == "load" and stage else row["what"]
            spans[key] = round(spans.get(key, 0.0) + row["seconds"], 2)
    # Runs' own time beyond their forwards: trims, keeping outputs, early-stop comparisons.
    around = sum(
        r["seconds"] - r.get("forward_seconds", r["seconds"]) for r in rows if not r.get("outside")
    )
    spans["around forwards (in probe runs, spills apart)"] = round(
        around - sum(r["seconds"] for r in rows if r.get("outside") and r["what"] == "spill"), 2
    )
    outside = wall - forwards
    spans["other"] = round(outside - sum(spans.values()), 2)
    return {
        "seconds": round(outside, 1),
        "share_of_wall": round(outside / wall, 3),
        "by_what": dict(sorted(spans.items(), key=lambda kv: -kv[1])),
    }


def floor(source: Path, output: Path, certificate: dict[str, Any], device: str) -> dict[str, Any]:
    """A user comparing the two by hand over the certificate's probes: fp32 load and sweep
    under the default attention, then ``precision_convert.load`` and the same sweep under
    each attention implementation the certificate judged (the default first), each model
    freed before the next; with the probes' tokens and this process's CPU seconds."""
    import gc

    import torch

    import precision_convert as pc
    from precision_convert.conversion.runtime.baseline import load_fp32
    from precision_convert.validation.probe.inputs.sweep import replay
    from precision_convert.validation.probe.inputs.tokenizers import tokenizer_for
    from precision_convert.validation.probe.run.attention import attention
    from precision_convert.validation.probe.run.execute import resolve, run_probes

    component = certificate["components"][0]
    judged = (component.get("attention") or {}).get("judged") or [None]
    times: dict[str, float] = {}

    def timed(key: str, work: Any, *args: Any) -> Any:
        start = time.perf_counter()
        result = work(*args)
        times[key] = time.perf_counter() - start
        return result

    user, system = cpu_seconds(resource.RUSAGE_SELF)
    fp32 = timed("load_fp32", lambda: load_fp32(source).to(device).eval())
    inputs = replay(fp32, component["inputs"], tokenizer=tokenizer_for(output))
    outputs = timed(f"sweep_fp32_{judged[0]}", run_probes, fp32, inputs, device, torch.float32)
    frozen = resolve(inputs, outputs)  # the fp32 outputs resolve later probes
    del outputs, fp32
    gc.collect()
    candidate = timed("load_pc", lambda: pc.load(output, device=device))
    compute = getattr(torch, certificate.get("compute_dtype") or "float32")
    for implementation in judged:
        with attention(candidate, implementation if implementation != judged[0] else None):
            timed(f"sweep_pc_{implementation}", run_probes, candidate, frozen, device, compute)
    loads = times["load_fp32"] + times["load_pc"]
    default = [f"sweep_fp32_{judged[0]}", f"sweep_pc_{judged[0]}"]
    user_after, system_after = cpu_seconds(resource.RUSAGE_SELF)
    result: dict[str, Any] = {k: round(v, 2) for k, v in times.items()}
    result["attention"] = judged
    result["probes"] = len(frozen.probes)
    result["probe_tokens"] = sum(
        v.numel()
        for p in frozen.probes
        for k, v in p.kwargs.items()
        if k.endswith("input_ids") and torch.is_tensor(v)
    )
    result["user_s"] = round(user_after - user, 1)
    result["sys_s"] = round(system_after - system, 1)
    result["total"] = round(sum(times.values()), 2)
    result["default_attention_total"] = round(loads + sum(times[k] for k in default), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted({*SIZES, *REFERENCE}), default="55m")
    parser.add_argument("--target", choices=TARGETS, default="bf16-safe")
    parser.add_argument("--coverage", help="override the size's coverage level")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, help="pin the command and the floor to this many threads"
    )
    parser.add_argument("--keep", type=Path, help="build (and reuse) the models here")
    parser.add_argument(
        "--hot", action="store_true", help="a model that needs islands and a search (fp16-safe)"
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="every row of REFERENCE_ROWS, one after another: a JSON list",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = REFERENCE_ROWS if args.reference else ((args.size, args.target),)
    with tempfile.TemporaryDirectory(prefix="bench-certify-") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        results = [bench(root, size, target, args) for size, target in rows]
    print(json.dumps(results if args.reference else results[0], indent=2))


def bench(root: Path, size: str, target: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row: ``size`` converted to ``target`` by the command, then the floor by hand."""
    coverage = args.coverage or {**SIZES, **REFERENCE}[size]["coverage"]
    hot = args.hot and size in SIZES
    source, fp32_bytes = build(root, size, hot)
    output = root / f"out-{source.name.removeprefix('src-')}-{target}"
    baseline_rss = import_baseline()
    run = run_command(source, output, target, coverage, args.device, args.threads)
    certificate_file = output / "precision_certificate.json"
    if run["exit_code"] not in (0, 1) or not certificate_file.is_file():
        return {"size": size, "target": target, "error": "the command failed", **run}
    certificate = json.loads(certificate_file.read_text())
    config = output / "config.json"  # a pipeline's records are its components'
    record = json.loads(config.read_text()).get("precision_convert", {}) if config.is_file() else {}
    islands = {k: v for k, v in record.get("islands", {}).items() if v != "precision"}
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    # A pipeline's certificate is per component: comparing by hand has no one sweep there.
    single = len(certificate["components"]) == 1
    hand = floor(source, output, certificate, args.device) if single else None
    growth = run["peak_rss"] - baseline_rss
    paths = certificate.get("load_paths", [])
    wall = run["seconds"]
    return {
        "size": size,
        "hot": hot,
        "target": target,
        "coverage": coverage,
        "device": args.device,
        "threads": args.threads or "default",
        "fp32_gb": round(fp32_bytes / 1e9, 3),
        "verdict": certificate["verdict"],
        "probes": hand["probes"] if hand else None,
        "probe_tokens": hand["probe_tokens"] if hand else None,
        "wall_s": round(wall, 1),
        "user_s": round(run["user_s"], 1),
        "sys_s": round(run["sys_s"], 1),
        "sys_over_user": round(run["sys_s"] / run["user_s"], 2) if run["user_s"] else None,
        "floor_s": hand["total"] if hand else None,
        "wall_over_floor": round(wall / hand["total"], 2) if hand else None,
        "wall_over_default_attention_floor": (
            round(wall / hand["default_attention_total"], 2) if hand else None
        ),
        "floor": hand,
        "peak_rss_gb": round(run["peak_rss"] / 1e9, 3),
        "import_baseline_rss_gb": round(baseline_rss / 1e9, 3),
        "peak_above_baseline_gb": round(growth / 1e9, 3),
        "peak_above_baseline_minus_fp32_gib": round((growth - fp32_bytes) / 2**30, 3),
        "islands_beyond_the_recipe": islands,
        "forwards": sum(r["forwards"] for r in run["ledger"]),
        "forwards_by_stage": forwards_by_stage(run["ledger"]),
        "forwards_by_kind": forwards_by_kind(run["ledger"]),
        "cpu_by_stage": cpu_by_stage(run["ledger"]),
        "outside_forwards": outside_forwards(run["ledger"], wall),
        "load_paths": {
            p["way"] + (f"+{p['attention']}" if p.get("attention") else ""): p["verdict"]
            + (f" ({p['detail']})" if p.get("detail") else "")
            for p in paths
        },
        "stderr_tail": run["stderr_tail"],
    }


if __name__ == "__main__":
    main()
