"""``slotctl stack validate|show``, and the check of stack files every stack command runs
(apply/diff: ``cli.declarative``; export: ``cli.export``, ``cli.k8s``).

``validate`` also says, for each model, what a load would find of its files in the models
dir (``$SLOTCTL_MODELS_DIR``) — without a network call: present, "would pull from
hf://… (its size is not known offline)", or a missing file no source can pull (a load of
it on this host would be refused, ``model.file_missing``, as ``slot load --dry-run``
says). Said after the verdict, never an error of the stack's: a stack is valid on the
host it is meant for, which may not be the one that validates it (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.cli.output import Style, print_json, render_problems
from controller.model.exitcode import ExitCode
from controller.spec.configdir import read_settings
from controller.spec.loader import LoadReport, load_stacks
from controller.spec.problems import Problem
from controller.spec.render import model_effective, render_stack, slot_effective

if TYPE_CHECKING:
    from controller.modelfiles.pull import PullPlan
    from controller.spec.loader import DesiredState

__all__ = ["cmd_show", "cmd_validate", "load_report", "model_files", "sampling_warnings"]


def load_report(args: argparse.Namespace) -> LoadReport:
    """The stack files of ``args.paths`` checked, ``controller.toml``'s problems first;
    a model's sampling default a slot's server is not told is a warning."""
    settings, problems = read_settings(args.config_dir)
    report = load_stacks(args.paths, settings)
    report.errors[:0] = problems
    if report.state is not None:
        report.warnings.extend(sampling_warnings(report.state))
    return report


def sampling_warnings(state: DesiredState) -> list[Problem]:
    """A warning for each slot whose server would not be told a sampling default of its
    model (:mod:`controller.providers.sampling`: what each engine takes at start)."""
    from controller.providers.sampling import SAMPLING_FORMS, unpassed

    out = []
    for slot in state.slots.values():
        model = state.models.get(slot.spec.model_id)
        keys = unpassed(slot.spec.provider, model)
        if model is None or not keys:
            continue
        takes = sorted(SAMPLING_FORMS.get(slot.spec.provider, ()))
        hint = (
            f"{slot.spec.provider}'s server takes {', '.join(takes)} at start; a request may "
            "still set the others itself"
            if takes
            else f"slotctl passes {slot.spec.provider}'s server no sampling defaults: set "
            "them in its own flags (server.cmd / extra_args) or in each request"
        )
        out.append(
            Problem(
                code="slot.sampling_not_passed",
                message=f"model {model.id!r} sets {', '.join(keys)}, which slot "
                f"{slot.name!r}'s server ({slot.spec.provider}) is not told",
                file=slot.file,
                slot=slot.name,
                key="model",
                line=slot.line,
                hint=hint,
                severity="warning",
            )
        )
    return out


def model_files(state: DesiredState, state_dir: Path) -> list[PullPlan]:
    """Each declared model's files as a load would find them, planned offline (no network:
    a size only the hub or the URL knows stays unknown, and says so)."""
    from controller.modelfiles.pull import ModelFiles
    from controller.providers.base import default_models_dir

    files = ModelFiles(default_models_dir(), state_dir)

    async def plan_all() -> list[PullPlan]:
        return [await files.plan(m, offline=True) for m in state.models.values()]

    return asyncio.run(plan_all())


def _file_line(plan: PullPlan) -> str | None:
    """A model's files in words, when a load would have anything to do with them."""
    if plan.action == "missing":
        return f"model {plan.model}: {plan.message}: a load would be refused on this host"
    if plan.action in ("pull", "verify"):
        return f"model {plan.model}: {plan.message}"
    return None


def cmd_validate(args: argparse.Namespace) -> ExitCode:
    report = load_report(args)
    plans: list[PullPlan] = []
    if report.ok and report.state is not None:
        plans = model_files(report.state, Path(args.state_dir))
    if args.output == "json":
        data: dict[str, Any] = {
            "valid": report.ok,
            "files": report.files,
            "errors": [p.to_dict() for p in report.errors],
            "warnings": [p.to_dict() for p in report.warnings],
        }
        if report.ok:
            data["models"] = [
                {
                    "model": p.model,
                    "source": p.source,
                    "action": p.action,  # none | pull | verify | missing
                    "bytes": p.bytes,
                    "message": p.message,
                }
                for p in plans
            ]
        print_json(data)
        return ExitCode.OK if report.ok else ExitCode.NEGATIVE
    style = Style(sys.stdout)
    for line in render_problems([*report.errors, *report.warnings], style):
        print(line)
    if report.ok and report.state is not None:
        state = report.state
        summary = (
            f"{len(report.files)} file(s) valid: stack {', '.join(state.stacks) or '-'}, "
            f"{len(state.models)} model(s), {len(state.slots)} slot(s)"
        )
        if report.warnings:
            summary += f", {len(report.warnings)} warning(s)"
        print(style.green("ok") + " " + summary)
        for plan in plans:
            said = _file_line(plan)
            if said is not None:
                print("  " + (style.yellow(said) if plan.action == "missing" else said))
        return ExitCode.OK
    print(
        style.red("invalid") + f" {len(report.errors)} error(s), {len(report.warnings)} warning(s) "
        f"in {len(report.files)} file(s)"
    )
    return ExitCode.NEGATIVE


def cmd_show(args: argparse.Namespace) -> ExitCode:
    report = load_report(args)
    style = Style(sys.stderr)
    for line in render_problems([*report.errors, *report.warnings], style):
        print(line, file=sys.stderr)
    if not report.ok or report.state is None:
        return ExitCode.NEGATIVE
    state = report.state
    if args.output == "json":
        slots: list[dict[str, Any]] = [
            {**slot_effective(s.spec), "stack": s.stack, "file": s.file, "line": s.line}
            for s in state.slots.values()
        ]
        print_json(
            {
                "stacks": list(state.stacks),
                "models": [model_effective(m) for m in state.models.values()],
                "slots": slots,
                "aliases": [a.spec.model_dump(mode="json") for a in state.aliases.values()],
                "adapters": [
                    a.spec.model_dump(mode="json", exclude_none=True)
                    for a in state.adapters.values()
                ],
            }
        )
        return ExitCode.OK
    documents = []
    for stack in state.stacks:
        members = [s for s in state.slots.values() if s.stack == stack]
        used = {s.spec.model_id for s in members}
        models = [m for m in state.models.values() if m.id in used]
        if stack == state.stacks[0]:  # unreferenced models go with the first stack
            referenced = {s.spec.model_id for s in state.slots.values()}
            models += [m for m in state.models.values() if m.id not in referenced]
        header = f"# stack {stack}: effective desired state (defaults and migrations applied)\n"
        aliases = [a.spec for a in state.aliases.values() if a.stack == stack]
        adapters = [a.spec for a in state.adapters.values() if a.stack == stack]
        text = render_stack(stack, models, members, aliases=aliases, adapters=adapters)
        documents.append(header + text)
    sys.stdout.write("\n".join(documents))
    return ExitCode.OK
