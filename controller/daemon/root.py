"""The one composition root: lock, runtime, manager, reconciler, recovery, close.

``slotctl up`` (and through it ``slotctl operator``), ``slotctl down`` without a
controller and ``slotctl stack apply --once`` all need the same wiring; they get it here
and nowhere else::

    async with open_root(config_dir, state_dir, "process", record) as root:
        await root.recover()        # desired state read, running servers adopted
        ...                         # run loops, converge, or stop everything
    # manager and runtime closed, the one-controller-per-state-dir lock released

The lock comes first, so two of these can never adopt, stop or start the same servers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import psutil

from controller import __version__
from controller.modelfiles.pull import ModelFiles
from controller.providers.base import default_models_dir
from controller.reconcile.reconciler import Action, Reconciler
from controller.runtime.base import OffersMemory, Runtime, RuntimeKind, WarmsUp
from controller.runtime.kinds import make_runtime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.configdir import ConfigSnapshot, read_settings
from controller.spec.desired import DesiredCache
from controller.spec.problems import Problem
from controller.store.files import sweep_temp_files
from controller.store.lock import ControllerLock, ControllerRecord

__all__ = ["PULL_PROGRESS_S", "Root", "controller_record", "model_files", "open_root"]

# How often a pull's progress is published (a ``progress`` event of each slot waiting for
# it, the views, the CLI's bar, the dashboard): the engine's throttle.
PULL_PROGRESS_S: Final = 1.0


@dataclass(slots=True)
class Root:
    """What the composition root built, for the time the lock is held."""

    config_dir: Path
    state_dir: Path
    lock: ControllerLock
    record: ControllerRecord
    runtime: Runtime
    manager: SlotManager
    reconciler: Reconciler
    problems: list[Problem]  # of controller.toml (the defaults apply meanwhile)
    swept: int  # temp files a writer killed mid-write had left behind

    async def recover(self) -> ConfigSnapshot:
        """Read the desired state (every source synced), hand it to the manager, adopt
        what runs (no load yet)."""
        if isinstance(self.runtime, WarmsUp):  # the kubernetes runtime's nodes and pods
            await self.runtime.warm_up()
        await self.reconciler.refresh_async()
        await self.reconciler.desired.wait_synced()
        snapshot = self.reconciler.snapshot
        await self.manager.set_desired(snapshot.desired())
        await self.manager.recover()
        return snapshot


def controller_record(
    config_dir: Path, runtime: str, listen: str | None = None
) -> ControllerRecord:
    """``controller.json`` for this process."""
    return ControllerRecord(
        pid=os.getpid(),
        create_time=psutil.Process().create_time(),
        runtime=runtime,
        listen=listen,
        config_dir=str(Path(config_dir).resolve()),
        version=__version__,
    )


def model_files(runtime: Runtime, models_dir: Path, state_dir: Path) -> ModelFiles | None:
    """The models dir's files, which a load pulls through before its server starts (the
    engine loads the hub's client library at its first hub call, not here). None for the
    kubernetes runtime: its pods pull on their nodes (an init container's ``slotctl model
    pull`` into the node's cache), where this controller cannot look."""
    if runtime.kind is RuntimeKind.KUBERNETES:
        return None
    return ModelFiles(models_dir, state_dir, progress_interval_s=PULL_PROGRESS_S)


@contextlib.asynccontextmanager
async def open_root(
    config_dir: Path,
    state_dir: Path,
    runtime_kind: str,
    record: ControllerRecord | None = None,
    *,
    resync_s: float = 30.0,
    on_plan: Callable[[Action], None] | None = None,
    desired: DesiredCache | None = None,
) -> AsyncIterator[Root]:
    """Take the lock, build the runtime, manager and reconciler; close them and release
    the lock however the body ends (servers keep running unless the body stops them)."""
    record = record or controller_record(config_dir, runtime_kind)
    lock = ControllerLock(state_dir)
    lock.acquire(record)
    try:
        # A writer killed between its temp file and the rename (a controller SIGKILLed
        # mid-transition) leaves ``.NAME.*.tmp`` behind; only the lock holder writes here.
        swept = sweep_temp_files(state_dir)
        settings, problems = read_settings(config_dir)
        runtime = make_runtime(runtime_kind, state_dir)
        # A runtime that places servers on other machines says what memory they offer
        # (the kubernetes runtime: the nodes'); the others leave it to this host's probe.
        memory = runtime.memory if isinstance(runtime, OffersMemory) else None
        models_dir = default_models_dir()
        files = model_files(runtime, models_dir, state_dir)
        manager = SlotManager(
            runtime=runtime,
            memory=memory,
            state_dir=state_dir,
            config_dir=config_dir,
            settings=settings,
            config=ManagerConfig(models_dir=models_dir),
            files=files,
        )
        if files is not None:  # a GC keeps the declared models' files (pinned: pinned)
            files.references = manager.file_references
        reconciler = Reconciler(
            manager, config_dir, resync_s=resync_s, on_plan=on_plan, desired=desired
        )
        root = Root(
            Path(config_dir),
            Path(state_dir),
            lock,
            record,
            runtime,
            manager,
            reconciler,
            problems,
            swept,
        )
        try:
            yield root
        finally:
            await manager.close()
            await runtime.close()
    finally:
        lock.release()
