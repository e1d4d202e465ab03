"""Which ``Host`` a request may name: the check against DNS rebinding (issue 26).

A web page on another site can make a browser send requests to ``127.0.0.1`` by
rebinding its own name to that address; its requests then carry the page's name in
``Host``. So the API (the data plane's ``/v1`` and the REST routes) answers only requests whose
``Host`` is an IP address literal (no name to rebind), ``localhost``, the listen host, or a
name configured with ``--allowed-host`` (``.example.com`` takes its subdomains too, ``*``
any name); every other is refused with ``421`` (``request.host_not_allowed``) before any
route or the token is looked at. A request without ``Host`` (HTTP/1.0) is no browser's.

:class:`HostPolicy` is pure; :class:`~controller.api.server.ApiServer` builds one per
listener (:data:`~controller.api.hostcheck.HOST_POLICY` on its app), the data plane and
:func:`~controller.api.hostcheck.hosts_middleware` (the app's, for what aiohttp serves) ask it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Final

__all__ = ["HostPolicy", "host_name"]

_CACHE_MAX: Final = 1024


def host_name(host: str) -> str:
    """The name (or address) of a ``Host`` value, without its port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """The ``Host`` values one listener answers (see the module docstring)."""

    def __init__(self, listen_host: str, allowed: Iterable[str] = ()) -> None:
        names = {"localhost", host_name(listen_host)}
        names.update(name.strip().lower().rstrip(".") for name in allowed if name.strip())
        self.any = "*" in names
        self.suffixes = tuple(sorted(n for n in names if n.startswith(".")))
        self.names = frozenset(n for n in names if not n.startswith("."))
        self._seen: dict[bytes, bool] = {}  # the data plane's raw values, judged once

    def allows(self, host: str | None) -> bool:
        if host is None or self.any:
            return True
        name = host_name(host)
        if not name or name in self.names or _is_address(name):
            return True
        return any(name.endswith(suffix) or name == suffix[1:] for suffix in self.suffixes)

    def allows_raw(self, host: bytes | None) -> bool:
        """:meth:`allows` of a raw header value (the data plane's), remembered."""
        if host is None or self.any:
            return True
        known = self._seen.get(host)
        if known is None:
            known = self.allows(host.decode("latin-1"))
            if len(self._seen) >= _CACHE_MAX:
                self._seen.clear()
            self._seen[host] = known
        return known
