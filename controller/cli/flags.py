"""The machinery of the ``slotctl`` command line: global options, the command tree, help.

Global options (``--config-dir``, ``--state-dir``, ``--runtime``, ``--server``,
``--token``, ``--debug``) are accepted before the command *and* after it, anywhere on
the line (as kubectl does): every sub-parser carries them with a suppressed default, so
a value given after the command wins over one given before it, and one not given
leaves the top-level default alone (:func:`add_globals`, :meth:`Tree.finish`).

A command is data (:class:`Command`: name, help, options, the handler itself); its
module is imported only when that command runs (:class:`LazyModule`). The standard
library only (and ``controller.model.exitcode``): ``slotctl --help`` and every command pay for
this module.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, NamedTuple

from controller.model.exitcode import ExitCode

__all__ = [
    "RUNTIME_KINDS",
    "SERVER_ENV",
    "STATE_DIR_ENV",
    "TOKEN_ENV",
    "Command",
    "Formatter",
    "Handler",
    "HelpOf",
    "LazyModule",
    "Tree",
    "add_globals",
    "examples_text",
    "output",
    "parse_duration",
    "parse_since",
]

SERVER_ENV: Final = "SLOTCTL_SERVER"
STATE_DIR_ENV: Final = "SLOTCTL_STATE_DIR"  # the default state dir (controller.kit.paths)
TOKEN_ENV: Final = "SLOTCTL_TOKEN"  # noqa: S105 (a variable name, not a secret)
# The same tuple as controller.runtime.RUNTIME_KINDS (importing it would import aiohttp).
RUNTIME_KINDS: Final = ("process", "docker", "kubernetes")

_NUMBER: Final = r"\d+(?:\.\d+)?"
_DURATION_RE: Final = re.compile(rf"(?:{_NUMBER}[smhd])+")
_PART_RE: Final = re.compile(rf"({_NUMBER})([smhd])")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90`` (seconds), ``90s``, ``15m``, ``2h``, ``1d``, ``1h30m`` -> seconds (> 0)."""
    value = text.strip().lower()
    total = 0.0
    if re.fullmatch(_NUMBER, value):
        total = float(value)
    elif _DURATION_RE.fullmatch(value):
        total = sum(float(n) * _UNITS[unit] for n, unit in _PART_RE.findall(value))
    if total <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use e.g. 90s, 15m, 2h, 1d or 1h30m"
        )
    return total


def parse_since(text: str) -> tuple[int | None, float | None]:
    """``--since``: an event id (digits: resume after it) or a duration (``10m``, ``2h``:
    the history of that long) -> ``(id, seconds)``."""
    value = text.strip()
    if re.fullmatch(r"#?\d+", value):
        return int(value.lstrip("#")), None
    try:
        return None, parse_duration(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid --since {text!r}: an event id (42) or a duration (90s, 10m, 2h, 1d)"
        ) from None


Handler = Callable[[argparse.Namespace], int]
Options = Callable[[argparse.ArgumentParser], None]


class Command(NamedTuple):
    """One ``slotctl`` command as data: what ``--help`` says, its options, its handler (a
    NamedTuple: ``dataclasses`` would cost every start-up ~20 ms of imports)."""

    name: str
    help: str
    run: Handler
    options: Options | None = None
    description: str | None = None
    examples: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()  # global options it does not take


class LazyModule:
    """A module imported at the first look at one of its attributes (a command's handler
    module: imported when that command runs, not at start-up)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


class Formatter(argparse.HelpFormatter):
    """Wraps prose paragraphs; keeps the lines of ``examples:`` as they are."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith("examples:"):
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)


class _RuntimeGiven(argparse.Action):
    """``--runtime``, remembering that it was given (``runtime_given``): the operator
    picks ``kubernetes`` inside a pod only when nobody chose."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.runtime_given = True


def add_globals(parser: argparse.ArgumentParser, *, top: bool, skip: tuple[str, ...] = ()) -> None:
    """The global options; on sub-parsers with suppressed defaults (see the docstring)."""
    group = parser.add_argument_group("global options") if not top else parser

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    group.add_argument(
        "--config-dir",
        type=Path,
        default=default(None),
        help="live desired state (default: $SLOTCTL_CONFIG_DIR, $XDG_CONFIG_HOME/slotctl)",
    )
    group.add_argument(
        "--state-dir",
        type=Path,
        default=default(None),
        help="observed state (default: $SLOTCTL_STATE_DIR, $XDG_STATE_HOME/slotctl)",
    )
    group.add_argument(
        "--runtime",
        choices=RUNTIME_KINDS,
        action=_RuntimeGiven,
        default=default(os.environ.get("SLOTCTL_RUNTIME", "process")),
        help="process (default), docker or kubernetes (the operator's default inside a "
        "pod); a running controller's own runtime wins",
    )
    if "--server" not in skip:
        group.add_argument(
            "--server",
            dest="api_server",
            metavar="URL",
            default=default(None),
            help=f"the controller's API (default: ${SERVER_ENV}, else the controller running "
            "on --state-dir, found through its controller.json)",
        )
    if "--token" not in skip:
        group.add_argument(
            "--token",
            dest="api_token",
            metavar="TOKEN",
            default=default(None),
            help=f"API bearer token (default: ${TOKEN_ENV}, else <state_dir>/token of the "
            "local controller)",
        )
    group.add_argument(
        "--debug",
        action="store_true",
        default=default(False),
        help="print tracebacks on errors",
    )


def examples_text(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


class Tree:
    """Builds sub-parsers that all carry the global options and a description."""

    def __init__(self) -> None:
        self.parsers: list[tuple[argparse.ArgumentParser, tuple[str, ...]]] = []

    def add(
        self,
        sub: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        help: str,
        *,
        description: str | None = None,
        examples: tuple[str, ...] = (),
        skip: tuple[str, ...] = (),
    ) -> argparse.ArgumentParser:
        parser = sub.add_parser(
            name,
            help=help,
            description=description or help[:1].upper() + help[1:] + ".",
            epilog=examples_text(*examples) if examples else None,
            formatter_class=Formatter,
        )
        self.parsers.append((parser, skip))
        return parser

    def declare(
        self,
        sub: argparse._SubParsersAction[argparse.ArgumentParser],
        commands: tuple[Command, ...],
    ) -> None:
        """A sub-parser for each of ``commands``, in their order."""
        for command in commands:
            parser = self.add(
                sub,
                command.name,
                command.help,
                description=command.description,
                examples=command.examples,
                skip=command.skip,
            )
            if command.options is not None:
                command.options(parser)
            parser.set_defaults(func=command.run)

    def group(
        self, parser: argparse.ArgumentParser, dest: str
    ) -> argparse._SubParsersAction[argparse.ArgumentParser]:
        """Sub-commands of ``parser``; bare ``slotctl GROUP`` prints the group's help."""
        parser.set_defaults(func=HelpOf(parser))
        return parser.add_subparsers(dest=dest, metavar="COMMAND", title="commands")

    def finish(self) -> None:
        # Globals go last so each command's own options come first in its help.
        for parser, skip in self.parsers:
            add_globals(parser, top=False, skip=skip)


class HelpOf:
    """``func`` of a command group typed without a sub-command: its help, exit 0."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def __call__(self, args: argparse.Namespace) -> ExitCode:
        self.parser.print_help()
        return ExitCode.OK


def output(parser: argparse.ArgumentParser, choices: tuple[str, ...] = ("text", "json")) -> None:
    parser.add_argument("-o", "--output", choices=choices, default=choices[0])
