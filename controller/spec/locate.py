"""Line numbers for TOML keys: maps a location path to the line that declares it.

tomlkit keeps layout but not line numbers, so this scans the text once: table headers
(``[a.b]``, ``[[slot]]`` with a per-array counter) and ``key =`` lines (dotted keys too).
Keys inside inline tables or multi-line values resolve to the line of their parent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

__all__ = ["LineIndex"]

_ARRAY_HEADER: Final = re.compile(r"^\s*\[\[\s*([^\[\]]+?)\s*\]\]\s*(#.*)?$")
_TABLE_HEADER: Final = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_KEY_LINE: Final = re.compile(
    r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*="""
)
_KEY_PART: Final = re.compile(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""")

Path = tuple[str | int, ...]


def _split_key(dotted: str) -> list[str]:
    return [part.strip("\"'") for part in _KEY_PART.findall(dotted)]


class LineIndex:
    """``index.line_of(("slot", 1, "server", "extra_args"))`` -> 1-based line or None."""

    def __init__(self, text: str) -> None:
        self._lines: dict[Path, int] = {}
        counters: dict[tuple[str, ...], int] = {}
        context: Path = ()
        in_multiline: str | None = None
        for number, raw in enumerate(text.splitlines(), start=1):
            if in_multiline:
                if in_multiline in raw:
                    in_multiline = None
                continue
            if match := _ARRAY_HEADER.match(raw):
                names = tuple(_split_key(match.group(1)))
                index = counters.get(names, -1) + 1
                counters[names] = index
                context = (*names, index)
                self._lines.setdefault(names, number)  # the array itself: its first header
                self._lines.setdefault(context, number)
                continue
            if match := _TABLE_HEADER.match(raw):
                context = self._table_context(tuple(_split_key(match.group(1))), counters)
                self._lines.setdefault(context, number)
                continue
            if match := _KEY_LINE.match(raw):
                key_path = (*context, *_split_key(match.group(1)))
                for depth in range(len(context) + 1, len(key_path) + 1):
                    self._lines.setdefault(key_path[:depth], number)
                rest = raw[match.end() :]
                for quote in ('"""', "'''"):
                    if rest.count(quote) == 1:
                        in_multiline = quote

    @staticmethod
    def _table_context(names: tuple[str, ...], counters: dict[tuple[str, ...], int]) -> Path:
        # [slot.server] after the 2nd [[slot]] belongs to slot index 1.
        for cut in range(len(names), 0, -1):
            head = names[:cut]
            if head in counters:
                return (*head, counters[head], *names[cut:])
        return names

    def line_of(self, path: Sequence[str | int]) -> int | None:
        """The line of the longest located prefix of ``path`` (None if nothing matches)."""
        path = tuple(path)
        for cut in range(len(path), 0, -1):
            line = self._lines.get(path[:cut])
            if line is not None:
                return line
        return None
