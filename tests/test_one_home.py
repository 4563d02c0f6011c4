"""One definition each of the helpers and patterns that several layers need: a second copy
of any of them is found here by reading the product's source."""

from __future__ import annotations

import re
import weakref
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("precision_convert", "convert", "validate", "recipes")


def _hits(pattern: str) -> list[str]:
    """``path:line`` of every line of the product's source that ``pattern`` matches."""
    found = []
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if re.search(pattern, line):
                    found.append(f"{path.relative_to(REPO)}:{number}")
    return found


@pytest.mark.parametrize(
    ("what", "pattern", "home"),
    [
        # An exception turned into one line: core.errors.one_line, over first_line.
        ("one_line", r"def one_line\(", "precision_convert/core/errors.py"),
        ("first line of a text", r"splitlines\(\)(\[0\]| if line\.strip)", "core/errors.py"),
        # A model dropped and its memory given back: runtime.memory.freed.
        ("freed", r"def freed\(", "convert/runtime/memory.py"),
        ("the free sequence", r"_free_model\(gone,", "convert/runtime/memory.py"),
        # Names matched by pattern: core.patterns.
        ("certificate file name", r"precision_certificate\(", "core/patterns.py"),
        ("variant file name", r"-\\d\+-of-\\d\+\)\?\\\.", "core/patterns.py"),
        ("Hub id", r"\[A-Za-z0-9\]\[\\w\.-\]\*", "core/patterns.py"),
        # A duration in a message: core.units.duration.
        ("duration wording", r"def _?duration\(", "core/units.py"),
    ],
)
def test_one_definition(what: str, pattern: str, home: str) -> None:
    hits = _hits(pattern)
    assert len(hits) == 1 and home in hits[0], f"{what}: {hits}"


def test_freed_drops_the_model_whatever_ends_the_block() -> None:
    from precision_convert.conversion.runtime.memory import freed

    class Model:
        pass

    with pytest.raises(RuntimeError, match="forward failed"), freed(Model()) as held:
        gone = weakref.ref(held.model)
        raise RuntimeError("forward failed")
    assert held.model is None and gone() is None
    with freed() as held:
        held.model = Model()
        gone = weakref.ref(held.model)
    assert gone() is None


def test_dtype_spellings_come_from_the_dtype_table() -> None:
    # A table of its own from torch dtypes to names, or a set of them spelled out, would drift
    # from core/dtypes.py's (a new float dtype added there and not here).
    spelled = r"torch\.(float16|bfloat16|float32|float64)\s*:\s*\"|\{torch\.(float16|bfloat16)\b"
    assert _hits(spelled) == []
