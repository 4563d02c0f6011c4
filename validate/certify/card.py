"""The converted model's ``README.md``: Hub metadata plus a readable account of the certificate.

The YAML front matter is a ``huggingface_hub.ModelCardData`` (``base_model``, tags, the
library, and a ``precision_convert:`` summary); the body is a table of the judged metrics, so a
reader on the Hub sees why the conversion is trusted without opening the JSON, and a loading
section that says, for every way of loading the files, what a user gets.

Tags: ``parity-certified`` only when the certificate passed (a comparison with the source)
*and* the library's plain ``from_pretrained`` with default arguments was checked and passed
(for a pipeline: every plain load recorded); a passing certificate whose plain load was not
checked (a model validated block by block, or a certificate from before load paths were
recorded) is tagged ``parity-certified-pc-load-only``; a failed one, or a smoke check (the
converted weights compared with themselves), carries neither, and its card says what it was
compared with. The card is a pure function of the certificate (and the activation charts beside
it, and the repo it is pushed to), so it can be checked by regenerating it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from precision_convert.conversion.analysis.chart import CHART_NAME
from precision_convert.core.dtypes import Target
from precision_convert.core.patterns import CERTIFICATE_NAME, REPO_ID, code_files
from precision_convert.validation.certify.card_cast import cast_warning
from precision_convert.validation.certify.card_loading import ways_of_loading
from precision_convert.validation.certify.card_metrics import _rows
from precision_convert.validation.certify.card_proofs import proof_lines
from precision_convert.validation.certify.card_sizes import reach_lines
from precision_convert.validation.certify.card_text import (
    certified,
    code,
    escape,
    way_passed,
)
from precision_convert.validation.certify.card_triggers import trigger_lines
from precision_convert.validation.certify.certificate import (
    CARD_NAME,
    FAIL,
    SMOKE_PASS,
    Certificate,
    write_atomically,
)
from precision_convert.validation.certify.consistency import (
    budget_limited,
    contradiction,
    modules_not_covered,
)

#: The tag of a certificate that holds wherever users load it, and of one that holds only
#: through ``precision_convert.load`` (the library's plain load was not checked).
PLAIN_TAG = "parity-certified"
PC_LOAD_ONLY_TAG = "parity-certified-pc-load-only"


def base_model_id(certificate: Certificate) -> str | None:
    """The Hub id to declare as ``base_model``: the source's repo id when it has one."""
    source_id = certificate.source.get("id")
    if isinstance(source_id, str) and REPO_ID.fullmatch(source_id) and not Path(source_id).exists():
        return source_id
    return None


def source_name(certificate: Certificate) -> str | None:
    """How the card names the source: its Hub id, or its directory's name (never a local
    path, even from a certificate written before paths were left out); None when the source
    was not the baseline (a smoke check names the converted directory there)."""
    source_id = certificate.source.get("id")
    if not certificate.against_source or not isinstance(source_id, str) or not source_id:
        return None
    return base_model_id(certificate) or Path(source_id).name or source_id


def compared_with(certificate: Certificate) -> str:
    """What the baseline was, in words: which weights, the dtypes they were stored in, and
    that they were upcast to fp32."""
    stored = stored_in(certificate)
    as_stored = f", {stored}," if stored else ""
    if certificate.against_source:
        name = source_name(certificate) or "not named"
        return f"the source ({name}){as_stored} upcast to fp32"
    return f"the converted weights themselves{as_stored} upcast to fp32"


def stored_in(certificate: Certificate) -> str | None:
    """The dtypes the baseline's floating weights were stored in, in words ("stored in
    bfloat16"; a mix with each dtype's share; a pipeline per component where they differ);
    None for a certificate that does not record them."""
    stored = certificate.source.get("stored_dtypes")
    if not isinstance(stored, dict) or not stored:
        return None
    mixes = {name: _mix(counts) for name, counts in stored.items() if counts}
    if not mixes:
        return None
    if len(set(mixes.values())) == 1:
        return f"stored in {next(iter(mixes.values()))}"
    return "stored in " + "; ".join(f"{mix} ({name})" for name, mix in mixes.items())


def _mix(counts: dict[str, int]) -> str:
    """``bfloat16``, or ``float32 (97.5%) and bfloat16 (2.5%)``: shares of floating values."""
    if len(counts) == 1:
        return next(iter(counts))
    total = sum(counts.values())
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])
    shares = [f"{dtype} ({100 * n / total:.3g}%)" for dtype, n in ordered]
    return ", ".join(shares[:-1]) + " and " + shares[-1]


def tags(certificate: Certificate) -> list[str]:
    found = ["precision-convert"]
    target = Target.lookup(certificate.target)
    if target is not None:
        found += list(dict.fromkeys([target.value, target.plain.value]))
        if target.safe:
            found.append("precision-safe")
    elif certificate.target:  # several components with different targets
        found.append(certificate.target)
    if certified(certificate):
        found.append(PLAIN_TAG if plain_load_passed(certificate) else PC_LOAD_ONLY_TAG)
    return found


def outside_bounds(certificate: Certificate) -> str | None:
    """The failed measurements the metric table shows, counted in one clause (their failure
    lines, one per probe and metric, would repeat the table); None when there are none.
    Coverage is left to its own failure line, which says what to do."""
    failed = [m for m in certificate.metrics if not m.passed and m.metric != "coverage"]
    if not failed:
        return None
    kinds = {
        "with NaN/Inf values": [m for m in failed if m.metric == "nonfinite" and m.value],
        "with an output missing or reshaped": [
            m for m in failed if m.metric == "nonfinite" and m.value is None
        ],
        "with black frames": [m for m in failed if m.metric == "constant_frames"],
    }
    fatal = ", ".join(f"{len(ms)} {kind}" for kind, ms in kinds.items() if ms)
    return f"{len(failed)} measurements outside their bounds" + (f" ({fatal})" if fatal else "")


def plain_load_passed(certificate: Certificate) -> bool:
    """Whether every plain ``from_pretrained`` the certificate records was checked and passed
    (False when none was recorded)."""
    plain = [p for p in certificate.load_paths if p.way == "plain"]
    return bool(plain) and all(way_passed(p) for p in plain)


def summary(certificate: Certificate) -> dict[str, Any]:
    """The ``precision_convert:`` block of the YAML front matter."""
    failed = [m for m in certificate.metrics if not m.passed]
    return {
        "version": certificate.tool.get("version"),
        "target": certificate.target,
        "compute_dtype": certificate.compute_dtype,
        # A pass its own records contradict is not repeated as one.
        "verdict": certificate.verdict
        if certified(certificate) or not certificate.passed
        else FAIL,
        "baseline": compared_with(certificate)
        + ("" if certificate.against_source else " (a smoke check)"),
        "device": certificate.device.get("type"),
        "components": {c.name or c.class_name or "model": c.task for c in certificate.components},
        "metrics_judged": len(certificate.metrics),
        "metrics_failed": len(failed),
        "loading": _loading_summary(certificate),
        # A verdict that covers only what a time budget afforded says so where tools read it.
        **(
            {"coverage": "limited by --budget (see not_covered)"}
            if budget_limited(certificate)
            else {}
        ),
        "certificate": certificate.file_name,
    }


def _loading_summary(certificate: Certificate) -> dict[str, dict[str, str]]:
    """``{component or "model": {way: verdict}}`` for the front matter."""
    out: dict[str, dict[str, str]] = {}
    for p in certificate.load_paths:
        out.setdefault(p.component or "model", {})[p.label] = p.verdict
    return out


def render(
    certificate: Certificate, *, charts: Sequence[str] = (), repo_id: str | None = None
) -> str:
    """The full README.md text for ``certificate``; its loading snippet names ``repo_id``
    (the repo it is pushed to) when given."""
    lines = [
        "---",
        _metadata(certificate),
        "---",
        "",
        f"# {escape(certificate.target)} conversion of "
        f"{escape(source_name(certificate) or 'a model')}",
        "",
        f"Converted with precision-convert {escape(certificate.tool.get('version', ''))} to "
        f"{code(certificate.target)} (compute dtype {code(certificate.compute_dtype)}), and "
        f"{_verdict(certificate)} on {escape(certificate.device.get('type'))}.",
        "",
        *_budget_warning(certificate),
        *cast_warning(certificate),
    ]
    if not certificate.against_source:
        lines += [
            "Comparing the weights with themselves finds overflow and compute-precision loss, "
            "not the rounding of the weights: to certify, compare with the source "
            "(`precision-convert validate DIR --baseline SOURCE`).",
            "",
        ]
    # What a Hub visitor needs first (how to load it, what was and was not judged), then
    # the detail tables.
    lines += _why_failed(certificate)
    lines += _loading(certificate, repo_id)
    lines += _code_files(certificate)
    lines += _limitations(certificate)
    lines += proof_lines(certificate)
    lines += _parity(certificate)
    lines += _components(certificate)
    lines += _charts(charts)
    lines += ways_of_loading(certificate)
    lines += [
        f"Every file's sha256 is listed in `{certificate.file_name}`; "
        "`precision-convert push` refuses files that differ from it.",
        "",
    ]
    return "\n".join(lines)


def _metadata(certificate: Certificate) -> str:
    """The card's YAML header: the Hub's metadata (base model, tags, library, the source's
    own pipeline tag and license) and the certificate's summary."""
    from huggingface_hub import ModelCardData
    from huggingface_hub.utils import yaml_dump

    inherited = certificate.source.get("card") or {}
    library = next((c.library for c in certificate.components if c.library != "pipeline"), None)
    if any(c.mode == "pipeline" for c in certificate.components):
        library = "diffusers"
    base_model = base_model_id(certificate)
    data = ModelCardData(
        base_model=base_model,
        # The Hub's closest relation for a precision conversion (it has no "cast").
        base_model_relation="quantized" if base_model else None,
        tags=tags(certificate),
        library_name=inherited.get("library_name")
        or (library if library in ("transformers", "diffusers", "open_clip") else None),
        pipeline_tag=inherited.get("pipeline_tag"),
        license=inherited.get("license"),
        precision_convert=summary(certificate),
    )
    # Collections of plain values on one line each (tags, each component's ways of
    # loading): a pipeline's header would otherwise push the card's text off the first screen.
    return yaml_dump(data.to_dict(), sort_keys=False, default_flow_style=None).strip()


def _verdict(certificate: Certificate) -> str:
    """The verdict in words, and what it was compared with: a ``pass`` only where the records
    agree with it."""
    if certificate.verdict == SMOKE_PASS:
        verdict = "**smoke-checked only, not certified**"
    elif contradicted := contradiction(certificate):
        verdict = (
            "**not certified**: its verdict `pass` is contradicted by its own records "
            f"({escape(contradicted, code_spans=True)})"
        )
    elif not certified(certificate):
        verdict = "**not certified**"
    elif plain_load_passed(certificate):
        verdict = "**certified** (through `precision_convert.load` and plain `from_pretrained`)"
    else:
        verdict = "**certified for `precision_convert.load` only** (plain loads not checked)"
    if certificate.against_source:
        return f"{verdict} against {escape(compared_with(certificate))}"
    return f"{verdict}: compared with {escape(compared_with(certificate))}"


def _budget_warning(certificate: Certificate) -> list[str]:
    """The card's first warnings when a time budget left probes out, or modules no probe ran
    were allowed (``--allow-unexercised``): the verdict does not cover them."""
    lines: list[str] = []
    for limited in (budget_limited(certificate), modules_not_covered(certificate)):
        if limited is not None:
            lines += [f"**Not a full certificate**: {escape(limited, code_spans=True)}.", ""]
    return lines


def _why_failed(certificate: Certificate) -> list[str]:
    """The failures section (none when it passed): the failures other than metrics, and one
    line pointing at the metric rows outside their bounds."""
    if not certificate.failures:
        return []
    lines = [
        "## Why it failed",
        "",
        *(f"- {escape(f, code_spans=True)}" for f in certificate.failures_beside_metrics()),
    ]
    if outside := outside_bounds(certificate):
        lines.append(
            f"- {outside}: the ❌ rows under Parity (every one in `{certificate.file_name}`)"
        )
    lines.append("")
    return lines


def _parity(certificate: Certificate) -> list[str]:
    """The parity section: each metric's worst row per output; every probe's values stay in
    the certificate (a per-probe table of each output made a Llama's card 70 KB)."""
    if not certificate.metrics:
        return ["## Parity", "", "Nothing was compared with fp32.", ""]
    return [
        "## Parity",
        "",
        *_rows(certificate.metrics),
        "",
        f"Every probe's value of every metric is in `{CERTIFICATE_NAME}` (`metrics`); "
        "`precision-convert validate --report full` charts them per probe.",
        "",
    ]


def _components(certificate: Certificate) -> list[str]:
    """The components table: class, task, validation mode and recipe of each."""
    return [
        "## Components",
        "",
        "| component | class | task | mode | recipe |",
        "|---|---|---|---|---|",
        *(
            "| "
            + " | ".join(
                escape(cell)
                for cell in (c.name or "—", c.class_name, c.task, c.mode, c.recipe or "—")
            )
            + " |"
            for c in certificate.components
        ),
        "",
    ]


def _charts(charts: Sequence[str]) -> list[str]:
    """The activation-range charts the analysis saved, as images (none: no section)."""
    if not charts:
        return []
    return [
        "## Activation ranges",
        "",
        *(
            f"![activation ranges of {escape(c.rpartition('/')[0] or 'the model')}]({quote(c)})"
            for c in charts
        ),
        "",
    ]


#: What each probe origin (``ModelInputs.origin``) means to a reader of the card.
ORIGINS = {
    "builder": "synthetic inputs built from the config",
    "tokenizer": "text and token ids through the model's own tokenizer",
    "file": "user-given inputs (--inputs)",
}


def _limitations(certificate: Certificate) -> list[str]:
    """What the verdict covers and what it does not: the device, where the probes came from,
    and the sizes, positions and contexts they reached."""
    device = escape(certificate.device.get("type") or "an unrecorded device")
    lines = [
        "## Limitations",
        "",
        f"- Judged on {device} only: other devices and kernels round differently and were not run.",
    ]
    for c in certificate.components:
        origin = c.inputs.get("origin")
        if origin is None:
            continue
        who = f"{code(c.name)}: " if c.name else ""
        what = ORIGINS.get(origin) or escape(f"inputs of origin {origin!r}")
        made = "" if origin == "file" else f" (seed {escape(c.inputs.get('seed'))}), not real data"
        lines.append(f"- {who}probes are {what}{made}.")
    return [*lines, *reach_lines(certificate), *trigger_lines(certificate), ""]


def _loading(certificate: Certificate, repo_id: str | None) -> list[str]:
    """The loading section: the recommended call (from ``repo_id`` when the card is pushed
    there), and which of the calls judged match fp32 and which do not (the table of every
    way comes after the metrics)."""
    variant = certificate.source.get("variant")
    where = f'"{repo_id or "<this repo or dir>"}"'
    if variant:
        where += f', variant="{variant}"'
    lines = [
        "## Loading",
        "",
        "```python",
        "import precision_convert as pc",
        f"model = pc.load({where})  # stored dtypes kept, fp32 islands intact",
        "```",
        "",
    ]
    said: dict[str, list[str]] = {"pass": [], "fail": []}
    for p in certificate.load_paths:  # a pass that its own metrics contradict does not match
        if way_passed(p):
            said["pass"].append(p.call)
        elif p.verdict in said:
            said["fail"].append(p.call)
    calls = {verdict: list(dict.fromkeys(found)) for verdict, found in said.items()}
    if calls["pass"]:
        lines.append(f"Match fp32, islands kept: {_calls(calls['pass'])}.")
    if calls["fail"]:
        lines.append(f"Do not match fp32: {_calls(calls['fail'])}.")
    if calls["pass"] or calls["fail"]:
        lines += ["(Every way of loading, in detail: the last section.)", ""]
    return lines


def _code_files(certificate: Certificate) -> list[str]:
    """The Python files the repository carries (copied from the source with the weights): a
    library runs them only on ``trust_remote_code=True``, and a visitor should know first."""
    files = code_files(certificate.files)
    if not files:
        return []
    return [
        "## Code",
        "",
        "This repository carries Python code copied from the source, which runs if you pass "
        f"`trust_remote_code=True`: {', '.join(code(f) for f in files)}. Read it first.",
        "",
    ]


#: Calls named in the loading summary before the rest are counted.
MAX_CALLS = 6


def _calls(calls: Sequence[str]) -> str:
    shown = ", ".join(code(c) for c in calls[:MAX_CALLS])
    return shown + (f" and {len(calls) - MAX_CALLS} more" if len(calls) > MAX_CALLS else "")


def write_card(certificate: Certificate, directory: str | Path) -> Path:
    """Write README.md next to the certificate, showing any activation charts the analysis saved
    (``precision_activations.png`` at the top or in a pipeline component's folder)."""
    directory = Path(directory)
    path = directory / CARD_NAME
    write_atomically({path: render_card(certificate, directory)})
    return path


def render_card(certificate: Certificate, directory: Path, repo_id: str | None = None) -> str:
    """The card :func:`write_card` writes for ``certificate`` into ``directory`` (a pure
    function of both), without writing it; with ``repo_id``, the card as pushed there (its
    loading snippet names the repo)."""
    charts = [p.relative_to(directory).as_posix() for p in sorted(directory.rglob(CHART_NAME))]
    return render(certificate, charts=charts, repo_id=repo_id)
