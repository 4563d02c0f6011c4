"""MoE experts as fp32 islands: ``--keep-fp32`` and the island search take the fused experts
module transformers 5 runs (``model.layers.0.mlp.experts``), the record keeps the per-expert
names the checkpoint stores, and the island keeps its dtype, and the rare ids that overflow it
in fp16 stay right, through ``pc.load``, the plain default load and a re-save of either.

A tiny Mixtral shaped after Mixtral-8x7B (tests/_moe.py) whose router sends three rare ids to an
expert whose ``act(gate) * up`` reaches about 2.0e5. Fused experts are transformers 5's: under
4.x each expert is a module of its own and these tests are skipped, saying so; every test
records the transformers version it ran under (``record_property``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _moe
import pytest
import torch
import transformers
from _corrupt import assert_one_error_line
from safetensors import safe_open
from typer.testing import CliRunner

import precision_convert as pc
from precision_convert.cli.main import app

TRANSFORMERS = transformers.__version__
pytestmark = pytest.mark.skipif(
    int(TRANSFORMERS.split(".")[0]) < 5,
    reason=f"fused experts are transformers 5's; transformers {TRANSFORMERS} runs each expert "
    "as a module of its own",
)
#: The stored names of the planted layer's experts: 8 experts x (w1, w2, w3).
LAYER_0_EXPERTS = sorted(
    f"model.layers.0.block_sparse_moe.experts.{e}.{w}" for e in range(8) for w in ("w1", "w2", "w3")
)
#: A prompt holding the three rare ids among ordinary ones.
PROMPT = torch.tensor([[1, 415, _moe.RARE[0], 2936, _moe.RARE[1], 302, 9045, _moe.RARE[2], 28723]])
#: What every load must reach on the prompt against fp32 (the lm-logits threshold).
COSINE = 0.99


@pytest.fixture(autouse=True)
def _states_the_transformers_version(record_property: Callable[[str, Any], None]) -> None:
    record_property("transformers", TRANSFORMERS)


@pytest.fixture(scope="module")
def mixtrals(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``mixtrals("hot")`` / ``mixtrals("control")``: the tiny Mixtral, built on first use."""
    root = tmp_path_factory.mktemp("mixtral")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _moe.mixtral(root / name, hot=name == "hot")
        return built[name]

    return get


@pytest.fixture(scope="module")
def fp32_logits(mixtrals: Callable[[str], Path]) -> torch.Tensor:
    """The hot source's logits on :data:`PROMPT`, run in fp32."""
    return _logits(_fp32(mixtrals("hot")))


@pytest.fixture(scope="module")
def kept(mixtrals: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The hot Mixtral in fp16-safe with ``--keep-fp32`` naming the fused experts module, as
    ``model --json`` reports it (not calibrated nor certified: the loads are what is tested)."""
    out = tmp_path_factory.mktemp("kept") / "mixtral-fp16-safe"
    done = CliRunner().invoke(
        app,
        [
            "model",
            str(mixtrals("hot")),
            "--to",
            "fp16-safe",
            "--keep-fp32",
            _moe.HOT_EXPERTS,
            "--no-calibrate",
            "--no-validate",
            "--json",
            "-o",
            str(out),
        ],
    )
    assert done.exit_code == 0, done.output
    return out, json.loads(done.stdout)


def test_the_record_names_the_stored_experts_and_the_summary_their_cost(kept: Any) -> None:
    out, summary = kept
    with safe_open(out / "model.safetensors", "pt") as stored:
        names = stored.keys()
        dtypes = {name: stored.get_slice(name).get_dtype() for name in names}
        fp32_bytes = sum(
            4 * math.prod(stored.get_slice(name).get_shape())
            for name in names
            if dtypes[name] == "F32"
        )
        record = json.loads(stored.metadata()["precision_convert"])
    for name in LAYER_0_EXPERTS:
        assert dtypes[f"{name}.weight"] == "F32"
        assert dtypes[f"{name.replace('layers.0', 'layers.1')}.weight"] == "F16"
    assert dtypes["model.layers.0.block_sparse_moe.gate.weight"] == "F16"
    experts = [m for m in record["fp32_modules"] if "experts" in m]
    assert experts == LAYER_0_EXPERTS  # stored names, never the runtime one
    assert {record["islands"][m] for m in experts} == {"user"}
    component = summary["components"][0]
    islands = component["islands"]
    assert islands[LAYER_0_EXPERTS[0]]["parameters"] == 112 * 32  # intermediate x hidden
    assert f"(run as {_moe.HOT_EXPERTS})" in islands[LAYER_0_EXPERTS[0]]["rule"]
    assert sum(islands[m]["parameters"] for m in LAYER_0_EXPERTS) == 8 * 3 * 112 * 32
    assert component["fp32_bytes"] == fp32_bytes  # what the file holds in fp32
    assert component["fp32_parameters"] == sum(i["parameters"] for i in islands.values())


def _fp32(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROMPT).logits.float()


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str], torch.nn.Module]:
    """``loads(out, way)``: ``out`` loaded one way: ``pc.load``, the plain default
    ``from_pretrained``, or either after ``pc.load(out).save_pretrained`` (``resave:…``)."""
    from transformers import AutoModelForCausalLM

    scratch = tmp_path_factory.mktemp("resaved")

    def load(out: Path, way: str) -> torch.nn.Module:
        if way.startswith("resave:"):
            again = scratch / f"{out.name}-{len(list(scratch.iterdir()))}"
            pc.load(out).save_pretrained(again)
            out, way = again, way.removeprefix("resave:")
        model = pc.load(out) if way == "pc.load" else AutoModelForCausalLM.from_pretrained(out)
        return model.eval()

    return load


WAYS = ["pc.load", "plain", "resave:pc.load", "resave:plain"]


def _right_on_the_rare_ids(model: torch.nn.Module, reference: torch.Tensor) -> None:
    logits = _logits(model)
    assert torch.isfinite(logits).all(), f"non-finite logits under transformers {TRANSFORMERS}"
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
    assert float(cosine) >= COSINE


@pytest.mark.parametrize("way", WAYS)
def test_every_load_keeps_the_expert_island_and_the_rare_ids_right(
    kept: Any,
    loads: Callable[[Path, str], torch.nn.Module],
    mixtrals: Callable[[str], Path],
    fp32_logits: torch.Tensor,
    way: str,
) -> None:
    out, _ = kept
    model = loads(out, way)
    experts = model.get_submodule(_moe.HOT_EXPERTS)
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float32
    if way.endswith("pc.load"):  # the stored dtypes: fp16 outside the islands
        assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float16
        source = _fp32(mixtrals("hot")).get_submodule(_moe.HOT_EXPERTS)
        assert torch.equal(experts.gate_up_proj, source.gate_up_proj)  # merged exactly
        assert torch.equal(experts.down_proj, source.down_proj)
    _right_on_the_rare_ids(model, fp32_logits)


def test_one_expert_named_as_stored_keeps_the_whole_fused_module(
    mixtrals: Callable[[str], Path],
) -> None:
    """One fused parameter holds one dtype: naming one stored expert keeps all eight."""
    from precision_convert.conversion.analysis.runtime_names import runtime_modules
    from precision_convert.conversion.io.source import open_source
    from precision_convert.conversion.plan import build_plan
    from precision_convert.recipes import get as get_recipe

    source = open_source(mixtrals("hot"))
    runtime = runtime_modules(source)
    assert runtime[LAYER_0_EXPERTS[0]] == _moe.HOT_EXPERTS
    assert runtime["model.layers.0.block_sparse_moe.gate"] == "model.layers.0.mlp.gate"
    named = "model.layers.0.block_sparse_moe.experts.5.w1"
    plan = build_plan(
        list(source.tensors()),
        target="fp16",
        recipe=get_recipe("llama"),
        keep_fp32=[named],
        runtime=runtime,
    )
    assert sorted(i.name for i in plan.islands) == LAYER_0_EXPERTS
    fused = [i for i in plan.islands if i.name != named]
    assert all(f"fused with {named} into {_moe.HOT_EXPERTS}" in i.rule for i in fused)


def test_a_runtime_name_no_module_has_is_refused(
    mixtrals: Callable[[str], Path], tmp_path: Path
) -> None:
    done = CliRunner().invoke(
        app,
        [
            "model",
            str(mixtrals("hot")),
            "--to",
            "fp16-safe",
            "--keep-fp32",
            "model.layers.0.mlp.expert",
            "--no-validate",
            "-o",
            str(tmp_path / "o"),
        ],
    )
    assert done.exit_code == 2
    line = assert_one_error_line(done.stderr)
    assert line == (
        "precision-convert: --keep-fp32 'model.layers.0.mlp.expert' matches no module of the model"
    )
    assert not (tmp_path / "o").exists()


def test_a_weight_past_fp16s_range_in_one_expert_keeps_the_whole_fused_module(
    mixtrals: Callable[[str], Path], tmp_path: Path
) -> None:
    """The weights' range island of one stored expert covers every tensor fused with it, in
    what ``inspect`` plans and what ``model`` writes (both plan the same way)."""
    import shutil

    from safetensors.torch import load_file, save_file

    wide = tmp_path / "wide"
    shutil.copytree(mixtrals("control"), wide)
    weights = load_file(wide / "model.safetensors")
    odd = "model.layers.1.block_sparse_moe.experts.6.w2.weight"
    weights[odd] = weights[odd].float()
    weights[odd][0, 0] = 1.0e5  # past 65504: fp16 would store inf
    save_file(weights, wide / "model.safetensors", metadata={"format": "pt"})
    done = CliRunner().invoke(app, ["inspect", str(wide), "--json"])
    assert done.exit_code == 0, done.output
    planned = json.loads(done.stdout)["components"][0]["islands"]["fp16-safe"]
    experts = sorted(name for name in planned if "experts" in name)
    assert experts == [name.replace("layers.0", "layers.1") for name in LAYER_0_EXPERTS]
    assert {planned[name] for name in experts} == {"range"}


def test_experts_fused_from_mixed_dtypes_are_refused_in_one_line(
    mixtrals: Callable[[str], Path], tmp_path: Path
) -> None:
    """One fused parameter cannot hold two dtypes: a checkpoint storing one expert's ``w1`` in
    fp32 beside bf16 ones is refused by name, with the source untouched."""
    import shutil

    from safetensors.torch import load_file, save_file

    from precision_convert.core.errors import InputError

    mixed = tmp_path / "mixed"
    shutil.copytree(mixtrals("hot"), mixed)
    weights = load_file(mixed / "model.safetensors")
    odd = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    weights[odd] = weights[odd].float()
    save_file(weights, mixed / "model.safetensors", metadata={"format": "pt"})
    before = (mixed / "model.safetensors").read_bytes()
    with pytest.raises(InputError) as refused:
        pc.load(mixed)
    message = str(refused.value)
    assert "\n" not in message
    assert "'model.layers.0.mlp.experts.gate_up_proj'" in message
    assert "stored in different dtypes" in message
    others = "model.layers.0.block_sparse_moe.experts.0.w1.weight bf16 and 14 more"
    assert f"({odd} fp32, {others})" in message
    assert (mixed / "model.safetensors").read_bytes() == before


# --- acceptance: the search finds the island, the certificate says so -------------------------


@pytest.fixture(scope="module")
def certified(
    mixtrals: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str, str], Any]]:
    """``certified("hot", "fp16-safe")``: converted and certified at ``quick`` coverage."""
    from precision_convert.api.conversion import convert

    root = tmp_path_factory.mktemp("certified")
    done: dict[tuple[str, str], Any] = {}

    def get(name: str, target: str) -> Any:
        if (name, target) not in done:
            out = root / f"{name}-{target}"
            done[name, target] = convert(mixtrals(name), to=target, output=out, coverage="quick")
        return done[name, target]

    yield get


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "target", "verdict"),
    [
        ("hot", "fp16", "fail"),
        ("hot", "fp16-safe", "pass"),
        ("hot", "bf16-safe", "pass"),
        ("control", "fp16", "pass"),
        ("control", "fp16-safe", "pass"),
        ("control", "bf16-safe", "pass"),
    ],
)
def test_the_hot_expert_is_refused_in_fp16_and_certified_with_an_island(
    certified: Callable[[str, str], Any], name: str, target: str, verdict: str
) -> None:
    result = certified(name, target)
    certificate = json.loads((result.output / "precision_certificate.json").read_text())
    assert certificate["verdict"] == verdict, certificate["failures"]
    assert certificate["versions"]["transformers"] == TRANSFORMERS
    islands = {i.name: i for i in result.components[0].plan.islands}
    experts = sorted(n for n in islands if "experts" in n)
    warnings = result.components[0].plan.warnings
    assert not any("even with every module in fp32" in w for w in warnings), warnings
    if (name, target) == ("hot", "fp16-safe"):
        assert experts == LAYER_0_EXPERTS  # the whole fused module, found by the search
        assert {islands[n].reason for n in experts} == {"search"}
        assert all(p["verdict"] == "pass" for p in certificate["load_paths"] if "plain" in p["way"])
    else:
        assert experts == []


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_the_certified_island_keeps_the_rare_ids_right(
    certified: Callable[[str, str], Any],
    loads: Callable[[Path, str], torch.nn.Module],
    fp32_logits: torch.Tensor,
    way: str,
) -> None:
    result = certified("hot", "fp16-safe")
    model = loads(result.output, way)
    assert model.get_submodule(_moe.HOT_EXPERTS).gate_up_proj.dtype == torch.float32
    _right_on_the_rare_ids(model, fp32_logits)
