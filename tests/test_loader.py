"""``precision_convert.load`` and the boundary hooks behind it.

The hook machinery is tested first on hand-made models cast module by module, then the loader
on every library it builds with: the stored dtypes must come back exactly (no flattening by
``from_pretrained``), hooks must sit only where the dtype changes, and the result must run.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _loader_helpers import convert_to, cosine, stored_dtypes
from torch import nn

import precision_convert as pc
from precision_convert.conversion.runtime import boundaries
from precision_convert.conversion.runtime.boundaries import (
    CAST_INPUTS,
    CAST_OUTPUTS,
    PROMOTE_MIXED,
    boundary_hooks,
    find_boundaries,
    hooked_modules,
)
from precision_convert.core.errors import InputError

# --- the hook machinery on hand-made models --------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.out = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.final = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.final(x)


def _net_with_fp32(*islands: str) -> tuple[nn.Module, nn.Module]:
    """(fp32 reference, the same weights in fp16 with ``islands`` kept fp32)."""
    torch.manual_seed(0)
    reference = _Net().eval()
    mixed = _Net().eval()
    mixed.load_state_dict(reference.state_dict())
    mixed.half()
    for name in islands:
        mixed.get_submodule(name).float()
    return reference, mixed


NORMS = ("blocks.0.norm", "blocks.1.norm", "final")


def test_precision_islands_hook_only_islands_and_entries() -> None:
    reference, mixed = _net_with_fp32(*NORMS)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError):
        mixed(x)
    found = find_boundaries(mixed, reasons=dict.fromkeys(NORMS, "precision"))
    assert found.compute == torch.float16
    assert set(found.precision_islands) == set(NORMS)
    assert not found.flows and not found.guards
    with boundary_hooks(mixed, found), torch.no_grad():
        hooked = hooked_modules(mixed)
        got = mixed(x)  # an fp32 input, cast at the model's door
    assert hooked == {
        "": (CAST_INPUTS,),
        "inp": (CAST_INPUTS,),
        **{name: (CAST_INPUTS, CAST_OUTPUTS) for name in NORMS},
    }
    # A precision island hands back the surrounding dtype.
    assert got.dtype == torch.float16
    assert cosine(got, reference(x)) >= 0.999
    assert hooked_modules(mixed) == {}


def test_flowing_island_output_stays_fp32_and_consumers_cast() -> None:
    reference, mixed = _net_with_fp32(*NORMS, "blocks.0.out")
    reasons = {**dict.fromkeys(NORMS, "precision"), "blocks.0.out": "range"}
    seen: list[torch.dtype] = []
    mixed.blocks[0].out.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    found = find_boundaries(mixed, reasons=reasons)
    assert found.flowing_islands == ("blocks.0.out",)
    assert found.promote == ("blocks.0",)
    # Every compute-dtype module that might now receive fp32 casts what it receives.
    assert set(found.guards) == {"inp", "blocks.0.fc", "blocks.1.fc", "blocks.1.out"}
    x = torch.randn(3, 4)
    with boundary_hooks(mixed, found), torch.no_grad():
        got = mixed(x)
    assert seen == [torch.float32]
    assert cosine(got, reference(x)) >= 0.999


class _Attention(nn.Module):
    """Functional consumers: ``q @ k`` and ``cat`` of two projections' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        return torch.cat([scores @ self.v(x), self.q(x)], dim=-1)


def test_functional_consumers_of_a_flowing_island_promote() -> None:
    torch.manual_seed(0)
    reference = _Attention().eval()
    mixed = _Attention().eval()
    mixed.load_state_dict(reference.state_dict())
    mixed.half().q.float()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="same dtype"):
            mixed(x.half())
        with boundary_hooks(mixed, find_boundaries(mixed, reasons={"q": "user"})) as found:
            got = mixed(x)
    assert found.promote == ("",)
    assert got.dtype == torch.float32  # promoted, never cast down
    assert cosine(got, reference(x)) >= 0.999


class _Container(nn.Module):
    """An fp32 tensor held directly by a container and used functionally (``x @ proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.proj = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) @ self.proj


def test_fp32_tensor_in_a_container_is_its_own_unit() -> None:
    torch.manual_seed(0)
    reference = _Container().eval()
    mixed = _Container().eval()
    mixed.load_state_dict(reference.state_dict())
    mixed.fc.half()
    found = find_boundaries(mixed)
    assert found.tensor_units == ("proj",)
    assert found.promote == ("",)
    x = torch.randn(2, 8)
    with boundary_hooks(mixed, found), torch.no_grad():
        assert cosine(mixed(x), reference(x)) >= 0.999


class _Recorder(nn.Module):
    """Records the dtypes its forward receives."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.seen: list[torch.dtype] = []

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.seen += [ids.dtype, mask.dtype, scale.dtype]
        return self.norm(self.embed(ids)) * scale


def test_integer_and_bool_inputs_are_never_cast() -> None:
    model = _Recorder().half()
    model.norm.float()
    ids, mask = torch.tensor([[1, 2, 3]]), torch.tensor([[True, True, False]])
    with boundary_hooks(model, find_boundaries(model, reasons={"norm": "precision"})):
        out = model(ids, mask=mask, scale=torch.tensor(2.0))
    assert model.seen == [torch.int64, torch.bool, torch.float16]
    assert out.dtype == torch.float16


def test_install_is_idempotent_and_removal_is_complete() -> None:
    _, mixed = _net_with_fp32(*NORMS)
    found = find_boundaries(mixed, reasons=dict.fromkeys(NORMS, "precision"))
    boundaries.install(mixed, found)
    boundaries.install(mixed, found)
    norm = mixed.get_submodule("final")
    assert len(norm._forward_pre_hooks) == 1 and len(norm._forward_hooks) == 1
    assert boundaries.remove(mixed) == len(NORMS) * 2 + 2
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in mixed.modules())
    with pytest.raises(ZeroDivisionError), boundary_hooks(mixed, found):
        raise ZeroDivisionError
    assert hooked_modules(mixed) == {}


def test_hooks_follow_a_later_cast_of_the_whole_model() -> None:
    """Diffusers pipelines upcast a VAE with ``.to(float32)``; the hooks must not fight it."""
    _, mixed = _net_with_fp32(*NORMS)
    with boundary_hooks(mixed, find_boundaries(mixed, reasons=dict.fromkeys(NORMS, "precision"))):
        mixed.to(torch.float32)
        out = mixed(torch.randn(2, 4))
    assert out.dtype == torch.float32


def test_a_layer_whose_own_tensors_disagree_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    model[1].bias.data = model[1].bias.data.float()
    with pytest.raises(InputError, match=r"module '1' holds tensors of different dtypes"):
        find_boundaries(model)


def test_promotion_mode_never_leaks_past_a_failing_forward() -> None:
    _, mixed = _net_with_fp32("blocks.0.out")
    found = find_boundaries(mixed, reasons={"blocks.0.out": "range"})
    assert found.promote == ("blocks.0",)

    def fail(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert torch._C._is_torch_function_mode_enabled()  # inside the promoted block
        raise RuntimeError("boom")

    mixed.blocks[0].fc.register_forward_pre_hook(fail)
    with boundary_hooks(mixed, found):
        with pytest.raises(RuntimeError, match="boom"):
            mixed(torch.randn(2, 4))
        assert not torch._C._is_torch_function_mode_enabled()


# --- the loader ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """``converted("llama", "bf16-safe")`` → a converted directory, built once per module."""
    root = tmp_path_factory.mktemp("converted")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, target: str) -> Path:
        if (name, target) not in cache:
            cache[name, target] = convert_to(tiny_model(name), target, root / f"{name}-{target}")
        return cache[name, target]

    return get


def _assert_stored_dtypes(model: nn.Module, directory: Path) -> None:
    """Every tensor of the files is in the model in exactly the dtype the files store."""
    state = model.state_dict()
    stored = stored_dtypes(directory)
    assert stored
    for name, dtype in stored.items():
        assert state[name].dtype == dtype, name


@pytest.mark.parametrize("target", ["bf16-safe", "fp16-safe", "bf16", "fp16"])
def test_transformers_model_loads_exactly_as_stored(
    converted: Callable[[str, str], Path], tiny_model: Callable[[str], Path], target: str
) -> None:
    from transformers import LlamaForCausalLM

    directory = converted("llama", target)
    model = pc.load(directory)
    _assert_stored_dtypes(model, directory)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    islands = set(json.loads((directory / "config.json").read_text())["precision_convert"]
                  ["fp32_modules"])  # fmt: skip
    norms = {n for n in hooked_modules(model) if n.endswith("norm")}
    assert norms == islands
    for name in islands:  # read back from the file, holding no more memory than they need
        weight = model.get_submodule(name).weight
        assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    assert set(hooked_modules(model)) == {"", "model", "lm_head"} | islands

    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(tiny_model("llama")).eval()(ids).logits
        got = model(ids).logits
    assert torch.isfinite(got).all()
    assert cosine(got, expected) >= 0.999


def test_plain_target_undoes_transformers_keep_in_fp32(
    converted: Callable[[str, str], Path],
) -> None:
    """T5's ``_keep_in_fp32_modules = ["wo"]`` would re-raise wo to fp32; fp16 plans say fp16."""
    directory = converted("t5-encoder", "fp16")
    model = pc.load(directory)
    _assert_stored_dtypes(model, directory)
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float16
    found = find_boundaries(model)
    assert not found.precision_islands and not found.flowing_islands and not found.guards


def test_fp16_safe_t5_keeps_wo_as_a_range_island(converted: Callable[[str, str], Path]) -> None:
    """The record's reasons reach the hooks: wo's output flows on, the norms' comes back."""
    model = pc.load(converted("t5-encoder", "fp16-safe"))
    hooked = hooked_modules(model)
    wo = [n for n in hooked if n.endswith(".wo")]
    norms = [n for n in hooked if n.endswith("layer_norm")]
    assert len(wo) == 2 and len(norms) == 5
    assert all(hooked[n] == (CAST_INPUTS,) for n in wo)
    assert all(hooked[n] == (CAST_INPUTS, CAST_OUTPUTS) for n in norms)
    assert all(PROMOTE_MIXED in hooked[n.rpartition(".")[0]] for n in wo)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 6, 7]])).last_hidden_state
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_diffusers_model_loads_exactly_as_stored(
    converted: Callable[[str, str], Path], tiny_model: Callable[[str], Path]
) -> None:
    """diffusers casts each tensor to the parameter's dtype; the loader puts the plan back."""
    from diffusers import UNet2DConditionModel

    directory = converted("unet", "fp16-safe")
    model = pc.load(directory)
    _assert_stored_dtypes(model, directory)
    assert model.time_embedding.linear_1.weight.dtype == torch.float32
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(1, 4, 16, 16, generator=generator)
    text = torch.randn(1, 5, 24, generator=generator)  # the UNet's cross_attention_dim
    with torch.no_grad():
        expected = UNet2DConditionModel.from_pretrained(tiny_model("unet"))(sample, 10, text)
        got = model(sample, 10, encoder_hidden_states=text).sample
    assert got.dtype == torch.float16
    assert cosine(got, expected.sample) >= 0.99


def test_diffusers_pipeline_loads_every_component(converted: Callable[[str, str], Path]) -> None:
    from diffusers import StableDiffusionPipeline

    directory = converted("sd-pipeline", "fp16-safe")
    pipe = pc.load(directory)
    assert isinstance(pipe, StableDiffusionPipeline)
    for name in ("unet", "vae", "text_encoder"):
        component = getattr(pipe, name)
        _assert_stored_dtypes(component, directory / name)
        assert hooked_modules(component), name
    generator = torch.Generator().manual_seed(2)
    embeds = torch.randn(1, 4, 24, generator=generator)  # the text encoder's width
    with torch.no_grad():
        images = pipe(
            prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds),
            num_inference_steps=2, height=32, width=32, output_type="pt", generator=generator,
        ).images  # fmt: skip
        tokens = pipe.text_encoder(torch.tensor([[0, 5, 6, 1]])).last_hidden_state
    assert torch.isfinite(images).all() and images.std() > 0
    assert tokens.dtype == torch.float16 and torch.isfinite(tokens).all()


@pytest.mark.parametrize("target", ["bf16-safe", "bf16", "fp16-safe"])
def test_openclip_model_loads_exactly_as_stored(
    converted: Callable[[str, str], Path],
    tiny_model: Callable[[str], Path],
    target: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    open_clip = pytest.importorskip("open_clip", reason="open_clip_torch is not installed")
    directory = converted("openclip", target)
    with caplog.at_level(logging.INFO):
        model = pc.load(directory)
    # open_clip's factory logs "No pretrained weights loaded ... initialized randomly" when it
    # builds without weights; a user would read that as a broken load. The builder never does.
    assert not [r for r in caplog.records if "random" in r.getMessage().lower()]
    _assert_stored_dtypes(model, directory)
    generator = torch.Generator().manual_seed(3)
    image = torch.randn(2, 3, 32, 32, generator=generator)
    text = torch.randint(2, 128, (2, 16), generator=generator)
    reference = open_clip.create_model(f"local-dir:{tiny_model('openclip')}").eval()
    with torch.no_grad():
        for got, want in (
            (model.encode_image(image), reference.encode_image(image)),
            (model.encode_text(text), reference.encode_text(text)),
        ):
            assert torch.isfinite(got).all()
            assert cosine(got, want) >= 0.995


def test_unconverted_directory_loads_as_stored(tiny_model: Callable[[str], Path]) -> None:
    """No record: stored dtypes still load exactly; nothing to hook but the entry points."""
    model = pc.load(tiny_model("t5-encoder"), device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    found = find_boundaries(model)
    assert not found.precision_islands and not found.flowing_islands


def test_device_is_checked_and_auto_resolves(converted: Callable[[str, str], Path]) -> None:
    directory = converted("t5-encoder", "bf16-safe")
    with pytest.raises(InputError, match="unknown device"):
        pc.load(directory, device="tpu-9000")
    model = pc.load(directory, device="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert {p.device.type for p in model.parameters()} == {expected}


def test_not_a_directory_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such directory"):
        pc.load(tmp_path / "missing")


def test_weights_that_contradict_their_record_are_refused(
    converted: Callable[[str, str], Path], tmp_path: Path
) -> None:
    directory = tmp_path / "tampered"
    shutil.copytree(converted("t5-encoder", "bf16-safe"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["precision_convert"]["fp32_modules"].append("shared")
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"keeps 'shared' in fp32 but 'shared.weight' is stored"):
        pc.load(directory)
