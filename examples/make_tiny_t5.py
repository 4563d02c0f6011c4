"""Build a tiny T5 v1.1 encoder (the text encoder of CogVideoX/SD3/Flux, shrunk) to convert.

No download is needed: the architecture is google/t5-v1_1-xxl's published config (from the zoo
next to this script) shrunk in depth and width only, and the weights are random from a fixed
seed. Its feed-forward output projections are scaled the way pretrained T5 weights are, so that
fp16 really overflows in them and ``fp16-safe`` has something to protect.

Usage: python examples/make_tiny_t5.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from zoo._build import save_transformers, scaled
from zoo.encoders import T5_V1_1_XXL_ENCODER

#: T5 v1.1's feed-forward output weights grow large in pre-training; this puts their outputs
#: past fp16's 65504 in a randomly initialized model.
WO_SCALE = 30000.0


def scale_feed_forward_outputs(model: Any) -> None:
    for block in model.encoder.block:
        block.layer[1].DenseReluDense.wo.weight.mul_(WO_SCALE)


def main(out: Path) -> None:
    values = scaled(T5_V1_1_XXL_ENCODER, d_model=64, d_kv=16, d_ff=128, num_heads=4, num_layers=4)
    save_transformers(values, out, adjust=scale_feed_forward_outputs)
    print(out)


if __name__ == "__main__":
    from transformers.utils import logging

    logging.disable_progress_bar()  # the demo's stderr is the command's own progress
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-t5"))
