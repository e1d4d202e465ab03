"""A slot's server processes: spawned, recorded, observed, signalled, their logs.

The primitives of the process runtime (:mod:`controller.runtime.process.runtime`, the
``Runtime`` protocol over them) and of its surge capability
(:mod:`controller.runtime.process.surge`, a slot's second server), both of which call them:
one owner of the records, the labels and the children's ``Popen`` objects.

The server runs in its own session/process group (so a stop reaches every process it
spawned), from an argv list (never a shell), with stdout/stderr in a per-slot log file
under the state dir (rotated at each start and capped in size). Each start records
``pid`` + the process start time in ``slots/<name>/process.json`` (through the store), so a
restarted controller **adopts** a live server instead of starting a duplicate, and a
recycled pid (same number, different start time) is never mistaken for ours.
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
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Final

import psutil

from controller.model.devices import VISIBILITY_ENV_VARS
from controller.model.errors import SlotSpawnFailed, StateWriteFailed
from controller.runtime.base import (
    LaunchSpec,
    Observed,
    RunStatus,
    visibility_env,
)
from controller.runtime.process.labels import (
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
from controller.runtime.process.records import ProcessRecords
from controller.store.state import StateStore

__all__ = ["LOG", "ServerProcesses"]

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


class ServerProcesses:
    """The servers of one state dir's slots as child processes (see the module docstring)."""

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
        # Where the output of each server this runtime started begins in its log (after
        # the runtime's own header line): the probe's log wake reads from there.
        self.output_at: dict[str, int] = {}

    def record(self, slot: str) -> dict[str, Any] | None:
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

    def env(self, launch: LaunchSpec, instance: str = "") -> dict[str, str]:
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
        if instance:  # a surge's second server (controller.runtime.process.surge)
            env[ENV_INSTANCE] = instance
        return env

    def spawn(
        self, launch: LaunchSpec, records: ProcessRecords | None = None, instance: str = ""
    ) -> Observed:
        """Start ``launch``'s server and record it (in ``records``: the slot's own record,
        or a surge's second server's, labelled ``instance``)."""
        records = records if records is not None else self.records
        log_path = self.log_path(launch.slot)
        log: IO[bytes] | None = None
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self.rotate(log_path)
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
                    env=self.env(launch, instance),
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
        self.output_at[launch.slot] = output_at
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
        return self.observe(launch.slot, record)

    # ------------------------------------------------------------------ observing

    def observe(self, slot: str, record: Mapping[str, Any]) -> Observed:
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
        proc = self.verified(pid, float(record.get("create_time", 0.0)))
        if proc is None:
            return _exited(running, None)
        if is_zombie(proc):
            return _exited(running, _reap(pid))
        return running

    @staticmethod
    def verified(pid: int, create_time: float) -> psutil.Process | None:
        """The process with this pid *and* start time, or None (gone or pid recycled)."""
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - create_time) > _CTIME_TOLERANCE_S:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def live_process(self, slot: str) -> psutil.Process | None:
        record = self.record(slot)
        if record is None:
            return self.labelled.find(slot)
        proc = self.verified(int(record["pid"]), float(record.get("create_time", 0.0)))
        if proc is None or is_zombie(proc):
            return self.labelled.find(slot)  # a stale record must not hide an unrecorded server
        return proc

    def record_from_labels(self, slot: str, proc: psutil.Process) -> dict[str, Any]:
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
    def signal_group(proc: psutil.Process, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)

    async def wait_gone(self, slot: str, proc: psutil.Process, timeout: float) -> bool:
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

    def forget(self, slot: str) -> None:
        self.output_at.pop(slot, None)
        record = self.record(slot)
        if record is not None:
            popen = _CHILDREN.get(int(record["pid"]))
            if popen is not None and popen.poll() is not None:
                del _CHILDREN[popen.pid]
        self.records.delete(slot)

    # ------------------------------------------------------------------ logs

    def rotate(self, path: Path) -> None:
        """Keep the previous runs' logs as ``server.log.1`` .. ``.N`` (crash loops!)."""
        if not path.exists() or path.stat().st_size == 0:
            return
        for index in range(self.log_backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{index}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{index + 1}"))
        path.replace(path.with_name(f"{path.name}.1"))

    def cap_log(self, slot: str) -> None:
        """Copy-truncate a running server's log once it passes the size cap."""
        path = self.log_path(slot)
        try:
            if path.stat().st_size <= self.log_max_bytes:
                return
        except FileNotFoundError:
            return
        self.rotate_copy(path)

    def rotate_copy(self, path: Path) -> None:
        for index in range(self.log_backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{index}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{index + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        with path.open("r+b") as handle:  # the server writes with O_APPEND: safe to truncate
            handle.truncate(0)

    def tail(self, slot: str, tail: int) -> list[str]:
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
