"""Whether a certificate agrees with itself: the rule every reader applies before trusting it.

A certificate's ``verdict`` is computed from its records when it is written, but a reader gets
the verdict and the records as one JSON document, and nothing in the document ties them
together: a ``pass`` whose every measurement is marked failed reads as a ``pass`` to a reader
that checks the schema alone. So ``pass`` is believed only where the records say it too
(:func:`contradiction`), the way the verdict is computed (:mod:`.assembly`):

- every **deciding** record passed: a measurement of the comparison through ``pc.load`` with a
  threshold (coverage, NaN/Inf, the parity metrics; a metric without one, ``max_abs``, is
  reported only), and every way of loading that ``decides`` (``pc.load`` and the library's
  plain default load, also under each other attention implementation) that was checked;
- every **required** record is there: at least one component, each validated (none
  ``not-run``), a coverage measurement of each model compared whole or block by block, and,
  where ways of loading are recorded, the ``pc.load`` and plain records of each;
- the baseline was the source, no failure is recorded, and each record agrees with itself: a
  measurement's ``passed`` with its value against its threshold, a way's ``pass`` with its
  own metrics.

Records that do not decide (``auto``, ``compute``, the re-saves, reported-only metrics) may
fail under a ``pass`` and are shown; a deciding way that could not be run (a model validated
block by block is never loaded whole) is ``not-checked`` and listed in the certificate's
``not_covered``; so are the probes a time budget (``--budget``) left out, which a ``pass``
does not claim: it is honest when ``not_covered`` lists them. The writer marks each metric
series ``deciding`` and lists ``not_covered``;
certificates written before those fields existed get them derived here, from the same records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from precision_convert.core.units import duration
from precision_convert.validation.certify.certificate import (
    PASS,
    SOURCE_BASELINE,
    Certificate,
    ComponentRecord,
    LoadPath,
    deciding,
    measured,
)
from precision_convert.validation.certify.load_ways import DECIDING, PC_LOAD, PLAIN
from precision_convert.validation.probe.run.metrics import Measurement

#: Component modes whose model was compared by itself (a coverage measurement each), and
#: those with ways of loading recorded (the pipeline's end-to-end run too).
COMPARED_MODES = ("whole", "blockwise")
LOADED_MODES = (*COMPARED_MODES, "pipeline")


def misjudged(m: Measurement) -> bool:
    """Whether ``m``'s ``passed`` disagrees with its value against its threshold (values are
    judged as recorded; a NaN/Inf value is recorded as null and not re-judged here)."""
    if m.value is None or m.threshold is None:
        return False
    within = m.value <= m.threshold if m.bound == "max" else m.value >= m.threshold
    return within != m.passed


def way_name(p: LoadPath) -> str:
    """A way of loading as a certificate's lines name it: ``model: the plain load `call```."""
    return f"{p.component or 'model'}: the {p.label} load `{p.call}`"


def way_contradiction(p: LoadPath) -> str | None:
    """Why ``p``'s own verdict disagrees with its metrics (None: it agrees): a ``pass`` with
    a metric marked failed or a failure listed, or a metric whose mark disagrees with its
    value. The card shows a way as matching fp32 only where this is None."""
    if p.verdict != "pass":
        return None
    failed = next((m for m in p.metrics if deciding(m) and not m.passed), None)
    if failed is not None:
        return f"{way_name(p)} is recorded as passing, but its {_row(failed)} is marked failed"
    wrong = next((m for m in p.metrics if misjudged(m)), None)
    if wrong is not None:
        return f"{way_name(p)}: {_row(wrong)} is marked passing against its threshold"
    if p.failures:
        return f"{way_name(p)} is recorded as passing with a failure: {p.failures[0]}"
    return None


def contradiction(certificate: Certificate) -> str | None:
    """The first way a ``pass`` certificate disagrees with its own records, in one line (None:
    it agrees, or its verdict is not ``pass``, which certifies nothing anyway)."""
    return next(_contradictions(certificate), None)


def refusal(certificate: Certificate, directory: str | Path) -> str | None:
    """Why a reader refuses ``certificate`` (in ``directory``) as contradicting itself, with
    the command that certifies the files again: one clause; None when it agrees."""
    contradicted = contradiction(certificate)
    if contradicted is None:
        return None
    return (
        f"verdict {PASS!r} contradicted by its own records: {contradicted}; validate again: "
        f"precision-convert validate {directory} --baseline SOURCE"
    )


def _contradictions(c: Certificate) -> Iterator[str]:
    if c.verdict != PASS:
        return
    if c.baseline.get("kind") != SOURCE_BASELINE:
        yield f"the baseline is {c.baseline.get('kind')!r}, and only the source can certify"
    if c.failures:
        yield f"a failure is recorded: {c.failures[0]}"
    if not c.components:
        yield "no component is recorded"
    for record in c.components:
        if record.mode == "not-run":
            yield f"{_name(record)}: recorded as not validated"
    for m in c.metrics:
        if deciding(m) and not m.passed:
            yield f"{_row(m)} is marked failed"
        elif misjudged(m):
            yield f"{_row(m)} is marked passing against its threshold"
    for record in c.components:
        if record.mode in COMPARED_MODES and not any(
            m.metric == "coverage" and deciding(m) and m.component == record.name for m in c.metrics
        ):
            yield f"{_name(record)}: its coverage measurement is missing"
    yield from _way_contradictions(c)


def _way_contradictions(c: Certificate) -> Iterator[str]:
    if c.load_paths:  # certificates from before ways of loading were recorded have none
        for record in c.components:
            if record.mode not in LOADED_MODES:
                continue
            for way in (PC_LOAD, PLAIN):
                if c.load_path(way, record.name) is None:
                    yield f"{_name(record)}: the record of the {way} load is missing"
    recorded = c.not_covered
    if recorded is None:  # written before the field existed: derived from the records
        recorded = not_covered(c.load_paths, c.components)
    listed = {item.get("what") for item in recorded}
    for p in c.load_paths:
        if (p.way in DECIDING) != p.decides:
            yield f"{way_name(p)} is marked decides: {str(p.decides).lower()}"
        elif p.decides and p.verdict == "fail":
            yield f"{way_name(p)} fails"
        elif p.decides and p.verdict == "not-checked" and way_name(p) not in listed:
            yield f"{way_name(p)} was not checked, and not_covered does not say so"
        elif (why := way_contradiction(p)) is not None:
            yield why


def not_covered(
    load_paths: Iterable[LoadPath], components: Iterable[ComponentRecord]
) -> list[dict[str, str]]:
    """What a verdict does not cover, one ``{"what", "why"}`` each: the deciding ways of
    loading that were not checked, and the probes whose fp32 baseline was not finite (not
    judged), the probes a time budget left out (``why``: :data:`BUDGET`) and the modules no
    probe ran that ``--allow-unexercised`` named (``why``: :data:`ALLOW_UNEXERCISED`).
    Written by the writer; derived so for a certificate from before the field existed."""
    found = [
        {"what": way_name(p), "why": p.detail or "no reason recorded"}
        for p in load_paths
        if p.decides and p.verdict == "not-checked"
    ]
    for record in components:
        if unjudged := record.inputs.get("unjudged"):
            found.append(
                {
                    "what": f"{_name(record)}: {len(unjudged)} probe(s) not judged",
                    "why": "the fp32 baseline's own output is not finite there",
                }
            )
        found += budget_left_out(record)
        found += [
            {"what": f"{_name(record)}: module `{m}` never ran", "why": ALLOW_UNEXERCISED}
            for m in (record.modules or {}).get("not_covered", ())
        ]
    return found


#: The ``why`` of a module no probe ran that ``--allow-unexercised`` named.
ALLOW_UNEXERCISED = "--allow-unexercised"


def modules_not_covered(certificate: Certificate) -> str | None:
    """One line naming the modules ``--allow-unexercised`` recorded as not covered (None:
    none): the card's first screen and the report say it beside the verdict."""
    named = [
        f"{_name(record)}: `{m}`" if record.name else f"`{m}`"
        for record in certificate.components
        for m in (record.modules or {}).get("not_covered", ())
    ]
    if not named:
        return None
    return (
        f"not covered (--allow-unexercised): {', '.join(named)} never ran in a judged probe; "
        "the verdict says nothing about them"
    )


#: The ``why`` of what a time budget (``--budget``) left out: a reader filters on it.
BUDGET = "budget"


def budget_left_out(record: ComponentRecord) -> list[dict[str, str]]:
    """What ``--budget`` left out of ``record``'s probes, one entry per probe kind (none
    without a budget, or when it afforded every probe)."""
    budget = record.inputs.get("budget") or {}
    kinds: dict[str, int] = budget.get("left_out_kinds") or {}
    return [
        {"what": f"{_name(record)}: {n} {kind or 'other'} probe(s) not run", "why": BUDGET}
        for kind, n in kinds.items()
    ]


def budget_limited(certificate: Certificate) -> str | None:
    """One line saying that a time budget limited what the verdict covers (None: no budget
    left anything out): shown beside the verdict, in the report and the card's first lines."""
    limited = [
        (record, budget)
        for record in certificate.components
        if (budget := record.inputs.get("budget") or {}).get("left_out")
    ]
    if not limited:
        return None
    seconds = max(float(budget.get("seconds", 0)) for _, budget in limited)
    counts: dict[str, int] = {}
    for _, budget in limited:
        for kind, n in (budget.get("left_out_kinds") or {}).items():
            counts[kind or "other"] = counts.get(kind or "other", 0) + int(n)
    kinds = ", ".join(f"{kind} {n}" for kind, n in counts.items())
    return (
        f"coverage limited by --budget {duration(seconds)}: {sum(counts.values())} probe(s) "
        f"not run ({kinds}); the verdict covers only the probes that ran (not_covered lists "
        "what it left out)"
    )


def _name(record: ComponentRecord) -> str:
    return record.name or "model"


def _row(m: Measurement) -> str:
    """A measurement as a contradiction names it: where, then :func:`measured`."""
    return f"{m.where} {measured(m)}"
