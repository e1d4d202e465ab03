"""Requests that aiohttp's HTTP parser refuses: answered ``400`` without a word of them,
logged as one line each (peer and reason, never a byte of the request), rate-limited.

Where it sits: :class:`~controller.api.server.ApiServer` builds every aiohttp connection
protocol through :func:`quiet_protocol` (the full API behind the data plane, which hands
aiohttp every head it does not parse itself, and the probe-only app of
``--metrics-listen``). aiohttp's own handler logs such a request as "Error handling
request" with a traceback whose exception carries the raw bytes — an ``Authorization:
Bearer`` header included — and echoes that text in the 400's body; any local process can
send them, unauthenticated, as fast as it likes (issue 26). Only parse errors are
answered here; every other failure keeps aiohttp's handling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

__all__ = ["RefusalLog", "quiet_protocol"]

log = logging.getLogger("slotctl.api")

_BODY: Final = "400 Bad Request: malformed HTTP request\n"


class RefusalLog:
    """At most ``burst`` lines per ``window_s``; the next line after a window says how
    many were left out (a flood of garbage costs the log a bounded number of lines)."""

    def __init__(
        self,
        *,
        burst: int = 5,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._window = float("-inf")
        self._lines = 0
        self.suppressed = 0

    def note(self, peer: str, reason: str) -> None:
        now = self.clock()
        if now - self._window >= self.window_s:
            self._window, self._lines = now, 0
        if self._lines >= self.burst:
            self.suppressed += 1
            return
        self._lines += 1
        more = f" ({self.suppressed} more refused since, not logged)" if self.suppressed else ""
        self.suppressed = 0
        log.warning(
            "refused a malformed HTTP request from %s (%s): answered 400%s", peer, reason, more
        )


REFUSALS: Final = RefusalLog()  # one for the process: every listener shares the budget


class _QuietRequestHandler(RequestHandler):
    """aiohttp's connection protocol, but for its parse errors (see the module docstring)."""

    __slots__ = ()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        peername = request.transport.get_extra_info("peername") if request.transport else None
        peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else "?"
        REFUSALS.note(peer, type(exc).__name__)
        response = web.Response(status=400, text=_BODY)
        response.force_close()
        return response


def quiet_protocol(server: web.Server) -> Callable[[], RequestHandler]:
    """The protocol factory of ``server`` (an aiohttp ``web.Server``, as its own
    ``__call__`` builds its handlers) with parse errors answered quietly."""
    kwargs: dict[str, Any] = dict(server._kwargs)
    loop = server._loop

    def factory() -> RequestHandler:
        return _QuietRequestHandler(server, loop=loop, **kwargs)

    return factory
