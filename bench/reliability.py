"""The reliability suite's full mode as a script: interrupt each kind of work N times with
each signal (seeded random points, see ``tests/reliability/_harness.py``), then run the
deterministic cases (file-system faults, long names, concurrent writers of one output), and
print the counts as JSON on stdout (one line of progress per trial on stderr).

    python bench/reliability.py                  # 5 per signal: 15 per kind, 75 in all
    python bench/reliability.py --per-signal 1 --kinds conversion push --signals SIGTERM

Seeds are tried in order until N trials of each kind and signal were really interrupted (a
draw past the command's end checks a finished run, which does not count).

A trial that breaks a promise (something partial at the target, a changed source, a failed
rerun, a leftover staging directory) is counted under ``failed`` with its error, and the
script exits 1. A trial whose disk state held but whose SIGINT message was wrong or missing
(a known defect of the CLI) counts as survived and under ``message_defects``. A SIGTERM must
exit 143 like a Ctrl-C exits 130, with its staging directory and lock removed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "reliability")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--per-signal", type=int, default=5, help="interrupted trials per kind and signal"
    )
    parser.add_argument("--kinds", nargs="*", help="only these kinds")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument(
        "--signals", nargs="*", help="only these signals (default: SIGKILL, SIGINT, SIGTERM)"
    )
    parser.add_argument(
        "--no-cases", action="store_true", help="skip the deterministic cases (CASES)"
    )
    options = parser.parse_args()

    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("PRECISION_CONVERT_CACHE", tempfile.mkdtemp(prefix="pc-bench-cache-"))

    import _harness
    import pytest
    from _fake_hub import FakeHub
    from test_push import TOKEN, USER, _online

    kinds = options.kinds or list(_harness.KINDS)
    trials: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pc-reliability-") as tmp, FakeHub() as hub:
        hub.add_token(TOKEN, USER)
        sources = _harness.Sources(Path(tmp) / "sources")

        def one(kind: str, sig: str, seed: int) -> dict[str, Any]:
            work = Path(tmp) / f"{kind}-{sig}-{seed}"
            work.mkdir()
            trial = _harness.Trial(kind, sig, seed)
            began = time.monotonic()
            try:
                if kind == "push":
                    with pytest.MonkeyPatch.context() as mp:
                        _online(mp, hub, work / "hf-home")
                        env = _harness.hub_env(hub.endpoint, TOKEN, work)
                        _harness.push(trial, work, sources, hub, env, _harness.run_in_process)
                else:
                    getattr(_harness, kind)(trial, work, sources)
                record = {**trial.to_json(), "ok": True}
            except Exception:  # every broken promise is counted, whatever its kind
                record = {**trial.to_json(), "ok": False, "error": traceback.format_exc()}
            record["seconds"] = round(time.monotonic() - began, 1)
            print(json.dumps(record), file=sys.stderr, flush=True)
            shutil.rmtree(work, ignore_errors=True)
            return record

        # Seeds in order until N trials of each (kind, signal) really were interrupted (a draw
        # past the command's end checks a finished run and does not count); at most 3N.
        for kind in kinds:
            for sig in options.signals or _harness.FULL_SIGNALS:
                interrupted = 0
                seed = options.first_seed
                while interrupted < options.per_signal and seed < options.first_seed + 3 * (
                    options.per_signal
                ):
                    record = one(kind, sig, seed)
                    trials.append(record)
                    interrupted += bool(record["interrupted"])
                    seed += 1
    summary = _summary(trials, time.monotonic() - started)
    if not options.no_cases:
        summary["cases"] = _cases()
        summary["seconds"] = round(time.monotonic() - started, 1)
    failed_cases = sum(c.get("failed", 0) for c in summary.get("cases", {}).values())
    print(json.dumps(summary, indent=2))
    return 0 if not summary["failed"] and not failed_cases else 1


#: The deterministic cases: each a fault injected at a known point, two writers of one output
#: raced, or a resource run short, with what the tool must leave behind checked.
CASES = {
    "file system": "tests/reliability/test_file_system.py",
    "concurrent writers": "tests/reliability/test_concurrency.py",
    # a full disk, a small memory budget, declared sizes no probe can run, SIGTERM among them
    "resources": "tests/reliability/test_resources.py",
}


def _cases() -> dict[str, dict[str, int]]:
    """Each of :data:`CASES` run by pytest in a process of its own: its counts by outcome."""
    import subprocess
    import xml.etree.ElementTree as ElementTree

    counts: dict[str, dict[str, int]] = {}
    for name, path in CASES.items():
        with tempfile.TemporaryDirectory(prefix="pc-cases-") as scratch:
            report = Path(scratch) / "junit.xml"
            subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
                 f"--junitxml={report}"],
                cwd=ROOT, stdout=sys.stderr, check=False,
            )  # fmt: skip
            cases = ElementTree.parse(report).getroot().iter("testcase")
            outcome: Counter[str] = Counter()
            for case in cases:
                kinds = {child.tag for child in case}
                outcome[
                    "failed" if kinds & {"failure", "error"} else
                    "skipped" if "skipped" in kinds else "passed"
                ] += 1  # fmt: skip
            counts[name] = dict(outcome)
    return counts


def _summary(trials: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Counts per kind. ``survived``: interrupted, and every promise about the disk held (the
    target, the source, the rerun, no staging left). ``message_defects``: of those, the ones
    whose SIGINT message was wrong or missing (a known defect, listed in ``defects_seen``).
    ``finished``: the draw fell past the command's end; checked, not counted."""
    by_kind: dict[str, Counter[str]] = {}
    for t in trials:
        counts = by_kind.setdefault(t["kind"], Counter())
        counts["trials"] += 1
        if not t["ok"]:
            counts["failed"] += 1
        elif t["interrupted"]:
            counts["survived"] += 1
            counts[f"survived_{t['signal']}"] += 1
            counts["message_defects"] += bool(t["defects"])
        else:
            counts["finished"] += 1
        if t["ok"]:
            for state in str(t["left"]).split(","):
                counts[f"left_{state}"] += 1
    return {
        "trials": len(trials),
        "interruptions_survived": sum(c["survived"] for c in by_kind.values()),
        "message_defects": sum(c["message_defects"] for c in by_kind.values()),
        "failed": [t for t in trials if not t["ok"]],
        "defects_seen": dict(Counter(d.split(":")[0] for t in trials for d in t["defects"])),
        "by_kind": {kind: dict(counts) for kind, counts in by_kind.items()},
        "seconds": round(seconds, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
