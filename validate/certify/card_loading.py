"""The card's "Ways of loading" section: every way of loading the files, what it loads
as (dtypes, and its memory against ``pc.load``'s), its result, and the attention
implementations judged. Probe lists the records spell out are counted here; the certificate
keeps the names."""

from __future__ import annotations

import re
from collections.abc import Sequence

from precision_convert.core.dtypes import BY_TORCH_NAME
from precision_convert.core.patterns import CERTIFICATE_NAME
from precision_convert.validation.certify.card_text import code, escape, way_result
from precision_convert.validation.certify.certificate import Certificate, LoadPath
from precision_convert.validation.certify.load_paths import SHARED_WITH_CANDIDATE

#: How the card names each way of loading (see validation.certify.load_paths).
WAY_NAMES = {
    "pc.load": "precision-convert",
    "plain": "plain default",
    "auto": '`"auto"` dtype',
    "compute": "explicit compute dtype",
    "resave:plain": "re-saved, plain default",
    "resave:auto": 're-saved, `"auto"` dtype',
    "resave:pc.load": "re-saved, precision-convert",
}


def ways_of_loading(certificate: Certificate) -> list[str]:
    """What every way of loading these files gives, judged like the model itself."""
    lines = ["## Ways of loading", ""]
    if not certificate.load_paths:
        checked = (
            "Only `precision_convert.load` was checked"
            if certificate.metrics
            else "No way of loading was checked (validation did not run)"
        )
        lines += [
            f"{checked}: the library's own `from_pretrained` may load these files differently.",
            "",
        ]
        return lines
    components = list(dict.fromkeys(p.component for p in certificate.load_paths))
    several = len(components) > 1
    each = (
        ", under each attention implementation judged"
        if any(c.attention for c in certificate.components)
        else ""
    )
    lines += [
        "Every way of loading these files, run on the validation inputs and judged against "
        "fp32 like the model itself; the verdict depends on `precision_convert.load` and the "
        f"plain default load{each}.",
        "",
        (
            "| component | way | call | loads as | result |"
            if several
            else "| way | call | loads as | result |"
        ),
        "|---|---|---|---|---|" if several else "|---|---|---|---|",
    ]
    for p in certificate.load_paths:
        reference = certificate.load_path("pc.load", p.component)
        name = WAY_NAMES.get(p.way, p.way)
        cells = [
            f"{name}, {escape(p.attention)} attention" if p.attention else name,
            code(p.call),
            _loads_as(p, reference),
            _shortened(way_result(p), certificate.load_paths),
        ]
        if several:
            cells.insert(0, escape(p.component or "—"))
        lines.append("| " + " | ".join(cells) + " |")  # each cell escaped, its | too
    lines.append("")
    lines += attention_lines(certificate)
    return lines


def attention_lines(certificate: Certificate) -> list[str]:
    """One line per component with a choice of attention: the implementations its probes
    were judged under, and those that were not (with why)."""
    lines = []
    for c in certificate.components:
        if not c.attention:
            continue
        default, judged = c.attention.get("default"), c.attention.get("judged", [])
        named = [code(a) + (" (the default)" if a == default else "") for a in judged]
        skipped = "; ".join(
            f"{code(a)}: {escape(why, code_spans=True)}"
            for a, why in c.attention.get("not_judged", {}).items()
        )
        where = f"{escape(c.name)}: " if c.name else ""
        stood_in = "; ".join(
            f"{code(a)}'s fp32 baseline of {_probes(record['probes'])} is the "
            f"default's ({escape(record['why'], code_spans=True)})"
            for a, record in c.attention.get("baseline_from_default", {}).items()
        )
        lines.append(
            f"{where}Attention judged under {' and '.join(named)}"
            + (f"; not judged: {skipped}" if skipped else "")
            + (f"; {stood_in}" if stood_in else "")
            + "."
        )
    return [*lines, ""] if lines else []


#: The probes a way ran on, as its record names them: the card gives the count (the
#: certificate keeps the names).
PROBE_LIST = re.compile(r"(checked on \d+ of \d+ probes) \([^)]*\)")
#: The long explanations a way's record carries, as the card says them (the certificate
#: keeps the records' words).
SHORTER = (
    (
        re.compile(re.escape(escape(SHARED_WITH_CANDIDATE, code_spans=True))),
        "outputs of calibration's last candidate: these very files through `pc.load`",
    ),
    (
        re.compile(r": its dtypes are judged on every probe by .*? attention by `pc\.load`"),
        ": a cross of two ways each judged on every probe",
    ),
)
#: "loads the same tensors in the same dtypes as `<call>`", whose call the card names by its
#: way instead.
SAME_AS = re.compile(r"loads the same tensors in the same dtypes as `([^`]*)`")


def _shortened(cell: str, paths: Sequence[LoadPath]) -> str:
    """``cell`` with its probe lists counted, long explanations shortened and a call it loads
    the same as named by its way."""
    names = {p.call: WAY_NAMES.get(p.way, p.way) for p in paths}
    cell = PROBE_LIST.sub(r"\1", cell)
    for pattern, short in SHORTER:
        cell = pattern.sub(short, cell)
    return SAME_AS.sub(lambda m: f"loads what the {names.get(m.group(1), 'other')} load does", cell)


#: Most probe names a card line lists before it gives their count instead.
MAX_PROBE_NAMES = 4


def _probes(names: Sequence[str]) -> str:
    if len(names) <= MAX_PROBE_NAMES:
        return ", ".join(code(n) for n in names)
    return f"{len(names)} probes (named in `{CERTIFICATE_NAME}`)"


def _nbytes(dtypes: dict[str, int]) -> int:
    """Bytes of the floating elements a load path records per dtype (4 for one not known)."""
    return sum(
        n * (BY_TORCH_NAME[d].itemsize if d in BY_TORCH_NAME else 4) for d, n in dtypes.items()
    )


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _loads_as(path: LoadPath, reference: LoadPath | None) -> str:
    """The dtypes a way of loading ends up with, and its memory against ``pc.load``'s."""
    if not path.dtypes:
        return "—"
    total = sum(path.dtypes.values())
    main = max(path.dtypes, key=path.dtypes.__getitem__)
    if len(path.dtypes) == 1:
        text = f"{escape(main)} throughout"
    else:
        rest = ", ".join(
            f"{n / total:.0%} {escape(d)}" for d, n in sorted(path.dtypes.items()) if d != main
        )
        text = f"{escape(main)}, {rest}"
    if reference is not None and reference is not path and reference.dtypes:
        mine, theirs = _nbytes(path.dtypes), _nbytes(reference.dtypes)
        if mine > theirs * 1.2:
            text += (
                f"; weights {_size(mine)} vs {_size(theirs)} with `pc.load`: "
                "the memory saving is lost"
            )
        elif path.dtypes.get("float32", 0) < reference.dtypes.get("float32", 0):
            some = "fp32 islands" if "float32" not in path.dtypes else "some fp32 islands"
            text += f" ({some} flattened)"
    return text
