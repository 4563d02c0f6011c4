"""How quantities read in this project's messages (one wording for every layer of core)."""

from __future__ import annotations

import re


def duration(seconds: float) -> str:
    """``seconds`` as a reader takes it in: ``40 s``, ``5 min``, ``2.5 h``, ``24 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours < 10 else f"{hours:.0f} h"


_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_duration(text: str) -> float:
    """Seconds in a duration as people write one: ``90s``, ``10m``, ``1h``, ``1h30m``,
    ``1.5h``; a unit is required (``10`` says neither seconds nor minutes).

    Raises:
        ValueError: ``text`` is not such a duration, or is zero.
    """
    found = _DURATION.fullmatch(text.strip().lower())
    if not text.strip() or found is None or not any(found.groups()):
        raise ValueError(f"{text!r} is not a duration: give it as 90s, 10m, 1h or 1h30m")
    hours, minutes, seconds = (float(part or 0) for part in found.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"{text!r} is no time at all: give a duration such as 10m")
    return total
