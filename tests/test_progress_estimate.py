"""The time a certificate says it has left: first said once a probe of each precision has been
timed, and never climbing past a fifth above the last figure without a line saying why."""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

from precision_convert.api.conversion import convert
from precision_convert.core.progress import (
    RISE_UNEXPLAINED,
    expect,
    forecasting,
    forward_ran,
    reporting,
)

_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}
_ESTIMATE = re.compile(r"^(?P<what>\w+): about (?P<n>[\d.]+) (?P<unit>s|min|h) left")


def _estimates(lines: list[str]) -> dict[str, list[tuple[float, str]]]:
    """Each forecast's estimates in the order said: (seconds, the line)."""
    out: dict[str, list[tuple[float, str]]] = {}
    for line in lines:
        found = _ESTIMATE.match(line)
        if found:
            seconds = float(found["n"]) * _UNITS[found["unit"]]
            out.setdefault(found["what"], []).append((seconds, line))
    return out


def _assert_never_rises_unexplained(lines: list[str]) -> None:
    for what, said in _estimates(lines).items():
        for (before, _), (after, line) in pairwise(said):
            if after > before * RISE_UNEXPLAINED:
                assert "up from about" in line, (what, said)


def test_the_estimate_waits_for_each_precision_and_says_why_it_rises() -> None:
    """fp32 probes alone give no estimate when the candidate's are still to run (an fp16
    forward on a CPU can take several fp32 ones); a slower kind of probe that raises the
    figure past a fifth is named on the line that raises it, and the figure falls after."""
    lines: list[str] = []
    with reporting(lambda *_: None, lines.append), forecasting("validation"):
        expect(40, "fp32 baseline 20, pc.load 20", fp32=20)
        for _ in range(20):
            forward_ran("fp32", 1.0, True, "vocabulary")
        assert not _estimates(lines), lines
        forward_ran("fp16", 4.0, True, "vocabulary")
        first = _estimates(lines)["validation"]
        assert len(first) == 1 and first[0][0] == 19 * 4.0, lines
        forward_ran("fp16", 40.0, True, "length")  # a kind ten times slower starts
        rise = _estimates(lines)["validation"][-1][1]
        assert "up from about 76 s" in rise and "a slower probe kind started: length" in rise
        for _ in range(17):
            forward_ran("fp16", 4.0, True, "vocabulary")
        expect(30, "other ways of loading at most 30")  # more forwards: a reason of their own
        forward_ran("fp16", 4.0, True, "vocabulary")
    said = _estimates(lines)["validation"]
    assert said[-1][0] < said[1][0], lines  # it fell once the slow probe was behind
    assert "30 more forwards planned" in said[-1][1], lines
    _assert_never_rises_unexplained(lines)


def test_a_conversion_says_each_estimate_after_both_precisions_ran(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """A real fp16-safe conversion: calibration's first estimate comes after its fp32 sweep
    and its first fp16 candidate probe, validation's after its first probe, and no figure
    climbs past a fifth above the one before without saying why."""
    events: list[tuple[str, str, int]] = []
    lines: list[str] = []

    def said(line: str) -> None:
        lines.append(line)
        events.append(("said", line, 0))

    with reporting(lambda label, done, *_: events.append(("ran", label, done)), said):
        result = convert(
            tiny_model("t5-encoder"), to="fp16-safe", output=tmp_path / "out", coverage="quick"
        )
    assert result.certificate is not None and result.certificate.verdict == "pass"
    estimates = _estimates(lines)
    assert set(estimates) == {"calibration", "validation"}, lines
    for what, needs in (("calibration", ("fp32", "fp16")), ("validation", ("fp16",))):
        first = next(i for i, e in enumerate(events) if e[1] == estimates[what][0][1])
        ran = [e[1] for e in events[:first] if e[0] == "ran" and e[2] >= 1]
        for precision in needs:
            assert any(
                label.startswith(what) and f" {precision} probes" in label for label in ran
            ), (what, precision, lines)
    _assert_never_rises_unexplained(lines)
