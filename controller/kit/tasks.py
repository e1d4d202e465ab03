"""One guarded-task helper: background tasks that are tracked, reported and cancelled.

Used wherever a task outlives the call that starts it (the slot manager's cleanups and
warm-ups, the API's loads and unloads): every task is kept until it ends, a failure is
logged (never "exception was never retrieved"), and :meth:`TaskSet.cancel` ends them all
at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

from controller.model.errors import SlotctlError

__all__ = ["TaskSet"]


class TaskSet:
    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, SlotctlError):
            self._log.warning("%s failed: %s", task.get_name(), error.message)
        elif error is not None:
            self._log.error("%s failed", task.get_name(), exc_info=error)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel(self) -> None:
        """Cancel every task and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
