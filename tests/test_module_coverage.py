"""Coverage by module: every module owning a cast parameter runs in a judged probe, or the
certificate names it and the input that would reach it; a vision-language model is probed
with an image in its prompt."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _models
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from precision_convert.api.conversion import convert
from precision_convert.core.patterns import CERTIFICATE_NAME
from precision_convert.validation.probe.run.modules import module_usage

VISION = "**.vision_tower"
PROJECTOR = "**.multi_modal_projector"


#: Words the tiny tokenizer knows (the probes' sentences'); the rest of its ids are fillers.
WORDS = (
    "a", "red", "fox", "jumps", "over", "the", "sleeping", "dog", "near", "river", "bank",
    "precision", "matters", "is",
)  # fmt: skip


def _processor(path: Path) -> None:
    """LLaVA-1.5's processor for the tiny model: a CLIP image processor at 32 px and a word
    tokenizer of 127 ids plus the ``<image>`` token (id 127), expanded to one per patch."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({word: 3 + i for i, word in enumerate(WORDS)})
    vocab.update({f"w{i}": i for i in range(len(vocab), 127)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which "default" drops
        image_token="<image>",
    ).save_pretrained(path)


#: How far the planted projector channel is scaled: its fp32 peak on an image goes from about
#: 0.4 to about 2e5, past fp16's 65504; the next linear's column is scaled back.
PLANT = 5e5


def _llava(
    path: Path, image_token_index: int = 127, *, processor: bool = False, planted: bool = False
) -> Path:
    """A tiny LLaVA-1.5 (CLIP vision tower, two-layer projector, Llama text model), with its
    processor when ``processor``. ``planted``: one channel of the projector's first linear
    scaled by :data:`PLANT` and its column of the second by 1/PLANT, so the projected image
    patches pass fp16's range inside the projector while its output, and everything text
    alone reaches, stay as they were."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config={"model_type": "clip_vision_model", **_models.CLIP_VISION},
        text_config={
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        image_token_index=image_token_index,
    )
    model = LlavaForConditionalGeneration(config).eval()
    if planted:
        projector = model.model.multi_modal_projector
        with torch.no_grad():
            channel = int(projector.linear_1.weight.norm(dim=1).argmax())
            projector.linear_1.weight[channel] *= PLANT
            projector.linear_1.bias[channel] *= PLANT
            projector.linear_2.weight[:, channel] /= PLANT
    model.save_pretrained(path)
    if processor:
        _processor(path)
    return path


@pytest.mark.parametrize("processor", [False, True], ids=["config", "processor"])
def test_llava_is_probed_with_an_image_in_its_prompt(tmp_path: Path, processor: bool) -> None:
    """Through its processor where it ships one, else from its config's image token."""
    source = _llava(tmp_path / "src", processor=processor)
    certificate = convert(source, to="bf16-safe", output=tmp_path / "out").certificate
    assert certificate.verdict == "pass", certificate.failures
    [record] = certificate.components
    assert record.task == "lm-logits"
    assert ("processor" in (record.inputs.get("tokenizer") or {})) is processor
    layout = next(iter(record.inputs["probes"].values()))
    assert "pixel_values" in layout["args"]
    ids = layout["args"]["input_ids"]["values"]
    assert sum(row.count(127) for row in ids) == 2 * (32 // 8) ** 2  # 16 features per image
    modules = record.modules or {}
    assert any("vision_tower" in m for m in modules["exercised"])
    assert any("multi_modal_projector" in m for m in modules["exercised"])
    assert modules["unreached"] == [] and modules["not_covered"] == []


def test_vlm_without_an_image_probe_fails_naming_its_vision_modules(tmp_path: Path) -> None:
    """An image token outside the vocabulary: no prompt can hold an image, text alone runs,
    and the vision tower and projector never do."""
    source = _llava(tmp_path / "src", image_token_index=1000)
    certificate = convert(source, to="bf16-safe", output=tmp_path / "out").certificate
    assert certificate.verdict == "fail"
    [line] = certificate.failures
    assert "vision_tower`" in line and "multi_modal_projector`" in line
    assert "never ran: no probe held `pixel_values`" in line
    assert not any("vision" in m for m in (certificate.components[0].modules or {})["exercised"])


def test_allow_unexercised_records_the_modules_as_not_covered(tmp_path: Path) -> None:
    from precision_convert.cli.main import app

    source = _llava(tmp_path / "src", image_token_index=1000)
    out = tmp_path / "out"
    args = ["model", str(source), "--to", "bf16-safe", "-o", str(out)]
    args += ["--allow-unexercised", VISION, "--allow-unexercised", PROJECTOR]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    on_disk = json.loads((out / CERTIFICATE_NAME).read_text())
    assert on_disk["verdict"] == "pass"
    modules = on_disk["components"][0]["modules"]
    assert len(modules["not_covered"]) == 2 and modules["unreached"] == []
    whys = [item["why"] for item in on_disk["not_covered"]]
    assert whys.count("--allow-unexercised") == 2
    first_screen = (out / "README.md").read_text().split("## ")[0]
    assert "not covered (--allow-unexercised)" in first_screen
    assert "vision_tower" in first_screen


def test_an_empty_allowed_module_name_is_refused(tmp_path: Path) -> None:
    from precision_convert.cli.main import app

    source = _llava(tmp_path / "src")
    args = ["model", str(source), "--to", "bf16-safe", "-o", str(tmp_path / "out")]
    result = CliRunner().invoke(app, [*args, "--allow-unexercised", "vision_tower..x"])
    assert result.exit_code == 2
    assert "--allow-unexercised 'vision_tower..x'" in result.output
    assert "empty name component" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


class _WithSpare(nn.Module):
    """A model whose ``spare`` its forward never names, and whose ``branch`` it names but
    only calls on a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.branch = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, flag: bool = False) -> Any:
        return self.branch(x) if flag else self.body(x)


def test_modules_never_named_are_unused_and_named_ones_unreached() -> None:
    model = _WithSpare()
    used = {name for name, _ in model.body.named_parameters(prefix="body")}
    usage = module_usage(model, used)
    assert usage.reached == {"body.0", "body.1"}
    assert dict(usage.groups) == {"branch": True, "spare": False}
    assert module_usage(model, [n for n, _ in model.named_parameters()]).groups == ()


class _WithMaskEmbedding(nn.Module):
    """wav2vec2's shape: the model's own parameter is read only where masking is asked for
    (training-time SpecAugment); its children run on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.mask_embedding = nn.Parameter(torch.zeros(4))
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        if mask is not None:
            x = torch.where(mask[..., None], self.mask_embedding, x)
        return self.body(x)


def test_a_module_that_ran_without_reading_its_own_parameters_is_unused() -> None:
    model = _WithMaskEmbedding()
    usage = module_usage(model, ["body.weight", "body.bias"])
    assert usage.reached == {"body"} and dict(usage.groups) == {"": False}


@pytest.mark.parametrize("flag", [False, True])
def test_module_usage_follows_the_parameters_a_run_read(flag: bool) -> None:
    from precision_convert.validation.probe.run.execute import Coverage

    model = _WithSpare()
    coverage = Coverage()
    with coverage.track(model):
        model(torch.ones(1, 4), flag)
    expected = {"branch"} if flag else {"body.0", "body.1"}
    assert coverage.usage.reached == expected
    with coverage.track(model):
        model(torch.ones(1, 4), not flag)
        coverage.unjudged()  # a run that judged nothing adds nothing
    assert coverage.usage.reached == expected


# --------------------------------------------------------------------------- planted projector


@pytest.fixture(scope="module")
def llavas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The planted LLaVA and its control, both shipping their processor."""
    root = tmp_path_factory.mktemp("llava")
    return {
        name: _llava(root / name, processor=True, planted=name == "planted")
        for name in ("planted", "control")
    }


@pytest.fixture(scope="module")
def converted(
    llavas: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Any]:
    """``converted(name, target)``: ``convert``'s result, made on first use."""
    root = tmp_path_factory.mktemp("converted")
    done: dict[tuple[str, str], Any] = {}

    def get(name: str, target: str) -> Any:
        if (name, target) not in done:
            out = root / f"{name}-{target}"
            done[name, target] = convert(llavas[name], to=target, output=out, coverage="quick")
        return done[name, target]

    return get


def _added_islands(result: Any) -> list[str]:
    """The islands calibration added (measured, or found by the search), not the recipe's."""
    islands = result.components[0].plan.islands
    return [i.name for i in islands if i.measured or i.reason == "search"]


def _image_prompt(source: Path) -> dict[str, torch.Tensor]:
    """A user's call: a sentence after an image, through the model's own processor."""
    from transformers import AutoProcessor

    image = torch.linspace(0, 255, 64 * 64 * 3).reshape(64, 64, 3).to(torch.uint8).numpy()
    text = "<image>\nA red fox jumps over the sleeping dog"
    return dict(
        AutoProcessor.from_pretrained(source)(images=[image], text=[text], return_tensors="pt")
    )


def _logits(model: Any, prompt: dict[str, torch.Tensor]) -> torch.Tensor:
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    pixels = prompt["pixel_values"].to(dtype)
    with torch.no_grad():
        return model(**{**prompt, "pixel_values": pixels}).logits.float()


def test_planted_projector_overflows_fp16_only(llavas: dict[str, Path]) -> None:
    """The plant is what it says: past 65504 in fp32 inside the projector, right in bf16,
    non-finite under a plain fp16 cast, with an image in the prompt."""
    from transformers import LlavaForConditionalGeneration

    source = llavas["planted"]
    prompt = _image_prompt(source)
    fp32 = LlavaForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval()
    peak: list[float] = []
    hook = fp32.model.multi_modal_projector.linear_1.register_forward_hook(
        lambda module, args, out: peak.append(float(out.abs().max()))
    )
    reference = _logits(fp32, prompt)
    hook.remove()
    assert peak[0] > 2 * 65504 and torch.isfinite(reference).all()
    assert torch.isfinite(_logits(fp32.to(torch.bfloat16), prompt)).all()
    half = LlavaForConditionalGeneration.from_pretrained(source, dtype=torch.float16).eval()
    assert not torch.isfinite(_logits(half, prompt)).all()


def test_planted_projector_is_refused_in_plain_fp16(converted: Callable[[str, str], Any]) -> None:
    certificate = converted("planted", "fp16").certificate
    assert certificate.verdict == "fail"
    assert any("NaN/Inf" in line for line in certificate.failures), certificate.failures


@pytest.mark.parametrize("way", ["pc.load", "plain"])
def test_planted_projector_is_islanded_and_right_in_fp16_safe(
    llavas: dict[str, Path], converted: Callable[[str, str], Any], way: str
) -> None:
    from transformers import LlavaForConditionalGeneration

    import precision_convert as pc

    result = converted("planted", "fp16-safe")
    assert result.certificate.verdict == "pass", result.certificate.failures
    added = _added_islands(result)
    assert any("multi_modal_projector" in name for name in added), added
    source = llavas["planted"]
    prompt = _image_prompt(source)
    reference = _logits(
        LlavaForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval(), prompt
    )
    loaded = (
        pc.load(result.output)
        if way == "pc.load"
        else LlavaForConditionalGeneration.from_pretrained(result.output)
    )
    logits = _logits(loaded.eval(), prompt)
    assert torch.isfinite(logits).all()
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
    assert cosine > 0.99


def test_planted_projector_is_certified_in_bf16_safe(converted: Callable[[str, str], Any]) -> None:
    certificate = converted("planted", "bf16-safe").certificate
    assert certificate.verdict == "pass", certificate.failures


@pytest.mark.parametrize("target", ["fp16", "fp16-safe", "bf16-safe"])
def test_unplanted_llava_is_certified_without_an_island(
    converted: Callable[[str, str], Any], target: str
) -> None:
    result = converted("control", target)
    assert result.certificate.verdict == "pass", result.certificate.failures
    assert _added_islands(result) == []
