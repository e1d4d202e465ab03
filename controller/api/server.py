"""Serving the API next to the controller: listen address, token, aiohttp runner.

:func:`check_listen` is ``slotctl up``'s preflight: each listen address is parsed and
test-bound before the controller writes anything, so an address in use is a typed
:class:`ListenUnavailable` (exit 2) that changed nothing. ``ApiServer`` serves the full
API (``build_app``) or, for ``--metrics-listen``, only the unauthenticated probes
(``build_probe_app``). The full API listens through the router's data plane
(:mod:`controller.dataplane.plane`), which serves every ``/v1`` request itself and
passes every other request to aiohttp, on the same connection.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from controller.api.app import ApiContext
from controller.api.assembly import build_app
from controller.api.hostcheck import HOST_POLICY, HostPolicy
from controller.api.refused import bridged_protocol, quiet_protocol
from controller.dataplane.plane import DataPlane
from controller.model.errors import ListenUnavailable, SlotConfigError

__all__ = ["ApiServer", "check_listen", "parse_listen"]


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8800`` for IPv6); port 0 picks a free one."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SlotConfigError(f"--listen {value!r}: expected HOST:PORT", keys=["listen"])
    return host.strip("[]") or "127.0.0.1", int(port)


def check_listen(value: str, flag: str = "--listen") -> tuple[str, int]:
    """``parse_listen``, then a test bind of every address ``HOST`` resolves to (as the
    server will bind them). Port 0 always binds. Raises ListenUnavailable."""
    host, port = parse_listen(value)
    if port == 0:
        return host, port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenUnavailable(
            f"{flag} {value}: cannot resolve {host!r}: {exc.strerror}", listen=value
        ) from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            # As the server binds (reuse_address): a port in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise listen_error(value, exc, flag) from None
    return host, port


def listen_error(value: str, exc: OSError, flag: str = "--listen") -> ListenUnavailable:
    """The typed error for a failed bind of ``value``."""
    if exc.errno == errno.EADDRINUSE:
        reason = "the address is already in use (another slotctl up, or another server?)"
    else:
        reason = exc.strerror or str(exc)
    return ListenUnavailable(
        f"cannot listen on {value}: {reason}; pick another with {flag} HOST:PORT",
        listen=value,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_SHUTDOWN_S = 5.0  # requests in flight get this long to finish when the server stops


@dataclass(slots=True)
class ApiServer:
    ctx: ApiContext
    host: str
    port: int
    runner: web.AppRunner | None = None
    app_factory: Callable[[ApiContext], web.Application] = build_app
    flag: str = "--listen"
    plane: DataPlane | None = None  # the router's data plane in front (with build_app)
    server: asyncio.Server | None = None

    async def start(self) -> str:
        """Start serving; returns the bound ``host:port`` (the real port when 0 was asked)."""
        # The Host values answered: the listen host, localhost, address literals and
        # --allowed-host (controller.api.hostcheck: against DNS rebinding).
        hosts = HostPolicy(self.host, self.ctx.allowed_hosts)
        app = self.app_factory(self.ctx)
        app[HOST_POLICY] = hosts
        self.runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=_SHUTDOWN_S,
        )
        await self.runner.setup()
        server = self.runner.server
        assert server is not None
        # aiohttp's protocol, answering the requests its parser refuses without echoing
        # or logging their bytes (controller.api.refused); behind the data plane, one a
        # connection, fed the requests that are not /v1 ones.
        factory: Callable[[], asyncio.BaseProtocol] = quiet_protocol(server)
        if self.app_factory is build_app:
            self.plane = DataPlane(self.ctx, bridged_protocol(server), hosts=hosts)
            factory = self.plane
        loop = asyncio.get_running_loop()
        try:
            self.server = await loop.create_server(
                factory, self.host, self.port, reuse_address=True
            )
        except OSError as exc:  # taken since the preflight check
            await self.stop()
            raise listen_error(f"{self.host}:{self.port}", exc, self.flag) from None
        if self.server.sockets:
            self.port = int(self.server.sockets[0].getsockname()[1])
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening; requests in flight get a moment to finish, then everything closes."""
        server, self.server = self.server, None
        if server is not None:
            server.close()
        plane, self.plane = self.plane, None
        if plane is not None:
            await plane.shutdown(_SHUTDOWN_S)
        runner, self.runner = self.runner, None
        if runner is not None:
            await runner.cleanup()
        if server is not None:
            await server.wait_closed()
