"""Recorded subsets of a sweep's probes, for runs that need not cover every probe.

Some runs check something every probe has already checked another way: a load path that
never decides the verdict, a cross of two ways each run on every probe, fp32 under a second
attention implementation that computes the default's function. They run on a *spot subset*
(:func:`spot_inputs`) the certificate names. What a spot subset cannot stand in for is a
probe whose attention mask hides positions (:func:`padded`): there attention
implementations differ in how they mask, so such probes always run.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from precision_convert.validation.probe.inputs.model_inputs import ModelInputs, Probe
from precision_convert.validation.probe.inputs.sizes import DECLARED


def spot_inputs(inputs: ModelInputs, *, crossed: bool = False) -> ModelInputs:
    """The probes a non-deciding way is checked on (its verdict is shown, never decides):
    every probe no sweep made, every probe at a size the model declares (the explicit-dtype
    load drops fp32 islands, and the overflow they hold may show only at 1024 px or 49
    frames), and the first and last of each other kind the sweep made (the shortest and
    longest length, the first and last vocabulary chunk and timestep), already resolved
    against the fp32 outputs. The certificate names them.

    ``crossed``: for a way crossing two ways each checked on every probe (the library's load
    under another attention implementation), without the vocabulary chunks: reaching every
    embedding row is what those two did; the cross is about the attention, which the
    padding, length and position probes exercise."""
    kinds: dict[str, list[str]] = {}
    for probe in inputs.probes:
        if probe.sweep and crossed and probe.sweep.get("kind") == "vocabulary":
            continue
        if probe.sweep:
            kinds.setdefault(str(probe.sweep.get("kind")), []).append(probe.name)
    wanted = {names[0] for names in kinds.values()} | {names[-1] for names in kinds.values()}
    kept = tuple(
        p
        for p in inputs.probes
        if not p.sweep or p.name in wanted or p.sweep.get("kind") == DECLARED
    )
    return replace(inputs, probes=kept)


def padded(probe: Probe) -> bool:
    """Whether ``probe`` hides positions from attention: real-token positions recorded, or
    an attention mask (any ``*attention_mask`` tensor) that is not all ones."""
    if probe.positions is not None:
        return True
    return any(
        key.endswith("attention_mask") and torch.is_tensor(value) and not bool((value == 1).all())
        for key, value in probe.kwargs.items()
    )


def attention_spot(inputs: ModelInputs) -> ModelInputs:
    """The probes fp32 runs again under another attention implementation: every probe with
    padding and the spot subset without the vocabulary chunks (``crossed``), in sweep order,
    but no free generation (its fp32 outputs are never compared: candidates' are judged for
    NaN/Inf only, and its teacher-forced twin is checked). The default's outputs stand in for
    the rest when these agree with them."""
    spot = {p.name for p in spot_inputs(inputs, crossed=True).probes}
    kept = tuple(p for p in inputs.probes if (p.name in spot or padded(p)) and not p.finite_only)
    return replace(inputs, probes=kept)


def one_key_rows_at_ends(inputs: ModelInputs) -> ModelInputs:
    """The probes the library's own load runs under another attention implementation when
    its compute format has fp32's exponent range (bf16): every probe but the first-position
    rows between the spot ends. Those rows attend to one key (or a cached BOS): where no
    score can overflow that fp32's does not, implementations differ there by rounding only,
    which the kept rows judge; the default attention ran every row."""
    spot = {p.name for p in spot_inputs(inputs).probes}
    kept = tuple(
        p for p in inputs.probes if p.sweep.get("kind") != "first-position" or p.name in spot
    )
    return replace(inputs, probes=kept)
