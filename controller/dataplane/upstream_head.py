"""The text of a model server's answer head, for :mod:`controller.dataplane.upstream`: the
patterns a header line must match, the headers that frame the body, a chunk's size, and
a connection's answer-head template.

Pure (no I/O); below the upstream client and the data plane's head module, which share
its patterns (a request head's lines are checked as an answer's are).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "BAD_VALUE",
    "FRAMING",
    "HEADER_LINES",
    "HEADER_NAME",
    "AnswerTemplate",
    "chunk_size",
    "content_length",
]

_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
HEADER_NAME: Final = re.compile(_TOKEN)
BAD_VALUE: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # not in a header value
# The header lines of a head, from the CRLF ending its first line: each a token, a colon
# and a value without controls (a folded line, a bare CR or LF, a NUL do not match).
HEADER_LINES: Final = re.compile(rb"(?:\r\n" + _TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*)*")
# The response headers that frame the body (and its type), in well-formed header lines.
FRAMING: Final = re.compile(
    rb"\r\n(connection|content-length|content-type|transfer-encoding):[ \t]*([^\r]*)",
    re.IGNORECASE,
)
# A Content-Length or Date line's value, without its OWS (well-formed lines only).
_HOLE: Final = re.compile(
    rb"\r\n(content-length|date):[ \t]*([^\r]*?)[ \t]*(?=\r\n|$)", re.IGNORECASE
)
_CHUNK_SIZE: Final = re.compile(rb"[0-9A-Fa-f]{1,15}")
_LENGTH_DIGITS_MAX: Final = 18  # int() refuses 4300 digits and more; no body is this long


def content_length(value: bytes, earlier: int | None = None) -> int | None:
    """A ``Content-Length`` value (OWS stripped) as a number; None when malformed: not
    digits, too many of them, or unequal to an ``earlier`` one of the same head."""
    if not value.isdigit() or len(value) > _LENGTH_DIGITS_MAX:
        return None
    length = int(value)
    return None if earlier is not None and length != earlier else length


@dataclass(frozen=True, slots=True)
class AnswerTemplate:
    """A connection's last answer head with a ``Content-Length`` body, cut around the
    values that change from one answer to the next (its length, its Date): a model
    server answers with the same head again but for those, and such a head is read at
    the cost of a comparison. ``pieces`` are the text around the holes; ``dated`` says,
    hole by hole, whether it is the Date (else the length); the rest is the parse's.

    Every piece between two holes holds the CRLF that ends the first hole's line, and a
    hole's value holds no control character, so a hole cannot reach another line."""

    pieces: tuple[bytes, ...]
    dated: tuple[bool, ...]
    status: int
    reason: bytes
    content_type: bytes
    first: int  # where the status line ends
    reusable: bool

    @classmethod
    def of(
        cls,
        head: bytes,
        first: int,
        status: int,
        reason: bytes,
        content_type: bytes,
        reusable: bool,
    ) -> AnswerTemplate | None:
        """The template of a parsed head with one Content-Length and at most one Date."""
        holes = [
            (m.start(2), m.end(2), m.group(1).lower() == b"date") for m in _HOLE.finditer(head)
        ]
        dates = sum(dated for *_, dated in holes)
        if len(holes) - dates != 1 or dates > 1 or any(start == end for start, end, _ in holes):
            return None
        pieces, at = [], 0
        for start, end, _ in holes:
            pieces.append(head[at:start])
            at = end
        pieces.append(head[at:])
        return cls(
            tuple(pieces),
            tuple(dated for *_, dated in holes),
            status,
            reason,
            content_type,
            first,
            reusable,
        )

    def length_of(self, head: bytes) -> int | None:
        """The Content-Length of ``head`` when it is this template's head with other
        values in its holes (a length > 0, a Date without controls); else None."""
        pieces, at, stop = self.pieces, len(self.pieces[0]), len(head)
        if not head.startswith(pieces[0]) or not head.endswith(pieces[-1]):
            return None
        stop -= len(pieces[-1])
        length = -1
        for i, dated in enumerate(self.dated):
            end = stop if i + 2 == len(pieces) else head.find(pieces[i + 1], at, stop)
            if end < at:
                return None
            value = head[at:end]
            if dated:
                if not value or BAD_VALUE.search(value):  # no control: the line stays one
                    return None
            else:
                found = content_length(value)
                if found is None:
                    return None
                length = found
            at = end + len(pieces[i + 1])
        return length if length > 0 else None  # no body: parsed (no framing to read)


def chunk_size(line: bytes) -> int:
    """The size of a chunk-size line (extensions ignored); -1 when malformed (``int``
    alone would take ``0x10``, ``-5`` or ``1_0``)."""
    size = line.split(b";", 1)[0].rstrip(b" \t")
    return int(size, 16) if _CHUNK_SIZE.fullmatch(size) else -1
