"""Supervision of the controller's background tasks (reconciler, housekeeping, watcher).

Fault containment (docs/reliability.md): every background task runs under
:meth:`Supervisor.supervise`, which reports an unexpected failure (an ``error`` event with
op ``background``, a log line, ``slotctl_background_failures_total``) and restarts the
task with backoff; the data plane keeps serving meanwhile. Only a failure of the
supervision itself is fatal: :attr:`Supervisor.fatal` is set and the controller stops,
exiting 1 and leaving the servers running for the next controller to adopt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from controller.kit.eventbus import EventBus
from controller.model.events import EventKind, Op

__all__ = ["HEALTHY_S", "RESTART_BASE_S", "RESTART_MAX_S", "Supervisor"]

log = logging.getLogger("slotctl.daemon")

RESTART_BASE_S = 0.5  # first restart of a failed background task
RESTART_MAX_S = 30.0  # backoff ceiling
HEALTHY_S = 60.0  # a run this long resets the backoff


class Supervisor:
    """Runs named background tasks until ``stop`` is set; see the module docstring."""

    def __init__(self, stop: asyncio.Event, events: EventBus, say: Callable[[str], None]) -> None:
        self.stop = stop
        self.events = events
        self.say = say
        self.fatal = False  # a supervisor ended before shutdown: exit 1, servers stay
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.create_task(self.supervise(name, factory), name=name)
        task.add_done_callback(self.task_ended)
        self.tasks.append(task)

    async def supervise(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Run one background task for the controller's lifetime.

        An unexpected exception (or the task returning before shutdown) is contained:
        reported (:meth:`report_failure`) and the task restarted after a backoff that
        doubles up to :data:`RESTART_MAX_S` and starts over once a run lasted
        :data:`HEALTHY_S`.
        """
        failures = 0
        while not self.stop.is_set():
            started = time.monotonic()
            error: Exception | None = None
            try:
                await factory()
            except Exception as exc:  # noqa: BLE001 - reported below, then restarted
                error = exc
            if self.stop.is_set():
                return
            if time.monotonic() - started >= HEALTHY_S:
                failures = 0
            delay = min(RESTART_MAX_S, RESTART_BASE_S * 2.0**failures)
            failures += 1
            self.report_failure(name, error, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)

    def report_failure(self, name: str, error: Exception | None, delay: float) -> None:
        """An ``error`` event (op ``background``, counted by the metrics) and a log line."""
        what = f"{type(error).__name__}: {error}" if error is not None else "it returned"
        log.error(
            "background task %s failed (%s); restarting it in %.1fs",
            name,
            what,
            delay,
            exc_info=error,
        )
        self.events.emit(
            EventKind.ERROR,
            Op.BACKGROUND,
            message=f"background task {name} failed ({what}); restarting it in {delay:.1f}s",
            error="controller.task_failed",
            details={"task": name, "restart_in_s": delay},
        )

    def task_ended(self, task: asyncio.Task[None]) -> None:
        """A supervisor ending before shutdown is an internal error: exit 1, servers stay.

        The servers keep running (as with ``--keep-running``) so that the controller a
        service manager restarts (systemd ``Restart=on-failure``) adopts them.
        """
        if self.stop.is_set() or task.cancelled():
            return
        error = task.exception()
        log.critical("supervisor of %s ended: %r", task.get_name(), error, exc_info=error)
        self.say(
            f"internal error: background task {task.get_name()} ended ({error!r}); exiting "
            "with status 1, servers keep running for the next controller to adopt"
        )
        self.fatal = True
        self.stop.set()

    async def join(self) -> None:
        """Wait for every task to end (``stop`` is set); a failure is logged, not raised:
        a background task that died must not keep the servers from being stopped."""
        for result in await asyncio.gather(*self.tasks, return_exceptions=True):
            if isinstance(result, Exception):
                log.error("background task failed: %r", result)
