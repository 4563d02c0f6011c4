"""Reports a person can take in at a glance, at real-model scale.

Models here have real layer structures (80 Llama layers; a UNet2DConditionModel with the
default block layout) built on the meta device and written with constant weights, so they
cost a header's worth of bytes: only names, shapes and dtypes matter to ``inspect``'s table.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _models
import pytest
import torch
from _corrupt import cli_env
from safetensors.torch import save_file
from typer.testing import CliRunner

from precision_convert.cli import _common
from precision_convert.cli.main import app
from precision_convert.conversion.analysis.activations import SEARCH_STAGE, search_islands
from precision_convert.conversion.analysis.chart import (
    activation_chart,
    heatmap_data,
)
from precision_convert.core.folding import Role, blocks, fold, ranges
from precision_convert.core.progress import report, reporting, shorten, stage
from precision_convert.validation.certify.card_metrics import (
    BAR_LABEL,
    BAR_WIDTH,
    ProbeSeries,
    folded_metrics,
    probe_series,
)
from precision_convert.validation.probe.run.metrics import Measurement

# --------------------------------------------------------------------------- models


def _write(model: Any, directory: Path, weights: str, overflow: dict[str, float]) -> Path:
    """Save ``model``'s config and constant weights (``overflow``: tensor -> one huge value)."""
    directory.mkdir(parents=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        value = torch.full(tensor.shape, 0.01)
        if name in overflow:
            value.view(-1)[0] = overflow[name]
        tensors[name] = value
    save_file(tensors, str(directory / weights), metadata={"format": "pt"})
    (
        model.config.save_pretrained
        if hasattr(model.config, "to_json_string")
        else model.save_config
    )(directory)
    return directory


@pytest.fixture(scope="module")
def llama80(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 80-layer Llama (tiny widths) whose down_proj weights overflow fp16 in layers 3, 77."""
    with torch.device("meta"):
        model = _models.llama(
            num_hidden_layers=80,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
            tie_word_embeddings=False,
        )
    model.config.architectures = ["LlamaForCausalLM"]  # what save_pretrained would record
    overflow = {f"model.layers.{i}.mlp.down_proj.weight": 1e6 for i in (3, 77)}
    return _write(model, tmp_path_factory.mktemp("llama80") / "m", "model.safetensors", overflow)


@pytest.fixture
def width() -> Iterator[None]:
    """Reports rendered 100 columns wide, whatever the terminal running the tests."""
    saved = _common.out._width
    _common.out._width = 100
    yield
    _common.out._width = saved


def _invoke(*args: str) -> Any:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


# --------------------------------------------------------------------------- folding


def test_ranges_and_blocks() -> None:
    assert ranges([7, 0, 2, 5, 6]) == "0,2,5..7"
    assert ranges(range(32)) == "0..31"
    # Instances that do not fill a grid are split into exact products, never padded.
    tuples = [(b, r) for b in range(4) for r in (0, 1)] + [(4, 0)]
    assert blocks(tuples) == [((0, 1, 2, 3), (0, 1)), ((4,), (0,))]


def test_fold_names_nested_slots_and_what_a_subset_is() -> None:
    names = [f"down_blocks.{b}.resnets.{r}.norm1" for b in range(4) for r in (0, 1)]
    names += [f"down_blocks.{b}.downsamplers.0.conv" for b in range(3)]
    names += ["down_blocks.1.resnets.0.conv_shortcut", "conv_in"]
    roles = fold(names)
    assert [r.label for r in roles] == [
        "down_blocks.{0..3}.resnets.{0,1}.norm1",
        "down_blocks.{0..2}.downsamplers.0.conv",
        "down_blocks.1.resnets.0.conv_shortcut",
        "conv_in",
    ]
    norm1 = roles[0]
    assert norm1.describe(names[:8]) == "all"
    assert norm1.describe(["down_blocks.2.resnets.1.norm1", "down_blocks.3.resnets.1.norm1"]) == (
        "(2,3; 1)"
    )
    assert roles[1].describe(["down_blocks.2.downsamplers.0.conv"]) == "2"
    ragged = fold([f"up.{b}.r.{r}.n" for b in range(3) for r in range(3 if b else 2)])[0]
    assert ragged.label == "up.0.r.{0,1}.n | up.{1,2}.r.{0..2}.n"
    assert Role.of("a.3.b").label == "a.3.b"


def test_long_names_lose_their_middle_not_their_layer_range() -> None:
    name = "model.layers.{0..79}.post_attention_layernorm"
    assert _common.elide(name, 33) == "model.layers.{0..79}…on_layernorm"
    assert _common.elide(name, 20) == "model.lay…_layernorm"  # no room: the tail comes first
    assert _common.elide(name, len(name)) == name


def test_inspect_folds_80_layers_into_one_screen(llama80: Path, width: None) -> None:
    """Snapshot of the folded table: one row per role, islands by index and reason."""
    result = _invoke("inspect", str(llama80))
    assert result.stderr == ""  # the report is stdout's; nothing else was said
    assert result.stdout == SNAPSHOT_LLAMA80
    assert len(result.stdout.splitlines()) < 60
    assert "\x1b" not in result.stdout  # not a terminal: no escape codes


SNAPSHOT_LLAMA80 = """\
LlamaForCausalLM: LlamaForCausalLM — recipe llama
┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━┓
┃ module                                        ┃ count ┃ parameters ┃ fp32 islands          ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━┩
│ lm_head                                       │     1 │      1,024 │                       │
│ model.embed_tokens                            │     1 │      1,024 │                       │
│ model.layers.{0..79}.input_layernorm          │    80 │      1,280 │ all: precision        │
│ model.layers.{0..79}.mlp.down_proj            │    80 │     40,960 │ fp16-safe 3,77: range │
│ model.layers.{0..79}.mlp.gate_proj            │    80 │     40,960 │                       │
│ model.layers.{0..79}.mlp.up_proj              │    80 │     40,960 │                       │
│ model.layers.{0..79}.post_attention_layernorm │    80 │      1,280 │ all: precision        │
│ model.layers.{0..79}.self_attn.k_proj         │    80 │     10,240 │                       │
│ model.layers.{0..79}.self_attn.o_proj         │    80 │     20,480 │                       │
│ model.layers.{0..79}.self_attn.q_proj         │    80 │     20,480 │                       │
│ model.layers.{0..79}.self_attn.v_proj         │    80 │     10,240 │                       │
│ model.norm                                    │     1 │         16 │ precision             │
└───────────────────────────────────────────────┴───────┴────────────┴───────────────────────┘
parameters by dtype — fp32: 188,944
bf16-safe: 161 fp32 islands
fp16-safe: 163 fp32 islands
fp16-overflow model.layers.{3,77}.mlp.down_proj.weight: max |x| = 1e+06 exceeds 65504 (and 1 more like it)
"""  # noqa: E501 (a report line, as printed)


def test_inspect_full_and_json_list_every_module(llama80: Path) -> None:
    modules = 80 * 9 + 3
    full = _invoke("inspect", str(llama80), "--full")
    assert sum(line.startswith("│ model.layers.") for line in full.stdout.splitlines()) == 80 * 9
    as_json = _invoke("inspect", str(llama80), "--json")
    payload = json.loads(as_json.stdout)  # stdout is the JSON and nothing else
    assert len(payload["components"][0]["modules"]) == modules


def test_inspect_fits_a_full_structure_unet(tmp_path: Path, width: None) -> None:
    """SD 1.5's UNet blocks (tiny widths): under 100 lines, every island named by its role
    with which instances and why."""
    sd15 = {k: v for k, v in _models.zoo.pipelines.SD15_UNET.items() if not k.startswith("_")}
    tiny = {"block_out_channels": (8,) * 4, "norm_num_groups": 4, "cross_attention_dim": 8}
    with torch.device("meta"):
        unet = _models.unet(**{**sd15, **tiny, "attention_head_dim": 2, "sample_size": 8})
    source = _write(unet, tmp_path / "unet", "diffusion_pytorch_model.safetensors", {})
    _common.out._width = 200  # wide enough that no name is elided: every label is checkable
    text = _invoke("inspect", str(source)).stdout
    assert len(text.splitlines()) < 100
    islands = json.loads(_invoke("inspect", str(source), "--json").stdout)["components"][0][
        "islands"
    ]["fp16-safe"]
    assert len(islands) > 100
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    for role in fold(islands):
        assert role.label in rows, role.label
        assert "precision" in rows[role.label]


# --------------------------------------------------------------------------- chart


def test_heatmap_data_snapshot() -> None:
    """Panels per repeated structure (constant slots written out), strips for the rest."""
    names = ["embed"]
    names += [f"layers.{i}.{r}" for i in range(3) for r in ("norm", "attn.to_out.0")]
    names += [f"up.{b}.res.{r}.conv" for b in range(2) for r in range(2)]
    names += ["head"]
    peaks = {n: float(i + 1) for i, n in enumerate(names) if n != "head"}
    islands = {"layers.1.norm": "precision", "layers.2.attn.to_out.0": "range"}
    data = heatmap_data(peaks, names, islands).to_json()
    assert data == {
        "panels": [
            {
                "title": "layers.{}",
                "rows": ["norm", "attn.to_out.0"],
                "columns": ["0", "1", "2"],
                "peaks": [[2.0, 4.0, 6.0], [3.0, 5.0, 7.0]],
                "islands": [[None, "precision", None], [None, None, "range"]],
            },
            {
                "title": "up.{}.res.{}",
                "rows": ["conv"],
                "columns": ["0.0", "0.1", "1.0", "1.1"],
                "peaks": [[8.0, 9.0, 10.0, 11.0]],
                "islands": [[None, None, None, None]],
            },
        ],
        "strips": [
            {
                "title": "outside repeated layers",
                "rows": [""],
                "columns": ["embed", "head"],
                "peaks": [[1.0, None]],  # the head never ran
                "islands": [[None, None]],
            }
        ],
    }


def test_heatmap_scales_to_80_layers_and_a_thousand_modules(tmp_path: Path) -> None:
    roles = ["input_layernorm", "self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"]
    llama = [f"model.layers.{i}.{r}" for i in range(80) for r in roles]
    data = heatmap_data(dict.fromkeys(llama, 1.0), llama, {})
    assert [len(p.rows) for p in data.panels] == [4] and len(data.panels[0].columns) == 80
    # An SDXL-sized UNet: over a thousand modules fold to a few dozen rows.
    unet = [
        f"down_blocks.{b}.attentions.{a}.transformer_blocks.{t}.{r}"
        for b in (1, 2)
        for a in (0, 1)
        for t in range(10)
        for r in ("attn1.to_q", "attn1.to_k", "attn2.to_q", "ff.net.2", "norm1")
    ] + [f"up_blocks.{b}.resnets.{r}.{m}" for b in range(3) for r in range(3) for m in "abc"]
    unet += [f"single_{i}" for i in range(900)]
    big = heatmap_data(dict.fromkeys(unet, 1.0), unet, {})
    assert sum(len(p.rows) for p in big.panels) == 8
    assert all(len(s.columns) <= 40 for s in big.strips)

    from precision_convert.conversion.analysis.activations import ActivationStats

    stats = {
        m: ActivationStats(m, i, 10.0 ** (i % 7), 1.0, 1.0, 0.0, 0.0) for i, m in enumerate(llama)
    }
    path = activation_chart(stats, llama, {llama[0]: "precision"}, tmp_path / "c.png", "t")
    from PIL import Image

    with Image.open(path) as image:  # one column per layer fits; no 2640-pixel bar chart
        assert image.size[0] <= 2200 and image.size[1] <= 1000


# --------------------------------------------------------------------------- certificate


def _m(probe: str, value: float | None, passed: bool = True, metric: str = "rel_l2") -> Measurement:
    return Measurement("", probe, "logits", metric, value, 0.1, "max", passed)


def test_certificate_rows_fold_probes_and_blocks() -> None:
    metrics = [_m("forward", 0.01), _m("forward:length-64", 0.03), _m("forward:special", 0.02)]
    metrics += [_m(f"block:model.layers.{i}", 0.2 if i == 7 else 0.01, i != 7) for i in range(9)]
    rows = folded_metrics(metrics)
    assert [(r.where, r.value, r.passed, r.worst_probe) for r in rows] == [
        ("block:model.layers.{0..8}/logits", 0.2, False, "block 7 (of 9)"),
        ("logits", 0.03, True, "forward:length-64 (of 3)"),
    ]
    (series,) = probe_series(metrics)  # blocks are not probes
    assert [p for p, _ in series.values] == ["forward", "forward:length-64", "forward:special"]
    bars = [bar for _, _, bar in series.rows()]
    assert bars[1].startswith("█" * 13) and bars[1].endswith("0.3× the bound")
    over = ProbeSeries("logits", "rel_l2", 0.1, (("forward", 0.19),))
    assert over.rows()[0][2] == "█" * BAR_WIDTH + " 1.9× the bound: over"


# --------------------------------------------------------------------------- progress


def test_search_reports_candidates_against_a_bound_that_holds() -> None:
    needed = {"m3", "m11"}
    seen: list[tuple[str, int, int | None, bool]] = []
    with reporting(lambda *args: seen.append(args)), stage("calibration"):
        result = search_islands([f"m{i}" for i in range(16)], lambda extra: needed <= extra)
    assert set(result.added) == needed
    label = f"calibration › {SEARCH_STAGE}"
    counts = [(done, total) for what, done, total, _ in seen if what == label]
    assert all(total is not None and done <= total for done, total in counts)
    assert counts[-1] == (result.evaluations, result.evaluations)  # the line is closed
    assert counts[0][1] >= result.evaluations and counts[0][1] < 16 * (math.log2(16) + 1) + 3
    seen.clear()
    report("after", 1, 2)  # outside `reporting`: nobody hears it, nothing is kept
    assert seen == []


# --------------------------------------------------------------------------- recipes


def test_recipes_list_one_line_each_and_details_by_name() -> None:
    listing = _invoke("recipes").stdout.splitlines()
    from precision_convert.recipes import builtin

    assert len(listing) == len(builtin()) + 1
    assert all(len(line) <= _common.out.width for line in listing)
    assert listing[0].split()[0] == next(iter(builtin()))
    details = _invoke("recipes", "llama").stdout
    assert "LlamaForCausalLM" in details and "hazard" in details


def test_stage_lines_restart_and_close() -> None:
    """The CLI's stage display: a line per label, restarted when a count starts over (the
    next model's probes), gone once done reaches the total."""

    class Recorder:
        def __init__(self) -> None:
            self.live: dict[int, dict[str, Any]] = {}
            self.next = 0

        def add_task(self, description: str, **fields: Any) -> int:
            self.next += 1
            self.live[self.next] = {"description": description, **fields}
            return self.next

        def update(self, task: int, **fields: Any) -> None:
            self.live[task].update(fields)

        def remove_task(self, task: int) -> None:
            del self.live[task]

    progress = Recorder()
    display = _common._StepDisplay(progress)
    display.report("validation › Llama fp32 probes", 1, 4, False)
    display.report("validation › Llama fp32 probes", 2, 4, False)
    (line,) = progress.live.values()
    assert line["count"] == "2 of 4" and line["completed"] == 2
    display.report("validation › Llama fp32 probes", 0, 4, False)  # the next run starts
    (again,) = progress.live.values()
    assert again is not line and again["count"] == "0 of 4"
    display.report("calibration › island search", 3, 20, True)
    assert any(v["count"] == "3 of at most 20" for v in progress.live.values())
    display.report("calibration › island search", 5, 5, True)
    display.report("validation › Llama fp32 probes", 4, 4, False)
    assert progress.live == {}


# --------------------------------------------------------------------------- noise


@contextmanager
def _diffusers_log() -> Iterator[list[str]]:
    """Every message diffusers logs meanwhile (its logger does not propagate to the root)."""
    seen: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


_NOISE = ("config attributes", "cannot run with", "it/s]", "Loading pipeline components")


def test_a_converted_pipeline_loads_and_validates_quietly(
    tiny_model: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """Converting, validating and plain-loading a diffusers pipeline: no "config attributes
    … will be ignored" for the record, no "fp16 cannot run with cpu", no diffusers bars
    (transformers' follow huggingface_hub's switch, which the command turns off)."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel
    from transformers.utils import logging as hf_logging

    from precision_convert.api.conversion import convert

    source, out = tiny_model("sd-pipeline"), tmp_path / "sd-fp16-safe"
    monkeypatch.setattr(hf_logging, "_tqdm_active", False)  # as the command's environment sets
    capfd.readouterr()
    with _diffusers_log() as logged, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert convert(source, to="fp16-safe", output=out, coverage="quick").passed
        said = [*logged, *(str(w.message) for w in warned), capfd.readouterr().err]
        # A user's own plain loads: diffusers draws its bar, but says nothing of the record.
        DiffusionPipeline.from_pretrained(out)
        UNet2DConditionModel.from_pretrained(out / "unet")
        said += [*logged, *(str(w.message) for w in warned)]
    assert not [s for s in said if any(n in s for n in _NOISE)], said
    unet = json.loads((out / "unet" / "config.json").read_text())
    assert "_precision_convert" in unet and "precision_convert" not in unet

    # The capture hears that warning when it is there: the record under its plain name.
    unet["precision_convert"] = unet.pop("_precision_convert")
    (out / "unet" / "config.json").write_text(json.dumps(unet))
    with _diffusers_log() as logged:
        UNet2DConditionModel.from_pretrained(out / "unet")
    assert any("config attributes" in s for s in logged)


def test_pc_load_of_a_pipeline_says_no_more_than_diffusers_plain_load(
    zoo_converted: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """``pc.load`` passes diffusers each component built as its declared class; diffusers'
    "non-standard module" warning (and its module printout) about the safety checker is not
    shown, as a plain ``from_pretrained`` shows none, and the logger is left as it was."""
    from diffusers import DiffusionPipeline

    import precision_convert as pc

    out = zoo_converted("stable-diffusion-1.5", "fp16-safe").output
    logger = logging.getLogger("diffusers.pipelines.pipeline_loading_utils")
    before = list(logger.filters)
    capfd.readouterr()
    with _diffusers_log() as logged:
        pipe = pc.load(out)
    said = [*logged, capfd.readouterr().err]
    assert not [s for s in said if "non-standard module" in s], said
    assert logger.filters == before
    # The capture hears it when it is said: diffusers' own load given the component.
    with _diffusers_log() as logged:
        DiffusionPipeline.from_pretrained(out, safety_checker=pipe.safety_checker)
    assert any("non-standard module" in s for s in logged)


@pytest.fixture(scope="module")
def hot_t5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """README's tiny T5 (examples/make_tiny_t5.py): feed-forward outputs past 65504."""
    example = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_t5.py"
    spec = importlib.util.spec_from_file_location("make_tiny_t5", example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path_factory.mktemp("hot") / "tiny-t5"
    module.main(path)
    return path


def test_calibration_warns_once_per_spike_in_the_right_words(hot_t5: Path, tmp_path: Path) -> None:
    """A spike is named once, at the innermost module it leaves (not again for the MLP,
    dropout, layer and block that hand it on); a value past 65504 is not "within 2x" of it;
    the count of the rest points at what exists (--json), not at a "record"."""
    from precision_convert.api.inspection import inspect_source

    report = inspect_source(hot_t5, calibrate=True, chart=tmp_path / "c.png", coverage="quick")
    calibration = report.components[0].calibration
    assert calibration is not None
    warned = list(calibration.warnings)
    named = {w.split(" ")[0] for w in warned}
    wo = "encoder.block.0.layer.1.DenseReluDense.wo"
    assert wo in named
    for outer in ("encoder.block.0", f"{wo.rsplit('.', 1)[0]}"):
        assert outer not in named  # the same tensor, handed on
    assert "encoder.block.0.layer.1.dropout" not in named
    assert len(warned) <= len(calibration.near_limit) / 2
    for line in warned:
        peak = re.search(r"peaks at ([0-9.e+]+)", line)
        if peak and float(peak[1]) > 65504:
            assert "past fp16's 65504" in line and "within" not in line, line
        assert "calibration record" not in line


def test_calibration_warnings_name_what_needs_attention_and_count_the_rest() -> None:
    from precision_convert.core.dtypes import FP16_RANGE
    from precision_convert.validation.calibration.watch import (
        CARRIED,
        STILL_LOW,
        WATCH_WARNINGS,
        Watched,
        _watch_warnings,
        accounted_warnings,
    )

    block = "model.layers.3"
    spike = [  # one tensor, handed on and received: the projection's output first
        Watched(f"{block}.mlp.down_proj", "output", "leaf", 9e4, CARRIED),
        Watched(f"{block}.mlp", "output", "container", 9e4, CARRIED),
        Watched(block, "output", "container", 9e4, STILL_LOW),  # but this one is not fixed
        Watched("model.layers.4.input_layernorm", "input", "leaf", 9e4, CARRIED),
    ]
    others = [
        Watched(f"model.layers.{i}.mlp.down_proj", "output", "leaf", 4e4 + i, CARRIED)
        for i in range(10, 10 + WATCH_WARNINGS)
    ]
    warned = _watch_warnings([*spike, *others], FP16_RANGE)
    assert warned[0].startswith(f"{block}.mlp.down_proj (leaf) output peaks at 9e+04, past fp16")
    assert "reaches 2 more module inputs/outputs" in warned[0]
    assert warned[1].startswith(f"{block} (container)") and "still carries it in fp16" in warned[1]
    assert "within 2x of fp16's 65504" in warned[2] and "reaches" not in warned[2]
    assert len(warned) == WATCH_WARNINGS + 1
    assert warned[-1].startswith("2 more module inputs/outputs") and "--json" in warned[-1]
    # What the plan carries in fp32 is what the verdict judged: the command sums those up;
    # the spike still carried in fp16, and the count of the rest, stay warnings.
    accounted = accounted_warnings([*spike, *others], FP16_RANGE)
    assert accounted == [warned[0], *warned[2:WATCH_WARNINGS]]


def test_a_failed_plain_cast_says_it_once_and_points_at_the_safe_target(
    hot_t5: Path, tmp_path: Path
) -> None:
    """Plain fp16 of README's tiny T5 fails: the table says where, once (not a ✗ line per
    probe and metric after it), the bars say what they measure, and the error line says which
    target would have kept what fp16 cannot hold."""
    out = tmp_path / "t5-fp16"
    args = ["model", str(hot_t5), "--to", "fp16", "-o", str(out), "--coverage", "quick"]
    done = CliRunner().invoke(app, [*args, "--report", "full"])  # the bars are the full report's
    assert done.exit_code == 1, done.output
    crosses = [line for line in done.stdout.splitlines() if line.startswith("✗")]
    bounds = [line for line in crosses if "measurements outside their bounds" in line]
    assert len(bounds) == 1
    # Besides it, only ways of loading judged apart (eager attention) get a line of their own.
    assert all("set_attn_implementation" in line for line in crosses if line not in bounds)
    assert "FAIL" in done.stdout and BAR_LABEL in done.stdout.replace("\n", " ")
    assert "over the bound" not in done.stdout and "the bound: over" in done.stdout
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("precision-convert: ") and "--to fp16-safe" in error
    why = (out / "README.md").read_text().split("## Why it failed")[1].split("\n## ")[0]
    reasons = [line for line in why.splitlines() if line.startswith("- ")]
    assert sum("outside their bounds" in line for line in reasons) == 1
    assert all("outside their bounds" in r or "set_attn_implementation" in r for r in reasons)


def test_inspect_refuses_options_that_need_calibrate(hot_t5: Path, workdir: Path) -> None:
    """``--chart`` without ``--calibrate`` used to write nothing and exit 0."""
    done = CliRunner().invoke(app, ["inspect", str(hot_t5), "--chart", "x.png"])
    assert done.exit_code == 2, done.output
    assert done.stderr.strip() == "precision-convert: --chart applies only with --calibrate: add it"
    assert not (workdir / "x.png").exists() and done.stdout == ""


def test_terminal_progress_shows_what_it_knows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal: bytes so far without an unknown total ("1.8/? MB") or speed ("?"), no
    "-:--:--" before there is an ETA, no "0 of 1", and a label shortened by its stages, never
    through the middle of a class name."""
    import io

    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr(_common, "console", Console(file=screen, force_terminal=True, width=80))
    with _common.byte_progress("converting", True) as advance:
        advance("model.safetensors", 1_800_000)
        with stage("validation"):
            report("LlamaForCausalLM fp32 probes", 0, 1)
            report("T5EncoderModel fp32 probes", 0, 4)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert "1.8 MB" in shown and "/?" not in shown and " ?" not in shown
    assert "-:--:--" not in shown and "0 of 1" not in shown and "0 of 4" in shown
    assert "…LlamaForCausalLM fp32 probes" in shown and "Llama…" not in shown


def test_labels_lose_their_stages_then_whole_words() -> None:
    label = "validation › LlamaForCausalLM fp32 probes"
    assert shorten(label, 60) == label
    assert shorten(label, 38) == "…LlamaForCausalLM fp32 probes"
    assert shorten(label, 20) == "…LlamaForCausalLM…"
    assert shorten("island search › " + "x" * 30, 12) == "…" + "x" * 10 + "…"


def test_reports_off_a_terminal_are_as_wide_as_their_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Piped or redirected, a report is not wrapped at 80 columns (words and names split,
    URLs spread over lines, names elided); COLUMNS still sets a width."""
    from precision_convert.cli._reports import print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    name = "model.layers.{0..79}.self_attn.rotary_emb.inv_freq_" + "x" * 60
    rows = [[name, "12", "max_abs_rel", "https://huggingface.co/ns/" + "m" * 80]]
    print_table("a title", ["module", "count", "metric", "pushed to"], rows)
    shown = capsys.readouterr().out
    assert name in shown and "max_abs_rel" in shown and rows[0][3] in shown
    assert len(shown.splitlines()) == 6  # title, 3 rules, header, one row: nothing wrapped
    monkeypatch.setenv("COLUMNS", "80")
    assert _common.out.width == 80


# --------------------------------------------------------------------------- summaries

#: The zoo families a newcomer tries first: a report of each must fit a screen.
SUMMARISED = ("gpt2", "llama-3.2-1b", "flan-t5-base", "stable-diffusion-1.5")
#: Lines a summary report may take on stdout.
SCREEN = 40


def _report_lines(result: Any, full: bool, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What ``model`` prints on stdout for ``result`` (the same two calls), 80 columns wide."""
    from precision_convert.cli._reports import print_certificate, print_conversion

    capsys.readouterr()
    print_conversion(result, full=full)
    print_certificate(result.certificate, result.output, full=full)
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("name", SUMMARISED)
def test_a_conversion_report_fits_a_screen(
    zoo_converted: Any, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary holds the verdict, what was judged, the rows nearest their bounds and
    where the files are, in at most 40 lines; ``--report full`` lists every folded row."""
    from precision_convert.validation.certify.card_metrics import folded_metrics

    result = zoo_converted(name, "fp16-safe")
    saved = _common.out._width
    _common.out._width = 80
    try:
        summary = _report_lines(result, False, capsys)
        full = _report_lines(result, True, capsys)
    finally:
        _common.out._width = saved
    assert len(summary) <= SCREEN, "\n".join(summary)
    assert summary[-1] == "verdict: pass"
    assert any(line.startswith("judged: ") and " probes" in line for line in summary)
    assert any(str(result.output / "precision_certificate.json") in line for line in summary)
    rows = folded_metrics(result.certificate.metrics)
    shown = sum(1 for line in full if line.startswith("│") and (" ok " in line))
    assert shown >= len(rows)  # every folded row (island rows may add more)
    assert len(full) > len(summary)


@pytest.mark.parametrize("name", SUMMARISED)
def test_the_card_opens_with_loading_and_limitations(zoo_converted: Any, name: str) -> None:
    """A Hub visitor reads how to load the model and what was not judged before line 60,
    the detail tables after, in a card under 12 KB (a pipeline's 24 KB): per-probe values stay
    in the certificate, which stays far below a megabyte."""
    from huggingface_hub import ModelCard

    output = zoo_converted(name, "fp16-safe").output
    card = (output / "README.md").read_text()
    lines = card.splitlines()
    at = {line: i + 1 for i, line in reversed(list(enumerate(lines))) if line.startswith("## ")}
    assert at["## Loading"] < at["## Limitations"] < 60, at
    # a pipeline's card names each component's ways of loading: five components' rows
    assert len(card.encode()) < (24_000 if (output / "model_index.json").exists() else 12_000)
    assert "rel_l2 per probe" not in card
    assert "Every probe's value of every metric is in `precision_certificate.json`" in card
    assert at["## Limitations"] < at["## Parity"] < at["## Ways of loading"]
    limits = "\n".join(lines[at["## Limitations"] : at["## Parity"]])
    assert "Judged on cpu only" in limits and "not real data" in limits
    assert "pc.load(" in "\n".join(lines[at["## Loading"] : at["## Limitations"]])
    assert ModelCard.load(output / "README.md").data.to_dict()["precision_convert"]["loading"]
    assert (output / "precision_certificate.json").stat().st_size < 1_000_000


def test_validate_prints_a_summary_and_the_full_tables_when_asked(
    zoo_converted: Any, tiny_model: Any, tmp_path: Path
) -> None:
    """``validate`` run as users run it: the summary by default, the per-probe charts only
    with ``--report full``."""
    import shutil

    copy = tmp_path / "gpt2-fp16-safe"
    shutil.copytree(zoo_converted("gpt2", "fp16-safe").output, copy)
    args = ["validate", str(copy), "--baseline", str(tiny_model("gpt2")), "--coverage", "quick"]
    summary = _invoke(*args).stdout.splitlines()
    full = _invoke(*args, "--report", "full").stdout.splitlines()
    assert len(summary) <= SCREEN and summary[-1] == "verdict: pass"
    assert not any("per probe" in line for line in summary)
    assert any("rel_l2 per probe" in line for line in full)


# --------------------------------------------------------------------------- help


COMMANDS = ("model", "inspect", "validate", "push", "batch", "recipes")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_reads_like_a_command_line(command: str) -> None:
    """Usage names arguments as the README does (no ``{source}``), flags take no ``<bool>``,
    arguments and options are shown by words (no ``<str>`` or ``<path>``), and ``-h`` is
    ``--help``."""
    shown = _invoke(command, "--help").stdout
    assert _invoke(command, "-h").stdout == shown
    usage = next(line for line in shown.splitlines() if "Usage:" in line)
    assert "{" not in usage and f"precision-convert {command} [OPTIONS]" in usage
    assert "<bool>" not in shown
    assert "<bool>" not in _invoke("--help").stdout
    assert not re.search(r"<(str|path|int|float)>", shown), shown


@pytest.mark.parametrize("command", COMMANDS)
def test_help_in_a_pipe_never_cuts_an_option_name(command: str) -> None:
    """``model --help | cat`` at 80 columns: every option name (and its ``--no-`` form) is
    shown whole, the help text wrapped instead."""
    import typer.main

    script = Path(sys.executable).with_name("precision-convert")
    done = subprocess.run(
        [str(script), command, "--help"],
        capture_output=True,
        text=True,
        env={**cli_env(), "COLUMNS": "80"},
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    shown = done.stdout
    params = typer.main.get_command(app).commands[command].params  # type: ignore[attr-defined]
    names = [name for param in params for name in (*param.opts, *param.secondary_opts)]
    words = set(re.findall(r"(?<![\w-])--?[\w-]+", shown))
    assert [name for name in names if name.startswith("-") and name not in words] == [], shown
    assert max(len(line) for line in shown.splitlines()) <= 80, shown


def test_fp32_share_never_reads_zero_for_a_plan_with_islands() -> None:
    from precision_convert.cli._reports import share_text

    assert share_text(0.0004, True) == "<0.1%"
    assert share_text(0.0, False) == "0.0%"
    assert share_text(0.125, True) == "12.5%"


def test_device_reads_the_same_wherever_it_is_offered() -> None:
    import typer.main

    group = typer.main.get_command(app)
    helps = {
        name: next(p.help for p in group.commands[name].params if p.name == "device")
        for name in ("model", "validate")
    }
    assert helps["model"] == helps["validate"] and "cuda:N" in helps["model"]


def test_a_usage_error_is_one_line_like_any_other(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("precision-convert")
    for args, says in (
        (["validate"], "precision-convert: missing argument 'CONVERTED'; see "),
        (["inspect", "x", "--calbrate"], "precision-convert: no such option: --calbrate"),
    ):
        done = subprocess.run(
            [str(script), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120
        )
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(says), done.stderr


def test_a_recipe_reads_as_its_toml_does() -> None:
    shown = _invoke("recipes", "autoencoder-kl").stdout
    assert "config for fp16-safe, fp16: force_upcast = true" in shown
    assert 'validation: task = "vae"' in shown
    assert "{" not in shown and "True" not in shown
