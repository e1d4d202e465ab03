"""``slotctl up``: start-up and shutdown wiring of the controller.

Composition only: the SlotManager changes state, the reconciler decides what to do, the
guard writes config. This module checks the start can succeed (preflight), opens the
composition root (lock, runtime, manager, reconciler), starts the API servers, runs the
background tasks under the supervisor (``daemon.supervise``: the reconciler, the
manager's housekeeping and the directory watcher of ``daemon.watch``), prints progress
(one :func:`~controller.model.events.event_line` per event) and shuts down cleanly on
SIGINT/SIGTERM: drains, then stops managed servers unless ``--keep-running``, which
leaves them for the next ``up`` to adopt; the API goes last.
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

from controller import __version__
from controller.api.app import ApiContext
from controller.api.assembly import build_probe_app
from controller.api.dashboard import LOGIN_CODE_TTL_S, login_path, mint_login_code
from controller.api.server import ApiServer, check_listen, is_loopback
from controller.daemon.gitops import GitOps
from controller.daemon.root import Root, controller_record, open_root
from controller.daemon.supervise import Supervisor
from controller.daemon.watch import DirWatcher
from controller.kit.eventbus import Subscription
from controller.model.errors import SlotConfigError
from controller.model.events import PROGRESS_KINDS, Event, EventKind, Op, event_line
from controller.model.exitcode import ExitCode
from controller.reconcile.reconciler import Action, Reconciler
from controller.slots.manager import SlotManager
from controller.spec.desired import DesiredCache
from controller.store.lock import ControllerLock, ensure_token

__all__ = ["Controller", "DaemonOptions", "root_warning", "stop_everything"]

log = logging.getLogger("slotctl.daemon")


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
    allowed_hosts: tuple[str, ...] = ()  # --allowed-host: Host names answered (and below)
    quiet: bool = False  # --log-format json: the structured log replaces progress lines


class Controller:
    def __init__(self, opts: DaemonOptions) -> None:
        self.opts = opts
        self.stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.root: Root | None = None
        self.manager: SlotManager | None = None
        self.reconciler: Reconciler | None = None
        self.supervisor: Supervisor | None = None
        self.watcher: DirWatcher | None = None
        # The desired state's one owner: the reconciler's, read by the API, GitOps and the
        # operator's CR source.
        self.desired = DesiredCache(opts.config_dir)
        self.gitops = (
            GitOps(opts.stack_dir, opts.config_dir, self.say, desired=self.desired)
            if opts.stack_dir
            else None
        )
        self._forced = False  # a second interrupt: drains end at once

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
        self._write(f"{stamp} {text}")

    def _write(self, line: str) -> None:
        self.opts.out.write(line + "\n")
        self.opts.out.flush()

    def _print_plan(self, action: Action) -> None:
        self.say(f"plan   {action.slot:<16} {action.kind:<9} {action.reason}")

    def _printable(self, event: Event) -> bool:
        """What ``up`` prints (its subscription takes nothing else: it is not woken twice a
        request for the lease flips)."""
        if self.opts.quiet:
            return False  # already a structured log line (controller.model.events)
        if event.kind == EventKind.TRANSITION and event.op == Op.LEASE:
            return False  # ready <-> serving, twice a request: the event stream has them
        return event.kind in PROGRESS_KINDS

    def _print_event(self, event: Event) -> None:
        if self._printable(event):
            self._write(event_line(event))

    # ---------------------------------------------------------------- start

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

    async def run(self) -> ExitCode:
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
            desired=self.desired,
        ) as root:
            self.root = root
            return await self._run_locked(root)

    async def _run_locked(self, root: Root) -> ExitCode:
        opts = self.opts
        if root.swept:
            self.say(f"removed {root.swept} temp file(s) left by an interrupted write")
        warning = root_warning(os.geteuid(), opts.runtime)
        if warning is not None:
            self.say(warning)
        if root.lock.tightened:
            self.say(
                f"the state dir {opts.state_dir} was open to other users: made it private "
                "(0700; it holds the API token and the servers' logs)"
            )
        for problem in root.problems:
            self.say(f"config {problem.where()}: {problem.message}")
        manager, reconciler = root.manager, root.reconciler
        self.manager, self.reconciler = manager, reconciler
        gitops = self.gitops
        if gitops is not None:
            await gitops.apply_off_loop()
        self._install_signals()
        self.say(
            f"slotctl {__version__} controller: runtime {opts.runtime}, config "
            f"{opts.config_dir}, state {opts.state_dir}"
            + (f", GitOps from {opts.stack_dir}" if opts.stack_dir else "")
        )
        servers = await self._start_api(manager, reconciler)
        supervisor = self.supervisor = Supervisor(self.stop, manager.events, self.say)
        self.watcher = DirWatcher(
            opts.config_dir,
            opts.stack_dir,
            stop=self.stop,
            say=self.say,
            refresh=self._refresh,
            apply_stack_dir=gitops.apply_off_loop if gitops is not None else None,
            debounce_ms=opts.watch_debounce_ms,
        )
        with manager.events.subscribe(accept=self._printable, flips=False) as events:
            printer = asyncio.create_task(self._print_events(events))
            # Nothing is adopted, restored or reaped before every source of desired state
            # is synced (the operator's custom resources listed): a stop meanwhile ends it.
            if await self._synced():
                await root.recover()
                # Resident and autoload slots load in priority order before the reconciler's
                # workers start: the most important get the memory, the rest wait for it.
                await manager.restore(wait=False)
                for server in servers:
                    server.ctx.ready.set()
                supervisor.start("reconciler", lambda: reconciler.run(self.stop))
                supervisor.start("manager", lambda: manager.run(self.stop))
                supervisor.start("watch", self.watcher.run)
                if gitops is not None:
                    # A save between the first apply and the watcher taking over (recover()
                    # can take a while) would otherwise wait for the next save: apply once
                    # more (idempotent) once the watcher runs.
                    await asyncio.sleep(0.1)
                    await gitops.apply_off_loop()
                self.ready.set()
            try:
                await self.stop.wait()
            finally:
                # Drains first, the API last: a request in flight finishes (or its stream
                # ends with an error event) instead of being cut by the server going away.
                try:
                    await self._shutdown(supervisor, printer)
                finally:
                    for server in servers:
                        await server.stop()
        return ExitCode.FATAL if supervisor.fatal else ExitCode.OK

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
            gitops_stacks=self.gitops.stacks if self.gitops is not None else set(),
            allowed_hosts=opts.allowed_hosts,
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
                self._offer_login(ctx, address)
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

    async def _synced(self) -> bool:
        """Until the desired state is synced (True) or the controller is stopped (False)."""
        if self.desired.synced:
            return True
        self.say("waiting for the desired state's sources to be listed")
        synced = asyncio.ensure_future(self.desired.wait_synced())
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({synced, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            synced.cancel()
            stopped.cancel()
        return self.desired.synced

    async def _print_events(self, events: Subscription) -> None:
        async for event in events:
            self._print_event(event)

    async def _refresh(self) -> None:
        """Re-read the config dir in a worker thread; the reconciler queues what changed."""
        reconciler = self.reconciler
        assert reconciler is not None
        await reconciler.refresh_async()

    # ---------------------------------------------------------------- stop

    async def _shutdown(self, supervisor: Supervisor, printer: asyncio.Task[None]) -> None:
        self.stop.set()
        await supervisor.join()
        manager = self.manager
        assert manager is not None
        if supervisor.fatal:
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

    def _offer_login(self, ctx: ApiContext, address: str) -> None:
        """The one-time dashboard link, only on a terminal: the code buys the token, and
        a log file or the journal (stdout under systemd) is readable by others. With
        ``--log-format json`` it goes to stderr (on a terminal), outside the log stream;
        elsewhere the line says where to get one."""
        stream = sys.stderr if self.opts.quiet else self.opts.out
        if not _is_terminal(stream):
            self.say(
                "dashboard login: `slotctl dashboard` prints a one-time link (none is "
                "printed here: the output is not a terminal)"
            )
            return
        url = f"http://{address}{login_path(mint_login_code(ctx))}"
        text = (
            f"dashboard login: {url}  (one-time link, valid {LOGIN_CODE_TTL_S / 60:g} min; "
            "`slotctl dashboard` prints a new one)"
        )
        if self.opts.quiet:
            stream.write(text + "\n")
            stream.flush()
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


def root_warning(euid: int, runtime: str) -> str | None:
    """The start's warning for a root controller on the process runtime (None: none).

    Its servers run as the controller's user, and a stack file chooses their binary,
    arguments and environment (docs/reliability.md, "Security model"): as root, whoever
    may write a stack file (the GitOps dir) or holds the API token runs code as root."""
    if euid != 0 or runtime != "process":
        return None
    return (
        "warning: slotctl runs as root with the process runtime: every server runs as root, "
        "and whoever can write a stack file or holds the API token chooses what runs; run "
        "it as an unprivileged user, set allowed_binaries in controller.toml, or use "
        "--runtime docker (docs/reliability.md, Security model)"
    )


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


async def stop_everything(
    config_dir: Path,
    state_dir: Path,
    runtime_kind: str,
    say: Callable[[str], None],
) -> ExitCode:
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
    return ExitCode.OK
