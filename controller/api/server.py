"""Serving the API next to the controller: listen address, token, aiohttp runner."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from aiohttp import web

from controller.api.app import ApiContext, build_app
from controller.errors import SlotConfigError

__all__ = ["ApiServer", "parse_listen"]


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8800`` for IPv6); port 0 picks a free one."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SlotConfigError(f"--listen {value!r}: expected HOST:PORT", keys=["listen"])
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(slots=True)
class ApiServer:
    ctx: ApiContext
    host: str
    port: int
    runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Start serving; returns the bound ``host:port`` (the real port when 0 was asked)."""
        self.runner = web.AppRunner(
            build_app(self.ctx), access_log=None, handle_signals=False, shutdown_timeout=5.0
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
