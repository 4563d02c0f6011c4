"""Images for probes: smooth seeded images, and a vision-language model's prompts holding
one, made by its own processor."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch

from precision_convert.validation.probe.inputs.tokenizers import ProbeTokenizer, pad_rows


def smooth_image(g: torch.Generator, *shape: int) -> torch.Tensor:
    """A smooth seeded image in [-1, 1]: low-frequency waves plus a little noise.

    Real images are mostly smooth; white noise would make PSNR of a decoded image meaningless.
    """
    *lead, h, w = shape
    y = torch.linspace(0, 1, h).view(h, 1)
    x = torch.linspace(0, 1, w).view(1, w)
    planes = []
    for _ in range(math.prod(lead)):
        fy, fx, phase = (torch.rand(3, generator=g) * torch.tensor([4.0, 4.0, 6.28])).tolist()
        plane = torch.sin(2 * math.pi * fy * y + phase) * torch.cos(2 * math.pi * fx * x)
        planes.append(0.8 * plane + 0.1 * torch.randn(h, w, generator=g))
    return torch.stack(planes).view(*shape).clamp(-1, 1)


def processor_prompt(
    tokenizer: ProbeTokenizer | None,
    sentences: Sequence[str],
    gen: Callable[[str], torch.Generator],
    side: int,
    params: Collection[str],
) -> dict[str, torch.Tensor] | None:
    """``sentences`` each after a ``side``-pixel image, through the model's own processor (the
    ``tokenizer``'s): the image token expanded as the processor expands it, and the image
    resized and normalised by its image processor; only the arguments in ``params``. None
    without such a processor, or when it refuses. ``gen`` makes a seeded generator per name."""
    processor = tokenizer.processor if tokenizer is not None else None
    if processor is None or "input_ids" not in params:
        return None
    rows: list[list[int]] = []
    pixels: list[torch.Tensor] = []
    for index, sentence in enumerate(sentences):
        image = smooth_image(gen(f"processor_image{index}"), 3, side, side)
        pixels_hwc = ((image + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        try:  # one row at a time: padding is done by hand, so no pad token is needed
            batch = processor(
                images=[pixels_hwc], text=[f"{processor.image_token}\n{sentence}"],
                return_tensors="pt",
            )  # fmt: skip
        # Processors raise plain Exception (and their tokenizers' Rust errors): no prompt.
        except Exception:
            return None
        rows.append(batch["input_ids"][0].tolist())
        pixels.append(batch["pixel_values"])
    assert tokenizer is not None
    ids, mask = pad_rows(rows, tokenizer.pad()[0], side=tokenizer.padding_side)
    prompt = {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.cat(pixels)}
    return {k: v for k, v in prompt.items() if k in params}
