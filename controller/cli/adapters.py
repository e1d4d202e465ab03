"""``slotctl adapter list|load|unload``: the LoRA adapters of a running controller (through
its API, ``/api/adapters``; docs/adapters.md)."""

from __future__ import annotations

import argparse
from typing import Any

from controller.cli.client import quote_segment
from controller.cli.output import table
from controller.cli.remote import client_of, print_data
from controller.model.exitcode import ExitCode

__all__ = ["cmd_adapter_list", "cmd_adapter_load", "cmd_adapter_unload"]

_COLUMNS = ("ADAPTER", "BASE", "RANK", "PRIO", "PINNED", "RESIDENT IN")


def _resident_in(answer: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for slot in answer.get("adapters") or []:
        for held in slot.get("resident") or []:
            state = str(held.get("state"))
            shown = slot["slot"] if state in ("loaded", "started") else f"{slot['slot']}({state})"
            out.setdefault(str(held.get("id")), []).append(shown)
    return out


def cmd_adapter_list(args: argparse.Namespace) -> ExitCode:
    answer = client_of(args, timeout=30.0).get("/api/adapters")
    if args.output != "table":
        print_data(args, answer, "")
        return ExitCode.OK
    where = _resident_in(answer)
    rows = [
        [
            str(a.get("id")),
            str(a.get("base")),
            str(a.get("rank") or "-"),
            str(a.get("priority")),
            "yes" if a.get("pinned") else "no",
            ",".join(where.get(str(a.get("id")), [])) or "-",
        ]
        for a in answer.get("declared") or []
    ]
    for line in table(_COLUMNS, rows):
        print(line)
    if not rows:
        print("(no adapters: declare [[adapter]] tables in a stack)")
    return ExitCode.OK


def _body(args: argparse.Namespace) -> dict[str, Any]:
    return {"slot": args.slot} if args.slot else {}


def cmd_adapter_load(args: argparse.Namespace) -> ExitCode:
    path = f"/api/adapters/{quote_segment(args.adapter)}/load"
    _, answer = client_of(args).post(path, _body(args))
    where = _resident_in(answer).get(args.adapter, [])
    print_data(args, answer, f"adapter {args.adapter}: loaded in {', '.join(where) or '-'}")
    return ExitCode.OK


def cmd_adapter_unload(args: argparse.Namespace) -> ExitCode:
    path = f"/api/adapters/{quote_segment(args.adapter)}/unload"
    _, answer = client_of(args).post(path, _body(args))
    left = _resident_in(answer).get(args.adapter, [])
    note = f"still in {', '.join(left)}" if left else "resident nowhere"
    print_data(args, answer, f"adapter {args.adapter}: unloaded ({note})")
    return ExitCode.OK
