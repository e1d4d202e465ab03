"""``ExitCode``: the exit statuses of ``slotctl`` (docs/cli.md), one name for each.

At the bottom of the layers (the standard library only) so the CLI and the controller
it runs in the foreground (``controller.daemon``) return the same values.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """What a ``slotctl`` command's exit status means (kubectl / Flux / Argo CD style)."""

    OK = 0
    # The command's negative answer: an invalid stack, drift with ``diff --exit-code``,
    # not converged in time, a ``load --dry-run`` that would be refused, a stale CRD.
    NEGATIVE = 1
    # ``slotctl up`` after an internal error: it stops, its servers keep running for the
    # next controller to adopt (docs/reliability.md). The same status as NEGATIVE.
    FATAL = 1
    ERROR = 2  # usage or any error, an unexpected one included: never 1
    INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
