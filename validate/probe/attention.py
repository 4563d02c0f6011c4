"""Attention implementations: the same weights, computed by different code.

transformers runs attention through one of several implementations, picked at load time
(``attn_implementation=``) or later (``model.set_attn_implementation``): ``sdpa`` (the default
where a model supports it), ``eager`` (the default elsewhere, and what users pick for
``output_attentions=True``), and kernels that need a GPU. They are not numerically alike in
low precision: eager adds ``finfo(dtype).min`` to masked scores, so in fp16 a fully masked row
(the first positions of a left-padded prompt) becomes ``-inf`` everywhere once any score is
below about -16, and softmax turns that row into NaN; sdpa's masking does not. A conversion
is judged, and its islands are searched, under every implementation a user can pick on the
machine at hand: the model's default, ``eager``, and ``sdpa`` where the model supports it.

Example:
    >>> choices = attention_choices(model)
    >>> for name in choices.others:
    ...     with attention(model, name):
    ...         outputs = run_probes(model, inputs, device)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from precision_convert.validation.probe.execute import RUN_ERRORS, Outputs

#: Implementations judged besides the default, in this order. Flash attention (a CUDA kernel)
#: is recorded as not judged; flex attention is left out.
SWITCHABLE = ("eager", "sdpa")
#: What a model without switchable attention records (no attention, or not transformers').
NOT_SWITCHABLE = "the model has no attention implementation to choose"


@dataclass(frozen=True)
class AttentionChoices:
    """The attention implementation a model runs under by default, the others judged, and
    those not judged with the reason (for the certificate)."""

    default: str | None
    others: tuple[str, ...] = ()
    not_judged: dict[str, str] = field(default_factory=dict)

    @property
    def judged(self) -> tuple[str, ...]:
        return (self.default, *self.others) if self.default else ()

    def to_json(self) -> dict[str, Any]:
        return {
            "default": self.default,
            "judged": list(self.judged),
            "not_judged": dict(self.not_judged),
        }


def current(model: Any) -> str | None:
    """The attention implementation ``model`` runs under now (None: no such setting)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    return name if isinstance(name, str) else None


def _has_attention(model: Any) -> bool:
    """Whether some module computes attention (a config alone does not: a CNN has one too,
    and judging it again would only repeat the same numbers)."""
    return any("Attention" in type(m).__name__ for m in model.modules())


def attention_choices(model: Any) -> AttentionChoices:
    """Which implementations ``model`` (as loaded, so under its default) is judged under."""
    default = current(model)
    switchable = hasattr(model, "set_attn_implementation") and _has_attention(model)
    if default is None or not switchable:
        return AttentionChoices(None, (), {"*": NOT_SWITCHABLE})
    name = type(model).__name__
    others: list[str] = []
    skipped: dict[str, str] = {}
    can_switch = getattr(type(model), "_can_set_attn_implementation", lambda: True)()
    for impl in SWITCHABLE:
        if impl == default:
            continue
        if impl == "sdpa" and not getattr(model, "_supports_sdpa", False):
            skipped[impl] = f"{name} does not support it"
        elif not can_switch:
            skipped[impl] = f"{name} cannot switch its attention after loading"
        else:
            others.append(impl)
    skipped["flash_attention_2"] = "needs a CUDA GPU and the flash-attn package"
    return AttentionChoices(default, tuple(others), skipped)


@contextmanager
def attention(model: Any, name: str | None) -> Iterator[Any]:
    """``model`` computing attention with ``name`` inside the block (None: as it is), its own
    implementation restored after.

    Raises:
        ValueError: the model did not take ``name`` (transformers may only warn).
    """
    before = current(model)
    if name is None or name == before:
        yield model
        return
    try:
        yield switch(model, name)
    finally:
        if before is not None and current(model) != before:
            model.set_attn_implementation(before)


def switch(model: Any, name: str) -> Any:
    """``model`` set to compute attention with ``name``, as a user would set it.

    Raises:
        ValueError: the model did not take ``name`` (transformers may only warn).
    """
    model.set_attn_implementation(name)
    if current(model) != name:
        raise ValueError(f"{type(model).__name__} did not switch to {name} attention")
    return model


def outputs_by_attention(
    model: Any, choices: AttentionChoices, run: Callable[[Any], Outputs]
) -> tuple[AttentionChoices, dict[str, Outputs]]:
    """``run(model)`` under each of ``choices.others``: the outputs per implementation, and
    the choices with any implementation the model would not switch to or run under moved to
    ``not_judged`` (with the error)."""
    outputs: dict[str, Outputs] = {}
    skipped = dict(choices.not_judged)
    for name in choices.others:
        try:
            with attention(model, name):
                outputs[name] = run(model)
        except RUN_ERRORS as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            skipped[name] = f"the fp32 model fails under it: {type(exc).__name__}: {first}"
    judged = replace(choices, others=tuple(outputs), not_judged=skipped)
    return judged, outputs
