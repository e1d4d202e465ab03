"""Whether a slot's port is free, and who holds it when not: the process and docker
(host network) runtimes refuse a start on a taken port before the server would fail to
bind, less clearly. And a free port for a slot that leaves its port to the controller
(:func:`pick_free_port`). Sits under both runtimes; no controller state.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Container

import psutil

from controller.model.errors import SlotSpawnFailed
from controller.runtime.base import LaunchSpec

__all__ = ["can_bind", "pick_free_port", "port_holder", "require_free_port"]

_PICK_TRIES = 64


def require_free_port(launch: LaunchSpec) -> None:
    """Refuse to start ``launch`` (:class:`SlotSpawnFailed`, naming the holder) when its
    port is taken: a server that cannot bind would only fail later, less clearly."""
    holder = port_holder(launch.host, launch.port)
    if holder is not None:
        raise SlotSpawnFailed(
            f"cannot start slot {launch.slot!r}: port {launch.port} is in use by {holder}",
            slot=launch.slot,
            port=launch.port,
            holder=holder,
        )


def port_holder(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound; else who holds it (pid and command if known)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                return f"an error binding it ({exc.strerror})"
        else:
            return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            listening = conn.laddr and conn.laddr.port == port and conn.status == "LISTEN"
            if listening and conn.pid:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(conn.pid)
                    return f"pid {conn.pid} ({' '.join(proc.cmdline())[:80]})"
                return f"pid {conn.pid}"
    except psutil.AccessDenied:
        pass
    return "another process"


def can_bind(host: str, port: int) -> bool:
    """Whether ``host:port`` can be listened on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_free_port(taken: Container[int], host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the kernel's choice, as a bind to port 0 makes it) and
    not in ``taken`` (the ports other slots declare or were given)."""
    for _ in range(_PICK_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host if host not in ("", "localhost") else "127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in taken:
            return port
    raise SlotSpawnFailed(f"no free port found in {_PICK_TRIES} tries")
