"""The fp32 baseline: the source upcast to fp32, built by the same builders as ``pc.load``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from precision_convert.conversion.io.source import PipelineSource, open_source
from precision_convert.conversion.runtime.builders import (
    build_filled,
    build_pretrained,
    declared_classes_unquestioned,
    uses_remote_code,
)
from precision_convert.conversion.runtime.streaming import fp32_dtype
from precision_convert.core.errors import CannotValidateError, WeightsDoNotMap
from precision_convert.core.progress import ledger_span


def load_fp32(directory: Path, *, trust_remote_code: bool = False) -> Any:
    """The model (or pipeline) in ``directory`` in fp32, bf16 sources upcast, on the CPU.

    Each model is built as a weightless skeleton and filled one tensor at a time, so memory
    peaks at the fp32 model plus one tensor whatever the files hold; the library's
    ``from_pretrained`` is the fallback where weights do not map one-to-one (fused experts).
    Remote code runs only with ``trust_remote_code``.

    Raises:
        CannotValidateError: the model needs its own code (``auto_map`` and no transformers
            class of its own) and it is not trusted.
    """
    import torch

    opened = open_source(directory)
    needs_code = not isinstance(opened, PipelineSource) and uses_remote_code(
        opened, trust_remote_code=False
    )
    if needs_code and not trust_remote_code:
        raise CannotValidateError(
            "the fp32 baseline needs the model's own code (auto_map); pass "
            "--trust-remote-code to run it, or validate with its library and pass --inputs"
        )
    with ledger_span("load"):
        if isinstance(opened, PipelineSource):
            import diffusers

            components = {name: load_fp32(directory / name) for name in opened.components}
            with declared_classes_unquestioned():
                return diffusers.DiffusionPipeline.from_pretrained(directory, **components)
        try:
            return build_filled(opened, fp32_dtype, trust_remote_code=trust_remote_code)
        except WeightsDoNotMap:
            return build_pretrained(opened, torch.float32, trust_remote_code=trust_remote_code)
