"""Coverage sweeps: after a layout is chosen, the probes that vary what changes activations.

A model accepted by one layout (:func:`~.layouts.input_candidates`) has still seen a sliver of
its input space: 2×12 random ids, one timestep. Overflow hides elsewhere — one rare token's
embedding, positions past the first few dozen, the first denoising step at t=999. A sweep
keeps the chosen probe first (its outputs are reused) and adds the probes of the model's
family:

- token models (:mod:`.token_probes`): the whole vocabulary in chunks, the special tokens,
  real text, doubling lengths and padded batches; short rows with ``position_ids`` offsets
  reaching the rest of the position table (:mod:`.positions`); every id at position 0,
  repeated ids, and fp32's greedy continuations for models that generate (:mod:`.contexts`);
- diffusion denoisers, autoencoders, vision and speech encoders (:mod:`.media_probes`):
  timesteps across the schedule and realistic conditioning, larger images, normalized-image
  contrast and longer audio;
- autoencoders and denoisers: the image side, latent side and frame count the model declares
  (:mod:`.sizes`);
- any model: the user's calibration data (:mod:`.user_probes`).

How much is swept is a coverage budget (:mod:`.budgets`): ``quick``, ``standard`` (default) or
``thorough``. Every probe records how it was made (``Probe.sweep``) so the certificate can be
replayed with :func:`replay`.

Example:
    >>> chosen, outputs = select_inputs(model, input_candidates(model), run_probes)
    >>> inputs = sweep(model, chosen, "standard", tokenizer)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from precision_convert.core.errors import CannotValidateError
from precision_convert.validation.probe.inputs.arguments import input_arguments
from precision_convert.validation.probe.inputs.budgets import (
    DEFAULT_LEVEL,
    Budget,
    budget_for,
    fit_budget,
    fit_model,
)
from precision_convert.validation.probe.inputs.context_probes import rebuilt_contexts
from precision_convert.validation.probe.inputs.contexts import context_probes
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.media_probes import (
    contrast_probes,
    image_size_probes,
    timestep_probes,
)
from precision_convert.validation.probe.inputs.model_inputs import (
    ModelInputs,
    Probe,
    seeded_generator,
    tensor_digest,
)
from precision_convert.validation.probe.inputs.positions import position_probes, token_limits
from precision_convert.validation.probe.inputs.sizes import declared_size_probes
from precision_convert.validation.probe.inputs.token_probes import (
    token_probes,
    token_spec,
    with_tokens,
)
from precision_convert.validation.probe.inputs.tokenizers import ProbeTokenizer, probe_tokenizer
from precision_convert.validation.probe.inputs.user_probes import user_probes
from precision_convert.validation.probe.inputs.userdata import CalibrationData


def usable(tokenizer: Any | None) -> ProbeTokenizer | None:
    """``tokenizer`` as a :class:`ProbeTokenizer` when it can be used, else None (its note, if
    any, is on the layout's candidates already)."""
    tok = probe_tokenizer(tokenizer)
    return tok if tok is not None and tok.usable else None


def sweep(
    model: Any,
    chosen: ModelInputs,
    level: str = DEFAULT_LEVEL,
    tokenizer: Any | None = None,
    *,
    data: CalibrationData | None = None,
    component: str = "",
    train_timesteps: int | None = None,
    memory: int | None = None,
    directory: Path | None = None,
) -> ModelInputs:
    """``chosen`` plus the probes ``level`` sweeps for this model, plus user data.

    The chosen probes stay first and unchanged, so their outputs can be reused. Inputs the
    user supplied (``origin == "file"``) replace the built ones: nothing is swept, but
    ``data`` (``--calibration-data``) still adds its probes.

    Args:
        model: the (fp32) model the inputs are for.
        chosen: the layout :func:`~.execute.select_inputs` kept.
        level: ``quick``, ``standard`` or ``thorough`` (see :data:`~.budgets.BUDGETS`).
        tokenizer: the model's own tokenizer (a library one or a :class:`ProbeTokenizer`), for
            real text, special tokens and padding (None or unusable: seeded ids only).
        data: user calibration data, whose probes are appended.
        component: the pipeline component this model is ("" for a single model); user data
            keys ``<component>/<argument>`` address it.
        train_timesteps: the training schedule's length (a pipeline's scheduler config);
            default 1000.
        memory: the memory budget of a block-wise validation (a model that does not fit):
            probes are sized to it and few, since each is a pass over every block (see
            :func:`~.budgets.fit_budget`); the certificate notes how much of the vocabulary
            was reached.
        directory: where the model was loaded from (its feature extractor pads audio).
    """
    budget = (
        fit_budget(budget_for(level), model, memory)
        if memory
        else fit_model(budget_for(level), model)
    )
    # A tokenizer the layout found unusable (its note is there already) is not used here.
    tok = usable(tokenizer) if (chosen.tokenizer or {}).get("usable", True) else None
    probes: list[Probe] = []
    notes: list[str] = []
    sizes: dict[str, Any] = {}
    if chosen.origin != "file":
        made, made_notes = _built(model, chosen, budget, tok, train_timesteps)
        probes += made
        notes += made_notes
        declared, sizes = declared_size_probes(model, chosen, budget, directory)
        probes += declared
    if data is not None:
        probes += user_probes(
            model, chosen, data, tokenizer=tok, budget=budget, component=component
        )
    first = chosen.probes[0] if chosen.probes else None
    spec = (
        token_spec(model, first, tok, chosen.task)
        if first is not None and first.method == "forward" and chosen.task != "pipeline"
        else None
    )
    taken = {p.name for p in chosen.probes}
    unique = []
    for probe in probes:
        if probe.name not in taken:
            taken.add(probe.name)
            unique.append(probe)
    return replace(
        chosen,
        probes=(*chosen.probes, *unique),
        notes=(*chosen.notes, *notes),
        coverage=budget.level,
        memory=memory,
        limits=token_limits(spec) if spec is not None else None,
        sizes=sizes or None,
        forward_arguments=(
            input_arguments(model.forward)
            if first is not None and first.method == "forward"
            else ()
        ),
    )


@dataclass(frozen=True)
class SweepSettings:
    """A coverage level, the user's calibration data and time budget (seconds, ``--budget``;
    None: none): what every model of a run sweeps."""

    level: str = DEFAULT_LEVEL
    data: CalibrationData | None = None
    budget: float | None = None

    def apply(
        self,
        model: Any,
        chosen: ModelInputs,
        *,
        tokenizer: Any | None = None,
        component: str = "",
        directory: Path | None = None,
        memory: int | None = None,
    ) -> ModelInputs:
        """:func:`sweep` for ``model`` (``directory``: where it was loaded from, whose
        pipeline scheduler sets the timestep range; ``memory``: see :func:`sweep`)."""
        return sweep(
            model,
            chosen,
            self.level,
            tokenizer,
            data=self.data,
            component=component,
            train_timesteps=train_timesteps_of(directory) if directory is not None else None,
            memory=memory,
            directory=directory,
        )


def train_timesteps_of(directory: Path) -> int | None:
    """``num_train_timesteps`` of the scheduler next to a pipeline component, if any."""
    import json

    for candidate in (directory.parent / "scheduler", directory / "scheduler"):
        config = candidate / "scheduler_config.json"
        if config.is_file():
            try:
                value = json.loads(config.read_text("utf-8")).get("num_train_timesteps")
            except (OSError, ValueError, AttributeError):
                return None
            return int(value) if isinstance(value, int | float) and value > 1 else None
    return None


def replay(
    model: Any,
    description: Mapping[str, Any],
    *,
    tokenizer: Any | None = None,
    data: CalibrationData | None = None,
    component: str = "",
    train_timesteps: int | None = None,
    directory: Path | None = None,
) -> ModelInputs:
    """Rebuild the probes a certificate's ``inputs`` record describes, and check them
    (``directory``: the source's, whose feature extractor padded its audio probes).

    The layout is rebuilt from the recorded seed and layout index, the sweep from the recorded
    coverage level; every rebuilt argument must match its recorded sha256.

    Raises:
        CannotValidateError: the record is not replayable here (inputs from a file, another
            model) or a rebuilt tensor differs from the record.
    """
    if description.get("origin") == "file":
        raise CannotValidateError("these probes came from --inputs: replay them from that file")
    seed = int(description.get("seed", 0))
    layout = int(description.get("layout", 0))
    found = list(input_candidates(model, seed=seed, tokenizer=tokenizer))
    if layout >= len(found):
        raise CannotValidateError(f"layout {layout} does not exist for {type(model).__name__}")
    inputs = found[layout]
    level = description.get("coverage")
    if level:
        inputs = sweep(
            model,
            inputs,
            str(level),
            tokenizer,
            data=data,
            component=component,
            train_timesteps=train_timesteps,
            memory=description.get("memory_budget"),
            directory=directory,
        )
    recorded: Mapping[str, Any] = description.get("probes", {})
    probes = {p.name: p for p in (*inputs.probes, *rebuilt_contexts(model, inputs, recorded))}
    missing = [name for name in recorded if name not in probes]
    if missing:
        raise CannotValidateError(f"cannot rebuild probes {', '.join(missing)}")
    kept = tuple(probes[name] for name in recorded)
    for probe in kept:
        _check_digests(probe.name, probe.kwargs, recorded[probe.name].get("args", {}))
    return replace(inputs, probes=kept)


def _check_digests(where: str, value: Any, record: Any) -> None:
    if isinstance(value, torch.Tensor):
        if not isinstance(record, Mapping) or record.get("sha256") != tensor_digest(value):
            raise CannotValidateError(f"replayed {where} differs from the recorded one")
    elif isinstance(value, Mapping) and isinstance(record, Mapping):
        for key, item in value.items():
            _check_digests(f"{where}/{key}", item, record.get(key))


def _built(
    model: Any,
    chosen: ModelInputs,
    budget: Budget,
    tokenizer: ProbeTokenizer | None,
    train_timesteps: int | None,
) -> tuple[list[Probe], list[str]]:
    """The probes the budget sweeps for this model's family (none for a whole pipeline)."""
    if chosen.task == "pipeline" or not chosen.probes:
        return [], []
    first = chosen.probes[0]
    if chosen.task == "vae" and first.method == "encode":
        return image_size_probes(chosen, budget), []
    if first.method != "forward":
        return [], []
    probes: list[Probe] = []
    notes: list[str] = []
    if chosen.task == "denoise" and "timestep" in first.kwargs:
        probes += timestep_probes(model, chosen, budget, train_timesteps)
    spec = token_spec(model, first, tokenizer, chosen.task)
    if spec is not None:
        made, made_notes = token_probes(spec, chosen, budget, tokenizer)
        probes += made
        notes += made_notes
        trimmed = fit_model(budget_for(budget.level), model, logits=False).tokens_per_probe
        probes += position_probes(
            model,
            spec,
            chosen,
            budget,
            probes,
            tokens=lambda ids: with_tokens(spec, first.kwargs, ids),
            generator=lambda name: seeded_generator(chosen.seed, name),
            trimmed_tokens=trimmed,
        )
        probes += _contexts(model, spec, chosen, budget, tokenizer, made, trimmed, notes)
    if chosen.task in ("vision", "clip") and not any(
        k in first.kwargs for k in ("input_ids", "text")
    ):
        probes += contrast_probes(chosen, budget)
    return probes, notes


def _contexts(
    model: Any,
    spec: Any,
    chosen: ModelInputs,
    budget: Budget,
    tokenizer: ProbeTokenizer | None,
    made: list[Probe],
    trimmed: int,
    notes: list[str],
) -> list[Probe]:
    """The context probes (:mod:`.contexts`), fed at position 0 the ids the vocabulary probes
    hold when the level samples them; none in a block-wise run, where each probe is a pass
    streaming every block (``notes`` says so, and gets what could not run)."""
    if budget.memory_bound:
        notes.append(
            "block-wise memory budget: first-position, repeated-ids and generation probes not "
            "run; validate where the model fits for them"
        )
        return []
    vocabulary = [p for p in made if p.sweep.get("kind") == "vocabulary"]
    sampled = vocabulary[0].kwargs[spec.arg] if vocabulary else None
    probes, context_notes = context_probes(
        model, spec, chosen, budget, tokenizer, trimmed_tokens=trimmed, sampled=sampled
    )
    notes += context_notes
    return probes
