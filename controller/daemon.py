"""``slotctl up``: wiring of the controller — manager, reconciler, watchers, signals.

Composition only: the SlotManager changes state, the reconciler decides what to do, the
guard writes config. This module starts them, follows the config dir (and, in GitOps
mode, a stack directory) with watchfiles, prints progress, holds the one-controller-per-
state-dir lock and shuts down cleanly on SIGINT/SIGTERM (stopping managed servers unless
``--keep-running``, which leaves them for the next ``up`` to adopt).

Fault containment (docs/reliability.md): every background task (reconciler, manager
housekeeping, watcher) runs under :meth:`Controller._supervise`, which reports an
unexpected failure (event, log line, ``slotctl_background_failures_total``) and restarts
the task with backoff; the data plane keeps serving meanwhile. Only a failure of the
supervision itself is fatal: the controller then exits 1 and leaves the servers running
for the next controller to adopt. A watched directory that is deleted or replaced is
watched again once it exists; parsing and file I/O run off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import watchfiles

from controller import __version__
from controller.api.app import ApiContext
from controller.api.assembly import build_probe_app
from controller.api.dashboard import LOGIN_CODE_TTL_S, login_path, mint_login_code
from controller.api.server import ApiServer, check_listen, is_loopback
from controller.apply import apply_to_config, pruned_pinned
from controller.errors import SlotConfigError, SlotctlError
from controller.events import Event, EventKind, Op
from controller.reconcile import Action, Reconciler
from controller.root import Root, controller_record, open_root
from controller.slots import SlotManager
from controller.spec.configdir import read_config_dir, read_settings
from controller.spec.loader import DesiredState, load_stacks
from controller.store import ControllerLock, ensure_token

__all__ = ["Controller", "DaemonOptions", "stop_everything"]

log = logging.getLogger("slotctl.daemon")

_IGNORED = (".slotctl.lock", "residency.json", ".tmp")

RESTART_BASE_S = 0.5  # first restart of a failed background task
RESTART_MAX_S = 30.0  # backoff ceiling
HEALTHY_S = 60.0  # a run this long resets the backoff
ROOT_CHECK_MS = 500  # how often the watcher checks that its directories are still the same


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
        self.root: Root | None = None
        self.manager: SlotManager | None = None
        self.reconciler: Reconciler | None = None
        self._gitops_stacks: set[str] = set()
        self._stack_dir_invalid = False
        self._forced = False  # a second interrupt: drains end at once
        self._started = time.monotonic()
        self._fatal = False  # an internal error: exit 1 and leave the servers running
        self._apply_lock = asyncio.Lock()
        self._watch_runs = 0

    @property
    def lock(self) -> ControllerLock:
        """The one-controller lock of the state dir (``controller.json`` to read)."""
        return self.root.lock if self.root is not None else ControllerLock(self.opts.state_dir)

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
            if event.op == "lease":
                return  # ready <-> serving, twice a request: the event stream has them
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
        record = controller_record(opts.config_dir, opts.runtime, opts.listen)
        async with open_root(
            opts.config_dir,
            opts.state_dir,
            opts.runtime,
            record,
            resync_s=opts.resync_s,
            on_plan=self._print_plan,
        ) as root:
            self.root = root
            return await self._run_locked(root)

    async def _run_locked(self, root: Root) -> int:
        opts = self.opts
        if root.swept:
            self.say(f"removed {root.swept} temp file(s) left by an interrupted write")
        for problem in root.problems:
            self.say(f"config {problem.where()}: {problem.message}")
        manager, reconciler = root.manager, root.reconciler
        self.manager, self.reconciler = manager, reconciler
        if opts.stack_dir is not None:
            await self._apply_stack_dir_off_loop()
        self._install_signals()
        self.say(
            f"slotctl {__version__} controller: runtime {opts.runtime}, config "
            f"{opts.config_dir}, state {opts.state_dir}"
            + (f", GitOps from {opts.stack_dir}" if opts.stack_dir else "")
        )
        servers = await self._start_api(manager, reconciler)
        with manager.events.subscribe() as events:
            printer = asyncio.create_task(self._print_events(events))
            await root.recover()
            # Resident and autoload slots load in priority order before the reconciler's
            # workers start: the most important get the memory, the rest wait for it.
            await manager.restore(wait=False)
            for server in servers:
                server.ctx.ready.set()
            tasks = [
                asyncio.create_task(self._supervise(name, factory), name=name)
                for name, factory in (
                    ("reconciler", lambda: reconciler.run(self.stop)),
                    ("manager", lambda: manager.run(self.stop)),
                    ("watch", self._watch),
                )
            ]
            for task in tasks:
                task.add_done_callback(self._task_ended)
            if opts.stack_dir is not None:
                # A save between the first apply and the watcher taking over (recover() can
                # take a while) would otherwise wait for the next save: apply once more
                # (idempotent) once the watcher runs.
                await asyncio.sleep(0.1)
                await self._apply_stack_dir_off_loop()
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
        return 1 if self._fatal else 0

    # ---------------------------------------------------------------- supervision

    async def _supervise(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Run one background task for the controller's lifetime.

        An unexpected exception (or the task returning before shutdown) is contained:
        reported (an ``error`` event with op ``background``, which the metrics count, and a
        log line with the traceback) and the task restarted after a backoff that doubles up
        to :data:`RESTART_MAX_S` and starts over once a run lasted :data:`HEALTHY_S`.
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
            self._report_task_failure(name, error, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)

    def _report_task_failure(self, name: str, error: Exception | None, delay: float) -> None:
        what = f"{type(error).__name__}: {error}" if error is not None else "it returned"
        log.error(
            "background task %s failed (%s); restarting it in %.1fs",
            name,
            what,
            delay,
            exc_info=error,
        )
        assert self.manager is not None
        self.manager.events.emit(
            EventKind.ERROR,
            Op.BACKGROUND,
            message=f"background task {name} failed ({what}); restarting it in {delay:.1f}s",
            error="controller.task_failed",
            details={"task": name, "restart_in_s": delay},
        )

    def _task_ended(self, task: asyncio.Task[None]) -> None:
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
        self._fatal = True
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
            stack_dir=opts.stack_dir,
            gitops_stacks=self._gitops_stacks,
        )
        servers: list[ApiServer] = []
        try:
            if opts.listen:
                host, port = check_listen(opts.listen)
                server = ApiServer(ctx, host, port)
                address = await server.start()
                servers.append(server)
                assert self.root is not None
                self.root.lock.update(self.root.record.model_copy(update={"listen": address}))
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
        if self._fatal:
            self.say("stopping the controller after an internal error; servers keep running")
        elif self.opts.keep_running:
            self.say("stopping the controller; servers keep running (--keep-running)")
            ended = manager.revoke_leases("the controller stopped (its servers keep running)")
            if ended:
                self.say(f"ended {ended} lease(s): requests in flight get an error")
        else:
            self.say("stopping managed servers ...")
            await manager.stop_all(on_drain=self._say_drain)
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
        snapshot = read_config_dir(opts.config_dir)
        for name in pruned_pinned(state, snapshot):
            self.say(
                f"warning: pinned slot {name} is no longer in {opts.stack_dir}: kept (remove "
                f"it with `slotctl stack apply {opts.stack_dir} --prune --force`)"
            )
        try:
            changed = apply_to_config(
                state, opts.config_dir, prune=True, snapshot=snapshot, keep_pinned=True
            )
        except SlotctlError as exc:  # a refused write: report it, keep the last good state
            self.say(f"apply failed: [{exc.code}] {exc.message}")
            return False
        except OSError as exc:  # the config dir refuses writes (full, read-only)
            self.say(f"apply failed: cannot write the config dir: {exc}")
            return False
        if changed:
            self.say(f"applied {opts.stack_dir}: {', '.join(changed)}")
        return True

    async def _apply_stack_dir_off_loop(self) -> bool:
        """:meth:`apply_stack_dir` in a worker thread (parsing and writes block), one at a time."""
        async with self._apply_lock:
            return await asyncio.to_thread(self.apply_stack_dir)

    async def _refresh(self) -> None:
        """Re-read the config dir in a worker thread; the reconciler follows on the loop."""
        reconciler = self.reconciler
        assert reconciler is not None
        await reconciler.refresh_async()
        reconciler.enqueue_all()

    def _roots(self) -> dict[str, Path]:
        roots = {"config dir": self.opts.config_dir}
        if self.opts.stack_dir is not None:
            roots["stack dir"] = self.opts.stack_dir
        return roots

    async def _watch(self) -> None:
        """Follow the config dir (and the stack dir) until shutdown.

        A watch follows a directory's inode: a directory deleted, replaced (``rm -rf`` and
        re-create, ``git clone``, a rename over it) or missing is noticed within
        :data:`ROOT_CHECK_MS`, said in the log, and watched again once it exists; then
        everything is re-read, since changes may have been missed meanwhile (in GitOps mode
        the stack dir is re-applied, which also rebuilds a deleted config dir).
        """
        self._watch_runs += 1
        rebuild = self._watch_runs > 1  # restarted after a failure: changes may be missed
        while not self.stop.is_set():
            roots = self._roots()
            seen = {what: _identity(path) for what, path in roots.items()}
            present = [roots[what] for what, ident in seen.items() if ident is not None]
            if not present:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), ROOT_CHECK_MS / 1000)
                rebuild = self._roots_changed(seen) or rebuild
                continue
            # The re-read happens once the new watch runs (its first batch, at most
            # ROOT_CHECK_MS in): a change made before it is read, one made after it is
            # a change of the new watch; none falls between the two.
            async for changes in watchfiles.awatch(
                *present,
                stop_event=self.stop,
                debounce=self.opts.watch_debounce_ms,
                step=10,
                watch_filter=_relevant,
                rust_timeout=ROOT_CHECK_MS,
                yield_on_timeout=True,
            ):
                if rebuild:
                    rebuild = False
                    await self._rebuild()
                if changes:
                    await self._on_changes(changes)
                if self._roots_changed(seen, self._roots_deleted(changes)):
                    rebuild = True
                    break

    def _roots_deleted(self, changes: set[tuple[watchfiles.Change, str]]) -> set[str]:
        """The watched directories whose own deletion is among ``changes``.

        A directory deleted and re-created at once may get the same inode number back, so
        its identity alone cannot tell; its watch, though, died with the old one.
        """
        deleted = {Path(p).absolute() for c, p in changes if c == watchfiles.Change.deleted}
        return {what for what, path in self._roots().items() if path.absolute() in deleted}

    def _roots_changed(
        self, seen: dict[str, tuple[int, int] | None], deleted: set[str] | None = None
    ) -> bool:
        """Whether a watched directory appeared, vanished or was replaced; says which."""
        changed = False
        for what, path in self._roots().items():
            now = _identity(path)
            if now == seen.get(what) and what not in (deleted or ()):
                continue
            changed = True
            if now is None:
                tail = "nothing changes: the last good desired state stays"
                if what == "config dir" and self.opts.stack_dir is not None:
                    tail += "; re-applying the stack dir to rebuild it"
                self.say(f"{what} {path} is gone or not a directory: {tail}")
            else:
                self.say(f"{what} {path} was re-created or replaced: watching the new one")
        return changed

    async def _rebuild(self) -> None:
        if self.opts.stack_dir is not None and _identity(self.opts.stack_dir) is not None:
            await self._apply_stack_dir_off_loop()
        await self._refresh()

    async def _on_changes(self, changes: set[tuple[watchfiles.Change, str]]) -> None:
        stack_dir = self.opts.stack_dir
        if stack_dir is not None:
            roots = {stack_dir.absolute()}
            with contextlib.suppress(OSError, RuntimeError):  # a loop, a vanished dir
                roots.add(stack_dir.resolve())
            # Never resolve() a changed path: a symlink loop there would raise.
            touched = [Path(p).absolute() for _, p in changes]
            if any(t in roots or roots & set(t.parents) for t in touched):
                await self._apply_stack_dir_off_loop()
        await self._refresh()


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a directory, None when it is missing or not a directory."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


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

    Holds the controller lock meanwhile (the composition root takes it), so a controller
    started concurrently waits rather than adopting servers that are being stopped.
    """
    async with open_root(config_dir, state_dir, runtime_kind) as root:
        snapshot = await root.recover()
        await root.manager.stop_all(reason="slotctl down")
        stopped = 0
        for observed in await root.runtime.list_managed():
            if await root.manager.reap_orphan(observed.slot):
                stopped += 1
    say(f"stopped {len(snapshot.slots)} slot(s) and {stopped} orphan server(s)")
    return 0
