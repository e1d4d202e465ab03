"""``slotctl up``: wiring of the controller — manager, reconciler, watchers, signals.

Composition only: the SlotManager changes state, the reconciler decides what to do, the
guard writes config. This module starts them, follows the config dir (and, in GitOps
mode, a stack directory) with watchfiles, prints progress, holds the one-controller-per-
state-dir lock and shuts down cleanly on SIGINT/SIGTERM (stopping managed servers unless
``--keep-running``, which leaves them for the next ``up`` to adopt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil
import watchfiles

from controller import __version__
from controller.api.app import ApiContext, build_probe_app
from controller.api.dashboard import LOGIN_CODE_TTL_S, login_path, mint_login_code
from controller.api.server import ApiServer, check_listen, is_loopback
from controller.apply import apply_to_config
from controller.errors import SlotConfigError, SlotctlError
from controller.events import Event
from controller.reconcile import Action, Reconciler
from controller.runtime import make_runtime
from controller.slots import ManagerConfig, SlotManager
from controller.spec.configdir import read_settings
from controller.spec.loader import DesiredState, load_stacks
from controller.store import ControllerLock, ControllerRecord, ensure_token, sweep_temp_files

__all__ = ["Controller", "DaemonOptions", "stop_everything"]

log = logging.getLogger("slotctl.daemon")

_IGNORED = (".slotctl.lock", "residency.json", ".tmp")


@dataclass(slots=True)
class DaemonOptions:
    config_dir: Path
    state_dir: Path
    runtime: str = "process"
    stack_dir: Path | None = None
    keep_running: bool = False
    resync_s: float = 30.0
    watch_debounce_ms: int = 50
    out: TextIO = field(default_factory=lambda: sys.stdout)
    listen: str | None = "127.0.0.1:8800"  # None: no API
    metrics_listen: str | None = None  # /metrics, /healthz, /readyz without a token
    token: str | None = None  # None: generated into <state_dir>/token
    quiet: bool = False  # --log-format json: the structured log replaces progress lines


class Controller:
    def __init__(self, opts: DaemonOptions) -> None:
        self.opts = opts
        self.stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.lock = ControllerLock(opts.state_dir)
        self.manager: SlotManager | None = None
        self.reconciler: Reconciler | None = None
        self._gitops_stacks: set[str] = set()
        self._stack_dir_invalid = False
        self._forced = False  # a second interrupt: drains end at once
        self._started = time.monotonic()

    # ---------------------------------------------------------------- output

    def say(self, text: str) -> None:
        if self.opts.quiet:
            log.info(text)
            return
        stamp = time.strftime("%H:%M:%S")
        self.opts.out.write(f"{stamp} {text}\n")
        self.opts.out.flush()

    def _print_plan(self, action: Action) -> None:
        self.say(f"plan   {action.slot:<16} {action.kind:<9} {action.reason}")

    def _print_event(self, event: Event) -> None:
        if self.opts.quiet:
            return  # already a structured log line (controller.events)
        if event.kind == "transition":
            arrow = f"{event.from_state} -> {event.to_state}"
            tail = f"  {event.message}" if event.message else ""
            self.say(f"slot   {event.slot or '-':<16} {arrow:<22}{tail}")
        elif event.kind == "adopt":
            self.say(event.message)
        elif event.kind in ("refusal", "eviction", "error"):
            code = f" [{event.error}]" if event.error else ""
            self.say(f"{event.kind:<6} {event.slot or '-':<16}{code} {event.message}")

    # ---------------------------------------------------------------- main

    def preflight(self) -> None:
        """Everything that can refuse the start, checked before anything is written (a
        failed ``up`` leaves no state dir, token, config or stack applied behind): listen
        addresses parse, are free, and a non-loopback API has an explicit token."""
        opts = self.opts
        if opts.listen:
            host, _ = check_listen(opts.listen)
            if not is_loopback(host) and not opts.token:
                raise SlotConfigError(
                    f"refusing to serve the API on {host} (not loopback) without an explicit "
                    "token: pass --token or set SLOTCTL_TOKEN",
                    keys=["listen"],
                )
        if opts.metrics_listen:
            check_listen(opts.metrics_listen, "--metrics-listen")

    async def run(self) -> int:
        opts = self.opts
        self.preflight()
        opts.config_dir.mkdir(parents=True, exist_ok=True)
        record = ControllerRecord(
            pid=os.getpid(),
            create_time=psutil.Process().create_time(),
            runtime=opts.runtime,
            listen=opts.listen,
            config_dir=str(opts.config_dir.resolve()),
            version=__version__,
        )
        self._record = record
        self.lock.acquire(record)
        try:
            return await self._run_locked()
        finally:
            self.lock.release()

    async def _run_locked(self) -> int:
        opts = self.opts
        # A writer killed between its temp file and the rename (a controller SIGKILLed
        # mid-transition) leaves ``.NAME.*.tmp`` behind; only the lock holder writes here.
        swept = sweep_temp_files(opts.state_dir)
        if swept:
            self.say(f"removed {swept} temp file(s) left by an interrupted write")
        settings, problems = read_settings(opts.config_dir)
        for problem in problems:
            self.say(f"config {problem.where()}: {problem.message}")
        runtime = make_runtime(opts.runtime, opts.state_dir)
        manager = SlotManager(
            runtime=runtime,
            state_dir=opts.state_dir,
            config_dir=opts.config_dir,
            settings=settings,
            config=ManagerConfig(),
        )
        self.manager = manager
        if opts.stack_dir is not None:
            self.apply_stack_dir()
        reconciler = Reconciler(
            manager, opts.config_dir, resync_s=opts.resync_s, on_plan=self._print_plan
        )
        self.reconciler = reconciler
        self._install_signals()
        self.say(
            f"slotctl {__version__} controller: runtime {opts.runtime}, config "
            f"{opts.config_dir}, state {opts.state_dir}"
            + (f", GitOps from {opts.stack_dir}" if opts.stack_dir else "")
        )
        servers = await self._start_api(manager, reconciler)
        with manager.events.subscribe() as events:
            printer = asyncio.create_task(self._print_events(events))
            snapshot = reconciler.refresh()
            await manager.set_desired(snapshot.desired())
            await manager.recover()
            manager.report_unknown_residents()
            for server in servers:
                server.ctx.ready.set()
            tasks = [
                asyncio.create_task(reconciler.run(self.stop), name="reconciler"),
                asyncio.create_task(manager.run(self.stop), name="manager"),
                asyncio.create_task(self._watch(), name="watch"),
            ]
            for task in tasks:
                task.add_done_callback(self._task_ended)
            if opts.stack_dir is not None:
                # A save between the first apply and the watcher taking over (recover() can
                # take a while) would otherwise wait for the next save: apply once more
                # (idempotent) once the watcher runs.
                await asyncio.sleep(0.1)
                self.apply_stack_dir()
            self.ready.set()
            try:
                await self.stop.wait()
            finally:
                # Drains first, the API last: a request in flight finishes (or its stream
                # ends with an error event) instead of being cut by the server going away.
                try:
                    await self._shutdown(tasks, printer)
                finally:
                    for server in servers:
                        await server.stop()
        return 0

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A background task ending before shutdown is a fault: say so and stop cleanly."""
        if self.stop.is_set() or task.cancelled():
            return
        error = task.exception()
        self.say(f"background task {task.get_name()} ended unexpectedly: {error!r}; stopping")
        self.stop.set()

    async def _start_api(self, manager: SlotManager, reconciler: Reconciler) -> list[ApiServer]:
        """The API on ``--listen`` and the probes on ``--metrics-listen`` (either may be
        off); both share one context (metrics, readiness)."""
        opts = self.opts
        if not opts.listen and not opts.metrics_listen:
            return []
        token = opts.token or ensure_token(opts.state_dir)
        ctx = ApiContext(
            manager=manager,
            reconciler=reconciler,
            config_dir=opts.config_dir,
            state_dir=opts.state_dir,
            token=token,
            events=manager.events,
        )
        servers: list[ApiServer] = []
        try:
            if opts.listen:
                host, port = check_listen(opts.listen)
                server = ApiServer(ctx, host, port)
                address = await server.start()
                servers.append(server)
                self.lock.update(self._record.model_copy(update={"listen": address}))
                self.say(
                    f"API and dashboard on http://{address}/  (token: "
                    + ("--token/SLOTCTL_TOKEN" if opts.token else f"{opts.state_dir}/token")
                    + ")"
                )
                self._say_login(f"http://{address}{login_path(mint_login_code(ctx))}")
            if opts.metrics_listen:
                host, port = check_listen(opts.metrics_listen, "--metrics-listen")
                probes = ApiServer(
                    ctx, host, port, app_factory=build_probe_app, flag="--metrics-listen"
                )
                address = await probes.start()
                servers.append(probes)
                self.say(
                    f"metrics and probes (no token) on http://{address}/metrics, /healthz, /readyz"
                )
        except BaseException:
            for server in servers:
                await server.stop()
            raise
        return servers

    async def _print_events(self, events: object) -> None:
        from controller.events import Subscription

        assert isinstance(events, Subscription)
        async for event in events:
            self._print_event(event)

    async def _shutdown(self, tasks: list[asyncio.Task[None]], printer: asyncio.Task[None]) -> None:
        self.stop.set()
        # A background task that died must not keep the servers from being stopped.
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, Exception):
                log.error("background task failed: %r", result)
        manager = self.manager
        assert manager is not None
        if self.opts.keep_running:
            self.say("stopping the controller; servers keep running (--keep-running)")
            ended = manager.revoke_leases("the controller stopped (its servers keep running)")
            if ended:
                self.say(f"ended {ended} lease(s): requests in flight get an error")
        else:
            self.say("stopping managed servers ...")
            await manager.stop_all(on_drain=self._say_drain)
        await manager.close()
        close = getattr(manager.runtime, "close", None)
        if close is not None:
            result = close()
            if asyncio.iscoroutine(result):
                await result
        await asyncio.sleep(0)  # let the printer show the last transitions
        printer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await printer
        self.say("controller stopped")

    def _say_login(self, url: str) -> None:
        """The one-time dashboard link: on the terminal, never into the structured log
        (with ``--log-format json`` it goes to stderr, outside the log stream)."""
        text = (
            f"dashboard login: {url}  (one-time link, valid {LOGIN_CODE_TTL_S / 60:g} min; "
            "`slotctl dashboard` prints a new one)"
        )
        if self.opts.quiet:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        else:
            self.say(text)

    def _say_drain(self, slot: str, requests: int, timeout_s: float) -> None:
        self.say(
            f"waiting for {requests} request(s) in flight on slot {slot} to finish (up to "
            f"{timeout_s:g}s, drain_timeout_s); Ctrl-C again stops the servers now"
        )

    def _interrupt(self) -> None:
        """SIGINT/SIGTERM: the first stops gracefully (drains); one while stopping (a
        second Ctrl-C, or a stop for any other reason) stops the servers now."""
        if not self.stop.is_set():
            self.stop.set()
            return
        if not self._forced and self.manager is not None:
            self._forced = True
            self.say("second interrupt: stopping the servers without waiting for requests")
            self.manager.end_drains()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._interrupt)

    # ---------------------------------------------------------------- GitOps

    def apply_stack_dir(self) -> bool:
        """Validate the stack dir and apply it; an invalid one changes nothing."""
        opts = self.opts
        assert opts.stack_dir is not None
        settings, _ = read_settings(opts.config_dir)
        report = load_stacks([opts.stack_dir], settings)
        if not report.ok or report.state is None:
            for p in report.errors:
                where = p.where()
                self.say(f"invalid {where}: [{p.code}] {p.message}")
            self.say("stack dir is invalid: nothing changed, the last good desired state stays")
            self._stack_dir_invalid = True
            return False
        if self._stack_dir_invalid:
            self._stack_dir_invalid = False
            self.say(f"stack dir {opts.stack_dir} is valid again")
        for p in report.warnings:
            self.say(f"warning {p.where()}: [{p.code}] {p.message}")
        self._gitops_stacks.update(report.state.stacks)
        state = DesiredState(
            stacks=tuple(sorted(self._gitops_stacks)),
            models=report.state.models,
            slots=report.state.slots,
        )
        try:
            changed = apply_to_config(state, opts.config_dir, prune=True)
        except SlotctlError as exc:  # a refused write: report it, keep the last good state
            self.say(f"apply failed: [{exc.code}] {exc.message}")
            return False
        if changed:
            self.say(f"applied {opts.stack_dir}: {', '.join(changed)}")
        return True

    async def _watch(self) -> None:
        opts = self.opts
        paths = [opts.config_dir]
        if opts.stack_dir is not None:
            paths.append(opts.stack_dir)
        stack_dir = opts.stack_dir.resolve() if opts.stack_dir else None
        async for changes in watchfiles.awatch(
            *paths,
            stop_event=self.stop,
            debounce=opts.watch_debounce_ms,
            step=10,
            watch_filter=_relevant,
        ):
            touched = {Path(p).resolve() for _, p in changes}
            if stack_dir is not None and any(stack_dir in t.parents for t in touched):
                self.apply_stack_dir()
            assert self.reconciler is not None
            self.reconciler.refresh()
            self.reconciler.enqueue_all()


def _relevant(change: watchfiles.Change, path: str) -> bool:
    name = Path(path).name
    return not any(name.endswith(s) or name == s for s in _IGNORED) and not name.startswith(".")


async def stop_everything(
    config_dir: Path,
    state_dir: Path,
    runtime_kind: str,
    say: Callable[[str], None],
) -> int:
    """``slotctl down`` without a controller: adopt and stop every managed server.

    Holds the controller lock meanwhile, so a controller started concurrently waits
    rather than adopting servers that are being stopped.
    """
    lock = ControllerLock(state_dir)
    lock.acquire(
        ControllerRecord(
            pid=os.getpid(),
            create_time=psutil.Process().create_time(),
            runtime=runtime_kind,
            config_dir=str(config_dir),
        )
    )
    try:
        return await _stop_everything_locked(config_dir, state_dir, runtime_kind, say)
    finally:
        lock.release()


async def _stop_everything_locked(
    config_dir: Path, state_dir: Path, runtime_kind: str, say: Callable[[str], None]
) -> int:
    from controller.spec.configdir import read_config_dir

    snapshot = read_config_dir(config_dir)
    runtime = make_runtime(runtime_kind, state_dir)
    manager = SlotManager(
        runtime=runtime, state_dir=state_dir, config_dir=config_dir, settings=snapshot.settings
    )
    await manager.set_desired(snapshot.desired())
    await manager.recover()
    await manager.stop_all(reason="slotctl down")
    stopped = 0
    for observed in await runtime.list_managed():
        if await manager.reap_orphan(observed.slot):
            stopped += 1
    await manager.close()
    close = getattr(runtime, "close", None)
    if close is not None:
        result = close()
        if asyncio.iscoroutine(result):
            await result
    say(f"stopped {len(snapshot.slots)} slot(s) and {stopped} orphan server(s)")
    return 0
