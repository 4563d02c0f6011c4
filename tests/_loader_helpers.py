"""Helpers for the loader tests: metrics, stored dtypes, and the models the seed failures need.

The models here are the variants the reproductions call for that the shared tiny-model zoo
does not hold: a T5 whose norm kernel is as strict as apex's FusedRMSNorm, a CogVLM-style
remote-code checkpoint with fp16 weights and fp32 biases, and a Llama whose MLP output really
leaves fp16's range.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import _models
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from precision_convert.api.conversion import convert
from precision_convert.core.dtypes import BY_CODE


def convert_to(source: Path, target: str, output: Path, **kwargs: object) -> Path:
    """Convert with the real converter, no validation (the tests check parity themselves)."""
    convert(source, to=target, output=output, validate=False, **kwargs)  # type: ignore[arg-type]
    return output


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def psnr(image: torch.Tensor, reference: torch.Tensor, peak: float = 2.0) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2)."""
    mse = (image.double() - reference.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def stored_dtypes(directory: Path) -> dict[str, torch.dtype]:
    """Tensor name -> dtype, as the safetensors files in ``directory`` store them."""
    out: dict[str, torch.dtype] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                out[name] = BY_CODE[f.get_slice(name).get_dtype()].torch
    return out


def record(directory: Path, config_name: str = "config.json") -> dict[str, object]:
    """The record in a config: ``_precision_convert`` in a diffusers model's (diffusers
    passes over it silently), ``precision_convert`` elsewhere; never both."""
    config = json.loads((directory / config_name).read_text())
    key = "_precision_convert" if "_class_name" in config else "precision_convert"
    assert {"precision_convert", "_precision_convert"} & config.keys() == {key}
    return config[key]


class FusedRMSNorm(nn.Module):
    """A norm whose kernel needs input dtype == weight dtype, as apex's FusedRMSNorm does.

    On CPU ``F.layer_norm`` refuses an fp32 input with fp16 weights ("mixed dtype (CPU):
    expect parameter to have scalar type of Float"), the CPU form of CogVideoX's error.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden_states, self.weight.shape, self.weight, None, self.eps)


def t5_with_fused_norm(path: Path) -> Path:
    """A T5 encoder built while ``T5LayerNorm`` is :class:`FusedRMSNorm` (caller patches it)."""
    torch.manual_seed(0)
    model = _models.t5_encoder(vocab_size=96)
    with torch.no_grad():  # non-trivial norm scales, so a wrong norm dtype would show
        for module in model.modules():
            if isinstance(module, FusedRMSNorm):
                module.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def llama_with_overflow(path: Path, scale: float = 1e8) -> Path:
    """A Llama whose layer-0 MLP ``down_proj`` outputs exceed fp16's 65504 (weights scaled)."""
    torch.manual_seed(0)
    model = _models.llama(
        vocab_size=128, hidden_size=32, intermediate_size=64, tie_word_embeddings=False
    )
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(path)
    return path


#: A CogVLM-shaped model (vision conv + projector + language layers) as remote code.
TINY_VLM_CODE = """
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TinyVLMConfig(PretrainedConfig):
    model_type = "tinyvlm"

    def __init__(self, vocab_size=64, hidden_size=32, patch_size=4, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.patch_size = patch_size
        super().__init__(**kwargs)


class TinyVLMForCausalLM(PreTrainedModel):
    config_class = TinyVLMConfig
    base_model_prefix = "vlm"

    def __init__(self, config):
        super().__init__(config)
        h = config.hidden_size
        self.patch_embed = nn.Conv2d(3, h, config.patch_size, stride=config.patch_size)
        self.vision_proj = nn.Linear(h, h)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.norm = nn.LayerNorm(h)
        self.mlp = nn.Linear(h, h)
        self.lm_head = nn.Linear(h, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, pixel_values):
        image = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.vision_proj(image), self.embed_tokens(input_ids)], dim=1)
        x = x + self.mlp(torch.relu(self.norm(x)))
        return self.lm_head(x)
"""


def cogvlm_style(path: Path) -> Path:
    """A remote-code checkpoint stored as CogVLM's was: fp16 weights, fp32 biases."""
    path.mkdir(parents=True)
    code = path / "modeling_tinyvlm.py"
    code.write_text(TINY_VLM_CODE)
    spec = importlib.util.spec_from_file_location("tinyvlm_build", code)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    config = module.TinyVLMConfig(
        auto_map={
            "AutoConfig": "modeling_tinyvlm.TinyVLMConfig",
            "AutoModel": "modeling_tinyvlm.TinyVLMForCausalLM",
            "AutoModelForCausalLM": "modeling_tinyvlm.TinyVLMForCausalLM",
        },
        architectures=["TinyVLMForCausalLM"],
    )
    model = module.TinyVLMForCausalLM(config)
    state = {
        name: t.detach().to(torch.float32 if name.endswith(".bias") else torch.float16)
        for name, t in model.state_dict().items()
    }
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config.dtype = "float16"
    config.save_pretrained(path)
    return path


def fp32_reference(directory: Path) -> nn.Module:
    """The remote-code model with every tensor of ``directory`` upcast to fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, trust_remote_code=True
    )
    return model.float().eval()
