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

import torch

from precision_convert.core.errors import one_line
from precision_convert.core.progress import stage
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs, Probe, config_value
from precision_convert.validation.probe.inputs.spots import padded
from precision_convert.validation.probe.run.execute import RUN_ERRORS, Outputs

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
    #: Per other implementation, the probes whose fp32 baseline under it is the default's
    #: fp32 outputs (:func:`outputs_by_attention` says when), with why.
    baseline_from_default: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Per other implementation whose fp32 outputs differed from the default's on the probes
    #: checked, why every probe ran under it.
    fp32_every_probe: dict[str, str] = field(default_factory=dict)

    @property
    def judged(self) -> tuple[str, ...]:
        return (self.default, *self.others) if self.default else ()

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "default": self.default,
            "judged": list(self.judged),
            "not_judged": dict(self.not_judged),
        }
        if self.baseline_from_default:
            record["baseline_from_default"] = dict(self.baseline_from_default)
        if self.fp32_every_probe:
            record["fp32_every_probe"] = dict(self.fp32_every_probe)
        return record


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
    implementation restored after. Progress reported inside is labelled with the switch, so
    the same probes run again under another implementation read as a run of their own.

    Raises:
        ValueError: the model did not take ``name`` (transformers may only warn).
    """
    before = current(model)
    if name is None or name == before:
        yield model
        return
    try:
        with stage(f"{name} attention"):
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


#: Relative L2 distance within which two fp32 runs of one model under different attention
#: implementations compute the same function: their rounding differs by about 1e-6; a model
#: whose implementations compute different things (a softcap one of them skips) is far past it.
SAME_FUNCTION = 1e-4


def eager_score_bytes(model: Any, probe: Probe) -> int:
    """fp32 bytes eager attention holds for ``probe`` at its peak: the scores of every head
    and their softmax, each batch x heads x length^2 (0 where that cannot be told)."""
    heads = config_value(getattr(model, "config", None), "num_attention_heads", "n_head")
    ids = next(
        (v for k, v in probe.kwargs.items() if k.endswith("input_ids") and torch.is_tensor(v)),
        None,
    )
    if not isinstance(heads, int) or ids is None or ids.dim() != 2:
        return 0
    batch, length = ids.shape
    return 2 * 4 * batch * heads * length * length


def outputs_by_attention(
    model: Any,
    choices: AttentionChoices,
    inputs: ModelInputs,
    default: Outputs,
    run: Callable[[Any, ModelInputs], Outputs],
    *,
    allowance: int,
    spot: Callable[[ModelInputs], ModelInputs] | None = None,
) -> tuple[AttentionChoices, dict[str, Outputs]]:
    """The fp32 outputs on ``inputs`` (resolved) under each of ``choices.others``, and the
    choices with any implementation the model would not switch to or run under moved to
    ``not_judged`` (with the error).

    In fp32 the implementations compute one function (their rounding differs by about 1e-6)
    except where their masking differs, so not every probe runs again: the probes with
    padding (:func:`~.spots.padded`) always run, and of the others those ``spot`` picks (None:
    every one) run and are checked against the ``default`` implementation's outputs. Under
    ``eager``, a probe whose score matrices take more than ``allowance`` bytes (the longest
    context of a wide model: 0.5 GB at 2048 tokens and 16 heads, quadratic in the length) does
    not run either. When every checked probe matches within :data:`SAME_FUNCTION`, the
    default's outputs stand in as the baseline of the probes not run (recorded in
    ``baseline_from_default``); otherwise every probe runs (recorded in ``fp32_every_probe``).
    Candidates are still run under each implementation on every probe.
    """
    outputs: dict[str, Outputs] = {}
    skipped = dict(choices.not_judged)
    stand_in: dict[str, dict[str, Any]] = {}
    every: dict[str, str] = {}
    checked = {p.name for p in (spot(inputs) if spot is not None else inputs).probes}
    for name in choices.others:
        try:
            with attention(model, name):
                ran = _fp32_under(model, name, inputs, default, run, allowance, checked)
        except RUN_ERRORS as exc:
            skipped[name] = f"the fp32 model fails under it: {one_line(exc)}"
            continue
        outputs[name] = ran.outputs
        if ran.stood_in:
            stand_in[name] = ran.record(name, allowance)
        elif ran.differed:
            every[name] = (
                f"fp32 {name} differed from the default beyond {SAME_FUNCTION:g} relative L2 "
                f"on the probes checked ({', '.join(ran.compared)}): every probe ran under it"
            )
    judged = replace(
        choices,
        others=tuple(outputs),
        not_judged=skipped,
        baseline_from_default=stand_in,
        fp32_every_probe=every,
    )
    return judged, outputs


@dataclass(frozen=True)
class _Ran:
    """fp32 outputs under one other implementation and how they were made."""

    outputs: Outputs
    stood_in: tuple[str, ...]  # probes whose outputs are the default's
    large: frozenset[str]  # of those, the ones over the memory allowance
    compared: tuple[str, ...]  # probes run and checked against the default
    differed: bool  # the check failed, so every probe ran

    def record(self, name: str, allowance: int) -> dict[str, Any]:
        """The certificate's ``baseline_from_default`` entry for implementation ``name``."""
        reasons = []
        if self.large:
            reasons.append(
                f"{name} attention's fp32 scores exceed the probe memory allowance "
                f"({allowance / 2**20:.0f} MiB) on {len(self.large)}"
            )
        rest = len(self.stood_in) - len(self.large)
        if rest:
            reasons.append(f"{rest} have no padding, where the two compute one function in fp32")
        return {
            "probes": sorted(self.stood_in),
            "why": (
                f"{'; '.join(reasons)}; on the {len(self.compared)} probes checked fp32 "
                f"{name} matched the default within {SAME_FUNCTION:g} relative L2"
            ),
            "checked_on": list(self.compared),
        }


def _fp32_under(
    model: Any,
    name: str,
    inputs: ModelInputs,
    default: Outputs,
    run: Callable[[Any, ModelInputs], Outputs],
    allowance: int,
    checked: set[str],
) -> _Ran:
    """``model``'s outputs under implementation ``name`` (already switched to), run on the
    padded probes and the ``checked`` ones (see :func:`outputs_by_attention`)."""

    def only(names: set[str]) -> ModelInputs:
        return replace(inputs, probes=tuple(p for p in inputs.probes if p.name in names))

    large = (
        {p.name for p in inputs.probes if eager_score_bytes(model, p) > allowance}
        if name == "eager"
        else set()
    )
    masked = {p.name for p in inputs.probes if padded(p)}
    first = (masked | checked) - large
    rest = {p.name for p in inputs.probes} - first
    ran = run(model, only(first)) if first else {}
    compared = tuple(p.name for p in inputs.probes if p.name in first and p.name not in masked)
    agreed = bool(compared) and same_function(default, {n: ran[n] for n in compared})
    if rest and not agreed:
        ran.update(run(model, only(rest)))
        return _Ran(ran, (), frozenset(), compared, bool(compared))
    for probe in rest:
        ran[probe] = default[probe]
    order = tuple(p.name for p in inputs.probes if p.name in rest)
    return _Ran(ran, order, frozenset(large), compared, False)


def same_function(default: Outputs, other: Outputs) -> bool:
    """Whether every output of ``other`` is ``default``'s within :data:`SAME_FUNCTION` (same
    shapes, NaN/Inf at the same places)."""
    for probe, produced in other.items():
        reference = default.get(probe)
        if reference is None:
            return False
        for key, got in produced.items():
            want = reference.get(key)
            if want is None or want.shape != got.shape:
                return False
            finite = want.isfinite()
            if not torch.equal(finite, got.isfinite()):
                return False
            want, got = want[finite].double(), got[finite].double()
            scale = torch.linalg.vector_norm(want)
            if torch.linalg.vector_norm(got - want) > SAME_FUNCTION * scale:
                return False
    return True
