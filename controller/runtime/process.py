"""The process runtime (the default): each slot's server is a child process.

The server runs in its own session/process group (so a stop reaches every process it
spawned), from an argv list (never a shell), with stdout/stderr in a per-slot log file
under the state dir (rotated at each start and capped in size). Each start records
``pid`` + the process start time in ``slots/<name>/process.json`` (through the store), so a
restarted controller **adopts** a live server instead of starting a duplicate, and a
recycled pid (same number, different start time) is never mistaken for ours.

Processes are also *labelled* through their environment (``SLOTCTL_MANAGED``,
``SLOTCTL_SLOT``, ``SLOTCTL_OWNER``...), the process analogue of container labels: a
server whose record was lost (controller killed between spawn and record) is still found
and adopted (:mod:`controller.runtime.process_labels` finds them: /proc is read in full
at the first need and at each resync, and the servers the runtime spawns are remembered,
so a start is not a scan of every process). Nothing without our labels is ever signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Final

import psutil

from controller.devices import VISIBILITY_ENV_VARS
from controller.errors import SlotSpawnFailed, SlotTerminateTimeout, StateWriteFailed
from controller.runtime.base import (
    LaunchSpec,
    Observed,
    ProgressCallback,
    RunStatus,
    RuntimeKind,
    visibility_env,
)
from controller.runtime.logwatch import follow
from controller.runtime.ports import require_free_port
from controller.runtime.process_labels import (
    ENV_HASH,
    ENV_INSTANCE,
    ENV_MANAGED,
    ENV_OWNER,
    ENV_PORT,
    ENV_SLOT,
    ENV_STACK,
    LabelledServers,
    await_exec,
    is_zombie,
)
from controller.runtime.process_records import RECORD, ProcessRecords
from controller.runtime.process_surge import ProcessSurge
from controller.store import StateStore

__all__ = ["LOG", "RECORD", "ProcessRecords", "ProcessRuntime"]

log = logging.getLogger("slotctl.runtime")

LOG: Final = "server.log"
# Never leak the controller's secrets into a model server's environment.
# Device visibility is the controller's too: one inherited from its own environment (a
# CUDA_VISIBLE_DEVICES the user started it with; HIP also honours CUDA_VISIBLE_DEVICES and
# GPU_DEVICE_ORDINAL) would hide the GPUs a server was placed on.
_SCRUBBED_ENV: Final = frozenset({"SLOTCTL_TOKEN", *VISIBILITY_ENV_VARS, "CUDA_DEVICE_ORDER"})
_POLL_S: Final = 0.02
# Children of this controller process, by pid. Process-wide (not per runtime object): a
# child belongs to the OS process, and whoever observes its exit must reap it through its
# Popen so no zombie or "still running" Popen is left behind.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_CTIME_TOLERANCE_S: Final = 0.05


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
        self.store = StateStore(state_dir)
        self.owner = str(Path(state_dir).resolve())
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.kill_grace_s = kill_grace_s
        self.labelled = LabelledServers(self.owner)  # servers found by their labels
        self.records = ProcessRecords(self.store)
        self.surge = ProcessSurge(self)  # a second server of a slot (surge rollouts)
        # Where the output of each server this runtime started begins in its log (after
        # the runtime's own header line): the probe's log wake reads from there.
        self._output_at: dict[str, int] = {}

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
            self._forget(launch.slot)
        require_free_port(launch)
        return await asyncio.to_thread(self._spawn, launch)

    async def stop(self, slot: str, timeout: float) -> Observed:
        proc = self._live_process(slot)
        if proc is None:
            observed = await self.inspect(slot)
            self._forget(slot)
            return observed
        self._signal_group(proc, signal.SIGTERM)
        if not await self._wait_gone(slot, proc, timeout):
            self._signal_group(proc, signal.SIGKILL)
            if not await self._wait_gone(slot, proc, self.kill_grace_s):
                raise SlotTerminateTimeout(
                    f"slot {slot!r}: pid {proc.pid} survived SIGKILL for {self.kill_grace_s}s",
                    slot=slot,
                )
        observed = await self.inspect(slot)
        self._forget(slot)
        return observed

    async def inspect(self, slot: str) -> Observed:
        record = self._record(slot)
        observed = self._observe(slot, record) if record is not None else None
        if observed is None or not observed.running:
            # No record, or the recorded server is gone: a live server may still carry
            # the slot's labels (a controller killed between a spawn and its record).
            # Once /proc has been read, a look checks the few candidates: on the loop.
            find = self.labelled.find
            found = find(slot) if self.labelled.scanned else await asyncio.to_thread(find, slot)
            if found is None:
                return observed or Observed(slot=slot, status=RunStatus.MISSING)
            record = self._record_from_labels(slot, found)
            try:
                self.records.write(slot, record)
            except StateWriteFailed as exc:  # disk full: observing must still work
                log.warning("slot %s: cannot re-record its server: %s", slot, exc.message)
            observed = self._observe(slot, record)
        self._cap_log(slot)
        return observed

    async def list_managed(self) -> list[Observed]:
        names = set(await asyncio.to_thread(self.labelled.scan_all))
        names.update(n for n in self.store.names() if self._record(n))
        return [await self.inspect(name) for name in sorted(names)]

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        return await asyncio.to_thread(self._tail, slot, tail)

    async def close(self) -> None:
        """Nothing to release: servers are processes of their own (they keep running)."""

    def watch_log(self, slot: str, on_text: Callable[[str], None]) -> Callable[[], None] | None:
        """Follow the slot's log file (the readiness probe's wake-up, see
        :class:`controller.probe.LogWatcher`): a server this runtime started from its
        first line on, an adopted one from now on; None when it cannot be followed."""
        return follow(self.log_path(slot), on_text, offset=self._output_at.get(slot))

    def logs_from_start(self, slot: str) -> bool:
        """Whether :meth:`watch_log` reports the slot's server output from its first line
        (a server this runtime started: its log began at the spawn)."""
        return slot in self._output_at

    def _record(self, slot: str) -> dict[str, Any] | None:
        """The slot's process record, or None when absent or not a usable record (a
        hand-edited or foreign file is treated as lost: the labels still find the server)."""
        record = self.records.read(slot)
        if record is None:
            return None
        try:
            int(record["pid"])
            float(record.get("create_time", 0.0))
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring unusable process record of slot %s: %r", slot, record)
            return None
        return record

    # ------------------------------------------------------------------ spawning

    def log_path(self, slot: str) -> Path:
        return self.store.slot_dir(slot) / LOG

    def _env(self, launch: LaunchSpec, instance: str = "") -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        env.update(launch.env)
        env.update(visibility_env(launch.visible))  # exactly the GPUs it was placed on
        env.update(
            {
                ENV_MANAGED: "true",
                ENV_SLOT: launch.slot,
                ENV_STACK: launch.stack,
                ENV_HASH: launch.config_hash(),
                ENV_OWNER: self.owner,
                ENV_PORT: str(launch.port),
            }
        )
        if instance:  # a surge's second server (controller.runtime.process_surge)
            env[ENV_INSTANCE] = instance
        return env

    def _spawn(
        self, launch: LaunchSpec, records: ProcessRecords | None = None, instance: str = ""
    ) -> Observed:
        """Start ``launch``'s server and record it (in ``records``: the slot's own record,
        or a surge's second server's, labelled ``instance``)."""
        records = records if records is not None else self.records
        log_path = self.log_path(launch.slot)
        log: IO[bytes] | None = None
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._rotate(log_path)
            log = log_path.open("ab")
            log.write(f"--- slotctl: starting {' '.join(launch.run_argv)}\n".encode())
            log.flush()
            output_at = log.tell()
        except OSError as exc:  # disk full or read-only: typed, nothing started
            if log is not None:
                with contextlib.suppress(OSError):
                    log.close()
            raise StateWriteFailed(str(log_path), exc) from exc
        with log:
            try:
                popen = subprocess.Popen(
                    list(launch.run_argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env(launch, instance),
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: {launch.argv[0]}: {exc.strerror or exc}",
                    slot=launch.slot,
                    argv=list(launch.argv),
                ) from exc
        _CHILDREN[popen.pid] = popen
        if not await_exec(popen.pid) and popen.poll() is None:  # labels readable first
            logging.getLogger("slotctl.runtime").warning(
                "slot %s: pid %d shows no labels yet", launch.slot, popen.pid
            )
        self._output_at[launch.slot] = output_at
        self.labelled.remember(launch.slot, popen.pid)
        try:
            create_time = psutil.Process(popen.pid).create_time()
        except psutil.NoSuchProcess:
            create_time = time.time()
        record: dict[str, Any] = {
            "pid": popen.pid,
            "create_time": create_time,
            "started_at": time.time(),
            "argv": list(launch.run_argv),
            "config_hash": launch.config_hash(),
            "endpoint": launch.endpoint,
            "port": launch.port,
            "stack": launch.stack,
        }
        if instance:
            record["instance"] = instance
        try:
            records.write(launch.slot, record)
        except StateWriteFailed:
            # No record, no server: one that runs unrecorded (disk full) would outlive us.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)  # its own session: pgid == pid
            popen.wait()
            _CHILDREN.pop(popen.pid, None)
            raise
        return self._observe(launch.slot, record)

    # ------------------------------------------------------------------ observing

    def _observe(self, slot: str, record: Mapping[str, Any]) -> Observed:
        pid = int(record["pid"])
        running = Observed(
            slot=slot,
            status=RunStatus.RUNNING,
            ident=str(pid),
            started_at=record.get("started_at"),
            config_hash=record.get("config_hash"),
            endpoint=record.get("endpoint"),
            stack=record.get("stack"),
        )
        popen = _CHILDREN.get(pid)
        if popen is not None:
            code = popen.poll()
            return running if code is None else _exited(running, code)
        proc = self._verified(pid, float(record.get("create_time", 0.0)))
        if proc is None:
            return _exited(running, None)
        if is_zombie(proc):
            return _exited(running, _reap(pid))
        return running

    @staticmethod
    def _verified(pid: int, create_time: float) -> psutil.Process | None:
        """The process with this pid *and* start time, or None (gone or pid recycled)."""
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - create_time) > _CTIME_TOLERANCE_S:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def _live_process(self, slot: str) -> psutil.Process | None:
        record = self._record(slot)
        if record is None:
            return self.labelled.find(slot)
        proc = self._verified(int(record["pid"]), float(record.get("create_time", 0.0)))
        if proc is None or is_zombie(proc):
            return self.labelled.find(slot)  # a stale record must not hide an unrecorded server
        return proc

    def _record_from_labels(self, slot: str, proc: psutil.Process) -> dict[str, Any]:
        labels = self.labelled.labels_of(proc) or {}
        port = int(labels.get(ENV_PORT, "0") or 0)
        return {
            "pid": proc.pid,
            "create_time": proc.create_time(),
            "started_at": proc.create_time(),
            "argv": proc.cmdline(),
            "config_hash": labels.get(ENV_HASH),
            "endpoint": f"http://127.0.0.1:{port}" if port else None,
            "port": port,
            "stack": labels.get(ENV_STACK, ""),
            "adopted": True,
        }

    # ------------------------------------------------------------------ stopping

    @staticmethod
    def _signal_group(proc: psutil.Process, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)

    async def _wait_gone(self, slot: str, proc: psutil.Process, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        popen = _CHILDREN.get(proc.pid)
        while True:
            if popen is not None:
                if popen.poll() is not None:
                    return True
            elif not proc.is_running() or is_zombie(proc):
                _reap(proc.pid)
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)

    def _forget(self, slot: str) -> None:
        self._output_at.pop(slot, None)
        record = self._record(slot)
        if record is not None:
            popen = _CHILDREN.get(int(record["pid"]))
            if popen is not None and popen.poll() is not None:
                del _CHILDREN[popen.pid]
        self.records.delete(slot)

    # ------------------------------------------------------------------ logs

    def _rotate(self, path: Path) -> None:
        """Keep the previous runs' logs as ``server.log.1`` .. ``.N`` (crash loops!)."""
        if not path.exists() or path.stat().st_size == 0:
            return
        for index in range(self.log_backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{index}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{index + 1}"))
        path.replace(path.with_name(f"{path.name}.1"))

    def _cap_log(self, slot: str) -> None:
        """Copy-truncate a running server's log once it passes the size cap."""
        path = self.log_path(slot)
        try:
            if path.stat().st_size <= self.log_max_bytes:
                return
        except FileNotFoundError:
            return
        self._rotate_copy(path)

    def _rotate_copy(self, path: Path) -> None:
        for index in range(self.log_backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{index}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{index + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        with path.open("r+b") as handle:  # the server writes with O_APPEND: safe to truncate
            handle.truncate(0)

    def _tail(self, slot: str, tail: int) -> list[str]:
        path = self.log_path(slot)
        try:
            with path.open("rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - 256 * 1024))
                data = handle.read()
        except FileNotFoundError:
            return []
        lines = data.decode(errors="replace").splitlines()
        return lines[-tail:] if tail > 0 else lines


def _reap(pid: int) -> int | None:
    """Collect a zombie child's exit status (only works for our own children)."""
    popen = _CHILDREN.get(pid)
    if popen is not None:
        return popen.poll()
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def _exited(observed: Observed, code: int | None) -> Observed:
    return replace(observed, status=RunStatus.EXITED, exit_code=code, message=_exit_text(code))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exited (exit code unknown)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
