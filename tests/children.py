"""How tests start child processes: with their signal dispositions set explicitly.

A shell that runs the suite in the background (``make test &``, ``nohup``) starts it with
SIGINT (and under ``nohup`` SIGHUP) ignored, and an ignored signal stays ignored across
``exec``: a ``slotctl events`` the test then interrupts with SIGINT would never see it
(Python installs its KeyboardInterrupt handler only when SIGINT is not ignored at start).
So every child a test starts gets the dispositions of a foreground job (``preexec_fn``,
run in the child between fork and exec), whatever the shell did.
"""

from __future__ import annotations

import signal
from typing import Any, Final

__all__ = ["CHILD", "default_signals"]

_RESET: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def default_signals() -> None:
    """In the child: SIGINT, SIGTERM, SIGHUP and SIGQUIT back to their default action."""
    for sig in _RESET:
        signal.signal(sig, signal.SIG_DFL)


# Keyword arguments for subprocess.Popen/run (restore_signals: SIGPIPE and friends too).
CHILD: Final[dict[str, Any]] = {"preexec_fn": default_signals, "restore_signals": True}
