"""The certificate of a model with a 128k vocabulary stays under a megabyte.

At the default coverage the zoo's Llama-3.2 with a head probes cannot sample row by row (a
head of its own class: each token costs a row of logits, so the vocabulary takes as many
memory-sized probes as that allows) is swept with 667 probes (494 of them vocabulary chunks, 95
first-position and 32 repeated-id rows), and each probe is judged on two outputs by eight
metrics: thousands of measurements. The probes here are the sweep's own, built for the
model without running it, and the measurements are made as validation makes them
(:func:`measure`), so what is measured is the format: every probe's record and every
measurement, written as the certificate writes them. (The slow tests in test_command_output.py
check the certificate of a real default run too.)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from _models import with_custom_head

from precision_convert.validation.certify.certificate import (
    Certificate,
    ComponentRecord,
    in_series_order,
    measurements,
    write,
)
from precision_convert.validation.probe.run.metrics import measure

#: The most a certificate may weigh.
MEGABYTE = 1_000_000
#: What the records left out here (load paths, notes, versions, files) add, generously.
RESERVE = 100_000


def _probes(source: Path) -> dict[str, object]:
    """The standard sweep of the model at ``source``, as the certificate records it."""
    from transformers import AutoModelForCausalLM

    from precision_convert.validation.probe.inputs.layouts import input_candidates
    from precision_convert.validation.probe.inputs.sweep import sweep
    from precision_convert.validation.probe.inputs.tokenizers import tokenizer_for
    from precision_convert.validation.probe.run.session import SEED

    model = with_custom_head(AutoModelForCausalLM.from_pretrained(source).eval())
    tokenizer = tokenizer_for(source)
    layout = next(iter(input_candidates(model, seed=SEED, tokenizer=tokenizer)))
    return sweep(model, layout, "standard", tokenizer).describe()


def test_a_128k_vocabulary_certificate_stays_under_a_megabyte(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    inputs = _probes(tiny_model("llama-3.2-1b"))
    probes = list(inputs["probes"])  # type: ignore[call-overload]
    assert len(probes) > 500
    rng = random.Random(0)
    names = ("nonfinite", "rel_l2", "cosine", "max_abs", "max_abs_rel", "token_error",
             "nonfinite_tokens", "top1")  # fmt: skip
    thresholds = dict.fromkeys(names, 0.1)
    metrics = [
        row
        for probe in probes
        for output in ("logits", "logits.rms")
        for row in measure("", probe, output, {n: rng.random() / 1e3 for n in names}, thresholds)
    ]
    record = ComponentRecord("", "LlamaForCausalLM", "transformers", "causal-lm", "whole")
    record.inputs = inputs
    certificate = Certificate(
        verdict="pass", target="bf16-safe", compute_dtype="bfloat16", source={}, baseline={},
        device={}, versions={}, components=[record], metrics=in_series_order(metrics),
        failures=[], files={},
    )  # fmt: skip
    path = write(certificate, tmp_path)
    size = path.stat().st_size
    assert size < MEGABYTE - RESERVE, f"{size:,} bytes for {len(metrics):,} measurements"
    # Nothing was dropped to get there: every probe and measurement reads back as written.
    stored = json.loads(path.read_text())
    assert measurements(stored["metrics"]) == certificate.metrics
    assert stored["components"][0]["inputs"]["probes"].keys() == set(probes)
    # The flat list of the earlier format alone would not have fitted.
    flat = json.dumps([m.to_dict() for m in metrics], indent=2)
    assert len(flat) > MEGABYTE
