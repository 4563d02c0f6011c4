"""What a certificate costs beyond its forwards: fp32 runs once under the default attention
(another implementation only where the two can differ, with a recorded spot check), the
heap's fresh mappings only while calibration's hooks record, the ledger's time outside
forwards, and probes sized to what an encoder without a head holds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import _models
import pytest
import torch

from precision_convert.api.conversion import convert
from precision_convert.conversion.analysis import factors
from precision_convert.conversion.runtime import memory
from precision_convert.core.progress import LEDGER_VARIABLE
from precision_convert.validation.probe.inputs.budgets import budget_for, fit_model
from precision_convert.validation.probe.inputs.layouts import input_candidates
from precision_convert.validation.probe.inputs.spots import attention_spot, padded, spot_inputs
from precision_convert.validation.probe.inputs.sweep import sweep
from precision_convert.validation.probe.run.attention import (
    attention,
    attention_choices,
    outputs_by_attention,
    same_function,
)
from precision_convert.validation.probe.run.execute import run_probes, select_inputs

#: More than any quick probe's eager scores take: none is held back for memory here.
AMPLE = 1 << 40


def _qwen2_quick() -> tuple[Any, Any, Any]:
    """A tiny Qwen2 (sdpa by default), its quick probes and their fp32 outputs under sdpa."""
    torch.manual_seed(0)
    model = _models.qwen2().eval()
    chosen, _ = select_inputs(model, input_candidates(model), run_probes)
    inputs = sweep(model, chosen, "quick")
    return model, inputs, run_probes(model, inputs, "cpu", torch.float32)


def test_fp32_runs_again_under_eager_only_where_the_two_can_differ() -> None:
    """Under eager the fp32 model runs the padded probes and the spot subset but the free
    generation (never compared); the default's outputs stand in for the rest, named with the
    probes the check ran on, and fp32 eager really is the default's function on the probes it
    did not run."""
    model, inputs, default = _qwen2_quick()
    ran: list[str] = []

    def run(fp32: Any, probes: Any) -> Any:
        ran.extend(p.name for p in probes.probes)
        return run_probes(fp32, probes, "cpu", torch.float32)

    choices, outputs = outputs_by_attention(
        model, attention_choices(model), inputs, default, run, allowance=AMPLE, spot=attention_spot
    )
    masked = {p.name for p in inputs.probes if padded(p)}
    spot = {p.name for p in spot_inputs(inputs, crossed=True).probes if not p.finite_only}
    assert masked and masked <= set(ran) and set(ran) == masked | spot
    assert not any(p.finite_only for p in inputs.probes if p.name in ran)
    rest = [p.name for p in inputs.probes if p.name not in set(ran)]
    assert rest  # the sweep's other probes (vocabulary, special tokens...) are not run again
    assert all(outputs["eager"][n] is default[n] for n in rest)
    assert set(outputs["eager"]) == {p.name for p in inputs.probes}
    record = choices.to_json()["baseline_from_default"]["eager"]
    assert record["probes"] == sorted(rest)
    assert record["checked_on"] == [n for n in ran if n not in masked]
    assert "no padding" in record["why"] and "fp32_every_probe" not in choices.to_json()
    with attention(model, "eager"):
        eager = run_probes(model, replace(inputs, probes=_named(inputs, rest)), "cpu")
    assert same_function(default, eager)


def test_an_eager_fp32_spot_check_that_disagrees_runs_every_probe() -> None:
    """When fp32 eager is not the default's function on the spot probes, every probe runs
    under eager in fp32, and the record says why."""
    model, inputs, default = _qwen2_quick()
    shifted = {name: {k: v * 1.01 for k, v in out.items()} for name, out in default.items()}
    choices, outputs = outputs_by_attention(
        model,
        attention_choices(model),
        inputs,
        shifted,
        lambda fp32, probes: run_probes(fp32, probes, "cpu", torch.float32),
        allowance=AMPLE,
        spot=attention_spot,
    )
    assert not choices.baseline_from_default
    assert set(outputs["eager"]) == {p.name for p in inputs.probes}
    assert all(outputs["eager"][n] is not shifted[n] for n in outputs["eager"])
    why = choices.to_json()["fp32_every_probe"]["eager"]
    assert "every probe ran" in why and "0.0001 relative L2" in why


def _named(inputs: Any, names: list[str]) -> tuple[Any, ...]:
    return tuple(p for p in inputs.probes if p.name in set(names))


def test_a_certificate_runs_fp32_eager_on_part_of_its_probes_and_ledgers_the_rest(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16-safe's baseline runs every probe under sdpa and fewer under eager; the certificate
    names the stand-ins; the candidate still runs under eager on every probe and passes; the
    ledger records the time outside forwards (loads, hashing, writing) beside them."""
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(LEDGER_VARIABLE, str(ledger))
    result = convert(tiny_model("llama"), to="bf16-safe", output=tmp_path / "out", coverage="quick")
    certificate = result.certificate
    assert certificate is not None and certificate.verdict == "pass"
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    runs = [r for r in rows if not r.get("outside")]
    probes = len(certificate.components[0].inputs["probes"])
    # the layout's probe, then the whole sweep, under sdpa; then eager's one run, labelled so
    sdpa = [r["forwards"] for r in runs if r["stage"] == "validation › baseline"]
    eager_baseline = "validation › baseline › eager attention"
    [eager] = [r["forwards"] for r in runs if r["stage"] == eager_baseline]
    assert sdpa[-1] == probes and eager < probes
    record = certificate.components[0].attention or {}
    stood_in = record["baseline_from_default"]["eager"]
    assert stood_in["checked_on"] and len(stood_in["probes"]) + eager == probes
    ways = {p.label: p for p in certificate.load_paths}
    assert ways["pc.load+eager"].verdict == "pass" and ways["pc.load+eager"].decides
    eager_runs = [r for r in runs if r["stage"] == "validation › pc.load+eager"]
    assert sum(r["forwards"] for r in eager_runs) == probes
    assert all(0 <= r["forward_seconds"] <= r["seconds"] for r in runs)
    outside = {r["what"] for r in rows if r.get("outside")}
    assert {"load", "load plain", "hash", "write", "re-save"} <= outside, outside
    assert all(r["seconds"] >= 0 and r["forwards"] == 0 for r in rows if r.get("outside"))


_HEAP = """
import ctypes, sys, torch
from precision_convert.conversion.runtime import memory
owner, when = sys.argv[1:]
if owner == "command":
    memory.own_heap()
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(field, ctypes.c_size_t) for field in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def mapped_share():
    torch.ones(6 << 20)  # a 24 MiB activation, freed at once: glibc's moving threshold follows it
    before = libc.mallinfo2().hblkhd
    held = [torch.ones(2 << 20) for _ in range(32)]  # 8 MiB activations, live together
    return (libc.mallinfo2().hblkhd - before) / (32 * 8 << 20)
with memory.large_allocations_mapped():
    inside = mapped_share() if when == "inside" else None
print(inside if inside is not None else mapped_share())
"""


def _mapped_share(owner: str, when: str) -> float:
    """The share of a fresh process's 8 MiB activations that got mappings of their own (see
    ``_HEAP``), by glibc's count of mapped bytes: a mapped block goes back to the system when
    freed; a heap block stays in the process's RSS. (RSS itself is no measure of this: whether
    freed heap blocks reach the heap's top, where glibc trims them, depends on which holes the
    interpreter's start-up left for the small blocks between them, which varies with its hash
    seed.)"""
    done = subprocess.run(
        [sys.executable, "-c", _HEAP, owner, when], capture_output=True, text=True, check=True
    )
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_allocations_are_mapped_only_inside_the_block_of_an_owned_heap() -> None:
    """In the command's process, activations are mapped afresh inside the block (calibration's
    hooked forwards: freed, they go back at once) and come from the heap after it (no page
    faults when the next forward reuses them); in a library caller's process the block
    leaves glibc's moving threshold as it was."""
    # each mapping holds a page more than its block
    assert _mapped_share("command", "inside") == pytest.approx(1.0, abs=0.01)
    assert _mapped_share("command", "after") == 0.0
    assert _mapped_share("library", "inside") == 0.0


def test_every_forward_the_factor_hooks_record_runs_with_large_allocations_mapped(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16-safe runs no calibration: the fp32 baseline's factor hooks are the only ones, and
    in the command's process their forwards run in the mapped block as calibration's do (a
    265M certificate's heap grew 1.0 GiB past what was live in one run and not in another);
    the threshold is the owned one again afterwards."""
    thresholds: list[int] = []
    monkeypatch.setattr(memory, "_owned", True)  # the command's process, heap left as it is
    monkeypatch.setattr(memory, "_set_threshold", thresholds.append)
    during: list[int | None] = []
    hooks = factors.FactorRecorder.hooks

    def spied(self: factors.FactorRecorder, model: torch.nn.Module) -> Iterator[Any]:
        yield model.register_forward_pre_hook(
            lambda *_: during.append(thresholds[-1] if thresholds else None)
        )
        yield from hooks(self, model)

    monkeypatch.setattr(factors.FactorRecorder, "hooks", spied)
    result = convert(tiny_model("llama"), to="bf16-safe", output=tmp_path / "out", coverage="quick")
    assert result.certificate is not None and result.certificate.verdict == "pass"
    assert during and set(during) == {memory.LARGE_ALLOCATION}, set(during)
    assert thresholds[-1] == memory.OWNED_THRESHOLD


def test_an_encoder_without_a_head_takes_the_levels_probe_size() -> None:
    """Each token of an encoder without an LM head costs no row of logits: its probes keep
    the level's size (a tiny T5 encoder's 32k vocabulary in 8 probes, not 32), as with a plain
    linear head (computed for the kept rows only), while the same dimensions with a head
    probes cannot sample still shrink to what a probe may hold."""
    from transformers import T5Config, T5ForConditionalGeneration

    standard = budget_for("standard")
    encoder = _models.t5_encoder(vocab_size=32128)
    assert encoder.get_output_embeddings() is None
    assert fit_model(standard, encoder).tokens_per_probe == standard.tokens_per_probe
    with_head = T5ForConditionalGeneration(T5Config(**encoder.config.to_dict()))
    assert fit_model(standard, with_head).tokens_per_probe == standard.tokens_per_probe
    _models.with_custom_head(with_head)
    assert fit_model(standard, with_head).tokens_per_probe < standard.tokens_per_probe
