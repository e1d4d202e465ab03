"""``slotctl key``: create, list and revoke the controller's API keys (through its API;
admin scope). The key is printed once, by ``create``; ``list`` never shows a secret."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Final

from controller.cli.client import quote_segment
from controller.cli.output import table
from controller.cli.remote import client_of, print_data
from controller.model.exitcode import ExitCode

__all__ = ["cmd_key_create", "cmd_key_list", "cmd_key_revoke"]

_COLUMNS: Final = ("NAME", "SCOPE", "MODELS", "PRIORITY", "LIMITS", "EXPIRES", "LAST USED")


def cmd_key_create(args: argparse.Namespace) -> ExitCode:
    body: dict[str, Any] = {"name": args.name, "scope": args.scope, "models": args.models or []}
    for field in ("priority", "max_concurrency", "rpm", "expires"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    _, answer = client_of(args).post("/api/keys", body)
    if args.output != "table":
        print_data(args, answer, "")
        return ExitCode.OK
    print(answer["key"])
    print(
        f"key {answer['name']!r} created ({answer['scope']}): it is shown this once; "
        "send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
        file=sys.stderr,
    )
    return ExitCode.OK


def cmd_key_list(args: argparse.Namespace) -> ExitCode:
    answer = client_of(args).get("/api/keys")
    if args.output != "table":
        print_data(args, answer, "")
        return ExitCode.OK
    now = time.time()
    rows = [_row(k, now) for k in answer.get("keys", [])]
    for line in table(_COLUMNS, rows):
        print(line)
    if not rows:
        print(
            "(no keys: the API token is the only one; `slotctl key create NAME`)", file=sys.stderr
        )
    return ExitCode.OK


def cmd_key_revoke(args: argparse.Namespace) -> ExitCode:
    status, answer = client_of(args).request("DELETE", f"/api/keys/{quote_segment(args.name)}")
    if args.output != "table":
        print(json.dumps(answer, indent=2))
        return ExitCode.OK
    print(f"key {args.name!r} revoked")
    return ExitCode.OK if status == 200 else ExitCode.ERROR


def _row(key: dict[str, Any], now: float) -> list[str]:
    limits = []
    if key.get("max_concurrency"):
        limits.append(f"{key['max_concurrency']} at once")
    if key.get("rpm"):
        limits.append(f"{key['rpm']}/min")
    expires = key.get("expires_at")
    if key.get("expired"):
        until = "expired"
    else:
        until = _ago(expires - now, future=True) if expires else "never"
    last = key.get("last_used")
    return [
        str(key["name"]),
        str(key["scope"]),
        ",".join(key.get("models") or []) or "*",
        str(key.get("priority") or "(default)"),
        ", ".join(limits) or "-",
        until,
        _ago(now - last) if last else "never",
    ]


def _ago(seconds: float, *, future: bool = False) -> str:
    s = max(0.0, seconds)
    text = next(
        (
            f"{s / unit:.0f}{name}"
            for unit, name in ((86400, "d"), (3600, "h"), (60, "m"))
            if s >= unit
        ),
        f"{s:.0f}s",
    )
    return f"in {text}" if future else f"{text} ago"
