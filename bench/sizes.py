"""Benchmark what the declared-size and size-growth probes add to a certificate.

    python bench/sizes.py [--case vae-512 --case unet-64 ...] [--device cpu] [--dtype bfloat16]

Builds each model with random weights (:data:`CASES`: an SD-1.5-sized ``AutoencoderKL`` (83M,
SD 1.5's published config) declaring 512 px and the same declaring 1024 px, a UNet at 64x64
latents, a CogVideoX-shaped transformer of at most 300M at 13 latent frames), sweeps it at the
default coverage level as a certificate does, and times every probe twice: the fp32 baseline
and the candidate in ``--dtype`` (a cast of the model; what ``pc.load`` runs apart from its
islands). The certificate's *floor* (as in ``bench/certify.py``: comparing the two models by
hand over the certificate's own probes) is the sum of both sweeps; what the size probes add is
the share of it spent on the ``declared-size`` and ``size-growth`` probes, in seconds and as a
ratio of the floor without them. The per-probe peak recording that the growth fit needs is
timed too: the fp32 sweep under :func:`~precision_convert.validation.probe.run.growth.run_sized`
against a plain one. Prints one JSON object (and each case's to stderr as it finishes).

float16 convolutions on a CPU run about 100x slower than float32 ones (torch 2.13: 25 s for
one 128-channel 3x3 conv at 64x64), so on a CPU the candidate is timed in bfloat16 (the
``bf16-safe`` certificate's cost); use ``--device cuda --dtype float16`` for fp16's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

#: Kinds of the probes the size work adds (:mod:`~precision_convert.validation.probe.inputs.sizes`).
SIZE_KINDS = ("declared-size", "size-growth")


def sd15_vae(sample_size: int) -> Any:
    """SD 1.5's ``AutoencoderKL`` (its published config: 83.7M parameters), random weights."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=sample_size,
    )


def unet() -> Any:
    """SD 1.5's UNet layout at half width (its 64x64 latents, 768-wide text states)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        block_out_channels=(160, 320, 640, 640),
        layers_per_block=2,
        cross_attention_dim=768,
        attention_head_dim=8,
    )


def cogvideox() -> Any:
    """A CogVideoX-shaped transformer (49 frames: 13 latent, 4x temporal compression; 15
    blocks of 1024 wide: 290M) on 16x16 latents: the frame count is what is measured."""
    from diffusers import CogVideoXTransformer3DModel

    return CogVideoXTransformer3DModel(
        num_attention_heads=16,
        attention_head_dim=64,
        in_channels=16,
        out_channels=16,
        time_embed_dim=512,
        text_embed_dim=4096,
        num_layers=15,
        sample_width=16,
        sample_height=16,
        sample_frames=49,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=32,
    )


CASES: dict[str, Callable[[], Any]] = {
    "vae-512": lambda: sd15_vae(512),
    "unet-64": unet,
    "cogvideox-13": cogvideox,
    "vae-1024": lambda: sd15_vae(1024),
}


def measure(name: str, device: str, dtype_name: str) -> dict[str, Any]:
    """One case: its sweep's probes timed in fp32 and in ``dtype_name``, the size probes'
    share, and the fp32 sweep with and without the per-probe peak recording."""
    import torch

    from precision_convert.validation.probe.inputs.layouts import input_candidates
    from precision_convert.validation.probe.inputs.sweep import sweep
    from precision_convert.validation.probe.run.execute import resolve, run_probes, select_inputs
    from precision_convert.validation.probe.run.growth import run_sized

    torch.manual_seed(0)
    model = CASES[name]().eval().to(device)
    parameters = sum(p.numel() for p in model.parameters())
    chosen, _ = select_inputs(model, input_candidates(model, seed=0), run_probes)
    inputs = sweep(model, chosen)  # the default level: what `model` certifies at
    sized = {p.name for p in inputs.probes if p.sweep.get("kind") in SIZE_KINDS}

    def timed_sweep(model: Any, probes: Any, dtype: Any) -> tuple[dict[str, float], Any]:
        times: dict[str, float] = {}
        outputs: dict[str, Any] = {}
        for probe in probes.probes:
            one = resolve(replace(probes, probes=(probe,)), outputs)
            start = time.perf_counter()
            outputs.update(run_probes(model, one, device, dtype))
            times[probe.name] = time.perf_counter() - start
        return times, outputs

    fp32, outputs = timed_sweep(model, inputs, torch.float32)
    # The recording's cost on the probes short of the declared sizes (the same fp32 forwards
    # again, hooked): running the declared ones twice more would double a 1024 px case.
    cheap = tuple(p for p in inputs.probes if p.sweep.get("kind") != "declared-size")
    start = time.perf_counter()
    run_sized(model, replace(inputs, probes=cheap), device, torch.float32)
    recorded = time.perf_counter() - start
    plain = sum(fp32[p.name] for p in cheap)
    frozen = resolve(inputs, outputs)
    dtype = getattr(torch, dtype_name)
    candidate, _ = timed_sweep(model.to(dtype), frozen, dtype)
    total = {p: fp32[p] + candidate[p] for p in fp32}
    added = sum(total[p] for p in sized)
    floor = sum(total.values())
    return {
        "parameters": parameters,
        "probes": len(inputs.probes),
        "size_probes": sorted(sized),
        "sizes": inputs.sizes,
        "floor_s": round(floor, 2),
        "size_probes_s": round(added, 2),
        "size_probes_over_floor_without_them": round(added / max(floor - added, 1e-9), 2),
        "size_probes_share_of_floor": round(added / floor, 3),
        "per_probe_s": {p: [round(fp32[p], 2), round(candidate[p], 2)] for p in fp32},
        "fp32_sweep_s": round(sum(fp32.values()), 2),
        "recording_peaks_over_plain_fp32": round(recorded / plain, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cpu, else float16")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cpu" else "float16")
    results: dict[str, Any] = {"device": args.device, "candidate_dtype": dtype, "cases": {}}
    for name in args.case or list(CASES):
        results["cases"][name] = measure(name, args.device, dtype)
        print(json.dumps({name: results["cases"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
