"""What the fp32 sweep's bounds cost in islands, per zoo family.

    python bench/islands.py [--coverage quick] [--keep DIR] [FAMILY ...]

Each family of the real-config zoo (``examples/zoo``: published configs scaled down in depth
and width, with their own tokenizers) is converted and certified in ``bf16-safe`` and in
``fp16-safe`` as the command runs it, and, where the bound rule
(:func:`~precision_convert.validation.calibration.plans._bound_islands`, the only step that
turns a bound into an island) added islands, in ``fp16-safe`` again with the rule answering
none, in the same process (where it added none, the two runs are one computation: the rule's
empty answer is all that differs). Per component it prints
the islands, the share of parameters they keep fp32, the bounds the sweep computed and the
highest as a share of fp16's limit, the worst-context search's record, and per run the
verdict, the written safetensors bytes and the seconds. bf16 has fp32's range, so no bound
is near its limit and the rule never runs for ``bf16-safe``: one run stands for both columns.

Acceptance (the bound's cost): every family certified in both safe targets, the bound adding
at most 5% of the parameters as islands and at most 5% to the fp16-safe files. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import zoo  # examples/zoo, on the path above

from precision_convert.conversion.plan import Island
from precision_convert.core.dtypes import FP16_MAX  # the bounds are reported as a share of it


@contextmanager
def bound_rule(on: bool) -> Iterator[list[Island]]:
    """The calibration's bound rule as shipped (``on``) or answering no islands; yields the
    islands it answered, so a plan's bound islands are told from its others by where they came
    from, not by their rule's wording."""
    from precision_convert.validation.calibration import plans

    shipped = plans._bound_islands
    answered: list[Island] = []

    def recorded(*args: Any, **kwargs: Any) -> list[Island]:
        islands = shipped(*args, **kwargs) if on else []
        answered.extend(islands)
        return islands

    plans._bound_islands = recorded
    try:
        yield answered
    finally:
        plans._bound_islands = shipped


def convert_once(
    source: Path, target: str, output: Path, coverage: str, from_bounds: list[Island]
) -> dict[str, Any]:
    """One certified conversion's islands (those among ``from_bounds`` counted as the bound
    rule's), bounds, verdict, bytes and seconds."""
    from precision_convert.api.conversion import convert

    began = time.perf_counter()
    result = convert(source, to=target, output=output, coverage=coverage)
    seconds = time.perf_counter() - began
    records = {r.name: r for r in (result.certificate.components if result.certificate else [])}
    components = []
    for component in result.components:
        record = records.get(component.name)
        found = (record.calibration or {}) if record is not None else {}
        bounds = found.get("bounds") or []
        islands = component.plan.islands
        components.append(
            {
                "component": component.name,
                "islands": len(islands),
                "bound_islands": sorted(i.name for i in islands if i in from_bounds),
                "fp32_share": round(component.plan.fp32_share, 5),
                "bounds": len(bounds),
                "highest_bound_share_of_fp16_max": round(
                    max((b["bound"] for b in bounds), default=0.0) / FP16_MAX, 6
                ),
                "context_search": found.get("context_search"),
            }
        )
    written = sum(p.stat().st_size for p in output.rglob("*.safetensors"))
    return {
        "verdict": result.certificate.verdict if result.certificate else None,
        "seconds": round(seconds, 1),
        "safetensors_bytes": written,
        "components": components,
    }


def family_row(name: str, root: Path, coverage: str) -> dict[str, Any]:
    """bf16-safe, fp16-safe, fp16-safe without the bound rule where it added islands, and
    what the bound added."""
    source = root / name
    if not source.exists():
        zoo.build(name, source)

    def run(target: str, rule: bool) -> dict[str, Any]:
        output = root / f"{name}-{target}{'' if rule else '-without-bounds'}"
        shutil.rmtree(output, ignore_errors=True)
        with bound_rule(rule) as from_bounds:
            ran = convert_once(source, target, output, coverage, from_bounds)
        shutil.rmtree(output, ignore_errors=True)
        return ran

    runs = {"bf16-safe": run("bf16-safe", True), "fp16-safe": run("fp16-safe", True)}
    after = runs["fp16-safe"]
    added = sum(len(c["bound_islands"]) for c in after["components"])
    before = run("fp16-safe", False) if added else after
    if added:
        runs["fp16-safe without the bound rule"] = before
    share = sum(c["fp32_share"] for c in after["components"]) - sum(
        c["fp32_share"] for c in before["components"]
    )
    return {
        **runs,
        "bound_added": {
            "islands": added,
            "fp32_share_points": round(share, 5),
            "fp16_safe_bytes_growth": round(
                after["safetensors_bytes"] / before["safetensors_bytes"] - 1, 5
            ),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="zoo families (default: all)")
    parser.add_argument("--coverage", default="quick")
    parser.add_argument("--keep", type=Path, help="build (and reuse) the zoo models here")
    args = parser.parse_args()
    unknown = sorted(set(args.families) - set(zoo.FAMILIES))
    if unknown:
        parser.error(f"no zoo family {', '.join(unknown)}; known: {', '.join(zoo.FAMILIES)}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-islands-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.families or list(zoo.FAMILIES):
        if missing := zoo.missing_packages(name):
            rows[name] = {"skipped": f"needs {', '.join(missing)}"}
            continue
        rows[name] = family_row(name, root, args.coverage)
        print(f"{name}: {json.dumps(rows[name]['bound_added'])}", file=sys.stderr, flush=True)
    certified = all(
        row.get(label, {}).get("verdict") == "pass"
        for row in rows.values()
        if "skipped" not in row
        for label in ("bf16-safe", "fp16-safe")
    )
    within = all(
        row["bound_added"]["fp32_share_points"] <= 0.05
        and row["bound_added"]["fp16_safe_bytes_growth"] <= 0.05
        for row in rows.values()
        if "skipped" not in row
    )
    print(
        json.dumps(
            {"coverage": args.coverage, "certified": certified, "within_5%": within, **rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
