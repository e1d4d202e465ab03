"""Output helpers for the CLI: colour (off for pipes and under NO_COLOR), problem reports."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from controller.spec.problems import Problem

__all__ = ["Style", "print_json", "render_problems"]


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
