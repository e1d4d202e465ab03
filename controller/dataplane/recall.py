"""Heads recalled by their bytes: an upstream answer's head that is the last one's exact
bytes but for its ``Content-Length`` digits and its ``Date`` gets that head's verdict
again (:mod:`controller.dataplane.upstream` says when, and why that is llhttp's).

Pure; at the bottom of :mod:`controller.dataplane`, beside :mod:`.states`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["AnswerRecall", "Said", "answer_recall"]

_LENGTH_LINE: Final = b"\r\ncontent-length:"
_DATE_LINE: Final = b"\r\ndate:"
_DIGITS: Final = rb"[0-9]{1,18}"  # a length llhttp takes (no uint64 overflow)
# RFC 9110's IMF-fixdate ("Sun, 06 Nov 1994 08:49:37 GMT"): the Date a server sends.
_DATE: Final = rb"[A-Z][a-z]{2}, [0-9]{2} [A-Z][a-z]{2} [0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT"
_LENGTH: Final = re.compile(_DIGITS)
_FIXDATE: Final = re.compile(_DATE)

# What llhttp said of an answer head: status, reason, fields, Content-Type, keep-alive.
Said = tuple[int, bytes, list[tuple[bytes, bytes]], bytes, bool]


@dataclass(slots=True)
class AnswerRecall:
    """An answer head llhttp read, as a pattern of its exact bytes with the length's
    digits (group ``n``) and, when it had one, its Date's value (group ``d``) left open;
    with what llhttp said of it, and (``passed``, once the data plane made it) the header
    lines it passes to the client and whether it is an event stream (``made``: the head
    the client gets, but for the Date and the length)."""

    pattern: re.Pattern[bytes]
    date: bytes | None  # the Date as it came, when the pattern does not leave it open
    said: Said  # status, reason, fields (but the framing and the Date), type, keep-alive
    passed: tuple[bytes, bool] | None = None
    # The client's head of it but for the Date and the length, once the data plane made it:
    # (close, old, before them, after them, event stream).
    made: tuple[bool, bool, bytes, bytes, bool] | None = None


def _value_at(raw: bytes, lower: bytes, line: bytes) -> int:
    """Where the value of the one header ``line`` (lowercase, from its CRLF) starts in
    ``raw``; -1: none, or more than one."""
    at = lower.find(line)
    if at < 0 or lower.find(line, at + 1) >= 0:
        return -1
    start = at + len(line)
    while raw[start : start + 1] in (b" ", b"\t"):
        start += 1
    return start


def answer_recall(raw: bytes, length: int, date: bytes, said: Said) -> AnswerRecall | None:
    """The recall of the sized answer head ``raw`` (its status line to its blank line) whose
    ``Content-Length`` llhttp read as ``length`` and its ``Date`` as ``date``; None: its
    length is not where it is looked for."""
    lower = raw.lower()
    spans: list[tuple[int, int, bytes]] = []
    start = _value_at(raw, lower, _LENGTH_LINE)
    found = _LENGTH.match(raw, start) if start >= 0 else None
    if found is None or int(found.group()) != length:
        return None
    spans.append((start, found.end(), b"(?P<n>" + _DIGITS + b")"))
    start = _value_at(raw, lower, _DATE_LINE)
    found = _FIXDATE.match(raw, start) if start >= 0 else None
    open_date = found is not None and found.group() == date and raw[found.end()] == 13
    if found is not None and open_date:
        spans.append((start, found.end(), b"(?P<d>" + _DATE + b")"))
    pattern, at = b"", 0
    for begin, end, group in sorted(spans):
        pattern += re.escape(raw[at:begin]) + group
        at = end
    pattern += re.escape(raw[at:])
    return AnswerRecall(re.compile(pattern), None if open_date else date, said)
