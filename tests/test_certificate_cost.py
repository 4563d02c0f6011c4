"""What a certificate costs: one fp32 sweep and one ``pc.load`` sweep per conversion, every
probe and load path still recorded, and progress a log can follow."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import _models
import pytest
import torch
from typer.testing import CliRunner

from precision_convert.api.conversion import convert
from precision_convert.cli._common import PROGRESS_PREFIX
from precision_convert.cli.main import app
from precision_convert.core.progress import LEDGER_VARIABLE
from precision_convert.validation.calibration.search import _failed_first, _probes_first
from precision_convert.validation.certify.load_paths import spot_inputs
from precision_convert.validation.probe.inputs.model_inputs import ModelInputs, Probe


def _stages(ledger: Path) -> dict[str, int]:
    forwards: dict[str, int] = {}
    for line in ledger.read_text().splitlines():
        row = json.loads(line)
        forwards[row["stage"]] = forwards.get(row["stage"], 0) + row["forwards"]
    return forwards


def test_fp16_safe_runs_the_fp32_model_and_pc_load_once(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calibration's fp32 sweep is validation's baseline, and its last candidate (the output's
    very files) is pc.load's run: validation runs neither again, and says so."""
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(LEDGER_VARIABLE, str(ledger))
    result = convert(tiny_model("llama"), to="fp16-safe", output=tmp_path / "out", coverage="quick")
    certificate = result.certificate
    assert certificate is not None and certificate.verdict == "pass"
    stages = _stages(ledger)
    assert not any(s.startswith("validation › baseline") for s in stages), stages
    # pc.load under each attention implementation is calibration's run of its candidate
    assert not any(s.startswith("validation › pc.load") for s in stages), stages
    assert any(s.startswith("calibration") for s in stages)
    assert any("not run again" in note for note in certificate.notes)
    ways = {p.label: p for p in certificate.load_paths}
    # every way still recorded
    assert {"pc.load", "plain", "auto", "compute", "pc.load+eager", "plain+eager"} <= set(ways)
    for label in ("pc.load", "pc.load+eager"):
        assert ways[label].verdict == "pass" and ways[label].decides
        assert "same tensors in, same numbers out" in (ways[label].detail or "")
    probes = certificate.components[0].inputs["probes"]
    assert probes  # every probe still recorded
    # the library's load under eager: a cross of plain's dtypes and pc.load's eager, each
    # judged on every probe, decides on the spot subset, and says so
    crossed = ways["plain+eager"]
    assert crossed.decides and crossed.verdict == "pass"
    assert f"of {len(probes)} probes" in (crossed.detail or "") and "every probe" in crossed.detail
    assert stages["validation › plain+eager"] < len(probes) == stages["validation › plain"]


def test_spot_probes_keep_the_layout_and_each_sweep_kinds_ends() -> None:
    """A non-deciding way runs on the layout's probes and the first and last probe of each
    sweep kind; the rest of the sweep is for the deciding ways (a crossed one: not the
    vocabulary chunks either)."""
    probes = [Probe("forward", "forward", {})]
    probes += [Probe(f"len{i}", "forward", {}, sweep={"kind": "length"}) for i in range(4)]
    probes.append(Probe("vocab0", "forward", {}, sweep={"kind": "vocabulary"}))
    inputs = ModelInputs(task="causal-lm", probes=tuple(probes), seed=0)
    assert [p.name for p in spot_inputs(inputs).probes] == ["forward", "len0", "len3", "vocab0"]
    # a way crossing two checked on every probe leaves the vocabulary to them
    assert [p.name for p in spot_inputs(inputs, crossed=True).probes] == ["forward", "len0", "len3"]


def test_bf16_library_load_under_eager_runs_the_one_key_rows_at_their_ends() -> None:
    """Under bf16 (fp32's exponent range) ``pc.load`` under another attention runs every
    probe but the first-position rows between the first and last; under fp16, whose scores
    can overflow where fp32's do not, every probe; the attention spot leaves the free
    generation out (never compared)."""
    from precision_convert.core.dtypes import BF16, FP16, FP32, range_binds
    from precision_convert.validation.probe.inputs.spots import attention_spot, one_key_rows_at_ends

    probes = [Probe("forward", "forward", {})]
    probes += [
        Probe(f"first{i}", "forward", {}, sweep={"kind": "first-position"}) for i in range(4)
    ]
    probes += [Probe(f"len{i}", "forward", {}, sweep={"kind": "length"}) for i in range(3)]
    probes.append(Probe("free", "generate", {}, sweep={"kind": "generation"}, finite_only=True))
    inputs = ModelInputs(task="causal-lm", probes=tuple(probes), seed=0)
    kept = [p.name for p in one_key_rows_at_ends(inputs).probes]
    assert kept == ["forward", "first0", "first3", "len0", "len1", "len2", "free"]
    assert range_binds(FP16) and not range_binds(BF16) and not range_binds(FP32)
    assert "free" not in [p.name for p in attention_spot(inputs).probes]


def test_progress_off_a_terminal_is_plain_lines_with_an_estimate(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """A log of the command shows each stage while it runs, and the forwards ahead."""
    out = tmp_path / "out"
    done = CliRunner().invoke(
        app,
        [
            "model",
            str(tiny_model("llama")),
            "--to",
            "bf16-safe",
            "-o",
            str(out),
            "--coverage",
            "quick",
        ],
    )
    assert done.exit_code == 0, done.output
    lines = done.stderr.splitlines()
    assert "\x1b" not in done.stderr
    progress = [line for line in lines if line.startswith(PROGRESS_PREFIX)]
    assert any("validation: " in line and "forwards to run" in line for line in progress)
    assert any("baseline" in line and "started" in line for line in progress)
    assert any(line.endswith(" s") and "done in" in line for line in progress)


def _faint_head_llama(directory: Path) -> Path:
    """A Llama whose untied head weights sit among fp16's subnormals (about 3e-7): fp16 rounds
    them to a few steps and every logit is off by about 20%, so plain fp16 fails and the
    search must find the head, the last module in execution order. Nothing overflows."""
    torch.manual_seed(0)
    model = _models.llama(num_hidden_layers=4, tie_word_embeddings=False).eval()
    with torch.no_grad():
        model.lm_head.weight *= 4e-6
    model.save_pretrained(directory)
    return directory


def test_a_failing_search_candidate_stops_at_its_first_failing_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bisection's failing candidates each cost one forward (the probe the last one
    failed on runs first); only passing candidates run every probe under every attention
    implementation, and the last of them is what validation reuses."""
    source = _faint_head_llama(tmp_path / "src")
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(LEDGER_VARIABLE, str(ledger))
    result = convert(source, to="fp16-safe", output=tmp_path / "out", coverage="quick")
    certificate = result.certificate
    assert certificate is not None and certificate.verdict == "pass", certificate.failures
    islands = {i.name: i.reason for i in result.components[0].plan.islands}
    assert islands.get("lm_head") == "search"
    probes = len(certificate.components[0].inputs["probes"])
    judged = certificate.components[0].attention["judged"]  # type: ignore[index]
    candidates: dict[str, int] = {}
    for stage, forwards in _stages(ledger).items():
        if "island search candidate" in stage:  # its runs under each implementation, summed
            candidate = re.sub(r" › \w+ attention$", "", stage)
            candidates[candidate] = candidates.get(candidate, 0) + forwards
    every = probes * len(judged)
    failing = [n for n in candidates.values() if n < every]
    assert len(failing) >= 3, candidates
    assert all(n == 1 for n in failing), candidates  # each stopped at its first probe
    assert list(candidates.values())[-1] == every  # the kept plan ran everything
    ways = {p.label: p for p in certificate.load_paths}
    assert "same tensors in, same numbers out" in (ways["pc.load"].detail or "")


def test_candidates_run_what_failed_last_first() -> None:
    probes = tuple(Probe(name, "forward", {}) for name in ("a", "b", "c", "d"))
    inputs = ModelInputs(task="causal-lm", probes=probes, seed=0)
    assert [p.name for p in _probes_first(inputs, ["c", "a"]).probes] == ["c", "a", "b", "d"]
    assert _probes_first(inputs, []) is inputs
    failed = {(None, "a"): None, ("eager", "d"): None}
    assert _failed_first([None, "eager"], failed) == ["eager", None]
    assert _failed_first([None, "eager"], {}) == [None, "eager"]


def test_a_free_generation_passes_the_recording_hooks_its_forced_twin_feeds(
    tiny_model: Callable[[str], Path],
) -> None:
    """Calibration's statistics, per-probe peaks and factor peaks record the teacher-forced
    run of a continuation and let the free generation of the same ids pass: its activations
    are the forced run's, one hooked forward a token cost 3.3x its plain run."""
    from transformers import AutoModelForCausalLM

    from precision_convert.conversion.analysis.activations import recording
    from precision_convert.conversion.analysis.factors import FactorRecorder, recording_factors
    from precision_convert.validation.probe.run.continuations import STEP_PEAKS
    from precision_convert.validation.probe.run.execute import run_probes
    from precision_convert.validation.probe.run.growth import run_sized

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama")).eval()
    ids = torch.tensor([[5, 9, 13, 2]])
    free = Probe(
        "generate:free",
        "generate",
        {
            "input_ids": ids,
            "max_new_tokens": 3,
            "min_new_tokens": 3,
            "do_sample": False,
        },
        finite_only=True,
    )
    forced = Probe("forward:forced", "forward", {"input_ids": ids})

    def recorded(probe: Probe) -> tuple[int, int, dict[str, torch.Tensor]]:
        inputs = ModelInputs(task="causal-lm", probes=(probe,), seed=0)
        factors = FactorRecorder(model)
        with recording_factors(model, factors), recording(model) as recorder:
            outputs, _ = run_sized(
                model, inputs, "cpu", torch.float32, seen=recorder.seen, paused=lambda: False
            )
        gated = sum(site.gates.peak is not None for site in factors.gated)
        return len(recorder.stats()), gated, outputs[probe.name]

    modules, gated, out = recorded(free)
    assert (modules, gated) == (0, 0)
    assert out[STEP_PEAKS].shape == (1, 3)  # the generation itself still ran
    modules, gated, _ = recorded(forced)
    assert modules > 10 and gated == len(FactorRecorder(model).gated) > 0
    # outside any recording the free generation is a plain run_probes call, as before
    plain = run_probes(model, ModelInputs(task="causal-lm", probes=(free,), seed=0))
    torch.testing.assert_close(plain[free.name][STEP_PEAKS], out[STEP_PEAKS])
    # each step's peak is the largest |logit| generate returns for it; an inf logit shows
    with torch.no_grad():
        kept = model.generate(**free.kwargs, output_logits=True, return_dict_in_generate=True)
    whole = torch.stack([step.abs().amax(-1) for step in kept.logits], 1)
    torch.testing.assert_close(out[STEP_PEAKS], whole)
    with torch.no_grad():
        model.lm_head.weight[7] = float("inf")
    broken = run_probes(model, ModelInputs(task="causal-lm", probes=(free,), seed=0))
    assert not bool(torch.isfinite(broken[free.name][STEP_PEAKS]).all())


def test_rows_after_bos_share_one_bos_and_compute_what_whole_rows_do() -> None:
    """A causal LM's after-BOS rows continue one BOS cache instead of each recomputing BOS:
    every layer's hidden states at the row's own token are those of the two-token row."""
    from precision_convert.validation.probe.inputs.budgets import budget_for
    from precision_convert.validation.probe.inputs.contexts import first_position_probes
    from precision_convert.validation.probe.inputs.token_probes import token_spec
    from precision_convert.validation.probe.run.execute import build_inputs, call_probe

    torch.manual_seed(0)
    model = _models.llama().eval()
    chosen = build_inputs(model)
    spec = token_spec(model, chosen.probes[0], None, chosen.task)
    assert spec is not None
    probes = first_position_probes(
        model, spec, chosen.probes[0].kwargs, budget_for("standard"), None, trimmed_tokens=4096
    )
    after = [p for p in probes if p.sweep["bos"] is not None]
    bos = after[0].sweep["bos"]
    assert after and all(p.prefix is not None for p in after)
    assert sum(p.kwargs["input_ids"].numel() for p in after) == spec.vocab  # one token a row
    probe = after[0]
    ids = probe.kwargs["input_ids"]
    assert ids.shape[1] == 1
    shared = call_probe(model, probe)
    with torch.no_grad():
        whole = model(
            torch.cat([torch.full_like(ids, bos), ids], 1), output_hidden_states=True
        ).hidden_states
    assert len(whole) == sum(k.startswith("hidden_states.") for k in shared)
    for layer, states in enumerate(whole):
        torch.testing.assert_close(shared[f"hidden_states.{layer}"], states[:, 1:])
