"""The card's first lines when loading in float16 throughout fails: the explicit-dtype call
(``from_pretrained(dir, torch_dtype=torch.float16)``, the call diffusers' documentation
teaches) drops the fp32 islands that fp16's range needs.

The warning names each such call as the certificate judged it, what it gave (NaN/Inf, or
outputs off fp32) and at which size (``1024x1024 px``, ``49 frames``: overflow that grows
with the image side or frame count shows only there), and the calls that keep the islands,
so a user who copies the library's snippet knows, before scrolling, which call to use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from precision_convert.core.dtypes import Target
from precision_convert.validation.certify.card_text import code, escape, way_passed
from precision_convert.validation.certify.certificate import Certificate, LoadPath
from precision_convert.validation.certify.load_ways import COMPUTE, DECIDING

#: How each key of a declared-size probe's record reads, in the order the card says them.
_SIZE_KEYS = (
    ("num_frames", "{} frames"),
    ("latent_frames", "{} latent frames"),
    ("latent_side", "{0}x{0} latents"),
    ("audio_length", "audio padded to {} samples"),
)


def cast_warning(certificate: Certificate) -> list[str]:
    """The warning's lines (none unless a float16 target that keeps islands failed loaded
    in float16 the explicit-dtype way; a plain cast has no islands to drop): each failing
    call, what it gave and where, then the calls that keep the islands."""
    failed = [p for p in certificate.load_paths if p.way == COMPUTE and p.verdict == "fail"]
    safe = certificate.target is not None and Target(certificate.target).safe
    if certificate.compute_dtype != "float16" or not safe or not failed:
        return []
    lines = [
        "> **Do not cast this model to float16 as a whole.** It keeps fp32 islands where fp16 "
        "overflows: `model.half()`, `model.to(torch.float16)` and "
        "`from_pretrained(..., dtype=torch.float16)` turn them back into fp16, and the outputs "
        "fail against fp32 (see Loading). `pc.load` keeps them; move the model with "
        "`.to(device)` only.",
    ]
    for path in failed:
        lines += [">", f"> {code(path.call)} {_gave(path, certificate)}."]
    kept = list(
        dict.fromkeys(
            p.call
            for p in certificate.load_paths
            if p.way in DECIDING
            and p.attention is None
            and way_passed(p)
            and p.component in {f.component for f in failed}
        )
    )
    if kept:
        lines += [">", "> These keep the islands: " + ", ".join(code(c) for c in kept) + "."]
    return [*lines, ""]


def _gave(path: LoadPath, certificate: Certificate) -> str:
    """What a failed way gave, on which probes: NaN/Inf where any output was not finite, and
    at the sizes of the declared-size probes among the failing ones."""
    failing = [m for m in path.metrics if not m.passed]
    nonfinite = [m for m in failing if m.metric == "nonfinite"]
    what = "gives NaN/Inf" if nonfinite else "differs from fp32"
    probes = list(dict.fromkeys(m.probe for m in (nonfinite or failing)))
    record = next((c for c in certificate.components if c.name == path.component), None)
    described = (record.inputs.get("probes") or {}) if record is not None else {}
    sizes = [_size_words(described.get(p, {}).get("sweep") or {}) for p in probes]
    where = [s for s in sizes if s]
    if where:
        return f"{what} at {escape(', '.join(dict.fromkeys(where)))}"
    return f"{what} ({escape(path.failures[0], code_spans=True)})" if path.failures else what


def _size_words(how: Mapping[str, Any]) -> str | None:
    """A declared-size probe's size in words (``1024x1024 px, 49 frames``); None for any
    other probe."""
    if how.get("kind") != "declared-size":
        return None
    parts = []
    if "height" in how and "width" in how:
        parts.append(f"{how['height']}x{how['width']} px")
    parts += [words.format(how[key]) for key, words in _SIZE_KEYS if key in how]
    return ", ".join(parts) or None
