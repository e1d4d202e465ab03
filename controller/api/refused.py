"""aiohttp's connection protocol as slotctl runs it: requests that aiohttp's HTTP parser
refuses answered ``400`` without a word of them, logged as one line each (peer and reason,
never a byte of the request), rate-limited; and, behind the data plane, each answer told
to the data plane, so that it reads the connection's next request itself.

Where it sits: :class:`~controller.api.server.ApiServer` builds every aiohttp connection
protocol here: :func:`bridged_protocol` for the full API behind the data plane (which
passes aiohttp the bytes of each request that is not a ``/v1`` one, and hands it a
connection for good at a head llhttp refuses), :func:`quiet_protocol` for the probe-only
app of ``--metrics-listen``. aiohttp's own handler logs a refused request as "Error
handling request" with a traceback whose exception carries the raw bytes — an
``Authorization: Bearer`` header included — and echoes that text in the 400's body; any
local process can send them, unauthenticated, as fast as it likes (issue 26). Only parse
errors are answered here; every other failure keeps aiohttp's handling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

__all__ = ["RefusalLog", "bridged_protocol", "quiet_protocol"]

log = logging.getLogger("slotctl.api")

_BODY: Final = "400 Bad Request: malformed HTTP request\n"
# Behind the data plane, aiohttp's own keep-alive timer must never close a connection: the
# data plane serves the connection's /v1 requests meanwhile, and closes it when it is idle
# (controller.dataplane.plane.KEEPALIVE_S) itself.
_BRIDGED_KEEPALIVE_S: Final = 10.0 * 365 * 24 * 3600


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
    """aiohttp's connection protocol, but for its parse errors (see the module docstring);
    ``answered(keep)``, when set, hears of each answer it finished (``keep``: the
    connection goes on), as :class:`controller.dataplane.connection.Fallback` says."""

    __slots__ = ("answered",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answered: Callable[[bool], None] | None = None

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        resp, reset = await super().finish_response(request, resp, start_time)
        answered = self.answered
        if answered is not None:
            answered(not reset and bool(resp.keep_alive))
        return resp, reset

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


def quiet_protocol(server: web.Server) -> Callable[[], _QuietRequestHandler]:
    """The protocol factory of ``server`` (an aiohttp ``web.Server``, as its own
    ``__call__`` builds its handlers) with parse errors answered quietly."""
    kwargs: dict[str, Any] = dict(server._kwargs)
    loop = server._loop

    def factory() -> _QuietRequestHandler:
        return _QuietRequestHandler(server, loop=loop, **kwargs)

    return factory


def bridged_protocol(server: web.Server) -> Callable[[], _QuietRequestHandler]:
    """:func:`quiet_protocol` behind the data plane: its keep-alive timer left to the data
    plane (see :data:`_BRIDGED_KEEPALIVE_S`)."""
    kwargs: dict[str, Any] = {**server._kwargs, "keepalive_timeout": _BRIDGED_KEEPALIVE_S}
    loop = server._loop

    def factory() -> _QuietRequestHandler:
        return _QuietRequestHandler(server, loop=loop, **kwargs)

    return factory
