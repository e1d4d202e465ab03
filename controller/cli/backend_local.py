"""The local stack backend: the config and state dirs and the runtime, no controller needed.

Plans with :func:`controller.reconcile.apply.plan_stack`, writes through
:func:`controller.reconcile.apply.apply_to_config` (the guard), observes ``state.json`` and the
runtime (:func:`controller.reconcile.apply.observe_files`). The runtime is the running
controller's (``controller.json``) when one runs, else ``--runtime``; it and the event
loop it lives on are opened once per command and closed with the backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from controller.cli.backend import Applied, Closing, Diff, SlotStatus, StackRequest
from controller.reconcile.apply import apply_to_config, observe_files, plan_stack
from controller.runtime.base import Runtime
from controller.runtime.kinds import make_runtime
from controller.store.lock import ControllerLock

__all__ = ["LocalBackend"]

T = TypeVar("T")


class LocalBackend(Closing):
    """:class:`~controller.cli.backend.StackBackend` on the files (see the module docstring)."""

    remote = False

    def __init__(self, config_dir: Path, state_dir: Path, runtime_kind: str) -> None:
        self.config_dir = config_dir
        self.state_dir = state_dir
        running = ControllerLock(state_dir).running()
        self._runtime_kind = running.runtime if running else runtime_kind
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runtime: Runtime | None = None

    def _run(self, work: Callable[[Runtime], Coroutine[Any, Any, T]]) -> T:
        """``work(runtime)`` on this backend's loop (the runtime is made on it, once)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self._with_runtime(work))

    async def _with_runtime(self, work: Callable[[Runtime], Coroutine[Any, Any, T]]) -> T:
        if self._runtime is None:
            self._runtime = make_runtime(self._runtime_kind, self.state_dir)
        return await work(self._runtime)

    def diff(self, request: StackRequest, *, prune: bool) -> Diff:
        state = request.state
        plan = self._run(
            lambda rt: plan_stack(state, self.config_dir, self.state_dir, rt, prune=prune)
        )
        return Diff(plan=plan, json_patch=plan.json_patch())

    def apply(self, request: StackRequest, *, prune: bool, force: bool, dry_run: bool) -> Applied:
        plan = self.diff(request, prune=prune).plan
        aliases, adapters = plan.aliases_changed, plan.adapters_changed
        left = plan.kept(prune=prune)
        if dry_run:
            return Applied(
                actions=plan.actions, aliases=aliases, adapters=adapters, left_behind=left
            )
        changed = apply_to_config(request.state, self.config_dir, prune=prune, force=force)
        return Applied(plan.actions, changed, aliases=aliases, adapters=adapters, left_behind=left)

    def observe(self, names: list[str]) -> dict[str, SlotStatus]:
        observed = self._run(lambda rt: observe_files(names, self.state_dir, rt))
        return {
            name: SlotStatus(obs.state.value if obs.state else "pending", obs.message)
            for name, obs in observed.items()
        }

    def close(self) -> None:
        loop, runtime = self._loop, self._runtime
        self._loop = self._runtime = None
        try:
            if runtime is not None and loop is not None:
                loop.run_until_complete(runtime.close())
        finally:
            if loop is not None:
                loop.close()
