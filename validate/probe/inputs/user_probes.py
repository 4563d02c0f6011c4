"""Probes from the user's calibration data (``--calibration-data``), for any model family.

Text lines go through the model's tokenizer and are packed into probes of the budget's tokens;
JSONL records become probes of the arguments they name (``<component>/<argument>`` keys
address one component of a pipeline). :mod:`.userdata` reads the file; this builds its probes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from precision_convert.core.errors import InputError
from precision_convert.validation.probe.inputs.budgets import Budget
from precision_convert.validation.probe.inputs.media_probes import encode_decode
from precision_convert.validation.probe.inputs.model_inputs import (
    FromOutput,
    ModelInputs,
    Probe,
    library_of,
    parameters_of,
)
from precision_convert.validation.probe.inputs.token_probes import (
    finish_rows,
    padded_positions,
    token_spec,
    with_tokens,
)
from precision_convert.validation.probe.inputs.tokenizers import ProbeTokenizer, pad_rows
from precision_convert.validation.probe.inputs.userdata import (
    CalibrationData,
    addressed,
    decoder_start,
    to_tensor,
)


def user_probes(
    model: Any,
    chosen: ModelInputs,
    data: CalibrationData,
    *,
    tokenizer: ProbeTokenizer | None,
    budget: Budget,
    component: str = "",
) -> list[Probe]:
    """The probes ``data`` adds for ``model`` (a pipeline's ``component`` when named).

    Raises:
        InputError: (naming the file) text without a tokenizer or for a model that takes no
            token ids; a JSONL line naming arguments the model does not take.
    """
    if data.texts:
        return _text_probes(model, chosen, data, tokenizer, budget, component)
    return _record_probes(model, chosen, data, budget, component)


def _text_probes(
    model: Any,
    chosen: ModelInputs,
    data: CalibrationData,
    tokenizer: ProbeTokenizer | None,
    budget: Budget,
    component: str,
) -> list[Probe]:
    name = type(model).__name__
    first = chosen.probes[0] if chosen.probes else None
    spec = token_spec(model, first, tokenizer, chosen.task) if first is not None else None
    if first is None or spec is None or tokenizer is None:
        if component:  # a pipeline component that takes no text: the data is for another
            return []
        why = (
            f"{name} takes no token ids"
            if spec is None
            else f"{name} ships no tokenizer to turn text into token ids"
        )
        raise InputError(
            f"--calibration-data holds text lines, but {why}; give JSONL of model inputs "
            '(one object per line, e.g. {"input_ids": [[1, 2, 3]]}) instead',
            data.path,
        )
    # Lines packed greedily into probes of at most tokens_per_probe (rows x longest row).
    limit = spec.fixed - 1 if spec.fixed is not None else spec.limit
    encoded = [tokenizer.encode(line, limit) or [spec.pad] for line in data.texts]
    if max(max(ids) for ids in encoded) >= spec.vocab:
        raise InputError(
            f"--calibration-data: the tokenizer's ids exceed {name}'s vocabulary", data.path
        )
    sizes = [len(ids) for ids in encoded]
    groups: list[list[int]] = []
    longest = 0
    for index, size in enumerate(sizes):
        if groups and (len(groups[-1]) + 1) * max(longest, size) <= budget.tokens_per_probe:
            groups[-1].append(index)
            longest = max(longest, size)
        else:
            groups.append([index])
            longest = size
    probes = []
    for number, group in enumerate(groups, 1):
        rows = [encoded[i] for i in group]
        ids, mask = pad_rows(rows, spec.pad, width=limit if spec.fixed is not None else None)
        kwargs = with_tokens(spec, first.kwargs, finish_rows(spec, ids), mask)
        lines = data.text_lines or tuple(range(1, len(data.texts) + 1))
        how = {
            "kind": "user-text",
            "file": data.path.name,  # the name only: the certificate is published
            "lines": [lines[group[0]], lines[group[-1]]],  # first and last file line
            "samples": len(group),
        }
        probes.append(
            Probe(
                f"forward:user-text-{number}",
                "forward",
                kwargs,
                sweep=how,
                max_output=budget.max_output,
                positions=padded_positions(mask),
            )
        )
    return probes


def _record_probes(
    model: Any, chosen: ModelInputs, data: CalibrationData, budget: Budget, component: str
) -> list[Probe]:
    first = chosen.probes[0] if chosen.probes else None
    autoencoder = first is not None and first.method == "encode"
    method = "encode" if autoencoder else "forward"
    target = getattr(model, method) if autoencoder else model.forward
    params = parameters_of(target)
    # transformers/diffusers forwards take **kwargs for attention plumbing, not inputs: their
    # named parameters are the inputs. Other code may read inputs from **kwargs.
    open_kwargs = library_of(model) not in ("transformers", "diffusers") and any(
        p.kind == p.VAR_KEYWORD for p in inspect.signature(target).parameters.values()
    )
    name = type(model).__name__
    probes: list[Probe] = []
    for line, record in data.records:
        mine = addressed(record, component)
        if not mine:
            if not component:
                raise InputError(
                    f"--calibration-data: line {line} names no argument of {name}", data.path
                )
            continue
        unknown = sorted(set(mine) - set(params)) if not open_kwargs else []
        if component and len(unknown) == len(mine):
            continue  # a line for another component of the pipeline
        if unknown:
            raise InputError(
                f"--calibration-data: line {line} names {', '.join(unknown)}, which "
                f"{name}.{method} does not take (it takes {', '.join(params)})",
                data.path,
            )
        kwargs: dict[str, Any] = {k: to_tensor(v) for k, v in mine.items()}
        if first is not None:
            for key, value in first.kwargs.items():  # flags such as use_cache=False
                if key not in kwargs and not isinstance(value, torch.Tensor | FromOutput):
                    kwargs.setdefault(key, value)
            ids = kwargs.get("input_ids")
            if (
                "decoder_input_ids" in first.kwargs
                and "decoder_input_ids" not in kwargs
                and isinstance(ids, torch.Tensor)
                and ids.dim() == 2
            ):
                start = decoder_start(model)
                kwargs["decoder_input_ids"] = torch.cat(
                    [torch.full((ids.shape[0], 1), start, dtype=ids.dtype), ids[:, :-1]], 1
                )
        how = {"kind": "user-jsonl", "file": data.path.name, "line": line}
        label = f"user-{line}"
        if autoencoder:
            decode = next((p for p in chosen.probes if p.method == "decode"), None)
            probes += encode_decode(f":{label}", kwargs, decode, how, budget)
        else:
            probes.append(
                Probe(
                    f"forward:{label}", "forward", kwargs, sweep=how, max_output=budget.max_output
                )
            )
    return probes
