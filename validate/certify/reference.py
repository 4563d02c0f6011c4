"""What a certificate compares against, and how it names it in public.

The baseline of a certificate is the source (or a baseline the user names), or, for
``validate`` without ``--baseline``, the converted weights themselves: a smoke check that
never certifies. Before anything runs, this module resolves the baseline and names it (its Hub
id or its directory's name: the certificate is published), refuses one that is not the model
that was converted (another class, other tensor names or shapes), treats a copy of the output
as the output, and refuses a run whose certificate would replace a stronger or an unrelated
one. After the run, :func:`without_local_paths` takes local paths out of the certificate's text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precision_convert.conversion.io.finite import SourceRead, read_source
from precision_convert.conversion.io.source import (
    ModelSource,
    PipelineSource,
    Source,
    resolve,
)
from precision_convert.conversion.io.staging import written_here
from precision_convert.conversion.runtime.loader import read_record
from precision_convert.core.errors import InputError, home_expanded
from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    SELF_BASELINE,
    SOURCE_BASELINE,
    Certificate,
)

__all__ = [
    "SourceInfo",
    "check_replaceable",
    "check_same_architecture",
    "models_of",
    "read_baseline",
    "same_conversion",
    "source_info",
    "without_local_paths",
]


@dataclass(frozen=True)
class SourceInfo:
    """Where the baseline comes from, as the certificate records it."""

    path: Path  # the local directory it is read from (never recorded: it is private)
    id: str  # its Hub id, or its directory's name
    revision: str | None
    kind: str  # SOURCE_BASELINE, or SELF_BASELINE: the converted weights themselves


def source_info(baseline: str | Path | None, converted: Path) -> SourceInfo:
    """Resolve the baseline to a local directory and name it: its Hub id and revision, or
    its directory's name (the certificate is published: a local path is nobody's business)."""
    if baseline is None:
        return SourceInfo(converted, converted.resolve().name, None, SELF_BASELINE)
    path = resolve(baseline)
    text = str(baseline)
    hub = re.search(
        r"models--([^/]+)--([^/]+)/snapshots/([0-9a-f]{40})", path.absolute().as_posix()
    )
    if hub:
        return SourceInfo(path, f"{hub[1]}/{hub[2]}", hub[3], SOURCE_BASELINE)
    if not home_expanded(text).exists():  # a Hub id resolved some other way
        return SourceInfo(path, text, None, SOURCE_BASELINE)
    return SourceInfo(path, path.resolve().name, None, SOURCE_BASELINE)


def check_same_architecture(
    converted: Source, baseline: Source, root: Path, source: SourceInfo
) -> None:
    """Refuse a baseline that is not the model that was converted: another class, or tensors
    of other names or shapes. Comparing with it proves nothing, and its failing certificate
    would replace a true one.

    Raises:
        InputError: naming both classes, or the first tensor that differs.
    """
    here = f"{root.name or root}"
    there = f"the baseline {source.id}"
    if isinstance(converted, PipelineSource) != isinstance(baseline, PipelineSource):
        raise InputError(
            f"different architecture: {here} holds {_what(converted)}, {there} "
            f"{_what(baseline)}; pass the source it was converted from as --baseline"
        )
    for name, mine in models_of(converted).items():
        theirs = models_of(baseline).get(name)
        where = f"component {name!r} of " if name else ""
        if theirs is None:
            raise InputError(
                f"different architecture: {there} has no component {name!r}; pass the "
                "source it was converted from as --baseline"
            )
        if mine.class_name != theirs.class_name:
            raise InputError(
                f"different architecture: {where}{here} is a {mine.class_name}, {there} a "
                f"{theirs.class_name}; pass the source it was converted from as --baseline"
            )
        ours = {t.name: tuple(t.shape) for t in mine.tensors()}
        its = {t.name: tuple(t.shape) for t in theirs.tensors()}
        differing = sorted(n for n in ours.keys() | its.keys() if ours.get(n) != its.get(n))
        if differing:
            first = differing[0]
            shapes = " vs ".join(
                "absent" if s is None else str(list(s)) for s in (ours.get(first), its.get(first))
            )
            raise InputError(
                f"different architecture: {where}{here} and {there} are both "
                f"{mine.class_name} but {len(differing)} tensors differ in name or shape "
                f"(first: {first}, {shapes}); pass the source it was converted from as "
                "--baseline"
            )


def models_of(opened: Source) -> dict[str, ModelSource]:
    return dict(opened.components) if isinstance(opened, PipelineSource) else {"": opened}


def _what(opened: Source) -> str:
    if isinstance(opened, PipelineSource):
        return f"a {opened.model_index.get('_class_name') or 'diffusers'} pipeline"
    return f"a {opened.class_name or opened.library} model"


def same_conversion(converted: Source, baseline: Source) -> bool:
    """Whether ``baseline`` holds this very conversion (a copy of the output, or its weights
    re-saved): every model's record names the same plan. Compared with it, the weights are
    compared with themselves."""
    mine, theirs = models_of(converted), models_of(baseline)
    for name, model in mine.items():
        ours, its = read_record(model), read_record(theirs[name])
        if not ours or not its or ours.plan_sha256 != its.plan_sha256:
            return False
    return True


def check_replaceable(root: Path, source: SourceInfo, weights: Mapping[str, str]) -> None:
    """Refuse to replace the certificate in ``root`` with a weaker or an unrelated one.

    ``weights``: the sha256 of the baseline's weight files (:func:`source_files`). A
    certificate made against the source is never replaced by a check without a baseline
    (the weights compared with themselves), nor by one against another source (other weight
    files). A re-validation against the same source replaces it, whatever its verdict: it is
    the newer answer to the same question.

    Nor is a README.md this tool did not write (the card goes there): a folder of the user's
    own, not an output of ``precision-convert model``, keeps its card.

    Raises:
        InputError: naming the certificate, its source and what to pass instead, or the card.
    """
    if (root / CARD_NAME).exists() and not written_here(root):
        raise InputError(
            f"{CARD_NAME} is this folder's own (it is not an output of precision-convert) and "
            "validate writes its card there: move it aside, or validate a converted output",
            root,
        )
    try:
        existing = Certificate.read(root)
    except (OSError, ValueError, TypeError, KeyError):
        return  # none, or one that certifies nothing: nothing to protect
    if not existing.against_source:
        return
    recorded = existing.source.get("id") or "its source"
    made = f"{existing.file_name} compares these files with their source {recorded} (verdict "
    made += f"{existing.verdict})"
    if source.kind == SELF_BASELINE:
        raise InputError(
            f"{made}; this run would compare them with themselves and replace it with a "
            f"weaker check: pass --baseline {recorded} (or where it lies on disk)",
            root,
        )
    if dict(existing.source.get("files") or {}) != dict(weights):
        raise InputError(
            f"{made}; the weights of the baseline {source.id} are not those it records, so "
            f"this run would replace it with an unrelated one: pass --baseline {recorded}, or "
            f"delete {existing.file_name} to certify against {source.id} instead",
            root,
        )


def without_local_paths(certificate: Certificate, names: Mapping[Path, str]) -> Certificate:
    """``certificate`` with every local path in its text (an error quoting a file, a probe's
    file) replaced by a public name: each of ``names``' directories by its name, the home
    directory by ``~``. The certificate and its card are published with the weights."""
    home = Path.home()
    found = {str(home): "~"} if len(home.parts) > 1 else {}  # a home of "/" is no name
    for directory, name in names.items():
        found |= {str(directory.absolute()): name, str(directory.resolve()): name}
    longest_first = sorted(found, key=len, reverse=True)
    # A whole path only: /home/ann must not eat the start of /home/anna.
    pattern = re.compile("(?:" + "|".join(re.escape(p) for p in longest_first) + r")(?![\w.-])")

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: found[m[0]], value)
        if isinstance(value, dict):
            return {scrub(k): scrub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    return Certificate.from_dict(scrub(certificate.to_dict()), check=False)


def read_baseline(root: Path, opened: Source) -> SourceRead:
    """The weight files the baseline is built from, read once: their sha256, and the tensors
    among them that hold NaN or ±inf."""
    return read_source(root, models_of(opened))
