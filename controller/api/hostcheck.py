"""The ``Host`` check of what aiohttp serves: :func:`hosts_middleware` asks the listener's
:class:`~controller.router.hosts.HostPolicy` (:data:`HOST_POLICY` on its app; the policy
itself, shared with the data plane, is :mod:`controller.router.hosts`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from controller.model.errors import HostNotAllowed
from controller.router.hosts import HostPolicy, host_name

__all__ = ["HOST_POLICY", "HostPolicy", "host_name", "hosts_middleware"]


# The Host values an app answers (set by the server that serves it; absent: any).
HOST_POLICY: Final = web.AppKey("slotctl_hosts", HostPolicy)


@web.middleware
async def hosts_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Refuse a ``Host`` this listener does not answer, before the token or any route."""
    policy = request.app.get(HOST_POLICY)
    host = request.headers.get("Host")
    if policy is not None and not policy.allows(host):
        raise HostNotAllowed(
            f"this API does not answer to Host {str(host)[:100]!r}: use its address or "
            "localhost, or add the name with --allowed-host"
        )
    return await handler(request)
