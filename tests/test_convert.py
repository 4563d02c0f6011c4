"""Conversions of tiny real architectures: dtypes follow the plan, bits equal ``source.to()``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import _models
import pytest
import torch
from _loader_helpers import record
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from precision_convert.api.conversion import convert
from precision_convert.api.options import ConversionOptions
from precision_convert.core.errors import InputError
from precision_convert.core.names import units

TARGETS = ["bf16-safe", "fp16-safe", "bf16", "fp16"]
COMPUTE = {
    "bf16-safe": torch.bfloat16,
    "bf16": torch.bfloat16,
    "fp16-safe": torch.float16,
    "fp16": torch.float16,
}


def _source_state(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(path))
    for path in sorted(directory.glob("*.bin")):
        state.update(torch.load(path, weights_only=True))
    return state


def _config_name(directory: Path) -> str:
    open_clip_config = directory / "open_clip_config.json"
    return open_clip_config.name if open_clip_config.exists() else "config.json"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def check_converted(source: Path, output: Path, target: str) -> dict:
    """Every stored tensor has its planned dtype and equals source.to(dtype) bit for bit."""
    block = record(output, _config_name(output))
    assert block["target"] == target
    assert block["compute_dtype"] == str(COMPUTE[target]).removeprefix("torch.")
    assert set(block["islands"]) == set(block["fp32_modules"])
    fp32 = set(block["fp32_modules"])
    source_state = _source_state(source)
    seen: set[str] = set()
    unit_of = units(source_state)
    for shard in sorted(output.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            metadata = f.metadata()
            assert metadata["format"] == "pt"
            assert json.loads(metadata["precision_convert"]) == block
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                stored = f.get_tensor(name)
                original = source_state[name]
                if original.is_floating_point():
                    expected = torch.float32 if unit_of[name] in fp32 else COMPUTE[target]
                else:
                    expected = original.dtype
                assert stored.dtype == expected, name
                reference = original.to(expected)
                assert torch.equal(_bits(stored), _bits(reference)), name
                seen.add(name)
    assert seen, "no tensors written"
    return block


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", [*_models.CONVERT_FAMILIES, "openclip"])
def test_every_tensor_follows_the_plan(
    tiny_model: Callable[[str], Path], tmp_path: Path, name: str, target: str
) -> None:
    source = tiny_model(name)
    result = convert(source, to=target, output=tmp_path / "out", validate=False)
    block = check_converted(source, tmp_path / "out", target)
    assert block["plan_sha256"] == result.components[0].plan.sha256
    if target.endswith("-safe"):
        assert block["fp32_modules"], "a safe target keeps at least its normalization in fp32"
    else:
        assert block["fp32_modules"] == []


def test_t5_keeps_wo_fp32_only_for_fp16(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    source = tiny_model("t5-encoder")
    fp16 = convert(source, to="fp16-safe", output=tmp_path / "fp16", validate=False)
    bf16 = convert(source, to="bf16-safe", output=tmp_path / "bf16", validate=False)
    wo = "encoder.block.0.layer.1.DenseReluDense.wo"
    norm = "encoder.block.0.layer.0.layer_norm"
    fp16_islands = {i.name: i.reason for i in fp16.components[0].plan.islands}
    bf16_islands = {i.name: i.reason for i in bf16.components[0].plan.islands}
    assert fp16_islands[wo] == "range" and wo not in bf16_islands
    assert fp16_islands[norm] == bf16_islands[norm] == "precision"
    assert "shared" not in fp16_islands  # "wo"-style names never match by substring


@pytest.mark.parametrize(
    ("name", "expected", "not_expected"),
    [
        ("llama", {"model.norm", "model.layers.0.input_layernorm"}, {"model.embed_tokens"}),
        (
            "clip",
            {
                "logit_scale",
                "text_model.embeddings.position_embedding",
                "vision_model.embeddings.class_embedding",
                "vision_model.pre_layrnorm",
            },
            {"text_projection"},
        ),
        (
            "openclip",
            {
                "logit_scale",
                "positional_embedding",
                "token_embedding",
                "ln_final",
                "visual.class_embedding",
                "visual.ln_pre",
            },
            {"text_projection", "visual.proj", "visual.conv1"},
        ),
        ("unet", {"time_embedding.linear_1", "conv_norm_out"}, {"conv_in"}),
        (
            "cogvideox-transformer",
            {"norm_final", "patch_embed.proj", "time_embedding.linear_1"},
            {"norm_out.linear", "transformer_blocks.0.norm1.linear"},
        ),
    ],
)
def test_recipe_islands(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    name: str,
    expected: set[str],
    not_expected: set[str],
) -> None:
    result = convert(tiny_model(name), to="bf16-safe", output=tmp_path / "out", validate=False)
    islands = set(result.components[0].plan.fp32_modules)
    assert expected <= islands
    assert not (not_expected & islands), "AdaLayerNorm-style linears and projections stay low"


@pytest.mark.parametrize("name", ["t5-encoder", "llama", "bert", "clip"])
def test_converted_loads_with_plain_from_pretrained(
    tiny_model: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    import transformers

    source = tiny_model(name)
    convert(source, to="bf16-safe", output=tmp_path / "out", validate=False)
    architecture = json.loads((source / "config.json").read_text())["architectures"][0]
    cls = getattr(transformers, architecture)
    model = cls.from_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    fp32 = set(config["precision_convert"]["fp32_modules"])
    reference = cls.from_pretrained(source).state_dict()
    loaded = model.state_dict()
    unit_of = units(reference)
    for key, value in reference.items():
        if not value.is_floating_point():
            continue
        stored = value.to(torch.float32 if unit_of[key] in fp32 else torch.bfloat16)
        # transformers may load a tensor in another dtype than stored: compare in its dtype.
        assert torch.equal(loaded[key], stored.to(loaded[key].dtype)), key


@pytest.mark.parametrize("name", ["unet", "autoencoder-kl", "cogvideox-transformer"])
def test_diffusers_model_loads_and_sets_flags(
    tiny_model: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    import diffusers

    source = tiny_model(name)
    for target, upcast in (("fp16-safe", True), ("bf16-safe", False)):
        out = tmp_path / target
        convert(source, to=target, output=out, validate=False)
        config = json.loads((out / "config.json").read_text())
        model = getattr(diffusers, config["_class_name"]).from_pretrained(out)
        assert sum(p.numel() for p in model.parameters()) > 0
        if name == "autoencoder-kl":
            assert config["force_upcast"] is upcast


def test_pipeline_components_convert_under_their_own_recipes(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    from diffusers import StableDiffusionPipeline

    source = tiny_model("sd-pipeline")
    result = convert(source, to="fp16-safe", output=tmp_path / "out", validate=False)
    recipes = {c.name: c.plan.recipe for c in result.components}
    assert recipes == {"unet": "unet2d-condition", "vae": "autoencoder-kl", "text_encoder": "clip"}
    for component in ("unet", "vae", "text_encoder"):
        check_converted(source / component, tmp_path / "out" / component, "fp16-safe")
    for copied in (
        "model_index.json",
        "scheduler/scheduler_config.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/tokenizer.json",
    ):
        assert (tmp_path / "out" / copied).read_bytes() == (source / copied).read_bytes()
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "out")
    assert pipe.vae.config.force_upcast is True


def test_sharded_source_keeps_its_layout(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    source = tiny_model("mistral-7b-v0.3")  # three shards and an index, as published
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(shards) > 1
    convert(source, to="bf16", output=tmp_path / "out", validate=False)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == shards
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    source_index = json.loads((source / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == source_index["weight_map"]
    data_bytes = 0
    for shard in shards:
        with safe_open(tmp_path / "out" / shard, "pt") as f:
            data_bytes += sum(f.get_tensor(k).numel() * 2 for k in f.keys())  # noqa: SIM118
    assert index["metadata"]["total_size"] == data_bytes
    check_converted(source, tmp_path / "out", "bf16")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_pickle_source_with_tied_weights(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    from transformers import T5EncoderModel

    model = T5EncoderModel.from_pretrained(tiny_model("t5-encoder"))
    source = tmp_path / "bin"
    model.config.save_pretrained(source)
    state = model.state_dict()
    assert state["shared.weight"].data_ptr() == state["encoder.embed_tokens.weight"].data_ptr()
    torch.save(state, source / "pytorch_model.bin")
    out = tmp_path / "out"
    convert(source, to="bf16-safe", output=out, validate=False)
    assert not list(out.glob("*.bin"))
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "shared.weight" in names and "encoder.embed_tokens.weight" not in names  # once
    loaded = T5EncoderModel.from_pretrained(out)
    assert loaded.encoder.embed_tokens.weight.data_ptr() == loaded.shared.weight.data_ptr()
    assert torch.equal(loaded.shared.weight, state["shared.weight"].to(torch.bfloat16))


def test_tied_lm_head_survives(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    convert(tiny_model("llama"), to="fp16-safe", output=tmp_path / "out", validate=False)
    model = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _with_scaled_weight(source: Path, dest: Path, name: str, scale: float) -> Path:
    import shutil

    shutil.copytree(source, dest)
    state = load_file(dest / "model.safetensors")
    state[name] = state[name] * scale
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize(
    ("scale", "kind"), [(1e6, "exceed the fp16 range"), (1e-8, "flush to zero")]
)
def test_fp16_range_of_weights(
    tiny_model: Callable[[str], Path], tmp_path: Path, scale: float, kind: str
) -> None:
    weight = "model.layers.1.mlp.down_proj.weight"
    source = _with_scaled_weight(tiny_model("llama"), tmp_path / "src", weight, scale)
    safe = convert(source, to="fp16-safe", output=tmp_path / "safe", validate=False)
    island = {i.name: i for i in safe.components[0].plan.islands}["model.layers.1.mlp.down_proj"]
    assert island.reason == "range" and kind in island.rule
    check_converted(source, tmp_path / "safe", "fp16-safe")
    plain = convert(source, to="fp16", output=tmp_path / "plain", validate=False)
    assert any(weight in w and kind in w for w in plain.components[0].plan.warnings)
    with safe_open(tmp_path / "plain" / "model.safetensors", "pt") as f:
        assert f.get_tensor(weight).dtype == torch.float16


def test_keep_fp32_adds_user_islands(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    result = convert(
        tiny_model("t5-encoder"),
        to="fp16",
        output=tmp_path / "out",
        validate=False,
        keep_fp32=["encoder.block.1.layer.0.SelfAttention.o"],
    )
    islands = {i.name: i.reason for i in result.components[0].plan.islands}
    assert islands == {"encoder.block.1.layer.0.SelfAttention.o": "user"}
    check_converted(tiny_model("t5-encoder"), tmp_path / "out", "fp16")


def test_options_object_or_keywords_not_both(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """``options=`` gives the same output as the keywords it holds; a field given both ways
    with different values is refused (one of them would be dropped silently)."""
    pattern = "encoder.block.1.layer.0.SelfAttention.o"
    options = ConversionOptions(keep_fp32=(pattern,))
    result = convert(tiny_model("t5-encoder"), "fp16", tmp_path / "a", False, options=options)
    assert {i.name: i.reason for i in result.components[0].plan.islands} == {pattern: "user"}
    check_converted(tiny_model("t5-encoder"), tmp_path / "a", "fp16")
    with pytest.raises(InputError, match=r"^recipe given as a keyword and in options="):
        convert(tiny_model("t5-encoder"), "fp16", tmp_path / "b", options=options, recipe="t5")
    trusting = ConversionOptions(trust_remote_code=True)
    with pytest.raises(InputError, match=r"^trust_remote_code given as a keyword"):
        convert(tiny_model("t5-encoder"), "fp16", tmp_path / "b", options=trusting,
                trust_remote_code=False)  # fmt: skip
    assert not (tmp_path / "b").exists()
    # The same value both ways is one value; a keyword that is no option is a TypeError.
    assert ConversionOptions.given(options, keep_fp32=[pattern], recipe=None) is options
    with pytest.raises(TypeError, match="'keep_fp16'"):
        convert(tiny_model("t5-encoder"), "fp16", tmp_path / "b", keep_fp16=[pattern])  # type: ignore[call-arg]


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_cli_default_output_and_json(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    source = tiny_model("bert")
    before = _tree_digest(source)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["model", str(source), "--to", "bf16-safe", "--no-validate", "--json"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert Path(payload["output"]) == tmp_path / "bert-bf16-safe"
    assert payload["components"][0]["recipe"] == "bert"
    check_converted(source, tmp_path / "bert-bf16-safe", "bf16-safe")
    assert _tree_digest(source) == before, "the source must never be modified"
    again = CliRunner().invoke(app, ["model", str(source), "--to", "bf16-safe", "--no-validate"])
    assert again.exit_code == 2 and "--overwrite" in again.stderr
    forced = CliRunner().invoke(
        app,
        [
            "model",
            str(source),
            "--to",
            "fp16",
            "--no-validate",
            "--overwrite",
            "-o",
            "bert-bf16-safe",
        ],
    )
    assert forced.exit_code == 0, forced.output
    check_converted(source, tmp_path / "bert-bf16-safe", "fp16")
    assert [p.name for p in tmp_path.iterdir()] == ["bert-bf16-safe"]


def test_inspect_flags_mixed_dtype_modules(tmp_path: Path) -> None:
    """The CogVLM failure: fp16 weights with fp32 biases in the same module."""
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    torch.manual_seed(0)
    model = _models.bert(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    model.save_pretrained(tmp_path / "src")
    state = load_file(tmp_path / "src" / "model.safetensors")
    state = {k: v.half() if k.endswith(".weight") else v for k, v in state.items()}
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "src"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["components"][0]
    mixed = {h["name"] for h in report["hazards"] if h["kind"] == "mixed-dtype"}
    assert "encoder.layer.0.attention.self.query" in mixed
    assert any(h["kind"] == "config-dtype" for h in report["hazards"])
    assert report["parameters_by_dtype"]["fp16"] > report["parameters_by_dtype"]["fp32"]
    convert(tmp_path / "src", to="bf16-safe", output=tmp_path / "out", validate=False)
    after = CliRunner().invoke(app, ["inspect", str(tmp_path / "out"), "--json"])
    hazards = json.loads(after.stdout)["components"][0]["hazards"]
    assert not [h for h in hazards if h["kind"] == "mixed-dtype"]


def test_inspect_reads_its_own_output_by_its_recorded_map(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """An fp16-safe output's config declares float16 over fp16 weights and fp32 islands: the
    map its ``precision_convert`` record explains, reported as such, no hazard. Weights that
    no longer hold the record are still a hazard, with the config's dtype."""
    from typer.testing import CliRunner

    from precision_convert.cli.main import app

    output = tmp_path / "out"
    options = ConversionOptions(calibrate=False)
    convert(
        tiny_model("t5-encoder"), to="fp16-safe", output=output, validate=False, options=options
    )
    report = json.loads(CliRunner().invoke(app, ["inspect", str(output), "--json"]).stdout)
    component = report["components"][0]
    assert set(component["parameters_by_dtype"]) == {"fp16", "fp32"}
    assert component["hazards"] == []
    shown = CliRunner().invoke(app, ["inspect", str(output)])
    assert shown.exit_code == 0, shown.output
    kept = len(component["record"]["fp32_modules"])
    assert f"dtype map recorded by precision-convert (fp16-safe): float16 compute, {kept} " in (
        shown.stdout
    )
    assert "config declares" not in shown.stdout and "no hazards found" in shown.stdout

    weights = output / "model.safetensors"
    with safe_open(str(weights), "pt") as opened:
        metadata = opened.metadata()
    state = load_file(weights)
    island = next(n for n, t in state.items() if t.dtype == torch.float32)
    state[island] = state[island].half()  # the record keeps it fp32; the file no longer does
    save_file(state, str(weights), metadata=metadata)
    after = json.loads(CliRunner().invoke(app, ["inspect", str(output), "--json"]).stdout)
    kinds = {h["kind"]: h["detail"] for h in after["components"][0]["hazards"]}
    assert f"{island!r} is stored as fp16" in kinds["record"]
    assert kinds["config-dtype"].startswith("config declares float16 but the weights are")


def test_source_shard_metadata_is_kept(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    import shutil

    source = tmp_path / "src"
    shutil.copytree(tiny_model("bert"), source)
    state = load_file(source / "model.safetensors")
    save_file(state, source / "model.safetensors", metadata={"format": "pt", "origin": "lab-7"})
    convert(source, to="bf16", output=tmp_path / "out", validate=False)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["origin"] == "lab-7" and "precision_convert" in metadata
