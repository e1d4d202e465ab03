"""``slotctl import``: another tool's configuration as a slotctl stack file.

Reads a llama-swap ``config.yaml`` or a llama.cpp router presets file
(``controller.importers``: pure translations), checks the stack it makes as ``stack
validate`` would, prints it (or writes ``--output``), and prints on stderr every key
that was not carried over exactly (the typed report), then the ``slotctl key create``
commands to run. ``--strict`` fails on any key not carried over exactly. Exit 0 imported,
1 the stack does not validate or ``--strict`` refused it, 2 the source cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from controller.cli.output import Style, render_problems
from controller.importers.llamaswap import import_llama_swap
from controller.importers.presets import import_presets
from controller.importers.report import Finding
from controller.importers.stackdoc import ImportResult
from controller.model.errors import ImportSourceError
from controller.model.exitcode import ExitCode
from controller.spec.loader import load_stack_texts
from controller.spec.problems import Problem

__all__ = ["HubLister", "cmd_import", "detect_format"]

FORMATS = ("llama-swap", "llama-server-presets")


def detect_format(path: str, text: str) -> str:
    """``.ini`` (or a ``[section]`` first) is a presets file; anything else llama-swap's."""
    if path.lower().endswith(".ini"):
        return "llama-server-presets"
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and stripped[0] not in ";#":
            return "llama-server-presets" if stripped.startswith("[") else "llama-swap"
    return "llama-swap"


class HubLister:
    """A hub repository's files, through the hub's own client (``-hf user/model:quant``),
    each repository asked once; once the hub cannot be reached, not asked again (each try
    costs the client's retries)."""

    def __init__(self) -> None:
        self.listings: dict[str, list[str]] = {}
        self.unreachable: Exception | None = None

    def __call__(self, repo: str) -> Sequence[str]:
        if repo in self.listings:
            return self.listings[repo]
        if self.unreachable is not None:
            raise self.unreachable
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        try:
            files = list(HfApi().list_repo_files(repo))
        except HfHubHTTPError:
            raise  # the hub answered: this repository only
        except Exception as exc:
            self.unreachable = exc
            raise
        self.listings[repo] = files
        return files


def _read(path: Path) -> tuple[str, str]:
    if str(path) == "-":
        return "<stdin>", sys.stdin.read()
    try:
        return str(path), path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ImportSourceError(f"{path}: {exc.strerror or exc}", source=str(path)) from None


def cmd_import(args: argparse.Namespace) -> ExitCode:
    source, text = _read(args.file)
    fmt = args.source_format or detect_format(source, text)
    lister = None if args.offline else HubLister()
    result: ImportResult
    if fmt == "llama-swap":
        result = import_llama_swap(
            text, source=source, stack=args.stack or "llama-swap", env=os.environ, lister=lister
        )
    else:
        result = import_presets(
            text,
            source=source,
            stack=args.stack or "llama-router",
            binary=args.binary,
            lister=lister,
        )
    stack_text = result.render(source)
    report = load_stack_texts([(args.output or "<imported>", stack_text)])
    refused = result.report.strict_failures() if args.strict else []
    if args.format == "json":
        print(
            json.dumps(
                {
                    "format": fmt,
                    "stack": stack_text,
                    "findings": [f.to_dict() for f in result.report.findings],
                    "commands": result.commands,
                    "problems": [p.to_dict() for p in report.errors + report.warnings],
                    "strict_refused": len(refused),
                },
                indent=2,
            )
        )
    elif args.output and not refused:
        Path(args.output).write_text(stack_text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    elif not refused:
        sys.stdout.write(stack_text)
    if args.format != "json":
        _explain(result, source, report.errors + report.warnings, refused)
    if refused or report.errors:
        return ExitCode.NEGATIVE
    return ExitCode.OK


def _explain(
    result: ImportResult, source: str, problems: Sequence[Problem], refused: Sequence[Finding]
) -> None:
    style = Style(sys.stderr)
    counts = result.report.counts()
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "everything carried over"
    print(f"slotctl import: {source} ({result.report.source_format}): {summary}", file=sys.stderr)
    for finding in result.report.findings:
        print("  " + finding.line(source), file=sys.stderr)
    for line in render_problems(problems, style):
        print(line, file=sys.stderr)
    if result.commands:
        print("run these to create the API keys (each prints its key once):", file=sys.stderr)
        for command in result.commands:
            print(f"  {command}", file=sys.stderr)
    if refused:
        print(
            f"slotctl import: --strict: {len(refused)} key(s) not carried over exactly; "
            "nothing written",
            file=sys.stderr,
        )
