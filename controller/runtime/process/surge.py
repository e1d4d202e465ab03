"""The process runtime's surge capability: a slot's second server, promoted or stopped.

Beside :mod:`controller.runtime.process.runtime`, over the same
:class:`~controller.runtime.process.servers.ServerProcesses` (see :mod:`controller.runtime.surging`
for the protocol). The second server is spawned like the slot's own (its own session, the slot's
labels, the slot's log file: the old one keeps writing to the rotated one), labelled
``SLOTCTL_INSTANCE`` with a token of its own and recorded in ``surge.json`` beside the
slot's ``process.json``. A promotion moves the old record to ``retiring.json`` and the
second server's into ``process.json``; each write is atomic (the store) and the steps are
idempotent, so a controller killed between any two of them repeats the promotion after
its restart. Looks for the slot's own server by its labels pass over both of these.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
from typing import Any, Final

import psutil

from controller.runtime.base import LaunchSpec, Observed, RunStatus
from controller.runtime.ports import require_free_port
from controller.runtime.process.records import ProcessRecords
from controller.runtime.process.servers import ServerProcesses

__all__ = ["RETIRING_RECORD", "SURGE_RECORD", "ProcessSurge"]

SURGE_RECORD: Final = "surge.json"
RETIRING_RECORD: Final = "retiring.json"


class ProcessSurge:
    """A slot's second server on the process runtime."""

    def __init__(self, servers: ServerProcesses) -> None:
        self.servers = servers
        self.records = ProcessRecords(servers.store, SURGE_RECORD)
        self.retiring = ProcessRecords(servers.store, RETIRING_RECORD)
        servers.labelled.skip = self.instance_pids

    def instance_pids(self, slot: str) -> set[int]:
        """The pids of the slot's second server and of the one it is replacing."""
        pids = set()
        for records in (self.records, self.retiring):
            record = records.read(slot)
            if record is not None:
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    pids.add(int(record["pid"]))
        main = self.servers.records.read(slot)
        if main is not None:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                pids.discard(int(main["pid"]))  # promoted: it is the slot's own now
        return pids

    async def start_instance(self, launch: LaunchSpec) -> Observed:
        current = await self.inspect_instance(launch.slot)
        if current.running and current.config_hash == launch.config_hash():
            return current
        if current.status is not RunStatus.MISSING:
            await self.stop_instance(launch.slot, self.servers.kill_grace_s)
        require_free_port(launch)
        token = secrets.token_hex(6)
        return await asyncio.to_thread(self.servers.spawn, launch, self.records, token)

    async def inspect_instance(self, slot: str) -> Observed:
        record = self._usable(self.records, slot)
        if record is None:
            return Observed(slot=slot, status=RunStatus.MISSING)
        return self.servers.observe(slot, record)

    async def stop_instance(self, slot: str, timeout: float) -> None:
        record = self._usable(self.records, slot)
        main = self.servers.live_process(slot)
        keep = {main.pid} if main is not None else set()
        retiring = self._usable(self.retiring, slot)
        if retiring is not None:
            keep.add(int(retiring["pid"]))
        if record is not None and int(record["pid"]) not in keep:
            await self._end(slot, record, timeout)
        # A stray: spawned by a controller killed before its record was written.
        for proc in await asyncio.to_thread(self.servers.labelled.leaders, slot):
            if proc.pid not in keep:
                await self._kill(slot, proc, timeout)
        self.records.delete(slot)

    async def promote(self, slot: str) -> None:
        record = self._usable(self.records, slot)
        if record is None:
            return  # done already (or nothing to promote)
        main = self.servers.records.read(slot)
        if main is not None and main.get("pid") != record["pid"]:
            self.retiring.write(slot, dict(main))
        self.servers.records.write(slot, dict(record))
        self.records.delete(slot)

    async def stop_retiring(self, slot: str, timeout: float) -> bool:
        record = self._usable(self.retiring, slot)
        stopped = False
        if record is not None:
            main = self.servers.records.read(slot)
            if main is None or main.get("pid") != record["pid"]:
                await self._end(slot, record, timeout)
                stopped = True
        self.retiring.delete(slot)
        return stopped

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _usable(records: ProcessRecords, slot: str) -> dict[str, Any] | None:
        record = records.read(slot)
        if record is None:
            return None
        try:
            int(record["pid"])
            float(record.get("create_time", 0.0))
        except (KeyError, TypeError, ValueError):
            records.delete(slot)  # not a record of ours: nothing to act on
            return None
        return record

    async def _end(self, slot: str, record: dict[str, Any], timeout: float) -> None:
        proc = self.servers.verified(int(record["pid"]), float(record.get("create_time", 0.0)))
        if proc is not None:
            await self._kill(slot, proc, timeout)

    async def _kill(self, slot: str, proc: psutil.Process, timeout: float) -> None:
        """SIGTERM to its group, SIGKILL after ``timeout``; reaped."""
        self.servers.signal_group(proc, signal.SIGTERM)
        if not await self.servers.wait_gone(slot, proc, timeout):
            self.servers.signal_group(proc, signal.SIGKILL)
            await self.servers.wait_gone(slot, proc, self.servers.kill_grace_s)
