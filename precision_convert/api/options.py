"""How to convert and certify one source: every choice ``model`` and a batch entry share.

One object carries them from the command line (``precision-convert model``), a batch manifest
entry and a library call to :func:`~precision_convert.api.conversion.convert`, so an option
added here reaches all three, and a batch job's digest (what ``--resume`` compares) covers it.
It imports nothing heavy: the batch manifest reads it before any conversion starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypedDict

from precision_convert.core.errors import InputError


@dataclass(frozen=True)
class ConversionOptions:
    """The options of one conversion, beside its source, target and output folder.

    Attributes:
        revision: the branch, tag or commit of a Hub source.
        recipe: a built-in recipe name or a TOML file; default: matched by class/model_type.
        keep_fp32: extra module patterns to keep in fp32 (``*`` one component, ``**`` many).
        calibrate: run the model in fp32 to find islands the recipe does not name (and, for
            fp16-safe, check and search); default on for ``fp16-safe`` only, where range
            matters; on for ``bf16-safe`` it looks for layers that lose their mantissa.
        calibration_data: text lines or JSONL of model inputs, added to the probes of
            calibration and validation.
        inputs: a safetensors file of named inputs that replaces validation's probes.
        coverage: the probe budget of calibration and validation: ``quick``, ``standard``
            (default) or ``thorough``.
        budget: the certificate's time budget: a duration (``"10m"``, ``"1h30m"``) or
            seconds; probes it cannot afford are not run and are listed as not covered
            (a budget below the smallest certificate of the model is refused).
        device: where validation runs (``cpu``, ``cuda``…); default CUDA when present.
        trust_remote_code: let a model's own code (``auto_map``) run.
        allow_nonfinite_source: convert a source whose own weights hold NaN or ±inf (beyond
            attention masks stored as ±inf by design), which is refused otherwise; its
            certificate then fails, naming the tensors.
        allow_unexercised: module patterns (``COMPONENT/MODULE`` in a pipeline) that no probe
            may run: recorded as not covered instead of failing the certificate.
        variant: write the weights under the Hub's variant names (``model.<variant>.
            safetensors``…) and keep the source's config files unchanged, so the output can
            be added to the source repo and loaded with ``from_pretrained(..., variant=)``;
            the certificate is ``precision_certificate.<variant>.json``.
    """

    revision: str | None = None
    recipe: str | None = None
    keep_fp32: tuple[str, ...] = ()
    calibrate: bool | None = None
    calibration_data: str | Path | None = None
    inputs: str | Path | None = None
    coverage: str | None = None
    budget: str | float | None = None
    device: str | None = None
    trust_remote_code: bool = False
    allow_nonfinite_source: bool = False
    allow_unexercised: tuple[str, ...] = ()
    variant: str | None = None

    @classmethod
    def given(cls, options: ConversionOptions | None, **keywords: Any) -> ConversionOptions:
        """The options of one ``convert()`` call: ``options`` and the ``keywords`` of the same
        names that the caller gave (a keyword left out is not in ``keywords``), in one object.

        A field given both ways must have one value: if they differ, one of them would be
        dropped without a word, so that is refused.

        Raises:
            TypeError: a keyword that is no field (as for any function).
            InputError: a field given both ways with different values.
        """
        unknown = sorted(set(keywords) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"convert() got an unexpected keyword argument {unknown[0]!r}")
        for listed in ("keep_fp32", "allow_unexercised"):
            if listed in keywords:
                keywords[listed] = tuple(keywords[listed])
        if options is None:
            return cls(**keywords)
        differ = sorted(k for k, v in keywords.items() if v != getattr(options, k))
        if differ:
            raise InputError(
                f"{', '.join(differ)} given as a keyword and in options= with different "
                "values; give each once"
            )
        return options


class OptionKeywords(TypedDict, total=False):
    """:class:`ConversionOptions`' fields as ``convert()`` takes them as keywords (``device``
    is its own parameter); one left out is not given."""

    revision: str | None
    recipe: str | None
    keep_fp32: Sequence[str]
    calibrate: bool | None
    calibration_data: str | Path | None
    inputs: str | Path | None
    coverage: str | None
    budget: str | float | None
    trust_remote_code: bool
    variant: str | None
    allow_nonfinite_source: bool
    allow_unexercised: Sequence[str]


#: Option names, in declaration order (a batch manifest's keys among them).
OPTION_NAMES = tuple(f.name for f in fields(ConversionOptions))
