"""precision-convert: rewrite PyTorch checkpoints to bf16/fp16 safely."""
