"""One Docker engine as the docker runtime and its surge capability reach it.

The SDK client (created lazily on a worker thread, so constructing the runtime never blocks
and an engine that comes up later is found on the next call), the translation of engine
failures into typed errors (:meth:`DockerEngine.call`), the per-slot locks, finding a
slot's container, creating and starting one, and stopping one: the primitives both
:mod:`controller.runtime.docker.runtime` (the ``Runtime`` protocol) and
:mod:`controller.runtime.docker.surge` (a slot's second container) call.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import docker
import docker.errors
import requests

from controller.model.errors import (
    DockerEngineError,
    DockerUnavailable,
    SlotctlError,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)
from controller.runtime.base import (
    LaunchSpec,
    Mount,
    Observed,
)
from controller.runtime.docker.spec import (
    DEFAULT_SOCKET,
    container_name,
    create_options,
    labels_of,
    observe,
    owned,
)
from controller.runtime.ports import require_free_port

__all__ = ["DockerEngine", "Unreachable", "explanation"]

_WAIT_POLL_S: Final = 0.05

T = TypeVar("T")


class Unreachable(Exception):
    """The engine did not answer (translated per operation)."""


def explanation(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text).strip()


class DockerEngine:
    """The engine's client, typed failures, slot locks and container primitives."""

    def __init__(
        self,
        client: Any = None,
        *,
        base_url: str | None = None,
        base_mounts: Sequence[Mount] = (),
        network_mode: str = "host",
        stop_grace_s: float = 5.0,
        api_timeout_s: int = 60,
        owner: str | None = None,
    ) -> None:
        if isinstance(client, str):
            client, base_url = None, client
        self._docker: Any = client
        self.owner = owner
        self._owns_client = client is None
        self._base_url = base_url
        self.base_mounts = tuple(base_mounts)
        self.network_mode = network_mode
        self.stop_grace_s = stop_grace_s
        self.api_timeout_s = api_timeout_s
        self._client_lock = threading.Lock()
        self._runtimes: tuple[str, ...] | None = None
        self._slot_locks: dict[str, asyncio.Lock] = {}

    async def close(self) -> None:
        """Close the SDK client's connections (a later call opens new ones)."""
        if not self._owns_client:
            return  # a caller's client: theirs to close
        with self._client_lock:
            client, self._docker = self._docker, None
        if client is not None:
            await asyncio.to_thread(client.close)

    @property
    def where(self) -> str:
        """Where the engine is, for messages (``unix:///var/run/docker.sock``...)."""
        if self._base_url:
            return self._base_url
        if self._docker is not None:
            adapter = getattr(self._docker.api, "_custom_adapter", None)
            socket_path = getattr(adapter, "socket_path", None)
            if isinstance(socket_path, str):
                return f"unix://{socket_path}"
            return str(getattr(self._docker.api, "base_url", "the given client"))
        return os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET

    @property
    def local_engine(self) -> bool:
        return self.where.startswith("unix://")

    def client(self) -> Any:
        """The SDK client (worker thread only: creating it talks to the engine)."""
        with self._client_lock:
            if self._docker is None:
                _check_socket(self.where)
                try:
                    if self._base_url:
                        self._docker = docker.DockerClient(
                            base_url=self._base_url, version="auto", timeout=self.api_timeout_s
                        )
                    else:
                        self._docker = docker.from_env(timeout=self.api_timeout_s)
                except docker.errors.DockerException as exc:
                    raise Unreachable(str(exc)) from exc
            return self._docker

    async def call(self, op: str, slot: str | None, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in a worker thread; engine failures become typed errors."""
        spawn = op in ("start", "prepare")
        where = f" slot {slot!r}" if slot else ""
        try:
            return await asyncio.to_thread(fn, *args)
        except SlotctlError:
            raise
        except (Unreachable, requests.ConnectionError, ConnectionError) as exc:
            message = f"cannot {op}{where}: the Docker engine at {self.where} is unreachable"
            unreachable: type[SlotctlError] = SlotSpawnFailed if spawn else DockerUnavailable
            raise unreachable(f"{message} ({exc})", slot=slot, engine=self.where) from exc
        except (docker.errors.DockerException, requests.RequestException) as exc:
            message = f"cannot {op}{where}: Docker engine error: {explanation(exc)}"
            failed: type[SlotctlError] = SlotSpawnFailed if spawn else DockerEngineError
            raise failed(message, slot=slot, engine=self.where) from exc

    def lock(self, slot: str) -> asyncio.Lock:
        return self._slot_locks.setdefault(slot, asyncio.Lock())

    def find_owned(self, slot: str) -> Any:
        """The slot's container when it carries this controller's labels, else None."""
        container = self.find(slot)
        if container is None or not owned(labels_of(container.attrs), slot, self.owner):
            return None
        return container

    def find(self, slot: str) -> Any:
        """The container named for ``slot``, or None (worker thread)."""
        try:
            return self.client().containers.get(container_name(slot))
        except docker.errors.NotFound:
            return None

    def observe(self, container: Any, slot: str) -> Observed:
        return observe(container.attrs, slot, self.owner)

    def create_and_start(self, launch: LaunchSpec, name: str | None = None) -> Observed:
        if self.network_mode == "host" and self.local_engine:
            require_free_port(launch)
        client = self.client()
        try:
            options = self.create_options(launch)
            if name is not None:  # a surge's second container
                options["name"] = name
            container = client.containers.create(**options)
        except docker.errors.ImageNotFound as exc:
            raise SlotSpawnFailed(
                f"cannot start slot {launch.slot!r}: image {launch.image} is not present "
                f"locally (prepare pulls it): {explanation(exc)}",
                slot=launch.slot,
                image=launch.image,
            ) from exc
        try:
            container.start()
            container.reload()
        except docker.errors.APIError as exc:
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True)
            raise SlotSpawnFailed(
                f"cannot start slot {launch.slot!r}: {explanation(exc)}", slot=launch.slot
            ) from exc
        return self.observe(container, launch.slot)

    def create_options(self, launch: LaunchSpec) -> dict[str, Any]:
        return create_options(
            launch,
            owner=self.owner,
            base_mounts=self.base_mounts,
            network_mode=self.network_mode,
            runtimes=self.engine_runtimes() if launch.device_kind == "gpu" else (),
        )

    def engine_runtimes(self) -> tuple[str, ...]:
        if self._runtimes is None:
            info: Mapping[str, Any] = self.client().info()
            self._runtimes = tuple(str(name) for name in info.get("Runtimes") or {})
        return self._runtimes

    def terminate(self, container: Any, slot: str, timeout: float) -> None:
        """SIGTERM, SIGKILL after ``timeout`` s (the engine counts whole seconds), wait."""
        seconds = max(0, math.ceil(timeout))
        with contextlib.suppress(requests.ReadTimeout):
            container.stop(timeout=seconds)
        if self.wait_stopped(container, 0.0):
            return
        with contextlib.suppress(docker.errors.APIError):
            container.kill()
        if not self.wait_stopped(container, self.stop_grace_s):
            raise SlotTerminateTimeout(
                f"slot {slot!r}: container {container.id[:12]} still runs "
                f"{self.stop_grace_s}s after SIGKILL",
                slot=slot,
            )

    @staticmethod
    def wait_stopped(container: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            container.reload()
            if not bool(container.attrs["State"]["Running"]):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_WAIT_POLL_S)


def _check_socket(engine: str) -> None:
    """Fail fast, and without the SDK, when a unix-socket engine does not listen.

    (The SDK's unix connection also leaks its socket when the connect fails.)
    """
    if not engine.startswith("unix://"):
        return
    path = engine.removeprefix("unix://")
    if not Path(path).exists():
        raise Unreachable(f"no socket at {path}")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(path)
    except OSError as exc:
        raise Unreachable(f"{path}: {exc.strerror or exc}") from exc
