"""Build a tiny T5 v1.1 encoder (the text encoder of CogVideoX/SD3/Flux, shrunk) to convert.

No download is needed: the architecture comes from a config and the weights are random from a
fixed seed. Its feed-forward output projections are scaled the way pretrained T5 weights are,
so that fp16 really overflows in them and ``fp16-safe`` has something to protect.

Usage: python examples/make_tiny_t5.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import T5Config, T5EncoderModel


def main(out: Path) -> None:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=4,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
    )
    model = T5EncoderModel(config)
    with torch.no_grad():
        for block in model.encoder.block:
            block.layer[1].DenseReluDense.wo.weight.mul_(30000.0)
    model.save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-t5"))
