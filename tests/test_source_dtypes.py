"""The certificate and card say what the baseline's weights were stored in.

A source stored in bf16 is not an fp32 checkpoint: its baseline is bf16 values upcast to fp32.
``source.stored_dtypes`` records, per component, the floating values per stored dtype (read
from the headers), and the card (what ``validate`` writes and ``push`` sends) says so.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import _models
import pytest
import torch
from jsonschema import Draft202012Validator
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from precision_convert.api.conversion import convert
from precision_convert.cli.main import app
from precision_convert.validation.certify.card import render_card
from precision_convert.validation.certify.certificate import CARD_NAME, CERTIFICATE_NAME

_SHARE = r"\d+(\.\d+)?%"
SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "schema" / "certificate.schema.json"


def _source(path: Path, dtype: torch.dtype, *, mixed: bool = False) -> dict[str, int]:
    """The tiny Llama saved in ``dtype`` (``mixed``: its embedding kept in fp32); returns the
    floating values per dtype name that its file holds, counted from the loaded tensors."""
    model = _models.make("llama").to(dtype)
    model.save_pretrained(path)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    if mixed:
        tensors = {k: v.float() if "embed_tokens" in k else v for k, v in tensors.items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    counts: dict[str, int] = {}
    for t in tensors.values():
        name = str(t.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + math.prod(t.shape)
    return counts


def _check(out: Path, expected: dict[str, int], words: str) -> dict[str, object]:
    """The certificate on disk holds ``expected``, validates against the schema, and its card
    names ``words`` as what the baseline was stored in."""
    on_disk = json.loads((out / CERTIFICATE_NAME).read_text())
    assert on_disk["source"]["stored_dtypes"] == {"": expected}
    schema = json.loads(SCHEMA.read_text())
    errors = list(Draft202012Validator(schema).iter_errors(on_disk))
    assert not errors, [e.message for e in errors]
    card = (out / CARD_NAME).read_text()
    assert re.search(rf"\), {words}, upcast to fp32", card), card
    return on_disk


@pytest.mark.parametrize(
    ("dtype", "mixed", "words"),
    [
        (torch.bfloat16, False, "stored in bfloat16"),
        (torch.float32, False, "stored in float32"),
        # Both dtypes named with their shares of the floating values, the larger first.
        (
            torch.bfloat16,
            True,
            rf"stored in (bfloat16|float32) \({_SHARE}\) and (?!\1)\w+ \({_SHARE}\)",
        ),
    ],
    ids=["bf16", "fp32", "mixed"],
)
def test_certificate_and_card_name_the_stored_dtypes(
    tmp_path: Path, dtype: torch.dtype, mixed: bool, words: str
) -> None:
    expected = _source(tmp_path / "src", dtype, mixed=mixed)
    assert len(expected) == (2 if mixed else 1)
    out = tmp_path / "out"
    result = convert(tmp_path / "src", to="bf16", output=out, coverage="quick")
    assert result.certificate.source["stored_dtypes"] == {"": expected}
    _check(out, expected, words)


def test_validate_keeps_it_and_push_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``validate DIR --baseline SRC`` re-certifies with the field; the card ``push`` renders
    from the certificate says it too."""
    expected = _source(tmp_path / "src", torch.bfloat16)
    out = tmp_path / "out"
    convert(tmp_path / "src", to="bf16", output=out, validate=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["validate", str(out), "--baseline", str(tmp_path / "src"), "--coverage", "quick"]
    )
    assert result.exit_code == 0, result.output
    _check(out, expected, "stored in bfloat16")
    from precision_convert.validation.certify.certificate import Certificate

    pushed = render_card(Certificate.read(out), out, "someone/llama-bf16")
    assert "stored in bfloat16, upcast to fp32" in pushed


def test_a_pipeline_names_each_component(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    """Per component: an SD pipeline saved in fp32 has one entry per torch component."""
    from precision_convert.conversion.io.source import open_source
    from precision_convert.validation.certify.assembly import stored_dtypes_of

    source = tiny_model("sd-pipeline")
    found = stored_dtypes_of(open_source(source))
    assert {"unet", "vae", "text_encoder"} <= set(found)
    assert all(set(counts) == {"float32"} and all(counts.values()) for counts in found.values())
