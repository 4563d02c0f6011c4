"""What the model card says, made safe for its medium and true to the records.

The card is Markdown that the Hub renders as HTML, and much of what it quotes comes from
outside: a source's folder name, class names and strings from its ``config.json``, tensor and
module names, library error messages. :func:`escape` is the one function every such value
passes through on its way into the card: control characters are shown as escapes (``\\x1b``),
and what Markdown or HTML would read as syntax is neutralised (``<`` ``>`` ``&`` as entities,
backticks, ``*``, ``[``, ``]`` and ``|`` escaped, so a name can neither open a tag nor a link,
end a code span or split a table cell). A normal name (letters, digits, ``-``, ``_``, ``.``,
``/``) is unchanged, so the card of a normal model is byte for byte what it was.

The card's verdict statements come from the records, never from the verdict alone:
:func:`way_passed` believes a way of loading's ``pass`` only where its own metrics agree
(:func:`~.consistency.way_contradiction`), and a certificate's ``pass`` is believed only where
no record contradicts it (:func:`certified`).
"""

from __future__ import annotations

import math
import re

from precision_convert.core.errors import printable
from precision_convert.validation.certify.certificate import Certificate, LoadPath
from precision_convert.validation.certify.consistency import contradiction, way_contradiction

#: Markdown and HTML syntax a name must not carry into the card, and what stands for it.
_SYNTAX = {
    "\\": "\\\\",
    "`": "&#96;",
    "*": "\\*",
    "[": "\\[",
    "]": "\\]",
    "|": "\\|",
    "<": "&lt;",
    ">": "&gt;",
    "&": "&amp;",
}
#: Where a ``<`` would open raw HTML (a tag, a closing tag, a comment, a declaration or a
#: processing instruction); ``<=`` in "must be <= 0.1" opens nothing.
_TAG_OPENING = re.compile(r"<(?=[A-Za-z/!?])")


def escape(text: object, *, code_spans: bool = False) -> str:
    """``text`` as the card may show it.

    By default ``text`` is a value (a name, a path, a config string): every character of
    Markdown or HTML syntax is neutralised and every control character shown as an escape.
    With ``code_spans``, ``text`` is a line of precision-convert's own words (a failure, a
    way's detail) that may hold code spans and comparisons (``must be <= 0.1``) and quotes
    names inside them: control characters are shown as escapes and ``|`` escaped (a table
    cell holds such lines) everywhere, and outside its code spans every ``<`` that would open
    raw HTML is an entity.
    """
    shown = str(text)
    if not code_spans:
        return "".join(_SYNTAX.get(c) or printable(c) for c in shown)
    parts = shown.split("`")
    for i in range(0, len(parts), 2):  # the text between code spans
        parts[i] = _TAG_OPENING.sub("&lt;", parts[i])
    return printable("`".join(parts)).replace("|", "\\|")


def code(text: object) -> str:
    """``text`` as an inline code span (raw HTML is inert inside one; a ``|`` is escaped, as a
    table cell needs), or escaped as plain text when a code span cannot hold it (a backtick
    would end it, a control character has no place in it)."""
    shown = str(text)
    if "`" in shown or printable(shown) != shown:
        return escape(shown)
    return f"`{shown.replace('|', chr(92) + '|')}`"


def certified(certificate: Certificate) -> bool:
    """Whether the card may say the files are certified: the verdict is ``pass`` and no
    record contradicts it."""
    return certificate.passed and contradiction(certificate) is None


def way_passed(path: LoadPath) -> bool:
    """Whether the card may say a way of loading matches fp32: its verdict is ``pass`` and
    its own metrics say so too."""
    return path.verdict == "pass" and way_contradiction(path) is None


def way_result(path: LoadPath) -> str:
    """A way of loading's result cell: what its records support, never its verdict alone."""
    if path.verdict == "not-checked":
        return f"not checked: {escape(path.detail or 'no reason recorded', code_spans=True)}"
    if path.verdict == "pass" and (contradicted := way_contradiction(path)) is not None:
        return f"❌ contradicts its own metrics: {escape(contradicted, code_spans=True)}"
    if path.verdict == "pass":
        cosine = next((m for m in path.metrics if m.metric == "cosine"), None)
        floor = math.floor(cosine.value * 1e5) / 1e5 if cosine and cosine.value else None
        close = f" (cosine ≥ {floor:.5f})" if floor is not None else ""
        note = f"; {escape(path.detail, code_spans=True)}" if path.detail else ""
        return f"✅ matches fp32{close}{note}"
    if path.detail and path.detail.startswith("fails"):
        return f"❌ {escape(path.detail, code_spans=True)}"
    first = path.failures[0] if path.failures else (path.detail or "outputs differ")
    return f"❌ differs from fp32: {escape(first, code_spans=True)}"
