"""Benchmark: a ~6 GB fp32 Llama checkpoint to bf16-safe, against ``cp -r`` and transformers.

One run builds (or reuses) a sharded fp32 Llama checkpoint under ``--workdir`` and then times,
each in a fresh child process:

* ``cp -r SRC DST && sync`` — the disk floor: reads and writes every source byte;
* ``precision-convert model SRC --to bf16-safe --no-validate`` — the converter (it fsyncs);
* transformers' ``from_pretrained(dtype=bfloat16)`` + ``save_pretrained`` + ``sync``.

Wall time, peak RSS and the bytes read from disk come from ``os.wait4`` on that one child,
run from a tiny wrapper process (a child's ``ru_maxrss`` starts at its parent's high-water mark,
so this script's own memory must not be its parent). The bytes read are the kernel's
``ru_inblock`` (``read_bytes`` of ``/proc/PID/io``, in 512-byte blocks): reads that reached
the disk, not those the page cache answered; over the checkpoint's size they are the reads of
the source per run (``source_reads``: 1.0 is one pass).

By default the checkpoint's pages are evicted from the page cache before each run
(``POSIX_FADV_DONTNEED``, no root needed) after the Python stack has been imported once, so
every method starts from cold data and warm libraries alike; ``--cache all`` drops the whole
page cache instead (root), ``--cache warm`` reads the checkpoint in first. The JSON says
which. The converted output is then checked: every tensor's name, shape and stored
dtype, and a few tensors bit for bit against ``source.to(dtype)``.

Usage::

    python bench/convert.py                     # 6 GB checkpoint in bench/_work/, 3 rounds
    python bench/convert.py --size-gb 1 --repeat 1   # a quick run
    python bench/convert.py --skip-transformers --cache all

Targets: conversion wall ≤ 1.0× ``cp -r``+``sync``; converter peak RSS ≤ 1 GiB; the source
read once (``source_reads`` ≤ 1.1 with the default ``--cache checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
#: Bump when the checkpoint recipe changes so that an old checkpoint is rebuilt, not reused.
CHECKPOINT_VERSION = 1
MB = 1024 * 1024
GIB = 1024**3

# A TinyLlama-like shape (grouped-query attention); the layer count sets the size.
HIDDEN = 2048
INTERMEDIATE = 5632
HEADS = 32
KV_HEADS = 4
VOCAB = 32000


def _layer_params() -> int:
    head_dim = HIDDEN // HEADS
    attn = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * head_dim
    mlp = 3 * HIDDEN * INTERMEDIATE
    return attn + mlp + 2 * HIDDEN


def _layers_for(size_bytes: float) -> int:
    fixed = (2 * VOCAB * HIDDEN + HIDDEN) * 4  # embeddings, untied lm_head, final norm
    return max(1, round((size_bytes - fixed) / (_layer_params() * 4)))


def _tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of ``LlamaForCausalLM`` (untied head), in checkpoint order."""
    head_dim = HIDDEN // HEADS
    kv = KV_HEADS * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def build_checkpoint(path: Path, size_gb: float, shard_gb: float) -> dict[str, Any]:
    """Write a sharded fp32 Llama checkpoint to ``path``, one shard in memory at a time."""
    meta_path = path / "bench_checkpoint.json"
    wanted = {"version": CHECKPOINT_VERSION, "size_gb": size_gb, "shard_gb": shard_gb}
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in wanted.items()):
            return meta | {"reused": True}
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    layers = _layers_for(size_gb * 1e9)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)

    shapes = _tensor_shapes(layers)
    total = sum(math.prod(s) * 4 for _, s in shapes)
    shard_bytes = shard_gb * 1e9
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * 4
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    for n, group in enumerate(groups, 1):
        shard = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        state = {}
        for name, shape in group:
            if len(shape) == 1:  # norm scales: around 1, like trained ones
                state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                state[name] = 0.02 * torch.randn(shape, generator=gen)
            weight_map[name] = shard
        save_file(state, str(path / shard), metadata={"format": "pt"})
        del state
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    meta = wanted | {"layers": layers, "shards": len(groups), "tensor_bytes": total}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta | {"reused": False}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_caches() -> bool:
    """Flush dirty pages and drop the whole page cache; False when not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def evict(path: Path) -> None:
    """Drop ``path``'s files from the page cache (works unprivileged: clean pages go on
    ``POSIX_FADV_DONTNEED``, so sync first)."""
    os.sync()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(path: Path) -> None:
    """Read every file under ``path`` once, so that it sits in the page cache."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                while f.read(64 * MB):
                    pass


def prepare_cache(mode: str, source: Path) -> str:
    """Put the page cache in the state ``mode`` asks for; what was actually done."""
    if mode == "all":
        if drop_caches():
            return "all"
        mode = "checkpoint"  # not root: the next best cold start
    if mode == "checkpoint":
        evict(source)
        return "checkpoint"
    os.sync()
    warm(source)
    return "warm"


_WARM_IMPORTS = "import torch, transformers; from transformers import LlamaForCausalLM"


#: Runs one command and prints its wall time and peak RSS. It is a fresh, small process: a
#: child's ``ru_maxrss`` starts at its parent's high-water mark (fork and exec carry it over),
#: so timing straight from this script would charge its own memory to every child.
_WRAPPER = """
import os, sys, time
start = time.perf_counter()
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {wall} {usage.ru_maxrss} "
            f"{usage.ru_utime} {usage.ru_stime} {usage.ru_inblock}")
"""


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(limit_s: float, window_s: float = 3.0, cores: float = 0.15) -> float:
    """Wait (up to ``limit_s``) until the machine has used under ``cores`` CPUs for
    ``window_s``; other work on a shared host skews wall times. Returns seconds waited."""
    start = time.perf_counter()
    while True:
        before = _busy_cpu_s()
        time.sleep(window_s)
        after = _busy_cpu_s()
        if before is None or after is None or (after - before) / window_s < cores:
            break
        if time.perf_counter() - start > limit_s:
            break
    return round(time.perf_counter() - start, 1)


def measure(argv: list[str], *, cache: str, source: Path, scratch: Path) -> dict[str, Any]:
    """Run ``argv`` in a fresh child; wall time, that child's own peak RSS and the bytes it
    read from disk (``ru_inblock``: 512-byte blocks, its waited-for children included).

    ``other_cpu_s`` is the CPU time the rest of the machine used meanwhile: kernel threads
    working for the child (writeback, block I/O) and other processes on a shared host. Well
    above a second or two, something else was running and the wall time is suspect.
    """
    cache = prepare_cache(cache, source)
    busy_before = _busy_cpu_s()
    record = scratch / "measure.txt"
    argv = [shutil.which(argv[0]) or argv[0], *argv[1:]]
    # -S -I: the wrapper imports nothing beyond the interpreter core, so it stays a few MB.
    proc = subprocess.run(
        [sys.executable, "-S", "-I", "-c", _WRAPPER, str(record), *argv],
        capture_output=True,
        text=True,
    )
    busy_after = _busy_cpu_s()
    code, wall, maxrss_kib, user, system, inblock = record.read_text().split()
    record.unlink()
    other = None
    if busy_before is not None and busy_after is not None:
        other = max(0.0, busy_after - busy_before - float(user) - float(system))
    if proc.returncode != 0 or int(code) != 0:
        raise RuntimeError(f"{argv[0]} failed ({code}):\n{proc.stdout}\n{proc.stderr}")
    return {
        "wall_s": round(float(wall), 3),
        "peak_rss_mb": round(int(maxrss_kib) / 1024, 1),  # Linux reports KiB
        "user_s": round(float(user), 2),
        "sys_s": round(float(system), 2),
        "other_cpu_s": None if other is None else round(other, 1),
        "read_bytes": int(inblock) * 512,
        "cache": cache,
    }


_TRANSFORMERS_SCRIPT = """
import os, sys, torch
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
model.save_pretrained(sys.argv[2])
os.sync()
"""


def _headers(root: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry, across the shards of ``root``."""
    entries: dict[str, dict[str, Any]] = {}
    for shard in sorted(root.glob("*.safetensors")):
        with shard.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        entries.update(header)
    return entries


def spot_check(source: Path, output: Path, names: list[str]) -> dict[str, Any]:
    """Check every tensor's name, shape and stored dtype (norms F32, the rest BF16), then
    compare ``names`` bit for bit with ``source.to(stored dtype)``."""
    import torch
    from safetensors import safe_open

    src_headers, out_headers = _headers(source), _headers(output)
    layout_ok = src_headers.keys() == out_headers.keys() and all(
        out_headers[n]["shape"] == h["shape"]
        and out_headers[n]["dtype"] == ("F32" if len(h["shape"]) == 1 else "BF16")
        for n, h in src_headers.items()
    )
    src_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    out_map = json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]
    result: dict[str, Any] = {"names_shapes_dtypes_ok": layout_ok, "bitwise": {}}
    ok = layout_ok and src_map == out_map
    for name in names:
        with safe_open(source / src_map[name], "pt") as f:
            src = f.get_tensor(name)
        with safe_open(output / out_map[name], "pt") as f:
            out = f.get_tensor(name)
        bits = torch.int16 if out.element_size() == 2 else torch.int32
        same = out.shape == src.shape and torch.equal(out.view(bits), src.to(out.dtype).view(bits))
        result["bitwise"][name] = same
        ok = ok and same
    result["ok"] = bool(ok)
    return result


_CACHE_HELP = {
    "checkpoint": "the checkpoint's pages were evicted before each run (cold data); the Python "
    "stack was imported once beforehand, so libraries are warm for every method alike",
    "all": "the whole page cache was dropped before each run (cold data and cold libraries)",
    "warm": "the checkpoint was read through once before each run (warm data for every method)",
}


#: What the report keeps of each run.
_RUN_FIELDS = ("wall_s", "peak_rss_mb", "user_s", "sys_s", "other_cpu_s", "source_reads")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=HERE / "_work")
    parser.add_argument("--size-gb", type=float, default=6.0, help="fp32 checkpoint size (1e9 B)")
    parser.add_argument("--shard-gb", type=float, default=1.5, help="shard size (1e9 B)")
    parser.add_argument(
        "--cache",
        choices=["checkpoint", "all", "warm"],
        default="checkpoint",
        help="page cache before each run: evict the checkpoint (default), drop everything "
        "(needs root; falls back to 'checkpoint'), or warm the checkpoint",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds of cp/convert (medians are reported)"
    )
    parser.add_argument(
        "--transformers-repeat", type=int, default=1, help="rounds of transformers (slow)"
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=120,
        help="before each run, wait up to this many seconds for the machine to go idle",
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--keep-outputs", action="store_true")
    args = parser.parse_args()

    work = args.workdir.resolve()
    source = work / f"llama-fp32-{args.size_gb:g}gb"
    t0 = time.perf_counter()
    meta = build_checkpoint(source, args.size_gb, args.shard_gb)
    build_s = time.perf_counter() - t0
    size = dir_bytes(source)

    outs = {
        "cp_sync": work / "out-cp",
        "convert": work / "out-convert",
        "transformers": work / "out-transformers",
    }
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    commands = {
        "cp_sync": ["sh", "-c", 'cp -r "$0" "$1" && sync', str(source), str(outs["cp_sync"])],
        "convert": [
            str(VENV_BIN / "precision-convert"),
            "model",
            str(source),
            "--to",
            "bf16-safe",
            "--no-validate",
            "-o",
            str(outs["convert"]),
            "--json",
        ],
        "transformers": [
            sys.executable,
            "-c",
            _TRANSFORMERS_SCRIPT,
            str(source),
            str(outs["transformers"]),
        ],
    }
    rounds = {
        "cp_sync": args.repeat,
        "convert": args.repeat,
        "transformers": 0 if args.skip_transformers else args.transformers_repeat,
    }
    if args.cache != "all":
        # Libraries warm for everyone alike; only the checkpoint's own pages are in question.
        subprocess.run([sys.executable, "-c", _WARM_IMPORTS], check=True)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in commands}
    check: dict[str, Any] | None = None
    for round_ in range(max(rounds.values())):
        for name, argv in commands.items():
            if round_ >= rounds[name]:
                continue
            waited = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 else 0.0
            sample = measure(argv, cache=args.cache, source=source, scratch=work)
            sample["waited_for_quiet_s"] = waited
            sample["output_bytes"] = dir_bytes(outs[name])
            sample["source_reads"] = round(sample["read_bytes"] / size, 3)
            samples[name].append(sample)
            if name == "convert" and check is None:
                check = spot_check(source, outs["convert"], _spot_names(meta["layers"]))
            if not args.keep_outputs or round_ < rounds[name] - 1:
                shutil.rmtree(outs[name], ignore_errors=True)

    results: dict[str, Any] = {}
    for name, runs in samples.items():
        if not runs:
            continue
        results[name] = {
            "wall_s": round(_median([r["wall_s"] for r in runs]), 3),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
            "output_bytes": runs[-1]["output_bytes"],
            "source_reads": round(_median([r["source_reads"] for r in runs]), 3),
            "runs": [{k: r[k] for k in _RUN_FIELDS} for r in runs],
        }
    caches = {r["cache"] for runs in samples.values() for r in runs}

    size_mb = size / MB
    conv = results["convert"]
    cp_wall = results["cp_sync"]["wall_s"]
    # Per round too: cp and convert run back to back, so a round shares the host's mood.
    paired = [
        c["wall_s"] / p["wall_s"]
        for c, p in zip(samples["convert"], samples["cp_sync"], strict=False)
    ]
    ratios: dict[str, float] = {
        "convert_wall_over_cp_sync": conv["wall_s"] / cp_wall,
        "convert_wall_over_cp_sync_median_of_rounds": _median(paired),
        "convert_rss_over_model_size": conv["peak_rss_mb"] / size_mb,
        # Beside the wall ratio: a second pass over the source shows here first.
        "convert_source_reads": conv["source_reads"],
        "cp_sync_source_reads": results["cp_sync"]["source_reads"],
    }
    targets: dict[str, bool] = {
        "convert_wall_le_1x_cp_sync": conv["wall_s"] <= cp_wall,
        "convert_peak_rss_le_1gib": conv["peak_rss_mb"] <= 1024,
    }
    if caches <= {"all", "checkpoint"}:  # a warm checkpoint is read from memory, not disk
        targets["convert_source_reads_le_1_1"] = conv["source_reads"] <= 1.1
    if "transformers" in results:
        tr = results["transformers"]
        ratios["transformers_wall_over_cp_sync"] = tr["wall_s"] / cp_wall
        ratios["transformers_rss_over_model_size"] = tr["peak_rss_mb"] / size_mb
        ratios["convert_wall_over_transformers"] = conv["wall_s"] / tr["wall_s"]
        ratios["convert_rss_over_transformers"] = conv["peak_rss_mb"] / tr["peak_rss_mb"]
    report = {
        "checkpoint": {
            "path": str(source),
            "bytes": size,
            "gb": round(size / 1e9, 3),
            "layers": meta["layers"],
            "shards": meta["shards"],
            "reused": meta["reused"],
            "build_s": round(build_s, 1),
        },
        "page_cache": {c: _CACHE_HELP[c] for c in sorted(caches)},
        "methods": results,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "convert_wall_over_cp_sync_by_round": [round(r, 3) for r in paired],
        "targets_met": targets,
        "output_check": check,
        "host": {
            "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }
    print(json.dumps(report, indent=2))


def _spot_names(layers: int) -> list[str]:
    return [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        f"model.layers.{layers - 1}.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]


if __name__ == "__main__":
    main()
