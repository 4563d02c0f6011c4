"""Context probes: the worst contexts the search found (:mod:`~precision_convert.validation.probe.
run.contexts`), as probes the certificate records with their ids inline and a replay rebuilds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from precision_convert.validation.probe.inputs.model_inputs import ModelInputs, Probe
from precision_convert.validation.probe.inputs.token_probes import (
    TokenSpec,
    token_spec,
    with_tokens,
)

#: The probe kind of a context found by the search.
CONTEXT_KIND = "context"


def context_probe(
    spec: TokenSpec, template: Mapping[str, Any], context: Sequence[int], index: int, module: str
) -> Probe:
    """The probe of the ``index``-th context found, the one that drove ``module`` highest."""
    ids = torch.tensor([list(context)], dtype=torch.long)
    return Probe(
        f"forward:context-{index + 1}",
        "forward",
        with_tokens(spec, template, ids),
        sweep={"kind": CONTEXT_KIND, "argument": spec.arg, "module": module, "ids": list(context)},
    )


def rebuilt_contexts(model: Any, inputs: ModelInputs, recorded: Mapping[str, Any]) -> list[Probe]:
    """The context probes of a certificate's probe record, rebuilt on ``inputs``' layout."""
    first = inputs.probes[0] if inputs.probes else None
    spec = token_spec(model, first, None, inputs.task) if first is not None else None
    if spec is None or first is None:
        return []
    out = []
    for k, (name, record) in enumerate(
        (n, r) for n, r in recorded.items() if (r.get("sweep") or {}).get("kind") == CONTEXT_KIND
    ):
        how = record["sweep"]
        probe = context_probe(spec, first.kwargs, how.get("ids", []), k, str(how.get("module")))
        if probe.name == name:
            out.append(probe)
    return out
