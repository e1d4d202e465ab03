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

The SDK is synchronous: every call runs in a worker thread (``asyncio.to_thread``), except
the iteration of a pull's progress stream, which runs in a daemon thread of its own so a
stalled registry can neither exhaust the shared pool nor hold up interpreter exit. Engine
failures become typed errors: :class:`~controller.errors.SlotSpawnFailed` from ``start``
and ``prepare``, :class:`DockerEngineError` (engine answered with an error) or
:class:`DockerUnavailable` (engine unreachable, naming its socket) from the rest.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import inspect as pyinspect
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final, TypeVar

import docker
import docker.errors
import docker.types
import requests

from controller.errors import (
    DockerEngineError,
    DockerUnavailable,
    SlotctlError,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)
from controller.runtime.base import (
    HASH_LABEL,
    MANAGED_LABEL,
    SLOT_LABEL,
    STACK_LABEL,
    LaunchSpec,
    Mount,
    Observed,
    ProgressCallback,
    RunStatus,
)
from controller.runtime.process import port_holder

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

CONTAINER_PREFIX: Final = "slotctl-"
PORT_LABEL: Final = "slotctl.port"
# The controller (its resolved state dir) that created a container: two controllers on
# one engine never adopt, stop or reap each other's containers.
OWNER_LABEL: Final = "slotctl.owner"
DEFAULT_SOCKET: Final = "unix:///var/run/docker.sock"
AMD_DEVICES: Final = ("/dev/kfd", "/dev/dri")
NPU_DEVICES: Final = ("/dev/accel",)
_WAIT_POLL_S: Final = 0.05
_NEVER_STARTED: Final = "0001-01-01T00:00:00Z"

T = TypeVar("T")


class _Unreachable(Exception):
    """Internal: the engine did not answer (translated per operation)."""


def container_name(slot: str) -> str:
    return f"{CONTAINER_PREFIX}{slot}"


def device_options(
    device: str, runtimes: Sequence[str], exists: Callable[[str], bool] = os.path.exists
) -> dict[str, Any]:
    """Container create options giving a ``device`` slot its accelerator (pure).

    ``gpu``: every GPU as a device request when the engine has the NVIDIA runtime, else
    the AMD device nodes when the host has them; ``npu``: ``/dev/accel``; ``cpu``: none.
    Raises :class:`SlotSpawnFailed` when the host cannot provide what was asked for.
    """
    if device == "cpu":
        return {}
    if device == "gpu":
        if "nvidia" in runtimes:
            request = docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
            return {"device_requests": [request]}
        if all(exists(path) for path in AMD_DEVICES):
            return {"devices": [f"{path}:{path}:rwm" for path in AMD_DEVICES]}
        raise SlotSpawnFailed(
            "device 'gpu' requested, but the Docker engine has no 'nvidia' runtime and the "
            f"host has no {' + '.join(AMD_DEVICES)} (AMD); refusing to run on the CPU",
            device=device,
        )
    if device == "npu":
        if all(exists(path) for path in NPU_DEVICES):
            return {"devices": [f"{path}:{path}:rwm" for path in NPU_DEVICES]}
        raise SlotSpawnFailed(
            f"device 'npu' requested, but the host has no {' + '.join(NPU_DEVICES)}",
            device=device,
        )
    raise SlotSpawnFailed(f"unknown device {device!r}", device=device)


def _parse_started_at(value: str | None) -> float | None:
    """``State.StartedAt`` (RFC 3339, nanoseconds) as epoch seconds; None if never."""
    if not value or value == _NEVER_STARTED:
        return None
    text = value.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    main, sep, rest = text.partition(".")
    if sep:  # trim nanoseconds to the microseconds fromisoformat accepts
        digits = "".join(ch for ch in rest if ch.isdigit())
        zone = rest[len(digits) :]
        text = f"{main}.{digits[:6].ljust(6, '0')}{zone}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _owned(labels: Mapping[str, str], slot: str, owner: str | None) -> bool:
    """Ours: slotctl's labels for this slot and, when the runtime has an owner, that owner."""
    if labels.get(MANAGED_LABEL) != "true" or labels.get(SLOT_LABEL) != slot:
        return False
    return owner is None or labels.get(OWNER_LABEL) == owner


def _explanation(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text).strip()


def _covered(path: str, mounts: Sequence[Mount]) -> bool:
    """Is ``path`` already visible in the container (mounted at, or under, an identity bind)?"""
    wanted = Path(path)
    for mount in mounts:
        target = Path(mount.target)
        if wanted == target or (target in wanted.parents and Path(mount.source) == target):
            return True
    return False


class DockerRuntime:
    """Runtime for servers run as containers on a Docker engine (see module docstring)."""

    kind = "docker"

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
        image = self._require_image(launch)
        if not await self._call("prepare", launch.slot, self._image_missing, image):
            return
        await self._pull(launch.slot, image, progress)

    async def start(self, launch: LaunchSpec) -> Observed:
        self._require_image(launch)
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
        loop = asyncio.get_running_loop()
        stopped = threading.Event()
        streams: list[Any] = []
        since = time.time()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def deliver(text: str) -> None:
            if not stopped.is_set():
                on_text(text)

        def pump() -> None:
            try:
                container = self._find(slot)
                labels = (container.attrs.get("Config") or {}).get("Labels") if container else {}
                if container is None or not _owned(labels or {}, slot, self.owner):
                    return
                streams.append(
                    container.logs(stdout=True, stderr=True, stream=True, follow=True, since=since)
                )
                for chunk in streams[0]:
                    if stopped.is_set():
                        return
                    with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                        loop.call_soon_threadsafe(deliver, decoder.decode(bytes(chunk)))
            except Exception as exc:  # noqa: BLE001 - logged; the probe keeps its schedule
                if not stopped.is_set():
                    log.debug("log watch of slot %s ended: %s", slot, exc)
            finally:
                _close_streams(streams)

        threading.Thread(target=pump, name=f"slotctl-logs-{slot}", daemon=True).start()

        def stop() -> None:
            stopped.set()
            _close_streams(streams)

        return stop

    # ------------------------------------------------------------------ observing

    def _observe(self, container: Any, slot: str) -> Observed:
        attrs: Mapping[str, Any] = container.attrs
        labels: Mapping[str, str] = (attrs.get("Config") or {}).get("Labels") or {}
        state: Mapping[str, Any] = attrs.get("State") or {}
        ident = str(attrs.get("Id") or container.id)
        running = bool(state.get("Running"))
        status = RunStatus.RUNNING if running else RunStatus.EXITED
        started_at = _parse_started_at(state.get("StartedAt"))
        exit_code = None if running or started_at is None else int(state.get("ExitCode", 0))
        if not _owned(labels, slot, self.owner):
            return Observed(
                slot=slot,
                status=status,
                ident=ident,
                exit_code=exit_code,
                started_at=started_at,
                managed=False,
                message=(
                    f"container {container_name(slot)} ({ident[:12]}) is not managed by "
                    f"this controller (no {MANAGED_LABEL}=true / {SLOT_LABEL}={slot}"
                    + (f" / {OWNER_LABEL}={self.owner}" if self.owner else "")
                    + " labels): it is left untouched; remove or rename it to free the "
                    "slot's name"
                ),
            )
        port = labels.get(PORT_LABEL, "")
        return Observed(
            slot=slot,
            status=status,
            ident=ident,
            exit_code=exit_code,
            started_at=started_at,
            config_hash=labels.get(HASH_LABEL),
            endpoint=f"http://127.0.0.1:{port}" if port.isdigit() else None,
            stack=labels.get(STACK_LABEL),
            message=_state_text(state, started_at, exit_code),
        )

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
        found = []
        for container in containers:
            labels = (container.attrs.get("Config") or {}).get("Labels") or {}
            slot = labels.get(SLOT_LABEL)
            if slot and container.name == container_name(slot):
                found.append(self._observe(container, slot))
        return sorted(found, key=lambda o: o.slot)

    def _logs_sync(self, slot: str, tail: int) -> list[str]:
        container = self._find(slot)
        if container is None:
            return []
        labels = (container.attrs.get("Config") or {}).get("Labels") or {}
        if not _owned(labels, slot, self.owner):
            return []
        raw = container.logs(stdout=True, stderr=True, tail=tail if tail > 0 else "all")
        return bytes(raw).decode(errors="replace").splitlines()

    # ------------------------------------------------------------------ starting

    @staticmethod
    def _require_image(launch: LaunchSpec) -> str:
        if not launch.image:
            raise SlotSpawnFailed(
                f"slot {launch.slot!r} (provider {launch.provider}) has no container image: "
                "the docker runtime needs server.image",
                slot=launch.slot,
            )
        return launch.image

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

    def _create_and_start(self, launch: LaunchSpec) -> Observed:
        if self.network_mode == "host" and self._local_engine:
            holder = port_holder(launch.host, launch.port)
            if holder is not None:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: port {launch.port} is in use by {holder}",
                    slot=launch.slot,
                    port=launch.port,
                    holder=holder,
                )
        client = self._client()
        try:
            container = client.containers.create(**self._create_options(launch))
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
        labels = {**launch.labels(), PORT_LABEL: str(launch.port)}
        if self.owner is not None:
            labels[OWNER_LABEL] = self.owner
        options: dict[str, Any] = {
            "image": launch.image,
            "command": list(launch.argv),
            "name": container_name(launch.slot),
            "labels": labels,
            "environment": dict(launch.env),
            "mounts": [
                docker.types.Mount(m.target, m.source, type="bind", read_only=m.read_only)
                for m in self._mounts(launch)
            ],
            "init": True,
            "restart_policy": {"Name": "no"},
            "detach": True,
        }
        if self.network_mode == "host":
            options["network_mode"] = "host"
        else:
            options["network_mode"] = self.network_mode
            options["ports"] = {f"{launch.port}/tcp": ("127.0.0.1", launch.port)}
        runtimes = self._engine_runtimes() if launch.device == "gpu" else ()
        options.update(device_options(launch.device, runtimes))
        return options

    def _mounts(self, launch: LaunchSpec) -> list[Mount]:
        """The LaunchSpec's mounts, then base mounts and the model file (one per target)."""
        mounts: list[Mount] = []
        for mount in (*launch.mounts, *self.base_mounts):
            if all(m.target != mount.target for m in mounts):
                mounts.append(mount)
        if launch.model_path and not _covered(launch.model_path, mounts):
            mounts.append(Mount(launch.model_path, launch.model_path, read_only=True))
        return mounts

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

    # ------------------------------------------------------------------ pulling

    async def _pull(self, slot: str, image: str, progress: ProgressCallback | None) -> None:
        """Pull ``image``, reporting aggregate progress; raises SlotSpawnFailed on failure."""
        client = await self._call("prepare", slot, self._client)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(kind: str, value: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        def pump() -> None:
            try:
                for event in _pull_stream(client, image):
                    if cancelled.is_set():
                        return
                    emit("event", event)
                emit("done", None)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                emit("error", exc)

        threading.Thread(target=pump, name=f"slotctl-pull-{slot}", daemon=True).start()
        layers: dict[str, tuple[int, int]] = {}
        deadline = loop.time() + self.pull_timeout_s
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise SlotSpawnFailed(
                        f"cannot pull {image} for slot {slot!r}: no result within "
                        f"{self.pull_timeout_s:g}s",
                        slot=slot,
                        image=image,
                    )
                try:
                    kind, value = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    continue
                if kind == "done":
                    return
                if kind == "error":
                    raise self._pull_failed(slot, image, value)
                await self._report(slot, image, value, layers, progress)
        finally:
            cancelled.set()

    def _pull_failed(self, slot: str, image: str, exc: BaseException) -> SlotctlError:
        if isinstance(exc, SlotctlError):
            return exc
        if isinstance(exc, (requests.ConnectionError, ConnectionError, _Unreachable)):
            reason = f"the Docker engine at {self.engine} is unreachable ({exc})"
        else:
            reason = _explanation(exc)
        return SlotSpawnFailed(
            f"cannot pull {image} for slot {slot!r}: {reason}", slot=slot, image=image
        )

    @staticmethod
    async def _report(
        slot: str,
        image: str,
        event: Mapping[str, Any],
        layers: dict[str, tuple[int, int]],
        progress: ProgressCallback | None,
    ) -> None:
        if "error" in event:
            detail = event.get("errorDetail") or {}
            raise SlotSpawnFailed(
                f"cannot pull {image} for slot {slot!r}: {detail.get('message') or event['error']}",
                slot=slot,
                image=image,
            )
        layer = str(event.get("id") or "")
        detail = event.get("progressDetail") or {}
        if layer and detail.get("total"):
            layers[layer] = (int(detail.get("current") or 0), int(detail["total"]))
        if progress is None:
            return
        current = sum(c for c, _ in layers.values())
        total = sum(t for _, t in layers.values())
        result = progress(
            {
                "slot": slot,
                "image": image,
                "status": str(event.get("status") or ""),
                "layer": layer or None,
                "current": current,
                "total": total or None,
            }
        )
        if pyinspect.isawaitable(result):
            await result


def _pull_stream(client: Any, image: str) -> Iterator[Mapping[str, Any]]:
    """The engine's decoded pull events (blocking; a worker/daemon thread only)."""
    stream: Iterator[Mapping[str, Any]] = client.api.pull(image, stream=True, decode=True)
    yield from stream


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


def _state_text(state: Mapping[str, Any], started_at: float | None, code: int | None) -> str:
    if state.get("Running"):
        return "paused" if state.get("Paused") else "running"
    if started_at is None:
        return "created, never started"
    text = f"exited with code {code}"
    if state.get("OOMKilled"):
        text += " (killed: out of memory)"
    elif code == 137:
        text += " (killed by SIGKILL)"
    if state.get("Error"):
        text += f": {state['Error']}"
    return text


def _close_streams(streams: list[Any]) -> None:
    """Close followed log streams (from any thread: it unblocks their reader)."""
    for stream in streams:
        with contextlib.suppress(OSError, AttributeError):
            stream.close()
