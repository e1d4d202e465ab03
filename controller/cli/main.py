"""``slotctl`` entry point: parses arguments, runs a command, maps failures to exit codes.

Exit codes: 0 success, 1 the command's "negative" answer (invalid stack, drift), 2 usage
or any error, an unexpected exception included (never a bare traceback; ``--debug``
prints it). Typed errors print as ``slotctl: error [code]: message`` (for an API answer,
the code the controller sent).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller import __version__
from controller.cli import k8s, remote, slot, stack
from controller.cli.client import SERVER_ENV, TOKEN_ENV, error_code
from controller.errors import SlotctlError
from controller.paths import default_config_dir, default_state_dir
from controller.runtime import RUNTIME_KINDS

__all__ = ["EXIT_ERROR", "build_parser", "main"]

EXIT_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotctl",
        description="Declarative lifecycle controller for local model-serving slots.",
    )
    parser.add_argument("--version", action="version", version=f"slotctl {__version__}")
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="live desired state (default: $SLOTCTL_CONFIG_DIR, $XDG_CONFIG_HOME/slotctl)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="observed state (default: $SLOTCTL_STATE_DIR, $XDG_STATE_HOME/slotctl)",
    )
    parser.add_argument(
        "--runtime",
        choices=RUNTIME_KINDS,
        default=os.environ.get("SLOTCTL_RUNTIME", "process"),
        help="process (default) or docker; a running controller's own runtime wins",
    )
    parser.add_argument(
        "--server",
        dest="api_server",
        metavar="URL",
        default=None,
        help=f"the controller's API (default: ${SERVER_ENV}, else the controller running on "
        "--state-dir, found through its controller.json)",
    )
    parser.add_argument(
        "--token",
        dest="api_token",
        metavar="TOKEN",
        default=None,
        help=f"API bearer token (default: ${TOKEN_ENV}, else <state_dir>/token of the local "
        "controller)",
    )
    parser.add_argument("--debug", action="store_true", help="print tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    stack.register(sub)
    slot.register(sub)
    remote.register_slot_commands(_subcommands(sub.choices["slot"]))
    remote.register(sub)
    k8s.register(sub)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any]:
    """The sub-command action of ``parser`` (to add commands to ``slot``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise LookupError(f"{parser.prog} has no sub-commands")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config_dir = args.config_dir or default_config_dir()
    args.state_dir = args.state_dir or default_state_dir()
    try:
        code: int = args.func(args)
    except SlotctlError as exc:
        print(f"slotctl: error [{error_code(exc)}]: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("slotctl: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_ERROR
    # Every failure exits 2, never 1 (CI drift checks rely on it): a blind catch on purpose.
    except Exception as exc:  # noqa: BLE001
        if args.debug:
            traceback.print_exc()  # (raising SystemExit would swallow it silently)
            return EXIT_ERROR
        print(f"slotctl: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("slotctl: run with --debug for the traceback", file=sys.stderr)
        return EXIT_ERROR
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
