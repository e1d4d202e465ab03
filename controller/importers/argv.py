"""Command lines as the tools being imported read them.

llama-swap's ``cmd`` is one string: lines whose first non-blank character is ``#`` are
comments, a line ending in ``\\`` continues on the next, and the rest is split as a POSIX
shell would, without running one (llama-swap's ``SanitizeCommand``, v250:
``internal/config/commands.go``). :class:`ArgList` takes a server's options out of an
argv — ``--flag value``, ``--flag=value`` and llama-cpp-python's ``--flag_with_underscores``
alike — leaving the rest, in order, for ``server.extra_args``.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence

from controller.model.errors import ImportSourceError

__all__ = ["ArgList", "flag_name", "split_command"]


def split_command(cmd: str, *, key: str = "cmd") -> list[str]:
    """``cmd`` as llama-swap splits it into argv."""
    lines = []
    for line in cmd.split("\n"):
        trimmed = line.strip()
        if trimmed.startswith("#"):
            continue
        lines.append(trimmed[:-1] + " " if trimmed.endswith("\\") else line)
    try:
        argv = shlex.split("\n".join(lines), posix=True)
    except ValueError as exc:  # an unbalanced quote
        raise ImportSourceError(f"{key}: cannot split the command: {exc}", key=key) from None
    if not argv:
        raise ImportSourceError(f"{key}: the command is empty", key=key)
    return argv


def flag_name(arg: str) -> str | None:
    """``--ctx_size=8`` -> ``--ctx-size`` (long options with ``_`` folded to ``-``, as the
    stack guard compares them); None for a value."""
    if not arg.startswith("-") or arg in ("-", "--") or _is_number(arg):
        return None
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


class ArgList:
    """An argv whose options are taken out one kind at a time."""

    def __init__(self, argv: Iterable[str]) -> None:
        self.items = list(argv)

    def take(self, names: Iterable[str], *, value: bool = True) -> list[str | None]:
        """Remove every occurrence of the options ``names`` (and their values); return
        the values in order (None for a flag, or an option with nothing after it)."""
        wanted = {n.replace("_", "-") if n.startswith("--") else n for n in names}
        out: list[str | None] = []
        kept: list[str] = []
        i = 0
        while i < len(self.items):
            arg = self.items[i]
            name = flag_name(arg)
            if name not in wanted:
                kept.append(arg)
                i += 1
                continue
            if not value:
                out.append(None)
                i += 1
            elif "=" in arg:
                out.append(arg.split("=", 1)[1])
                i += 1
            elif i + 1 < len(self.items):
                out.append(self.items[i + 1])
                i += 2
            else:
                out.append(None)
                i += 1
        self.items = kept
        return out

    def last(self, names: Iterable[str]) -> str | None:
        """The last value given for ``names`` (the one a server keeps), taken out."""
        values = [v for v in self.take(names) if v is not None]
        return values[-1] if values else None

    def flag(self, names: Sequence[str]) -> bool:
        """Whether the value-less flag ``names`` was given (taken out)."""
        return bool(self.take(names, value=False))

    def names(self) -> list[str]:
        return [n for n in (flag_name(a) for a in self.items) if n]
