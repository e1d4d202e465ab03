"""``slotctl stack apply|diff|export`` and ``slotctl up|down``: the declarative workflow.

Exit codes follow kubectl/Flux/Argo CD: ``diff --exit-code`` is 0 in sync, 1 drift, 2 error
(any error, an unexpected one included: see ``cli.main``). ``apply`` is 0 applied (and
converged with ``--wait``/``--once``), 1 invalid or not converged in time, 2 error.

``apply`` and ``diff`` go through the controller's API (``/api/stacks/apply|diff``, the
TOML text of every file) when a controller is reachable: ``--server``/``$SLOTCTL_SERVER``
(which must answer), else the local controller of ``--state-dir`` if its API answers
``/healthz`` promptly; otherwise they work on the files directly, as without a
controller. The files are validated here first either way, and the output and exit codes
are the same on both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from controller import eventloop
from controller.apply import StackPlan, apply_to_config, observe_files, plan_stack
from controller.cli.client import (
    ApiClient,
    ApiError,
    find_controller,
    quote_segment,
    reachable_api,
)
from controller.cli.output import Style, print_json, render_problems
from controller.daemon import Controller, DaemonOptions, stop_everything
from controller.errors import SlotctlError
from controller.events import Event
from controller.logs import setup_logging
from controller.plan import Action
from controller.quadlet import render_quadlet
from controller.root import open_root
from controller.runtime import make_runtime
from controller.runtime.base import Runtime
from controller.spec.configdir import read_config_dir, read_settings
from controller.spec.loader import DesiredState, LoadReport, load_stacks
from controller.spec.problems import Problem
from controller.spec.render import render_stack
from controller.store import ControllerLock

__all__ = ["cmd_apply", "cmd_diff", "cmd_down", "cmd_export", "cmd_up"]

EXIT_OK, EXIT_NEGATIVE, EXIT_ERROR = 0, 1, 2

_KIND_COLOUR = {
    "create": "green",
    "recreate": "yellow",
    "load": "green",
    "update": "yellow",
    "delete": "red",
    "unload": "red",
    "adopt": "dim",
    "noop": "dim",
}


def _load(args: argparse.Namespace) -> tuple[LoadReport, Style]:
    settings, problems = read_settings(args.config_dir)
    report = load_stacks(args.paths, settings)
    report.errors[:0] = problems
    return report, Style(sys.stdout)


def _runtime_for(args: argparse.Namespace) -> tuple[Runtime, bool]:
    """The runtime of the running controller (if any), else ``--runtime``."""
    running = ControllerLock(args.state_dir).running()
    kind = running.runtime if running else args.runtime
    return make_runtime(kind, args.state_dir), running is not None


def _action_line(action: Action, style: Style) -> str:
    colour = getattr(style, _KIND_COLOUR.get(action.kind, "dim"))
    return f"  {colour(f'{action.kind:<9}')} {action.slot:<20} {action.reason}"


# ===================================================================== through the API


def _stack_api(args: argparse.Namespace) -> ApiClient | None:
    """The controller's API for apply/diff, or None to work on the files directly."""
    return reachable_api(
        args.state_dir,
        getattr(args, "api_server", None),
        getattr(args, "api_token", None),
        timeout=300.0,
    )


def _stack_files(report: LoadReport) -> list[dict[str, str]]:
    return [{"name": f, "text": Path(f).read_text(encoding="utf-8")} for f in report.files]


def _remote_plan(state: DesiredState, answer: dict[str, Any]) -> StackPlan:
    return StackPlan(
        state=state,
        actions=[Action(**a) for a in answer.get("actions", [])],
        config_diffs=dict(answer.get("config_diffs", {})),
        drift=dict(answer.get("drift", {})),
        notes=dict(answer.get("notes", {})),
        orphans=list(answer.get("orphans", [])),
        models_changed=list(answer.get("models_changed", [])),
    )


def _remote_problems(exc: ApiError) -> list[Problem]:
    fields = set(Problem.__dataclass_fields__)
    problems = exc.details.get("problems")
    if not isinstance(problems, list):
        return []
    return [
        Problem(**{k: v for k, v in p.items() if k in fields})
        for p in problems
        if isinstance(p, dict) and "code" in p and "message" in p
    ]


async def _plan(args: argparse.Namespace, state: DesiredState, prune: bool) -> StackPlan:
    runtime, _ = _runtime_for(args)
    try:
        return await plan_stack(state, args.config_dir, args.state_dir, runtime, prune=prune)
    finally:
        await runtime.close()


# ===================================================================== apply


def cmd_apply(args: argparse.Namespace) -> int:
    report, style = _load(args)
    if not report.ok or report.state is None:
        for line in render_problems([*report.errors, *report.warnings], Style(sys.stderr)):
            print(line, file=sys.stderr)
        print("slotctl: stack is invalid: nothing was applied", file=sys.stderr)
        return EXIT_NEGATIVE
    state = report.state
    # Refuse before anything is written: an error exit must mean "nothing changed".
    api = None if args.once else _stack_api(args)
    running = api is not None or ControllerLock(args.state_dir).running() is not None
    if args.once and running and not args.dry_run:
        print("slotctl: a controller is running on this state dir: use --wait", file=sys.stderr)
        return EXIT_ERROR
    if args.wait and not running and not args.dry_run:
        print(
            f"slotctl: no controller is running on {args.state_dir}: start `slotctl up` "
            "or use --once to reconcile in this process (nothing was applied)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if api is not None:
        return _apply_remote(args, api, report, state, style)
    plan = asyncio.run(_plan(args, state, args.prune))
    shown = [a for a in plan.actions if a.kind != "noop"]
    print(style.bold(f"plan for stack {', '.join(state.stacks)}:"))
    for action in shown or plan.actions[:0]:
        print(_action_line(action, style))
    if not shown:
        print(style.dim("  (no changes)"))
    if args.dry_run:
        print(style.dim("dry run: nothing written"))
        return EXIT_OK
    changed = apply_to_config(state, args.config_dir, prune=args.prune, force=args.force)
    print(f"configured: {', '.join(changed) if changed else 'nothing changed'}")
    if args.once:
        return EXIT_OK if asyncio.run(_converge_once(args)) else EXIT_NEGATIVE
    if args.wait:
        return EXIT_OK if asyncio.run(_wait(args, state)) else EXIT_NEGATIVE
    return EXIT_OK


def _apply_remote(
    args: argparse.Namespace,
    api: ApiClient,
    report: LoadReport,
    state: DesiredState,
    style: Style,
) -> int:
    """``cmd_apply`` through ``/api/stacks/apply``: the same output and exit codes."""
    body: dict[str, Any] = {
        "files": _stack_files(report),
        "prune": args.prune,
        "force": args.force,
        "dry_run": args.dry_run,
    }
    try:
        _, answer = api.post("/api/stacks/apply", body)
    except ApiError as exc:
        problems = _remote_problems(exc)
        if exc.status != 400 or not problems:
            raise
        for line in render_problems(problems, Style(sys.stderr)):
            print(line, file=sys.stderr)
        print("slotctl: stack is invalid: nothing was applied", file=sys.stderr)
        return EXIT_NEGATIVE
    actions = [Action(**a) for a in answer.get("plan", [])]
    shown = [a for a in actions if a.kind != "noop"]
    print(style.bold(f"plan for stack {', '.join(state.stacks)}:"))
    for action in shown:
        print(_action_line(action, style))
    if not shown:
        print(style.dim("  (no changes)"))
    if args.dry_run:
        print(style.dim("dry run: nothing written"))
        return EXIT_OK
    changed = answer.get("changed") or []
    print(f"configured: {', '.join(changed) if changed else 'nothing changed'}")
    if args.wait:
        return EXIT_OK if _wait_remote(args, api, state, body["files"]) else EXIT_NEGATIVE
    return EXIT_OK


def _wait_remote(
    args: argparse.Namespace, api: ApiClient, state: DesiredState, files: list[dict[str, str]]
) -> bool:
    """``_wait`` through the API: the controller's diff and slot views until in sync."""
    started = time.monotonic()
    deadline = started + args.timeout
    last: dict[str, str] = {}
    while True:
        _, answer = api.post("/api/stacks/diff", {"files": files, "prune": args.prune})
        plan = _remote_plan(state, answer)
        views = {v["name"]: v for v in api.get("/api/slots").get("slots", [])}
        for name in state.slots:
            view = views.get(name)
            shown = str(view["state"]) if view else "pending"
            if last.get(name) != shown:
                last[name] = shown
                elapsed = time.monotonic() - started
                message = view.get("message") if view else ""
                note = f"  {message}" if message else ""
                print(f"  {elapsed:6.1f}s  {name:<20} {shown}{note}", flush=True)
        if plan.in_sync:
            print(f"converged in {time.monotonic() - started:.1f}s")
            return True
        if time.monotonic() >= deadline:
            stuck = {a.slot: a.reason for a in plan.actions if a.kind != "noop"}
            stuck.update({n: "; ".join(d) for n, d in plan.drift.items() if d})
            messages = {n: str(v.get("message") or "") for n, v in views.items()}
            _report_stuck(stuck, {n: m for n, m in messages.items() if m})
            return False
        time.sleep(0.25)


async def _converge_once(args: argparse.Namespace) -> bool:
    """Reconcile in this process until converged; servers stay running (adoptable)."""
    async with open_root(args.config_dir, args.state_dir, args.runtime) as root:
        manager, reconciler = root.manager, root.reconciler
        started = time.monotonic()
        with manager.events.subscribe() as events:
            printer = asyncio.create_task(_print_progress(events, started))
            await root.recover()
            ok = await reconciler.converge(timeout=args.timeout)
            await asyncio.sleep(0)
            printer.cancel()
        if not ok:
            _report_stuck(
                {
                    n: v.message
                    for n, v in ((x.name, x) for x in manager.views())
                    if n in reconciler.errors or not v.dispatchable
                },
                reconciler.errors,
            )
        else:
            print(f"converged in {time.monotonic() - started:.1f}s (servers keep running)")
        return ok


async def _print_progress(events: Any, started: float) -> None:
    async for event in events:
        assert isinstance(event, Event)
        if event.kind == "transition":
            elapsed = time.monotonic() - started
            print(
                f"  {elapsed:6.1f}s  {event.slot:<20} {event.from_state} -> {event.to_state}"
                + (f"  {event.message}" if event.message else "")
            )
        elif event.kind in ("refusal", "error"):
            print(f"  {'':6}   {event.slot or '-':<20} {event.kind}: {event.message}")


def _report_stuck(stuck: dict[str, str], errors: dict[str, str]) -> None:
    print("slotctl: not converged; stuck slots:", file=sys.stderr)
    for name, message in sorted(stuck.items()):
        print(f"  {name}: {errors.get(name) or message or 'waiting'}", file=sys.stderr)


async def _wait(args: argparse.Namespace, state: DesiredState) -> bool:
    """Follow a running controller through state.json until the plan is all noop."""
    runtime, _ = _runtime_for(args)
    started = time.monotonic()
    deadline = started + args.timeout
    last: dict[str, str] = {}
    try:
        while True:
            plan = await plan_stack(
                state, args.config_dir, args.state_dir, runtime, prune=args.prune
            )
            observed = await observe_files(state.slots, args.state_dir, runtime)
            for name, obs in observed.items():
                shown = obs.state.value if obs.state else "pending"
                if last.get(name) != shown:
                    last[name] = shown
                    elapsed = time.monotonic() - started
                    note = f"  {obs.message}" if obs.message else ""
                    print(f"  {elapsed:6.1f}s  {name:<20} {shown}{note}")
            if plan.in_sync:
                print(f"converged in {time.monotonic() - started:.1f}s")
                return True
            if time.monotonic() >= deadline:
                stuck = {a.slot: a.reason for a in plan.actions if a.kind != "noop"}
                stuck.update({n: "; ".join(d) for n, d in plan.drift.items() if d})
                _report_stuck(stuck, {n: o.message for n, o in observed.items() if o.message})
                return False
            await asyncio.sleep(0.25)
    finally:
        await runtime.close()


# ===================================================================== diff


def cmd_diff(args: argparse.Namespace) -> int:
    report, style = _load(args)
    if not report.ok or report.state is None:
        for line in render_problems(report.errors, Style(sys.stderr)):
            print(line, file=sys.stderr)
        print("slotctl: stack is invalid: cannot diff", file=sys.stderr)
        return EXIT_ERROR
    api = _stack_api(args)
    if api is not None:
        _, answer = api.post("/api/stacks/diff", {"files": _stack_files(report), "prune": True})
        plan = _remote_plan(report.state, answer)
        patch = list(answer.get("json_patch", []))
    else:
        plan = asyncio.run(_plan(args, report.state, True))
        patch = plan.json_patch()
    if args.output == "json":
        print_json(plan.to_dict())
    elif args.output == "json-patch":
        print(json.dumps(patch, indent=2))
    else:
        _print_diff(plan, style)
    if args.exit_code and not plan.in_sync:
        return EXIT_NEGATIVE
    return EXIT_OK


def _print_diff(plan: StackPlan, style: Style) -> None:
    by_slot = {a.slot: a for a in plan.actions}
    for name, action in by_slot.items():
        diff = plan.config_diffs.get(name, "")
        drift = plan.drift.get(name, [])
        notes = plan.notes.get(name, [])
        if action.kind == "noop" and not diff and not drift and not notes:
            continue
        print(style.bold(f"=== slot {name}: {action.kind}") + f" — {action.reason}")
        for line in diff.splitlines():
            if line.startswith("+") and not line.startswith("+++"):
                print(style.green(line))
            elif line.startswith("-") and not line.startswith("---"):
                print(style.red(line))
            else:
                print(style.dim(line) if line.startswith("@@") else line)
        for line in drift:
            print(style.yellow(f"  runtime drift: {line}"))
        for line in notes:
            print(style.dim(f"  note: {line}"))
    for name in plan.orphans:
        print(style.bold(f"=== orphan {name}") + " — a managed server nobody declares")
    if plan.models_changed:
        print(
            style.bold("=== models") + f" — differ from the live catalogue: "
            f"{', '.join(plan.models_changed)}"
        )
    if plan.in_sync:
        print(style.green("in sync"))


# ===================================================================== export


def cmd_export(args: argparse.Namespace) -> int:
    snapshot = read_config_dir(args.config_dir)
    for problem in snapshot.errors:
        print(f"slotctl: warning: {problem.where()}: {problem.message}", file=sys.stderr)
    stacks = sorted({s.stack or "default" for s in snapshot.slots.values()})
    if args.stack:
        stacks = [s for s in stacks if s == args.stack]
        if not stacks:
            print(f"slotctl: no slots belong to stack {args.stack!r}", file=sys.stderr)
            return EXIT_ERROR
    if args.format == "quadlet":
        return _export_quadlet(args, snapshot)
    if len(stacks) > 1 and not args.output_dir:
        print(
            f"slotctl: several stacks ({', '.join(stacks)}): pick one with --stack or use "
            "--output-dir",
            file=sys.stderr,
        )
        return EXIT_ERROR
    referenced = {s.spec.model_id for s in snapshot.slots.values()}
    for index, stack in enumerate(stacks):
        slots = [s for s in snapshot.slots.values() if (s.stack or "default") == stack]
        used = {s.spec.model_id for s in slots}
        models = [m for m in snapshot.models.values() if m.id in used]
        if index == 0 and not args.stack:
            models += [m for m in snapshot.models.values() if m.id not in referenced]
        text = render_stack(stack, models, slots, full=False)
        _emit(args, f"{stack}.toml", text)
    return EXIT_OK


def _export_quadlet(args: argparse.Namespace, snapshot: Any) -> int:
    failed = 0
    for slot in snapshot.slots.values():
        if args.stack and slot.stack != args.stack:
            continue
        try:
            unit = render_quadlet(slot, snapshot.models)
        except SlotctlError as exc:
            print(f"slotctl: skipped {slot.name}: {exc.message}", file=sys.stderr)
            failed += 1
            continue
        _emit(args, f"slotctl-{slot.name}.container", unit)
    return EXIT_ERROR if failed else EXIT_OK


def _emit(args: argparse.Namespace, filename: str, text: str) -> None:
    if args.output_dir:
        out: Path = args.output_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / filename).write_text(text, encoding="utf-8")
        print(f"wrote {out / filename}")
    else:
        if args.format == "quadlet":
            print(f"# ---- {filename} ----")
        sys.stdout.write(text)


# ===================================================================== up / down


def cmd_up(args: argparse.Namespace) -> int:
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
    )
    if args.stack_dir is not None and not args.stack_dir.is_dir():
        print(f"slotctl: {args.stack_dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    return eventloop.run(Controller(opts).run())  # uvloop when installed (SLOTCTL_EVENT_LOOP)


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


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the controller, then any managed server left; without one, say so.

    A state dir that does not exist holds no controller and no server record: nothing is
    created (``down`` must not leave a fresh state dir behind a typo). While the
    controller drains, Ctrl-C asks it to stop at once (its second interrupt).
    """
    state_dir: Path = args.state_dir
    if not state_dir.is_dir():
        print(f"no controller is running on {state_dir} (no such state dir): nothing to stop")
        return EXIT_OK
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
            return EXIT_ERROR
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
