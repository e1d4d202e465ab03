"""The README's command table names the flags the commands take (issue 24: its ``stack
export`` row lacked ``--from`` and ``--namespace``, which the Helm chart's NOTES use)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from controller.cli.parser import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        (choices,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = choices.choices[name]
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    own = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    return own - {"--help", "--output"}


def test_the_stack_export_row_names_every_flag_of_stack_export() -> None:
    rows = [
        line
        for line in README.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `slotctl stack export")
    ]
    documented = {
        flag
        for row in rows
        for flag in re.findall(r"--[a-z][a-z-]*", re.split(r"(?<!\\)\|", row)[1])
    }
    parser = build_parser()  # its global options are in every row's footnote, not the row
    assert documented == _flags(_subparser(parser, "stack", "export")) - _flags(parser)
    assert any("--format crd" in row and "--from" in row for row in rows)  # as NOTES.txt


def test_no_doc_installs_slotctl_from_an_index_it_is_not_on() -> None:
    """Issue 40, item 14: docs/workflow.md's CI example ran ``pip install slotctl``, which
    is not published: a newcomer's CI failed at its first step. Installs come from a
    checkout (``pip install -e .``, ``make install``) or name the extras of one."""
    root = README.parent
    said = []
    for path in [README, *sorted((root / "docs").rglob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"pip install\s+['\"]?slotctl(\[|['\"]|\s|$)", line):
                said.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert said == []
