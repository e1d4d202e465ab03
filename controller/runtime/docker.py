"""The docker runtime: each slot's server is a container named ``slotctl-<slot>``.

Sits beside :mod:`controller.runtime.process` under the :class:`~controller.runtime.base.Runtime`
seam; the slot manager is its only caller. It turns a provider's
:class:`~controller.runtime.base.LaunchSpec` into a container through the docker SDK:

* **labels** ``slotctl.managed=true``, ``slotctl.slot``, ``slotctl.stack``,
  ``slotctl.config-hash`` (and ``slotctl.port``, so an adopted container's endpoint is
  known) mark what the controller owns. A container with a slot's name but without our
  labels is *reported* (``Observed(managed=False)``) and never stopped, removed or
  replaced;
* **adoption**: ``start`` on a running container of ours with the same config hash
  returns it (no duplicate after a controller restart); an exited one is removed and
  created anew (the controller owns restarts: restart policy ``no``);
* **placement**: host network by default (the server binds the slot's port on the host),
  ``init=True`` (``docker-init`` as PID 1 forwards SIGTERM and reaps), the LaunchSpec's
  mounts plus the runtime's ``base_mounts`` as binds, the model file read-only, GPUs as
  device requests when the engine has the NVIDIA runtime, else ``/dev/kfd`` +
  ``/dev/dri`` (AMD); a GPU slot on a host with neither fails instead of silently
  running on the CPU;
* **pulls** stream the engine's progress to a callback (the slot shows ``pulling``).

What a container is (name, labels, create options, observation) lives in the pure
:mod:`~controller.runtime.docker_spec`; the blocking pull and log streams in
:mod:`~controller.runtime.docker_streams`. The SDK is synchronous: every other call runs in
a worker thread (``asyncio.to_thread``). Engine
failures become typed errors: :class:`~controller.errors.SlotSpawnFailed` from ``start``
and ``prepare``, :class:`DockerEngineError` (engine answered with an error) or
:class:`DockerUnavailable` (engine unreachable, naming its socket) from the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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

from controller.errors import (
    DockerEngineError,
    DockerUnavailable,
    SlotctlError,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)
from controller.runtime.base import (
    MANAGED_LABEL,
    SLOT_LABEL,
    LaunchSpec,
    Mount,
    Observed,
    ProgressCallback,
    RunStatus,
    RuntimeKind,
)
from controller.runtime.docker_spec import (
    CONTAINER_PREFIX,
    DEFAULT_SOCKET,
    OWNER_LABEL,
    PORT_LABEL,
    container_name,
    create_options,
    device_options,
    labels_of,
    observe,
    owned,
    require_image,
)
from controller.runtime.docker_streams import follow_logs, pull_image
from controller.runtime.docker_surge import RETIRING_SUFFIX, SURGE_SUFFIX, DockerSurge
from controller.runtime.ports import require_free_port

__all__ = [
    "CONTAINER_PREFIX",
    "PORT_LABEL",
    "DockerEngineError",
    "DockerRuntime",
    "DockerUnavailable",
    "container_name",
    "device_options",
]

log = logging.getLogger("slotctl.runtime")

_WAIT_POLL_S: Final = 0.05

T = TypeVar("T")


class _Unreachable(Exception):
    """Internal: the engine did not answer (translated per operation)."""


def _explanation(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text).strip()


class DockerRuntime:
    """Runtime for servers run as containers on a Docker engine (see module docstring)."""

    kind = RuntimeKind.DOCKER

    def __init__(
        self,
        client: Any = None,
        *,
        base_url: str | None = None,
        base_mounts: Sequence[Mount] = (),
        network_mode: str = "host",
        stop_grace_s: float = 5.0,
        pull_timeout_s: float = 1800.0,
        api_timeout_s: int = 60,
        owner: str | None = None,
    ) -> None:
        """``client``: a ``docker.DockerClient``, or a base URL (``unix:///...``).

        Without either, the engine comes from the environment (``DOCKER_HOST``, else the
        default socket). The client is created lazily, so constructing the runtime never
        blocks and an engine that comes up later is found on the next call.

        ``base_mounts``: binds every container gets besides the LaunchSpec's own (e.g. the
        host's ``/usr`` for images that borrow host binaries); ``network_mode``: ``host``
        (default) or a network name, in which case the slot's port is published on
        ``127.0.0.1``; ``stop_grace_s``: how long to wait after SIGKILL before a stop
        raises :class:`SlotTerminateTimeout`; ``pull_timeout_s``: the longest a pull may
        take; ``api_timeout_s``: the SDK's per-request timeout.
        """
        if isinstance(client, str):
            client, base_url = None, client
        self._docker: Any = client
        self.owner = owner
        self._owns_client = client is None
        self._base_url = base_url
        self.base_mounts = tuple(base_mounts)
        self.network_mode = network_mode
        self.stop_grace_s = stop_grace_s
        self.pull_timeout_s = pull_timeout_s
        self.api_timeout_s = api_timeout_s
        self._client_lock = threading.Lock()
        self._runtimes: tuple[str, ...] | None = None
        self._slot_locks: dict[str, asyncio.Lock] = {}
        self.surge = DockerSurge(self)  # a slot's second container (surge rollouts)

    async def close(self) -> None:
        """Close the SDK client's connections (a later call opens new ones)."""
        if not self._owns_client:
            return  # a caller's client: theirs to close
        with self._client_lock:
            client, self._docker = self._docker, None
        if client is not None:
            await asyncio.to_thread(client.close)

    # ------------------------------------------------------------------ engine access

    @property
    def engine(self) -> str:
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
    def _local_engine(self) -> bool:
        return self.engine.startswith("unix://")

    def _client(self) -> Any:
        """The SDK client (worker thread only: creating it talks to the engine)."""
        with self._client_lock:
            if self._docker is None:
                _check_socket(self.engine)
                try:
                    if self._base_url:
                        self._docker = docker.DockerClient(
                            base_url=self._base_url, version="auto", timeout=self.api_timeout_s
                        )
                    else:
                        self._docker = docker.from_env(timeout=self.api_timeout_s)
                except docker.errors.DockerException as exc:
                    raise _Unreachable(str(exc)) from exc
            return self._docker

    async def _call(self, op: str, slot: str | None, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in a worker thread; engine failures become typed errors."""
        spawn = op in ("start", "prepare")
        where = f" slot {slot!r}" if slot else ""
        try:
            return await asyncio.to_thread(fn, *args)
        except SlotctlError:
            raise
        except (_Unreachable, requests.ConnectionError, ConnectionError) as exc:
            message = f"cannot {op}{where}: the Docker engine at {self.engine} is unreachable"
            unreachable: type[SlotctlError] = SlotSpawnFailed if spawn else DockerUnavailable
            raise unreachable(f"{message} ({exc})", slot=slot, engine=self.engine) from exc
        except (docker.errors.DockerException, requests.RequestException) as exc:
            message = f"cannot {op}{where}: Docker engine error: {_explanation(exc)}"
            failed: type[SlotctlError] = SlotSpawnFailed if spawn else DockerEngineError
            raise failed(message, slot=slot, engine=self.engine) from exc

    def _lock(self, slot: str) -> asyncio.Lock:
        return self._slot_locks.setdefault(slot, asyncio.Lock())

    def _find_owned(self, slot: str) -> Any:
        """The slot's container when it carries this controller's labels, else None."""
        container = self._find(slot)
        if container is None or not owned(labels_of(container.attrs), slot, self.owner):
            return None
        return container

    def _find(self, slot: str) -> Any:
        """The container named for ``slot``, or None (worker thread)."""
        try:
            return self._client().containers.get(container_name(slot))
        except docker.errors.NotFound:
            return None

    # ------------------------------------------------------------------ protocol

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        if not launch.image:
            return False  # start() says why a docker slot needs an image
        return await self._call("inspect image of", launch.slot, self._image_missing, launch.image)

    def _image_missing(self, image: str) -> bool:
        try:
            self._client().images.get(image)
        except docker.errors.ImageNotFound:
            return True
        return False

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        image = require_image(launch)
        if not await self._call("prepare", launch.slot, self._image_missing, image):
            return
        client = await self._call("prepare", launch.slot, self._client)
        await pull_image(
            client,
            launch.slot,
            image,
            timeout_s=self.pull_timeout_s,
            progress=progress,
            failed=lambda exc: self._pull_failed(launch.slot, image, exc),
        )

    def _pull_failed(self, slot: str, image: str, exc: BaseException) -> SlotctlError:
        if isinstance(exc, (requests.ConnectionError, ConnectionError, _Unreachable)):
            reason = f"the Docker engine at {self.engine} is unreachable ({exc})"
        else:
            reason = _explanation(exc)
        return SlotSpawnFailed(
            f"cannot pull {image} for slot {slot!r}: {reason}", slot=slot, image=image
        )

    async def start(self, launch: LaunchSpec) -> Observed:
        require_image(launch)
        async with self._lock(launch.slot):
            return await self._call("start", launch.slot, self._start_sync, launch)

    async def stop(self, slot: str, timeout: float) -> Observed:
        async with self._lock(slot):
            return await self._call("stop", slot, self._stop_sync, slot, timeout)

    async def inspect(self, slot: str) -> Observed:
        return await self._call("inspect", slot, self._inspect_sync, slot)

    async def list_managed(self) -> list[Observed]:
        return await self._call("list", None, self._list_sync)

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        return await self._call("read logs of", slot, self._logs_sync, slot, tail)

    def watch_log(self, slot: str, on_text: Callable[[str], None]) -> Callable[[], None] | None:
        """Follow the container's output from now on (the readiness probe's wake-up, see
        :class:`controller.probe.LogWatcher`): the engine's log stream is read on a daemon
        thread of its own, ``on_text`` is called on the event loop. Any failure just ends
        the watch (the probe keeps its schedule); returns the function that stops it."""

        def open_stream(since: float) -> Any:
            container = self._find_owned(slot)
            if container is None:
                return None
            return container.logs(stdout=True, stderr=True, stream=True, follow=True, since=since)

        return follow_logs(slot, open_stream, on_text)

    def logs_from_start(self, slot: str) -> bool:
        """The engine's stream is followed from now on (see :meth:`watch_log`)."""
        return False

    # ------------------------------------------------------------------ observing

    def _observe(self, container: Any, slot: str) -> Observed:
        return observe(container.attrs, slot, self.owner)

    def _inspect_sync(self, slot: str) -> Observed:
        container = self._find(slot)
        if container is None:
            return Observed(slot=slot, status=RunStatus.MISSING)
        return self._observe(container, slot)

    def _list_sync(self) -> list[Observed]:
        wanted = [f"{MANAGED_LABEL}=true"]
        if self.owner is not None:
            wanted.append(f"{OWNER_LABEL}={self.owner}")
        containers = self._client().containers.list(
            all=True, filters={"label": wanted}, ignore_removed=True
        )
        found: dict[str, Observed] = {}
        for container in containers:
            slot = labels_of(container.attrs).get(SLOT_LABEL)
            if not slot:
                continue
            own = container_name(slot)
            if container.name == own:
                found[slot] = self._observe(container, slot)
            elif container.name in (own + SURGE_SUFFIX, own + RETIRING_SUFFIX):
                # A surge's second container alone (a rollout a restart interrupted, the
                # slot removed meanwhile): the slot is listed, its own server missing, so
                # the orphan reaper (Rollouts.stop_orphaned) finds and stops it.
                found.setdefault(slot, Observed(slot=slot, status=RunStatus.MISSING))
        return sorted(found.values(), key=lambda o: o.slot)

    def _logs_sync(self, slot: str, tail: int) -> list[str]:
        container = self._find_owned(slot)
        if container is None:
            return []
        raw = container.logs(stdout=True, stderr=True, tail=tail if tail > 0 else "all")
        return bytes(raw).decode(errors="replace").splitlines()

    # ------------------------------------------------------------------ starting

    def _start_sync(self, launch: LaunchSpec) -> Observed:
        for _attempt in range(3):
            existing = self._find(launch.slot)
            if existing is not None:
                adopted = self._adopt_or_clear(existing, launch)
                if adopted is not None:
                    return adopted
            try:
                return self._create_and_start(launch)
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: the name was taken meanwhile: look again
                    raise
        raise SlotSpawnFailed(
            f"cannot start slot {launch.slot!r}: container {container_name(launch.slot)} "
            "keeps being recreated by someone else",
            slot=launch.slot,
        )

    def _adopt_or_clear(self, container: Any, launch: LaunchSpec) -> Observed | None:
        """Our running container: adopt it; our exited one: remove it; not ours: refuse."""
        observed = self._observe(container, launch.slot)
        if not observed.managed:
            raise SlotSpawnFailed(
                f"cannot start slot {launch.slot!r}: an unmanaged container holds the name "
                f"{container_name(launch.slot)} ({(observed.ident or '')[:12]}); slotctl "
                "never touches containers without its labels: remove or rename it",
                slot=launch.slot,
                container=observed.ident,
            )
        if observed.running:
            if observed.config_hash == launch.config_hash():
                return observed
            raise SlotSpawnFailed(
                f"slot {launch.slot!r} already runs container {(observed.ident or '')[:12]} "
                f"with another config ({observed.config_hash} != {launch.config_hash()}); "
                "stop it first",
                slot=launch.slot,
            )
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        return None

    def _create_and_start(self, launch: LaunchSpec, name: str | None = None) -> Observed:
        if self.network_mode == "host" and self._local_engine:
            require_free_port(launch)
        client = self._client()
        try:
            options = self._create_options(launch)
            if name is not None:  # a surge's second container
                options["name"] = name
            container = client.containers.create(**options)
        except docker.errors.ImageNotFound as exc:
            raise SlotSpawnFailed(
                f"cannot start slot {launch.slot!r}: image {launch.image} is not present "
                f"locally (prepare pulls it): {_explanation(exc)}",
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
                f"cannot start slot {launch.slot!r}: {_explanation(exc)}", slot=launch.slot
            ) from exc
        return self._observe(container, launch.slot)

    def _create_options(self, launch: LaunchSpec) -> dict[str, Any]:
        return create_options(
            launch,
            owner=self.owner,
            base_mounts=self.base_mounts,
            network_mode=self.network_mode,
            runtimes=self._engine_runtimes() if launch.device_kind == "gpu" else (),
        )

    def _engine_runtimes(self) -> tuple[str, ...]:
        if self._runtimes is None:
            info: Mapping[str, Any] = self._client().info()
            self._runtimes = tuple(str(name) for name in info.get("Runtimes") or {})
        return self._runtimes

    # ------------------------------------------------------------------ stopping

    def _stop_sync(self, slot: str, timeout: float) -> Observed:
        container = self._find(slot)
        if container is None:
            return Observed(slot=slot, status=RunStatus.MISSING)
        observed = self._observe(container, slot)
        if not observed.managed:
            return observed  # reported, never touched
        try:
            if observed.running:
                self._terminate(container, slot, timeout)
                container.reload()
                observed = self._observe(container, slot)
            container.remove(force=True)
        except docker.errors.NotFound:
            return Observed(slot=slot, status=RunStatus.MISSING, message="removed meanwhile")
        except docker.errors.APIError as exc:
            if "already in progress" not in _explanation(exc):
                raise
        return Observed(
            slot=slot,
            status=RunStatus.EXITED,
            ident=observed.ident,
            exit_code=observed.exit_code,
            started_at=observed.started_at,
            config_hash=observed.config_hash,
            endpoint=observed.endpoint,
            stack=observed.stack,
            message=f"{observed.message}; container removed",
        )

    def _terminate(self, container: Any, slot: str, timeout: float) -> None:
        """SIGTERM, SIGKILL after ``timeout`` s (the engine counts whole seconds), wait."""
        seconds = max(0, math.ceil(timeout))
        with contextlib.suppress(requests.ReadTimeout):
            container.stop(timeout=seconds)
        if self._wait_stopped(container, 0.0):
            return
        with contextlib.suppress(docker.errors.APIError):
            container.kill()
        if not self._wait_stopped(container, self.stop_grace_s):
            raise SlotTerminateTimeout(
                f"slot {slot!r}: container {container.id[:12]} still runs "
                f"{self.stop_grace_s}s after SIGKILL",
                slot=slot,
            )

    @staticmethod
    def _wait_stopped(container: Any, timeout: float) -> bool:
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
        raise _Unreachable(f"no socket at {path}")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(path)
    except OSError as exc:
        raise _Unreachable(f"{path}: {exc.strerror or exc}") from exc
