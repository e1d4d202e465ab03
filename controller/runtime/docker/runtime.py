"""The docker runtime: each slot's server is a container named ``slotctl-<slot>``.

Sits beside :mod:`controller.runtime.process.runtime` under the
:class:`~controller.runtime.base.Runtime` seam; the slot manager is its only caller. It turns a
provider's :class:`~controller.runtime.base.LaunchSpec` into a container through the docker SDK:

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
* **pulls** stream the engine's progress to a callback (the slot shows ``pulling``);
* **measures** a server's container (:class:`~controller.runtime.base.MeasuresContainers`):
  its memory cgroup's figure as ``docker stats`` computes it and its processes' host pids
  (``docker top``), from which the slot manager learns its footprint (issue 36).

What a container is (name, labels, create options, observation) lives in the pure
:mod:`~controller.runtime.docker.spec`; the blocking pull and log streams in
:mod:`~controller.runtime.docker.streams`. The engine's client, its typed failures and the container
primitives the surge shares are :mod:`~controller.runtime.docker.engine`'s. The SDK is
synchronous: every other call runs in a worker thread (``asyncio.to_thread``). Engine
failures become typed errors: :class:`~controller.model.errors.SlotSpawnFailed` from ``start``
and ``prepare``, :class:`DockerEngineError` (engine answered with an error) or
:class:`DockerUnavailable` (engine unreachable, naming its socket) from the rest.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import docker
import docker.errors
import requests

from controller.model.errors import (
    DockerEngineError,
    DockerUnavailable,
    SlotctlError,
    SlotSpawnFailed,
)
from controller.runtime.base import (
    MANAGED_LABEL,
    SLOT_LABEL,
    ContainerUsage,
    LaunchSpec,
    Mount,
    Observed,
    ProgressCallback,
    RunStatus,
    RuntimeKind,
)
from controller.runtime.docker.engine import DockerEngine, Unreachable, explanation
from controller.runtime.docker.spec import (
    CONTAINER_PREFIX,
    OWNER_LABEL,
    PORT_LABEL,
    container_name,
    device_options,
    labels_of,
    memory_in_use,
    pids_of,
    require_image,
)
from controller.runtime.docker.streams import follow_logs, pull_image
from controller.runtime.docker.surge import RETIRING_SUFFIX, SURGE_SUFFIX, DockerSurge

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
        self.docker = DockerEngine(
            client,
            base_url=base_url,
            base_mounts=base_mounts,
            network_mode=network_mode,
            stop_grace_s=stop_grace_s,
            api_timeout_s=api_timeout_s,
            owner=owner,
        )
        self.pull_timeout_s = pull_timeout_s
        self.surge = DockerSurge(self.docker)  # a slot's second container (surge rollouts)

    @property
    def engine(self) -> str:
        """Where the engine is, for messages (``unix:///var/run/docker.sock``...)."""
        return self.docker.where

    @property
    def owner(self) -> str | None:
        return self.docker.owner

    async def close(self) -> None:
        """Close the SDK client's connections (a later call opens new ones)."""
        await self.docker.close()

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        if not launch.image:
            return False  # start() says why a docker slot needs an image
        return await self.docker.call(
            "inspect image of", launch.slot, self._image_missing, launch.image
        )

    def _image_missing(self, image: str) -> bool:
        try:
            self.docker.client().images.get(image)
        except docker.errors.ImageNotFound:
            return True
        return False

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        image = require_image(launch)
        if not await self.docker.call("prepare", launch.slot, self._image_missing, image):
            return
        client = await self.docker.call("prepare", launch.slot, self.docker.client)
        await pull_image(
            client,
            launch.slot,
            image,
            timeout_s=self.pull_timeout_s,
            progress=progress,
            failed=lambda exc: self._pull_failed(launch.slot, image, exc),
        )

    def _pull_failed(self, slot: str, image: str, exc: BaseException) -> SlotctlError:
        if isinstance(exc, (requests.ConnectionError, ConnectionError, Unreachable)):
            reason = f"the Docker engine at {self.docker.where} is unreachable ({exc})"
        else:
            reason = explanation(exc)
        return SlotSpawnFailed(
            f"cannot pull {image} for slot {slot!r}: {reason}", slot=slot, image=image
        )

    async def start(self, launch: LaunchSpec) -> Observed:
        require_image(launch)
        async with self.docker.lock(launch.slot):
            return await self.docker.call("start", launch.slot, self._start_sync, launch)

    async def stop(self, slot: str, timeout: float) -> Observed:
        async with self.docker.lock(slot):
            return await self.docker.call("stop", slot, self._stop_sync, slot, timeout)

    async def inspect(self, slot: str) -> Observed:
        return await self.docker.call("inspect", slot, self._inspect_sync, slot)

    async def list_managed(self) -> list[Observed]:
        return await self.docker.call("list", None, self._list_sync)

    async def container_usage(self, slot: str) -> ContainerUsage | None:
        """The slot's running container's memory figure and host pids (see the module)."""
        return await self.docker.call("measure", slot, self._usage_sync, slot)

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        return await self.docker.call("read logs of", slot, self._logs_sync, slot, tail)

    def watch_log(self, slot: str, on_text: Callable[[str], None]) -> Callable[[], None] | None:
        """Follow the container's output from now on (the readiness probe's wake-up, see
        :class:`controller.probes.readiness.LogWatcher`): the engine's log stream is read on a
        daemon thread of its own, ``on_text`` is called on the event loop. Any failure just ends
        the watch (the probe keeps its schedule); returns the function that stops it."""

        def open_stream(since: float) -> Any:
            container = self.docker.find_owned(slot)
            if container is None:
                return None
            return container.logs(stdout=True, stderr=True, stream=True, follow=True, since=since)

        return follow_logs(slot, open_stream, on_text)

    def logs_from_start(self, slot: str) -> bool:
        """The engine's stream is followed from now on (see :meth:`watch_log`)."""
        return False

    def _inspect_sync(self, slot: str) -> Observed:
        container = self.docker.find(slot)
        if container is None:
            return Observed(slot=slot, status=RunStatus.MISSING)
        return self.docker.observe(container, slot)

    def _usage_sync(self, slot: str) -> ContainerUsage | None:
        container = self.docker.find_owned(slot)
        if container is None or container.status != "running":
            return None
        try:  # one sample now, not the two a CPU percentage waits for
            stats = container.stats(stream=False, one_shot=True)
        except docker.errors.InvalidVersion:  # an engine API older than 1.41
            stats = container.stats(stream=False)
        memory = memory_in_use(stats)
        if memory is None:
            return None
        return ContainerUsage(memory, pids_of(container.top()))

    def _list_sync(self) -> list[Observed]:
        wanted = [f"{MANAGED_LABEL}=true"]
        if self.docker.owner is not None:
            wanted.append(f"{OWNER_LABEL}={self.docker.owner}")
        containers = self.docker.client().containers.list(
            all=True, filters={"label": wanted}, ignore_removed=True
        )
        found: dict[str, Observed] = {}
        for container in containers:
            slot = labels_of(container.attrs).get(SLOT_LABEL)
            if not slot:
                continue
            own = container_name(slot)
            if container.name == own:
                found[slot] = self.docker.observe(container, slot)
            elif container.name in (own + SURGE_SUFFIX, own + RETIRING_SUFFIX):
                # A surge's second container alone (a rollout a restart interrupted, the
                # slot removed meanwhile): the slot is listed, its own server missing, so
                # the orphan reaper (Rollouts.stop_orphaned) finds and stops it.
                found.setdefault(slot, Observed(slot=slot, status=RunStatus.MISSING))
        return sorted(found.values(), key=lambda o: o.slot)

    def _logs_sync(self, slot: str, tail: int) -> list[str]:
        container = self.docker.find_owned(slot)
        if container is None:
            return []
        raw = container.logs(stdout=True, stderr=True, tail=tail if tail > 0 else "all")
        return bytes(raw).decode(errors="replace").splitlines()

    def _start_sync(self, launch: LaunchSpec) -> Observed:
        for _attempt in range(3):
            existing = self.docker.find(launch.slot)
            if existing is not None:
                adopted = self._adopt_or_clear(existing, launch)
                if adopted is not None:
                    return adopted
            try:
                return self.docker.create_and_start(launch)
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
        observed = self.docker.observe(container, launch.slot)
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

    def _stop_sync(self, slot: str, timeout: float) -> Observed:
        container = self.docker.find(slot)
        if container is None:
            return Observed(slot=slot, status=RunStatus.MISSING)
        observed = self.docker.observe(container, slot)
        if not observed.managed:
            return observed  # reported, never touched
        try:
            if observed.running:
                self.docker.terminate(container, slot, timeout)
                container.reload()
                observed = self.docker.observe(container, slot)
            container.remove(force=True)
        except docker.errors.NotFound:
            return Observed(slot=slot, status=RunStatus.MISSING, message="removed meanwhile")
        except docker.errors.APIError as exc:
            if "already in progress" not in explanation(exc):
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
