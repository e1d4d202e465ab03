"""Output helpers for the CLI: colour (off for pipes and under NO_COLOR), problem reports,
memory sizes (``controller.model.sizes``: one format everywhere, GiB with two decimals).

Imports nothing heavy (the spec models only for type checking): every command uses it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from controller.model.sizes import GIB, format_gib

if TYPE_CHECKING:
    from controller.spec.problems import Problem

__all__ = ["GIB", "Style", "format_memory", "print_json", "render_problems", "table"]


def format_memory(value: float | None, unit: int = 1) -> str:
    """``value`` (in ``unit`` bytes: 1, or GIB for a ``memory_gb``) as ``5.20 GiB``
    (:func:`controller.model.sizes.format_gib`), ``-`` when unknown or zero."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        return "-"
    return format_gib(value * unit)


class Style:
    """ANSI styling that switches itself off when it should (NO_COLOR, not a tty)."""

    def __init__(self, stream: TextIO) -> None:
        self.enabled = (
            not os.environ.get("NO_COLOR")
            and os.environ.get("TERM") != "dumb"
            and (bool(os.environ.get("FORCE_COLOR")) or stream.isatty())
        )

    def _wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled else text

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def yellow(self, text: str) -> str:
        return self._wrap("33", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def bold(self, text: str) -> str:
        return self._wrap("1", text)


def table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Aligned text columns, a header line first (also when there are no rows)."""
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return lines


def print_json(data: Any, stream: TextIO = sys.stdout) -> None:
    stream.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def render_problems(problems: Sequence[Problem], style: Style) -> list[str]:
    lines: list[str] = []
    for p in problems:
        mark = style.red("error") if p.severity == "error" else style.yellow("warning")
        context = []
        if p.slot:
            context.append(f"slot {p.slot}")
        if p.key:
            context.append(f"key {p.key}")
        where = style.bold(p.where())
        lines.append(f"{where}: {mark} [{p.code}] {', '.join(context)}".rstrip(", "))
        lines.append(f"    {p.message}")
        if p.hint:
            lines.append(style.dim(f"    hint: {p.hint}"))
    return lines
