"""``slotctl operator``, ``slotctl crd generate``, ``stack export --format crd``, ``stack import``.

The Kubernetes commands. CRD generation and conversion are pure (``controller.operator.crd``,
``controller.operator.convert``); the operator (kopf) is imported only when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from controller.cli import export
from controller.cli.output import Style, render_problems
from controller.kit.logs import setup_logging
from controller.model.exitcode import ExitCode
from controller.operator.convert import (
    dump_documents,
    parse_documents,
    resources_from_state,
    stacks_from_resources,
)
from controller.operator.crd import crd_files
from controller.spec.configdir import read_config_dir, read_settings
from controller.spec.loader import DesiredState, load_stacks

__all__ = ["cmd_crd_generate", "cmd_export", "cmd_import", "cmd_operator", "operator_runtime"]


# ------------------------------------------------------------------ crd generate


def cmd_crd_generate(args: argparse.Namespace) -> ExitCode:
    """Write (or ``--check``) the CRDs in each ``--output-dir``, and say what it did."""
    dirs: list[Path] = args.output_dir or [Path("crds")]
    files = crd_files()
    differs: list[Path] = []
    for directory in dirs:
        stale = []
        for name, text in files.items():
            path = directory / name
            current = path.read_text(encoding="utf-8") if path.exists() else None
            if current == text:
                continue
            stale.append(path)
            if not args.check:
                directory.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
                print(f"wrote {path}")
        if not stale:
            print(f"{directory}: the {len(files)} CRDs are current (nothing written)")
        elif not args.check:
            print(f"{directory}: {len(stale)} written, {len(files) - len(stale)} unchanged")
        differs += stale
    if args.check and differs:
        for path in differs:
            print(f"out of date: {path} (run `slotctl crd generate`)", file=sys.stderr)
        return ExitCode.NEGATIVE
    return ExitCode.OK


# ------------------------------------------------------------------ operator


def operator_runtime(runtime: str, given: bool, env: Mapping[str, str] | None = None) -> str:
    """The operator's runtime: the one asked for, else ``kubernetes`` inside a pod (the
    API server's address in the environment), else ``process``."""
    env = os.environ if env is None else env
    if not given and env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    return runtime


def cmd_operator(args: argparse.Namespace) -> ExitCode:
    from controller.operator.run import Operator, OperatorOptions

    setup_logging(args.log_format, args.log_level)
    opts = OperatorOptions(
        state_dir=args.state_dir,
        config_dir=args.config_dir,
        runtime=operator_runtime(args.runtime, bool(getattr(args, "runtime_given", False))),
        namespaces=list(args.namespace),
        all_namespaces=args.all_namespaces or not args.namespace,
        listen=None if args.listen == "none" else args.listen,
        token=args.token or os.environ.get("SLOTCTL_TOKEN") or None,
        allowed_hosts=tuple(args.allowed_host),
        liveness=args.liveness,
        resync_s=args.resync,
        quiet=args.log_format == "json",
        inference_pools=args.inference_pools,
        endpoint_picker=args.endpoint_picker,
    )
    try:
        operator = Operator(opts)
    except ValueError as exc:  # --inference-pools without the kubernetes runtime, a picker
        print(f"slotctl operator: {exc}", file=sys.stderr)
        return ExitCode.ERROR
    return ExitCode(asyncio.run(operator.run()))


# ------------------------------------------------------------------ conversion


def cmd_export(args: argparse.Namespace) -> ExitCode:
    if args.format != "crd":
        return export.cmd_export(args)
    state = _export_state(args)
    if state is None:
        return ExitCode.NEGATIVE
    if args.stack:
        slots = {n: s for n, s in state.slots.items() if s.stack == args.stack}
        aliases = {i: a for i, a in state.aliases.items() if a.stack == args.stack}
        adapters = {i: a for i, a in state.adapters.items() if a.stack == args.stack}
        state = DesiredState(
            stacks=(args.stack,),
            models=state.models,
            slots=slots,
            aliases=aliases,
            adapters=adapters,
        )
    text = dump_documents(resources_from_state(state, args.namespace, owners=_owners(state)))
    if args.output_dir:
        out: Path = args.output_dir
        out.mkdir(parents=True, exist_ok=True)
        name = f"{args.stack or 'slotctl'}.yaml"
        (out / name).write_text(text, encoding="utf-8")
        print(f"wrote {out / name}")
    else:
        sys.stdout.write(text)
    return ExitCode.OK


def _export_state(args: argparse.Namespace) -> DesiredState | None:
    if args.from_paths:
        settings, _ = read_settings(args.config_dir)
        report = load_stacks(args.from_paths, settings)
        if not report.ok or report.state is None:
            for line in render_problems(report.errors, Style(sys.stderr)):
                print(line, file=sys.stderr)
            return None
        return report.state
    snapshot = read_config_dir(args.config_dir)
    for problem in snapshot.errors:
        print(f"slotctl: warning: {problem.where()}: {problem.message}", file=sys.stderr)
    return snapshot.desired()


def _owners(state: DesiredState) -> dict[str, str]:
    """Model id -> the stack of the first slot bound to it (the rest: the first stack)."""
    owners: dict[str, str] = {}
    for slot in state.slots.values():
        if slot.spec.model_id and slot.stack:
            owners.setdefault(slot.spec.model_id, slot.stack)
    first = state.stacks[0] if state.stacks else None
    if first:
        for model_id in state.models:
            owners.setdefault(model_id, first)
    return owners


def cmd_import(args: argparse.Namespace) -> ExitCode:
    text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text(encoding="utf-8")
    result = stacks_from_resources(parse_documents(text), args.stack)
    if result.problems:
        for line in render_problems(result.problems, Style(sys.stderr)):
            print(line, file=sys.stderr)
        return ExitCode.NEGATIVE
    if not result.texts:
        print("slotctl: no slotctl.io Model or Slot objects in the input", file=sys.stderr)
        return ExitCode.NEGATIVE
    if args.output_dir:
        out: Path = args.output_dir
        out.mkdir(parents=True, exist_ok=True)
        for stack, body in result.texts.items():
            (out / f"{stack}.toml").write_text(body, encoding="utf-8")
            print(f"wrote {out / stack}.toml")
        return ExitCode.OK
    if len(result.texts) > 1:
        print(
            f"slotctl: several stacks ({', '.join(result.texts)}): use --output-dir",
            file=sys.stderr,
        )
        return ExitCode.ERROR
    sys.stdout.write(next(iter(result.texts.values())))
    return ExitCode.OK
