"""How quantities read in this project's messages (one wording for every layer of core)."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """``seconds`` as a reader takes it in: ``40 s``, ``5 min``, ``2.5 h``, ``24 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    return f"{hours:.1f} h" if hours < 10 else f"{hours:.0f} h"
