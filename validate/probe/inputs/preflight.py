"""User inputs checked against the model before any work: ``--inputs`` and JSONL
``--calibration-data`` alike.

What a model cannot take is the user's to fix, so it is refused at once (exit 2, the file and
the argument named) rather than found out by running: an argument ``forward`` does not take
(``--inputs``; JSONL lines are checked by name when their probes are built), a token id outside
the vocabulary, a sequence longer than the model's position limit. The last one matters most:
a model with rotary positions runs a 200,000-token line rather than failing, for minutes, on
attention whose cost grows with the square of the length. Text lines are the exception: the
probes cut each to the position limit with the model's tokenizer (text is not written to fit a
model), and a warning says which lines were cut and to how many tokens.

The model is only a skeleton here (parameters on the meta device), built once per component
that the inputs address; a model that cannot be built is left for validation to report (a
refusal of its remote code, say, goes into a failing certificate).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from precision_convert.conversion.io.source import ModelSource, PipelineSource, Source
from precision_convert.conversion.runtime.builders import build_skeleton
from precision_convert.core.errors import InputError
from precision_convert.validation.probe.inputs.model_inputs import Probe
from precision_convert.validation.probe.inputs.token_probes import (
    UNKNOWN_POSITION_LIMIT,
    token_spec,
)
from precision_convert.validation.probe.inputs.tokenizers import ProbeTokenizer, tokenizer_for
from precision_convert.validation.probe.inputs.userdata import CalibrationData, addressed, to_tensor

logger = logging.getLogger(__name__)


def check_user_inputs(
    opened: Source,
    *,
    data: CalibrationData | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
    inputs_path: str | Path | None = None,
    trust_remote_code: bool = False,
    warn_of_cuts: bool = True,
) -> None:
    """Refuse ``--inputs`` tensors and JSONL ``--calibration-data`` records the model cannot
    take, and warn about text lines the probes will cut (see the module docstring); not with
    ``warn_of_cuts=False``, for a caller whose validation checks the same data again.

    Raises:
        InputError: naming the file, the line (calibration data) and the argument.
    """
    if inputs is None and data is None:
        return
    models = dict(opened.components) if isinstance(opened, PipelineSource) else {"": opened}
    if inputs is not None and isinstance(opened, PipelineSource):
        stray = sorted(k for k in inputs if k.partition("/")[0] not in models or "/" not in k)
        if stray:
            raise InputError(
                f"--inputs: {', '.join(stray)} names no component of the pipeline (its inputs "
                f"are '<component>/<argument>'; components: {', '.join(models)})",
                inputs_path,
            )
    for name, model in models.items():
        calls = list(_calls(name, inputs, inputs_path, data))
        texts = data.texts if warn_of_cuts and data is not None else ()
        if not calls and not texts:
            continue
        try:
            skeleton = build_skeleton(model, trust_remote_code=trust_remote_code)
        except InputError:  # validation says why it cannot build it, in its own way
            continue
        for where, path, arguments in calls:
            _check_call(skeleton, model, where, path, arguments, names=where == "--inputs")
        # After the skeleton: loading a tokenizer reads the model's config too, and one the
        # library rejects was left to validation above.
        tokenizer = tokenizer_for(model.root) if texts else None
        if tokenizer is not None and tokenizer.usable and data is not None:
            _warn_of_cut_lines(skeleton, tokenizer, data)


def _calls(
    component: str,
    inputs: Mapping[str, torch.Tensor] | None,
    inputs_path: str | Path | None,
    data: CalibrationData | None,
) -> Iterator[tuple[str, Path | None, dict[str, Any]]]:
    """(what to call it in a message, its file, its arguments) for each call on
    ``component``."""
    if inputs is not None:
        prefix = f"{component}/"
        mine = (
            {k.removeprefix(prefix): v for k, v in inputs.items() if k.startswith(prefix)}
            if component
            else dict(inputs)
        )
        if mine:
            yield "--inputs", Path(inputs_path) if inputs_path is not None else None, mine
    if data is None:
        return
    for line, record in data.records:
        mine = addressed(record, component)
        if mine:
            yield f"--calibration-data: line {line}", data.path, mine


def _check_call(
    skeleton: Any,
    model: ModelSource,
    where: str,
    path: Path | None,
    arguments: Mapping[str, Any],
    *,
    names: bool,
) -> None:
    cls = type(skeleton).__name__
    takes = _arguments(skeleton)
    if names and takes is not None:
        unknown = sorted(set(arguments) - takes)
        if unknown:
            raise InputError(
                f"{where}: {', '.join(unknown)}: not an argument of {cls}.forward "
                f"(it takes {', '.join(sorted(takes))})",
                path,
            )
    tensors = {
        k: v if isinstance(v, torch.Tensor) else to_tensor(v)
        for k, v in arguments.items()
        if k in ("input_ids", "decoder_input_ids", "text")
    }
    spec = token_spec(skeleton, Probe("preflight", "forward", tensors), None, "")
    if spec is None:
        return
    bounds = [(spec.arg, spec.limit if spec.limit != UNKNOWN_POSITION_LIMIT else None)]
    if spec.decoder_start is not None and "decoder_input_ids" in tensors:
        bounds.append(("decoder_input_ids", spec.decoder_limit))
    for arg, limit in bounds:
        ids = tensors[arg]
        if ids.is_floating_point() or ids.dtype == torch.bool or not ids.numel():
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= spec.vocab:
            raise InputError(
                f"{where}: {arg!r} holds token id {low if low < 0 else high}, outside "
                f"{cls}'s vocabulary (ids 0 to {spec.vocab - 1})",
                path,
            )
        # A limit that is only the sweep's default (the config states none) is no bound: a
        # model that truly has 512 positions stops at its position table anyway.
        if limit is not None and ids.dim() and ids.shape[-1] > limit:
            raise InputError(
                f"{where}: {arg!r} is {ids.shape[-1]} tokens long, but {cls} "
                f"({model.config_name}) takes at most {limit} positions; shorten it",
                path,
            )


def _warn_of_cut_lines(skeleton: Any, tokenizer: ProbeTokenizer, data: CalibrationData) -> None:
    """Say which text lines the probes cut to the model's position limit (they truncate as
    :func:`~precision_convert.validation.probe.inputs.token_probes.text_rows` does: the limit,
    specials included)."""
    ids = torch.zeros(1, 1, dtype=torch.long)
    spec = token_spec(skeleton, Probe("preflight", "forward", {"input_ids": ids}), tokenizer, "")
    encode = tokenizer.tokenizer
    if spec is None or encode is None:
        return
    lengths = [len(encode(text, verbose=False)["input_ids"]) for text in data.texts]
    lines = data.text_lines or tuple(range(1, len(data.texts) + 1))
    cut = [(line, n) for line, n in zip(lines, lengths, strict=True) if n > spec.limit]
    if cut:
        shown = ", ".join(f"line {line}: {n} tokens" for line, n in cut[:3])
        logger.warning(
            "%s: --calibration-data: %d text line(s) longer than %s's %d positions are cut to "
            "their first %d tokens (%s%s)",
            data.path, len(cut), type(skeleton).__name__, spec.limit, spec.limit, shown,
            ", …" if len(cut) > 3 else "",
        )  # fmt: skip


def _arguments(model: Any) -> set[str] | None:
    """The keyword arguments ``forward`` takes; None when it takes any. transformers and
    diffusers forwards take ``**kwargs`` for attention plumbing only: their named parameters
    are the inputs."""
    parameters = inspect.signature(model.forward).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    roots = {c.__module__.partition(".")[0] for c in type(model).__mro__}
    if roots & {"transformers", "diffusers"}:  # remote code subclasses a library base too
        return named
    return None if any(p.kind == p.VAR_KEYWORD for p in parameters) else named
