"""The docker runtime's surge capability: a slot's second container, renamed into place.

Beside :mod:`controller.runtime.docker.runtime`, over the same engine
(:mod:`controller.runtime.docker.engine`) (the protocol: :mod:`controller.runtime.surging`).
The second container is created like the slot's own (its labels, its mounts, its new
port) under the name ``slotctl-<slot>-surge``; a promotion renames the slot's container to
``slotctl-<slot>-retiring`` and the second one to ``slotctl-<slot>``. The engine keeps the
names, so a controller killed between two steps finds where it stopped and each step is
idempotent. Only containers with this controller's labels for the slot are touched.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

import docker.errors

from controller.model.errors import SlotSpawnFailed
from controller.runtime.base import LaunchSpec, Observed, RunStatus
from controller.runtime.docker.engine import DockerEngine
from controller.runtime.docker.spec import container_name, labels_of, observe, owned

__all__ = ["RETIRING_SUFFIX", "SURGE_SUFFIX", "DockerSurge"]

SURGE_SUFFIX: Final = "-surge"
RETIRING_SUFFIX: Final = "-retiring"


class DockerSurge:
    """A slot's second container on the docker runtime."""

    def __init__(self, engine: DockerEngine) -> None:
        self.docker = engine

    async def start_instance(self, launch: LaunchSpec) -> Observed:
        async with self.docker.lock(launch.slot):
            return await self.docker.call("start", launch.slot, self._start_sync, launch)

    async def inspect_instance(self, slot: str) -> Observed:
        return await self.docker.call("inspect", slot, self._inspect_sync, slot, SURGE_SUFFIX)

    async def stop_instance(self, slot: str, timeout: float) -> None:
        async with self.docker.lock(slot):
            await self.docker.call("stop", slot, self._remove_sync, slot, SURGE_SUFFIX, timeout)

    async def promote(self, slot: str) -> None:
        async with self.docker.lock(slot):
            await self.docker.call("promote", slot, self._promote_sync, slot)

    async def stop_retiring(self, slot: str, timeout: float) -> bool:
        async with self.docker.lock(slot):
            return await self.docker.call(
                "stop", slot, self._remove_sync, slot, RETIRING_SUFFIX, timeout
            )

    # ------------------------------------------------------------------ worker threads

    def _get(self, slot: str, suffix: str = "") -> Any:
        """Our container of ``slot`` under that name, or None (absent, or not ours)."""
        try:
            container = self.docker.client().containers.get(container_name(slot) + suffix)
        except docker.errors.NotFound:
            return None
        return container if owned(labels_of(container.attrs), slot, self.docker.owner) else None

    def _inspect_sync(self, slot: str, suffix: str) -> Observed:
        container = self._get(slot, suffix)
        if container is None:
            return Observed(slot=slot, status=RunStatus.MISSING)
        return observe(container.attrs, slot, self.docker.owner)

    def _start_sync(self, launch: LaunchSpec) -> Observed:
        name = container_name(launch.slot) + SURGE_SUFFIX
        existing = self._get(launch.slot, SURGE_SUFFIX)
        if existing is not None:
            observed = observe(existing.attrs, launch.slot, self.docker.owner)
            if observed.running and observed.config_hash == launch.config_hash():
                return observed
            with contextlib.suppress(docker.errors.NotFound):
                existing.remove(force=True)
        try:
            return self.docker.create_and_start(launch, name=name)
        except docker.errors.APIError as exc:
            if exc.status_code == 409:  # the name is held by a container that is not ours
                raise SlotSpawnFailed(
                    f"cannot surge slot {launch.slot!r}: the name {name} is taken",
                    slot=launch.slot,
                ) from exc
            raise

    def _remove_sync(self, slot: str, suffix: str, timeout: float) -> bool:
        """Remove our container of ``slot`` under that name; True: there was one."""
        container = self._get(slot, suffix)
        if container is None:
            return False
        with contextlib.suppress(docker.errors.NotFound):
            container.reload()
            if container.attrs["State"]["Running"]:
                self.docker.terminate(container, slot, timeout)
            container.remove(force=True)
        return True

    def _promote_sync(self, slot: str) -> None:
        surge = self._get(slot, SURGE_SUFFIX)
        if surge is None:
            return  # promoted already (or nothing to promote)
        main = self._get(slot)
        if main is not None and main.id != surge.id:
            stale = self._get(slot, RETIRING_SUFFIX)
            if stale is not None:  # an older rollout's, never stopped: it goes first
                self._remove_sync(slot, RETIRING_SUFFIX, 0.0)
            main.rename(container_name(slot) + RETIRING_SUFFIX)
        surge.rename(container_name(slot))
