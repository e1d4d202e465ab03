"""The process runtime's labelled servers: finding a slot's server by its environment.

Part of :mod:`controller.runtime.process.runtime`. Processes carry slotctl's labels in their
environment (``SLOTCTL_MANAGED``, ``SLOTCTL_OWNER``, ``SLOTCTL_SLOT``...), the process
analogue of container labels, so a server whose record was lost (a controller killed
between its spawn and its record) is still found and adopted. ``/proc`` is read in full
once, at the first need, and again at each resync (:meth:`LabelledServers.scan_all`); the
servers the runtime spawns are remembered; every candidate is checked again (alive,
labels, group leader) before it is used.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Final

import psutil

__all__ = [
    "ENV_HASH",
    "ENV_INSTANCE",
    "ENV_MANAGED",
    "ENV_OWNER",
    "ENV_PORT",
    "ENV_SLOT",
    "ENV_STACK",
    "LabelledServers",
    "await_exec",
    "is_zombie",
]

ENV_MANAGED: Final = "SLOTCTL_MANAGED"
ENV_SLOT: Final = "SLOTCTL_SLOT"
ENV_STACK: Final = "SLOTCTL_STACK"
ENV_HASH: Final = "SLOTCTL_CONFIG_HASH"
ENV_OWNER: Final = "SLOTCTL_OWNER"
ENV_PORT: Final = "SLOTCTL_PORT"
# Which of a slot's servers this is (a surge rollout runs two for a while): a token per spawn.
ENV_INSTANCE: Final = "SLOTCTL_INSTANCE"
# How long a spawn waits for its child's exec to show in /proc (see await_exec).
EXEC_WAIT_S: Final = 2.0


class LabelledServers:
    """The labelled servers of one owner (a state dir), by slot."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        # The pids that may be a slot's labelled server (see find): what the last full
        # scan of /proc found, plus every server this runtime spawned since.
        self.candidates: dict[str, set[int]] = {}
        self.scanned = False
        # The pids a look for the slot's own server passes over: a surge's second server
        # and the one it replaces (controller.runtime.process.surge sets it).
        self.skip: Callable[[str], Collection[int]] = lambda slot: ()
        self._lock = threading.Lock()  # scans and spawns run on worker threads

    def labels_of(self, proc: psutil.Process) -> dict[str, str] | None:
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            return None
        if env.get(ENV_MANAGED) != "true" or env.get(ENV_OWNER) != self.owner:
            return None
        return env

    def find(self, slot: str) -> psutil.Process | None:
        """The live server labelled as ``slot``'s (its process group leader), or None.

        /proc is read in full once, at the first need, not at every start of a slot
        without a record (that scan was O(processes) per load). A server without a record
        can only come from before this runtime (a controller killed between its spawn and
        its record): while a controller runs, it is the one that starts servers on its
        state dir (``ControllerLock``), and every server started since is one this runtime
        spawned, which it remembers. ``list_managed`` (each resync) scans in full again.
        Every candidate is checked again (alive, labels, group leader) before it is used.
        """
        if not self.scanned:
            self.scan_all()
        with self._lock:
            pids = sorted(self.candidates.get(slot, ()))
        skipped = self.skip(slot)
        for pid in pids:
            if pid in skipped:
                continue
            proc = self._leader(slot, pid)
            if proc is not None:
                return proc
            with self._lock:  # gone, or a recycled pid
                self.candidates.get(slot, set()).discard(pid)
        return None

    def leaders(self, slot: str) -> list[psutil.Process]:
        """Every live server labelled as ``slot``'s (a full scan of /proc first): during
        a surge two, else one; more are strays of an interrupted spawn."""
        self.scan_all()
        with self._lock:
            pids = sorted(self.candidates.get(slot, ()))
        return [proc for pid in pids if (proc := self._leader(slot, pid)) is not None]

    def remember(self, slot: str, pid: int) -> None:
        with self._lock:
            self.candidates.setdefault(slot, set()).add(pid)

    def _leader(self, slot: str, pid: int) -> psutil.Process | None:
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            return None
        labels = self.labels_of(proc)
        if labels is None or labels.get(ENV_SLOT) != slot:
            return None
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
            # The group leader is the server; children of it carry the same labels.
            if os.getpgid(proc.pid) == proc.pid and not is_zombie(proc):
                return proc
        return None

    def scan_all(self) -> list[str]:
        """Every slot with a labelled process of ours (a full scan of /proc); each such
        process becomes a candidate of :meth:`find` (which keeps the group leaders)."""
        names = []
        for proc in _labelled_processes():
            labels = self.labels_of(proc)
            slot = labels.get(ENV_SLOT) if labels is not None else None
            if slot:
                names.append(slot)
                self.remember(slot, proc.pid)
        self.scanned = True
        return names


def is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


_PROC: Final = Path("/proc")
_MANAGED_ENTRY: Final = f"\0{ENV_MANAGED}=true\0".encode()


def _labelled_processes() -> Iterator[psutil.Process]:
    """The processes that may carry slotctl labels: on Linux those whose initial
    environment (``/proc/PID/environ``, one raw read each) has ``SLOTCTL_MANAGED=true``;
    the caller still checks every label through psutil. Through psutil alone a scan
    parsed every process's environment (~2 ms of CPU at 80 processes); the pre-filter
    costs ~0.3 ms. Elsewhere: every process."""
    if not _PROC.is_dir():
        yield from psutil.process_iter()
        return
    # os.listdir, not Path.iterdir: a Path per process doubled the scan's CPU (130 processes:
    # 0.8 ms against 1.5 ms); a list, not scandir: a scan that stops early leaves nothing open.
    for name in os.listdir(_PROC):  # noqa: PTH208
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as env:
                raw = b"\0" + env.read()
            if _MANAGED_ENTRY in raw:
                yield psutil.Process(int(name))
        except (OSError, psutil.Error):  # gone, or not ours to read: not a candidate
            continue


def await_exec(pid: int, timeout_s: float = EXEC_WAIT_S) -> bool:
    """Wait (bounded) until ``pid``'s ``/proc/PID/environ`` shows slotctl's labels.

    ``Popen`` returns once the child's exec has passed its point of no return (the
    close-on-exec pipe it waits on closes there), but the kernel fills in the new image's
    argument and environment area a little later (``create_elf_tables``): a read of
    ``/proc/PID/environ`` in between is empty. A just-spawned server read then has no
    labels: a resync or a second controller's look would take it for a stranger (and start
    a duplicate). True once the labels show; False when the process is gone, its
    environment cannot be read, or ``timeout_s`` passed. Elsewhere than Linux: True.
    """
    if not _PROC.is_dir():
        return True
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        try:
            with open(f"/proc/{pid}/environ", "rb") as env:
                if _MANAGED_ENTRY in b"\0" + env.read():
                    return True
        except OSError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
