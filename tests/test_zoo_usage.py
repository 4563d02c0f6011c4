"""What users run after loading a converted zoo model, where it differs from one forward pass.

The certificate's probes are single forwards. Users instead generate with a KV cache (each
step feeds one token against cached keys and values), run a pipeline with classifier-free
guidance over several scheduler steps (a batch of conditional and negative prompts whose
difference is amplified), and encode sentences with mean pooling. Each is run here on the
converted model loaded with ``pc.load`` and compared with the fp32 source doing the same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import ZOO_TARGETS

from precision_convert.conversion.runtime.loader import load
from precision_convert.validation.probe.run.parity import thresholds_for

CAUSAL_LMS = (
    "llama-3.2-1b",
    "mistral-7b-v0.3",
    "qwen2.5-0.5b",
    "gemma-2-2b",
    "phi-3-mini-4k",
    "gpt2",
)
NEW_TOKENS = 32
PROMPT = "The river rose above its banks after three days of rain, and"


@pytest.fixture(scope="module")
def converted(zoo_converted: Callable[[str, str], Any]) -> Callable[[str, str], Path]:
    """``converted(family, target)``: the directory of the session's certified conversion."""
    return lambda name, target: zoo_converted(name, target).output


def _fp32(source: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def _unexplained(
    tokens: torch.Tensor, reference: torch.Tensor, candidate: torch.Tensor
) -> list[int]:
    """Steps where a generated token is not fp32's choice and the gap is not rounding.

    ``reference``/``candidate``: fp32's and the converted model's logits over the generated
    sequence (one full forward each). A step may pick another token than fp32's argmax only
    when fp32's margin over the picked token is within the candidate's own error there.
    """
    bad = []
    for step, token in enumerate(tokens.tolist()):
        ref = reference[step]
        best = int(ref.argmax())
        error = float((candidate[step] - ref).abs().max())
        if token != best and float(ref[best] - ref[token]) > 2 * error:
            bad.append(step)
    return bad


@pytest.mark.parametrize("target", ZOO_TARGETS)
@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_generate_with_kv_cache_agrees_with_fp32(
    tiny_model: Callable[[str], Path],
    converted: Callable[[str, str], Path],
    name: str,
    target: str,
) -> None:
    from transformers import AutoTokenizer

    source = tiny_model(name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompt = tokenizer(PROMPT, return_tensors="pt")
    model = load(converted(name, target))
    with torch.no_grad():
        generated = model.generate(
            **prompt,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,  # no early eos: every step is compared
            do_sample=False,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
        start = prompt["input_ids"].shape[1]
        assert generated.shape[1] == start + NEW_TOKENS
        new = generated[0, start:]
        # Teacher-forced logits of both models over the whole sequence, at the positions
        # that predicted each new token.
        window = slice(start - 1, start - 1 + NEW_TOKENS)
        reference = _fp32(source)(generated).logits[0, window].float()
        candidate = model(generated).logits[0, window].float()
    assert torch.isfinite(candidate).all()
    # The logits along the generated text stay within the certificate's own bound, so the
    # near-tie allowance below cannot excuse a broken model...
    rel_l2 = float((candidate - reference).norm() / reference.norm())
    assert rel_l2 < thresholds_for("lm-logits")["rel_l2"]
    # ...and every token generated through the cache is fp32's choice or a rounding tie.
    assert _unexplained(new, reference, candidate) == []


PIPELINES = ("stable-diffusion-1.5", "stable-diffusion-xl")


def _guided_images(pipe: Any) -> torch.Tensor:
    """Four Euler/PNDM steps with classifier-free guidance and a negative prompt."""
    return pipe(
        prompt="a red fox near the river bank",
        negative_prompt="blurry, dark",
        guidance_scale=7.5,
        num_inference_steps=4,
        height=64,
        width=64,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images.float()


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


@pytest.mark.parametrize("target", ZOO_TARGETS)
@pytest.mark.parametrize("name", PIPELINES)
def test_guided_pipeline_call_matches_fp32(
    tiny_model: Callable[[str], Path],
    converted: Callable[[str, str], Path],
    name: str,
    target: str,
) -> None:
    from diffusers import DiffusionPipeline

    reference = _guided_images(
        DiffusionPipeline.from_pretrained(tiny_model(name), torch_dtype=torch.float32)
    )
    images = _guided_images(load(converted(name, target)))
    assert torch.isfinite(images).all()
    assert float(images.std()) > 0.01  # not a flat (all-black) frame
    assert _psnr(images, reference) > 30.0


@pytest.mark.parametrize("target", ZOO_TARGETS)
def test_sentence_transformers_encode_matches_fp32(
    tiny_model: Callable[[str], Path], converted: Callable[[str, str], Path], target: str
) -> None:
    """sentence-transformers' encode of a plain model directory, as users run it: the model's
    token states (``from_pretrained`` defaults), mean-pooled under the attention mask of a
    padded batch (sentences of different lengths)."""
    st = pytest.importorskip("sentence_transformers")

    sentences = [PROMPT, "A fox.", "Precision matters: 65504 is the largest half number!"]

    def encode(directory: Path, **model_kwargs: Any) -> torch.Tensor:
        encoder = st.SentenceTransformer(str(directory), device="cpu", model_kwargs=model_kwargs)
        return torch.as_tensor(encoder.encode(sentences, convert_to_numpy=True)).float()

    reference = encode(tiny_model("bert-base-uncased"), dtype=torch.float32)
    candidate = encode(converted("bert-base-uncased", target))
    assert torch.isfinite(candidate).all()
    cosine = torch.nn.functional.cosine_similarity(candidate, reference, dim=-1)
    assert float(cosine.min()) > 0.999, cosine
