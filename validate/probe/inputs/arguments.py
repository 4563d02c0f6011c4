"""What range of each forward argument the probes ran: the certificate's ``inputs.arguments``.

A probe set can vary the latents and the timestep yet feed one conditioning value to every
probe (SDXL's ``time_ids`` at one size), and a model is then certified for inputs it never
saw. So per argument of ``forward`` that takes an input (not a flag), the record says how many
distinct values the probes fed and their range (per column for a row of a few scalars such as
``time_ids``: original size, crop, target size), and names as not covered every argument never
fed or fed one value in every probe.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from precision_convert.validation.probe.inputs.model_inputs import (
    Probe,
    parameters_of,
    tensor_digest,
)

#: A 2-D argument with at most this many columns is a row of scalar conditioning per sample
#: (SDXL's six ``time_ids``, SVD's three ``added_time_ids``): its range is kept per column.
SCALAR_COLUMNS = 8
NEVER_FED = "never fed"
ONE_VALUE = "one value in every probe"


def input_arguments(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of ``forward`` that take an input: those without a flag's default (a
    bool or a number); ``*args`` and ``**kwargs`` left out."""
    out = []
    for name, parameter in parameters_of(forward).items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = parameter.default
        if default is inspect.Parameter.empty or default is None:
            out.append(name)
    return tuple(out)


def _tensors(name: str, value: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """``value``'s tensors, a dict's under ``name.key``."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(f"{name}.{key}", item)


def argument_ranges(probes: Iterable[Probe], arguments: Iterable[str]) -> dict[str, Any]:
    """Per argument fed to the ``forward`` probes, the probes feeding it, its distinct values
    and range (``columns``: per column, for a row of :data:`SCALAR_COLUMNS` scalars or fewer);
    ``not_covered``: each argument of ``arguments`` never fed, or fed one value throughout."""
    seen: dict[str, dict[str, Any]] = {}
    for probe in probes:
        if probe.method != "forward":
            continue
        for top, value in probe.kwargs.items():
            for name, tensor in _tensors(top, value):
                entry = seen.setdefault(name, {"probes": 0, "digests": set(), "tensors": []})
                entry["probes"] += 1
                entry["digests"].add(tensor_digest(tensor))
                entry["tensors"].append(tensor.detach())
    fed: dict[str, Any] = {}
    not_covered: dict[str, str] = {}
    for name, entry in seen.items():
        values = [t.float() for t in entry["tensors"] if t.numel()]
        record: dict[str, Any] = {"probes": entry["probes"], "values": len(entry["digests"])}
        if values:
            record["range"] = [
                round(min(float(t.min()) for t in values), 4),
                round(max(float(t.max()) for t in values), 4),
            ]
        rows = [t for t in values if t.dim() == 2 and t.shape[-1] <= SCALAR_COLUMNS]
        if rows and len(rows) == len(values) and len({t.shape[-1] for t in rows}) == 1:
            stacked = torch.cat(rows)
            record["columns"] = [
                [round(float(low), 4), round(float(high), 4)]
                for low, high in zip(stacked.min(0).values, stacked.max(0).values, strict=True)
            ]
        fed[name] = record
        if len(entry["digests"]) == 1:
            not_covered[name] = ONE_VALUE
    for name in arguments:
        if not any(fed == name or fed.startswith(f"{name}.") for fed in seen):
            not_covered[name] = NEVER_FED
    return {"fed": fed, "not_covered": not_covered}
