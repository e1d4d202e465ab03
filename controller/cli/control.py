"""``slotctl up`` and ``slotctl down``: run the controller in the foreground, stop it.

``up`` hands its options to :class:`controller.daemon.Controller` (its exit status is the
controller's: 0, or 1 after an internal error); ``down`` signals the running controller
(``controller.json``), says what it drains (from its API), and without one stops the
servers left behind through the composition root (``daemon.stop_everything``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from controller.cli.client import ApiClient, find_controller, quote_segment
from controller.daemon.main import Controller, DaemonOptions, stop_everything
from controller.kit import eventloop
from controller.kit.logs import setup_logging
from controller.model.errors import SlotctlError
from controller.model.exitcode import ExitCode
from controller.store.lock import ControllerLock

__all__ = ["cmd_down", "cmd_up"]


def cmd_up(args: argparse.Namespace) -> ExitCode:
    setup_logging(args.log_format, args.log_level)
    opts = DaemonOptions(
        config_dir=args.config_dir,
        state_dir=args.state_dir,
        runtime=args.runtime,
        stack_dir=args.stack_dir,
        keep_running=args.keep_running,
        resync_s=args.resync,
        quiet=args.log_format == "json",
        listen=None if args.listen == "none" else args.listen,
        metrics_listen=args.metrics_listen,
        token=args.token
        or getattr(args, "api_token", None)
        or os.environ.get("SLOTCTL_TOKEN")
        or None,
        allowed_hosts=tuple(args.allowed_host),
    )
    if args.stack_dir is not None and not args.stack_dir.is_dir():
        print(f"slotctl: {args.stack_dir} is not a directory", file=sys.stderr)
        return ExitCode.ERROR
    # uvloop when installed (SLOTCTL_EVENT_LOOP)
    return ExitCode(eventloop.run(Controller(opts).run))


def _wait_exited(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited. A zombie has exited: it waits for its parent (a
    supervisor, a shell, a test runner) to reap it, which may never be us
    (``psutil.Process.wait`` would wait for the reaping, and time out)."""
    deadline = time.monotonic() + timeout
    try:
        proc = psutil.Process(pid)
        while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        pass
    return True


def cmd_down(args: argparse.Namespace) -> ExitCode:
    """Stop the controller, then any managed server left; without one, say so.

    A state dir that does not exist holds no controller and no server record: nothing is
    created (``down`` must not leave a fresh state dir behind a typo). While the
    controller drains, Ctrl-C asks it to stop at once (its second interrupt).
    """
    state_dir: Path = args.state_dir
    if not state_dir.is_dir():
        print(f"no controller is running on {state_dir} (no such state dir): nothing to stop")
        return ExitCode.OK
    running = ControllerLock(state_dir).running()
    kind = running.runtime if running else args.runtime
    if running is None:
        print(f"no controller is running on {state_dir}; stopping any server it left ...")
    else:
        print(
            f"stopping the controller (pid {running.pid}); waiting up to {args.timeout:g}s "
            "for it to drain and stop its servers (Ctrl-C: stop them now) ..."
        )
        for line in _drains(args):
            print(f"  {line}")
        os.kill(running.pid, signal.SIGTERM)
        try:
            stopped = _wait_exited(running.pid, args.timeout)
        except KeyboardInterrupt:
            print("  interrupted: the controller stops its servers without waiting", flush=True)
            os.kill(running.pid, signal.SIGTERM)  # its second interrupt: no more draining
            stopped = _wait_exited(running.pid, args.timeout)
        if not stopped:
            print(
                f"slotctl: controller pid {running.pid} did not stop within {args.timeout:g}s",
                file=sys.stderr,
            )
            return ExitCode.ERROR
    return asyncio.run(stop_everything(args.config_dir, args.state_dir, kind, print))


def _drains(args: argparse.Namespace) -> list[str]:
    """What the controller will wait for, from its API (nothing when it has none)."""
    lines: list[str] = []
    try:
        endpoint = find_controller(args.state_dir, None, getattr(args, "api_token", None))
        api = ApiClient(endpoint, timeout=2.0)
        for view in api.get("/api/slots").get("slots", []):
            name = str(view["name"])
            requests = int(view.get("leases", 0)) - int(view.get("holds", 0))
            if requests > 0:
                spec = api.get(f"/api/slots/{quote_segment(name)}").get("spec") or {}
                timeout = spec.get("drain_timeout_s")
                limit = f"{timeout:g}s" if isinstance(timeout, int | float) else "drain_timeout_s"
                lines.append(
                    f"slot {name}: {requests} request(s) in flight, drained for up to {limit}"
                )
            if view.get("holds"):
                lines.append(f"slot {name}: {view['holds']} hold(s) released (not drained)")
    except SlotctlError:  # no API, or it does not answer: the controller still stops
        return lines
    return lines
