"""``slotctl stack export --format toml|quadlet``: the live desired state as files.

Reads the config dir (never a controller's memory: the files are the desired state);
``--format crd`` is ``cli.k8s``'s, which hands the other formats to this module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from controller.model.errors import SlotctlError
from controller.model.exitcode import ExitCode
from controller.providers.quadlet import render_quadlet
from controller.spec.configdir import ConfigSnapshot, read_config_dir
from controller.spec.render import render_stack

__all__ = ["cmd_export"]


def cmd_export(args: argparse.Namespace) -> ExitCode:
    snapshot = read_config_dir(args.config_dir)
    for problem in snapshot.errors:
        print(f"slotctl: warning: {problem.where()}: {problem.message}", file=sys.stderr)
    stacks = sorted(
        {s.stack or "default" for s in snapshot.slots.values()}
        | {a.stack or "default" for a in snapshot.aliases.values()}
        | {a.stack or "default" for a in snapshot.adapters.values()}
    )
    if args.stack:
        stacks = [s for s in stacks if s == args.stack]
        if not stacks:
            print(f"slotctl: no slots belong to stack {args.stack!r}", file=sys.stderr)
            return ExitCode.ERROR
    if args.format == "quadlet":
        return _export_quadlet(args, snapshot)
    if len(stacks) > 1 and not args.output_dir:
        print(
            f"slotctl: several stacks ({', '.join(stacks)}): pick one with --stack or use "
            "--output-dir",
            file=sys.stderr,
        )
        return ExitCode.ERROR
    referenced = {s.spec.model_id for s in snapshot.slots.values()}
    for index, stack in enumerate(stacks):
        slots = [s for s in snapshot.slots.values() if (s.stack or "default") == stack]
        adapters = [a.spec for a in snapshot.adapters.values() if (a.stack or "default") == stack]
        used = {s.spec.model_id for s in slots} | {a.base for a in adapters}
        models = [m for m in snapshot.models.values() if m.id in used]
        if index == 0 and not args.stack:
            models += [m for m in snapshot.models.values() if m.id not in referenced]
        aliases = [a.spec for a in snapshot.aliases.values() if (a.stack or "default") == stack]
        text = render_stack(stack, models, slots, full=False, aliases=aliases, adapters=adapters)
        _emit(args, f"{stack}.toml", text)
    return ExitCode.OK


def _export_quadlet(args: argparse.Namespace, snapshot: ConfigSnapshot) -> ExitCode:
    from controller.store.state import StateStore

    store = StateStore(args.state_dir)  # the ports chosen for the slots that leave theirs
    failed = 0
    for slot in snapshot.slots.values():
        if args.stack and slot.stack != args.stack:
            continue
        try:
            unit = render_quadlet(slot, snapshot.models, store.read_port(slot.name))
        except SlotctlError as exc:
            print(f"slotctl: skipped {slot.name}: {exc.message}", file=sys.stderr)
            failed += 1
            continue
        _emit(args, f"slotctl-{slot.name}.container", unit)
    return ExitCode.ERROR if failed else ExitCode.OK


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
