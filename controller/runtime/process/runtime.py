"""The process runtime (the default): each slot's server is a child process.

The server runs in its own session/process group (so a stop reaches every process it
spawned), from an argv list (never a shell), with stdout/stderr in a per-slot log file
under the state dir (rotated at each start and capped in size). Each start records
``pid`` + the process start time in ``slots/<name>/process.json`` (through the store), so a
restarted controller **adopts** a live server instead of starting a duplicate, and a
recycled pid (same number, different start time) is never mistaken for ours.

The spawning, records, signals and logs are :mod:`controller.runtime.process.servers`'s
(shared with the surge capability, :mod:`controller.runtime.process.surge`).

Processes are also *labelled* through their environment (``SLOTCTL_MANAGED``,
``SLOTCTL_SLOT``, ``SLOTCTL_OWNER``...), the process analogue of container labels: a
server whose record was lost (controller killed between spawn and record) is still found
and adopted (:mod:`controller.runtime.process.labels` finds them: /proc is read in full
at the first need and at each resync, and the servers the runtime spawns are remembered,
so a start is not a scan of every process). Nothing without our labels is ever signalled.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from controller.model.errors import SlotSpawnFailed, SlotTerminateTimeout, StateWriteFailed
from controller.runtime.base import (
    LaunchSpec,
    Observed,
    ProgressCallback,
    RunStatus,
    RuntimeKind,
)
from controller.runtime.logwatch import follow
from controller.runtime.ports import require_free_port
from controller.runtime.process.labels import LabelledServers
from controller.runtime.process.records import ProcessRecords
from controller.runtime.process.servers import ServerProcesses
from controller.runtime.process.surge import ProcessSurge
from controller.store.state import StateStore

__all__ = ["ProcessRuntime"]

log = logging.getLogger("slotctl.runtime")


class ProcessRuntime:
    """Runtime for servers started as local child processes."""

    kind = RuntimeKind.PROCESS

    def __init__(
        self,
        state_dir: Path,
        *,
        log_max_bytes: int = 20 * 1024 * 1024,
        log_backups: int = 3,
        kill_grace_s: float = 5.0,
    ) -> None:
        self.servers = ServerProcesses(
            state_dir,
            log_max_bytes=log_max_bytes,
            log_backups=log_backups,
            kill_grace_s=kill_grace_s,
        )
        self.surge = ProcessSurge(self.servers)  # a second server of a slot (surge rollouts)

    @property
    def store(self) -> StateStore:
        return self.servers.store

    @property
    def owner(self) -> str:
        """Who the servers belong to: the state dir's resolved path (their label)."""
        return self.servers.owner

    @property
    def labelled(self) -> LabelledServers:
        return self.servers.labelled

    @property
    def records(self) -> ProcessRecords:
        return self.servers.records

    def log_path(self, slot: str) -> Path:
        return self.servers.log_path(slot)

    # ------------------------------------------------------------------ protocol

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        return False  # model files are the manager's concern; no image to pull

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        return None

    async def start(self, launch: LaunchSpec) -> Observed:
        current = await self.inspect(launch.slot)
        if current.running:
            if current.config_hash == launch.config_hash():
                return current  # adopt: never a duplicate
            raise SlotSpawnFailed(
                f"slot {launch.slot!r} already runs a server (pid {current.ident}) with another "
                f"config ({current.config_hash} != {launch.config_hash()}); stop it first",
                slot=launch.slot,
            )
        if current.status is RunStatus.EXITED:
            self.servers.forget(launch.slot)
        require_free_port(launch)
        return await asyncio.to_thread(self.servers.spawn, launch)

    async def stop(self, slot: str, timeout: float) -> Observed:
        proc = self.servers.live_process(slot)
        if proc is None:
            observed = await self.inspect(slot)
            self.servers.forget(slot)
            return observed
        self.servers.signal_group(proc, signal.SIGTERM)
        if not await self.servers.wait_gone(slot, proc, timeout):
            self.servers.signal_group(proc, signal.SIGKILL)
            if not await self.servers.wait_gone(slot, proc, self.servers.kill_grace_s):
                raise SlotTerminateTimeout(
                    f"slot {slot!r}: pid {proc.pid} survived SIGKILL for "
                    f"{self.servers.kill_grace_s}s",
                    slot=slot,
                )
        observed = await self.inspect(slot)
        self.servers.forget(slot)
        return observed

    async def inspect(self, slot: str) -> Observed:
        record = self.servers.record(slot)
        observed = self.servers.observe(slot, record) if record is not None else None
        if observed is None or not observed.running:
            # No record, or the recorded server is gone: a live server may still carry
            # the slot's labels (a controller killed between a spawn and its record).
            # Once /proc has been read, a look checks the few candidates: on the loop.
            find = self.servers.labelled.find
            found = (
                find(slot) if self.servers.labelled.scanned else await asyncio.to_thread(find, slot)
            )
            if found is None:
                return observed or Observed(slot=slot, status=RunStatus.MISSING)
            record = self.servers.record_from_labels(slot, found)
            try:
                self.servers.records.write(slot, record)
            except StateWriteFailed as exc:  # disk full: observing must still work
                log.warning("slot %s: cannot re-record its server: %s", slot, exc.message)
            observed = self.servers.observe(slot, record)
        self.servers.cap_log(slot)
        return observed

    async def list_managed(self) -> list[Observed]:
        names = set(await asyncio.to_thread(self.servers.labelled.scan_all))
        names.update(n for n in self.servers.store.names() if self.servers.record(n))
        return [await self.inspect(name) for name in sorted(names)]

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        return await asyncio.to_thread(self.servers.tail, slot, tail)

    async def close(self) -> None:
        """Nothing to release: servers are processes of their own (they keep running)."""

    def watch_log(self, slot: str, on_text: Callable[[str], None]) -> Callable[[], None] | None:
        """Follow the slot's log file (the readiness probe's wake-up, see
        :class:`controller.probes.readiness.LogWatcher`): a server this runtime started from its
        first line on, an adopted one from now on; None when it cannot be followed."""
        return follow(self.servers.log_path(slot), on_text, offset=self.servers.output_at.get(slot))

    def logs_from_start(self, slot: str) -> bool:
        """Whether :meth:`watch_log` reports the slot's server output from its first line
        (a server this runtime started: its log began at the spawn)."""
        return slot in self.servers.output_at
