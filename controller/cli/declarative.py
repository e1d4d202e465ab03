"""``slotctl stack apply|diff``: the declarative workflow, one code path over either backend.

The files are validated here first; then the stack backend chosen once per command
(``cli.backend.open_backend``: the controller's API when one is reachable, else the
config and state dirs) plans, writes and observes, so the output and exit codes are the
same on both. ``apply --wait`` follows the backend until the stack is in sync;
``apply --once`` (no controller running) converges in this process through the
composition root, on the event loop ``slotctl up`` runs on (:mod:`controller.kit.eventloop`),
printing the manager's events.

Exit codes (:class:`~controller.model.exitcode.ExitCode`) follow kubectl/Flux/Argo CD:
``diff --exit-code`` is 0 in sync, 1 drift, 2 error (any error, an unexpected one
included: see ``cli.main``). ``apply`` is 0 applied (and converged with
``--wait``/``--once``), 1 invalid or not converged in time, 2 error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from controller.cli.backend import StackBackend, StackRejected, StackRequest
from controller.cli.output import Style, print_json, render_problems
from controller.cli.progress import Progress
from controller.cli.stack import load_report
from controller.daemon.root import open_root
from controller.kit import eventloop
from controller.kit.eventbus import Subscription
from controller.model.events import PROGRESS_KINDS, event_line
from controller.model.exitcode import ExitCode
from controller.reconcile.apply import StackPlan
from controller.reconcile.plan import Action
from controller.spec.problems import Problem
from controller.store.lock import ControllerLock

__all__ = ["cmd_apply", "cmd_diff", "open_backend", "wait"]

# Applies and diffs of large stacks plan against every slot: give the API time.
STACK_TIMEOUT_S = 300.0

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
_POLL_S = 0.25


def _print_problems(problems: list[Problem], what: str) -> None:
    for line in render_problems(problems, Style(sys.stderr)):
        print(line, file=sys.stderr)
    print(f"slotctl: stack is invalid: {what}", file=sys.stderr)


def open_backend(args: argparse.Namespace, *, remote: bool = True) -> StackBackend:
    """The API backend when a controller is reachable (and ``remote``), else the local."""
    if remote:
        from controller.cli.client import reachable_api

        api = reachable_api(
            args.state_dir,
            getattr(args, "api_server", None),
            getattr(args, "api_token", None),
            timeout=STACK_TIMEOUT_S,
        )
        if api is not None:
            from controller.cli.backend_api import ApiBackend

            return ApiBackend(api)
    from controller.cli.backend_local import LocalBackend

    return LocalBackend(args.config_dir, args.state_dir, args.runtime)


def _action_line(action: Action, style: Style) -> str:
    colour = getattr(style, _KIND_COLOUR.get(action.kind, "dim"))
    return f"  {colour(f'{action.shown_kind:<9}')} {action.slot:<20} {action.reason}"


def _alias_line(line: str, style: Style, what: str = "alias") -> str:
    sign, _, text = line.partition(" ")
    kind, colour = {"+": ("create", style.green), "-": ("delete", style.red)}.get(
        sign, ("update", style.yellow)
    )
    return f"  {colour(f'{kind:<9}')} {what} {text}"


# ===================================================================== apply


def cmd_apply(args: argparse.Namespace) -> ExitCode:
    report, style = load_report(args), Style(sys.stdout)
    if not report.ok or report.state is None:
        _print_problems([*report.errors, *report.warnings], "nothing was applied")
        return ExitCode.NEGATIVE
    request = StackRequest.from_report(report)
    # ``--once`` runs on the loop ``slotctl up`` runs on; a bad SLOTCTL_EVENT_LOOP is
    # refused here, before anything is written.
    loop = eventloop.loop_factory() if args.once and not args.dry_run else None
    with open_backend(args, remote=not args.once) as backend:
        # Refuse before anything is written: an error exit must mean "nothing changed".
        running = backend.remote or ControllerLock(args.state_dir).running() is not None
        if args.once and running and not args.dry_run:
            print("slotctl: a controller is running on this state dir: use --wait", file=sys.stderr)
            return ExitCode.ERROR
        if args.wait and not running and not args.dry_run:
            print(
                f"slotctl: no controller is running on {args.state_dir}: start `slotctl up` "
                "or use --once to reconcile in this process (nothing was applied)",
                file=sys.stderr,
            )
            return ExitCode.ERROR
        try:
            applied = backend.apply(
                request, prune=args.prune, force=args.force, dry_run=args.dry_run
            )
        except StackRejected as exc:
            _print_problems(exc.located, "nothing was applied")
            return ExitCode.NEGATIVE
        shown = [a for a in applied.actions if a.kind != "noop"]
        print(style.bold(f"plan for stack {', '.join(request.state.stacks)}:"))
        for action in shown:
            print(_action_line(action, style))
        for line in applied.aliases:  # what the aliases become: + new, ~ changed, - removed
            print(_alias_line(line, style))
        for line in applied.adapters:  # and the adapters
            print(_alias_line(line, style, "adapter"))
        if not shown and not applied.aliases and not applied.adapters:
            print(style.dim("  (no changes)"))
        for what in applied.left_behind:  # as docker compose warns of orphans
            print(
                style.yellow(f"  left behind: {what}")
                + " — the stack no longer declares it; `stack apply --prune` removes it"
            )
        if args.dry_run:
            print(style.dim("dry run: nothing written"))
            return ExitCode.OK
        changed = applied.changed
        print(f"configured: {', '.join(changed) if changed else 'nothing changed'}")
        if args.wait:
            converged = wait(backend, request, prune=args.prune, timeout=args.timeout)
            return ExitCode.OK if converged else ExitCode.NEGATIVE
    if loop is not None:
        converged = eventloop.run(lambda: _converge_once(args), loop)
        return ExitCode.OK if converged else ExitCode.NEGATIVE
    return ExitCode.OK


def wait(backend: StackBackend, request: StackRequest, *, prune: bool, timeout: float) -> bool:
    """Follow the controller (through ``backend``) until the stack is in sync: a line per
    slot state seen change, then ``converged in …`` (True) or the stuck slots (False)."""
    progress = Progress()
    deadline = time.monotonic() + timeout
    names = list(request.state.slots)
    while True:
        plan = backend.diff(request, prune=prune).plan
        observed = backend.observe(names)
        for name, status in observed.items():
            progress.seen(name, status.state, status.message, status.pull)
        if plan.in_sync:
            progress.close()
            print(f"converged in {progress.elapsed:.1f}s")
            return True
        if time.monotonic() >= deadline:
            progress.close()
            _report_stuck(_stuck(plan), {n: s.message for n, s in observed.items() if s.message})
            return False
        time.sleep(_POLL_S)


def _stuck(plan: StackPlan) -> dict[str, str]:
    stuck = {a.slot: a.reason for a in plan.actions if a.kind != "noop"}
    stuck.update({n: "; ".join(d) for n, d in plan.drift.items() if d})
    return stuck


def _report_stuck(stuck: dict[str, str], errors: dict[str, str]) -> None:
    print("slotctl: not converged; stuck slots:", file=sys.stderr)
    for name, message in sorted(stuck.items()):
        print(f"  {name}: {errors.get(name) or message or 'waiting'}", file=sys.stderr)


async def _converge_once(args: argparse.Namespace) -> bool:
    """Reconcile in this process until converged; servers stay running (adoptable)."""
    async with open_root(args.config_dir, args.state_dir, args.runtime) as root:
        manager, reconciler = root.manager, root.reconciler
        started = time.time()
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
            print(f"converged in {time.time() - started:.1f}s (servers keep running)")
        return ok


async def _print_progress(events: Subscription, started: float) -> None:
    async for event in events:
        if event.kind in PROGRESS_KINDS:
            print(event_line(event, started=started), flush=True)


# ===================================================================== diff


def cmd_diff(args: argparse.Namespace) -> ExitCode:
    report, style = load_report(args), Style(sys.stdout)
    if not report.ok or report.state is None:
        _print_problems(report.errors, "cannot diff")
        return ExitCode.ERROR
    with open_backend(args) as backend:
        diff = backend.diff(StackRequest.from_report(report), prune=True)
    plan = diff.plan
    if args.output == "json":
        print_json(plan.to_dict())
    elif args.output == "json-patch":
        print(json.dumps(diff.json_patch, indent=2))
    else:
        _print_diff(plan, style)
    if args.exit_code and not plan.in_sync:
        return ExitCode.NEGATIVE
    return ExitCode.OK


def _print_diff(plan: StackPlan, style: Style) -> None:
    by_slot = {a.slot: a for a in plan.actions}
    for name, action in by_slot.items():
        diff = plan.config_diffs.get(name, "")
        drift = plan.drift.get(name, [])
        notes = plan.notes.get(name, [])
        if action.kind == "noop" and not diff and not drift and not notes:
            continue
        print(style.bold(f"=== slot {name}: {action.shown_kind}") + f" — {action.reason}")
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
    if plan.models_unused:
        print(
            style.bold("=== models") + " — in the live catalogue, declared by no stack given "
            f"and used by no slot or alias: {', '.join(plan.models_unused)} "
            "(`stack apply --prune` removes them)"
        )
    if plan.aliases_changed:
        print(style.bold("=== aliases") + " — differ from the live aliases:")
        for line in plan.aliases_changed:
            paint = style.green if line.startswith("+") else style.red if line[:1] == "-" else str
            print(paint(f"  {line}"))
    if plan.adapters_changed:
        print(style.bold("=== adapters") + " — differ from the live adapters:")
        for line in plan.adapters_changed:
            paint = style.green if line.startswith("+") else style.red if line[:1] == "-" else str
            print(paint(f"  {line}"))
    if plan.in_sync:
        print(style.green("in sync"))
