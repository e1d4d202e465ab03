"""``slotctl`` entry point: parses arguments, runs a command, maps failures to exit codes.

The command line itself (commands, options, help) is ``cli.parser``; each command's
module is imported only when it runs, so start-up stays fast.

Exit codes (:class:`~controller.model.exitcode.ExitCode`, the one list of them): 0 success, 1
the command's "negative" answer (invalid stack, drift), 2 usage (argparse's own status)
or any error, an unexpected exception included (never a bare traceback; ``--debug``
prints it), 130 interrupted by Ctrl-C (quietly: following ``logs -f`` or ``events``
until Ctrl-C is the normal way to end them). Typed errors print as ``slotctl: error
[code]: message`` (for an API answer, the code the controller sent).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from controller.cli.parser import build_parser
from controller.kit.paths import default_config_dir, default_state_dir
from controller.model.errors import SlotctlError
from controller.model.exitcode import ExitCode

__all__ = ["build_parser", "main"]


def _code(exc: SlotctlError) -> str:
    """The code to show for ``exc``: the server's own for an API answer."""
    remote: str | None = getattr(exc, "remote_code", None)
    return remote or exc.code


def main(argv: Sequence[str] | None = None) -> ExitCode:
    """Run one command; its exit status (an :class:`ExitCode`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config_dir = args.config_dir or default_config_dir()
    args.state_dir = args.state_dir or default_state_dir()
    try:
        code = ExitCode(args.func(args))
    except SlotctlError as exc:
        print(f"slotctl: error [{_code(exc)}]: {exc.message}", file=sys.stderr)
        return ExitCode.ERROR
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        return ExitCode.ERROR
    # Every failure exits 2, never 1 (CI drift checks rely on it): a blind catch on purpose.
    except Exception as exc:  # noqa: BLE001
        if args.debug:
            traceback.print_exc()  # (raising SystemExit would swallow it silently)
            return ExitCode.ERROR
        print(f"slotctl: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("slotctl: run with --debug for the traceback", file=sys.stderr)
        return ExitCode.ERROR
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
