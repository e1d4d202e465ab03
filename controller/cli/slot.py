"""``slotctl slot list|get|logs``: read-only views that need no running controller.

They read the config dir (desired) and the state dir (observed) — the files are the
contract between the CLI and the controller on one host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import datetime
from typing import Any

import yaml

from controller.errors import SlotctlError, SlotNotFound
from controller.lifecycle import SlotState
from controller.memory import GIB
from controller.runtime import make_runtime
from controller.spec.configdir import ConfigSnapshot, read_config_dir
from controller.spec.render import slot_effective
from controller.store import ControllerLock, SlotStateRecord, StateStore

__all__ = ["register"]

_COLUMNS = ("NAME", "STATE", "MODEL", "DEVICE", "PRIO", "PINNED", "MEMORY", "SINCE", "MESSAGE")


def register(sub: Any) -> None:
    slot = sub.add_parser("slot", help="inspect slots (state, config, logs)")
    cmds = slot.add_subparsers(dest="slot_cmd", required=True, metavar="COMMAND")
    lst = cmds.add_parser("list", help="every slot with its state")
    lst.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")
    lst.set_defaults(func=cmd_list)
    get = cmds.add_parser("get", help="one slot: config and observed state")
    get.add_argument("name")
    get.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    get.set_defaults(func=cmd_get)
    logs = cmds.add_parser("logs", help="the server's output")
    logs.add_argument("name")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("--tail", type=int, default=100)
    logs.set_defaults(func=cmd_logs)


def _age(stamp: str) -> str:
    try:
        then = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return "-"
    seconds = max(0, int(time.time() - then))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _rows(snapshot: ConfigSnapshot, store: StateStore) -> list[dict[str, Any]]:
    names = list(snapshot.slots) + [n for n in store.names() if n not in snapshot.slots]
    rows = []
    for name in names:
        record = _record(store, name)
        desired = snapshot.slots.get(name)
        spec = desired.spec if desired else None
        model = snapshot.models.get(spec.model_id) if spec and spec.model_id else None
        memory = (
            spec.memory_gb
            if spec and spec.memory_gb is not None
            else (model.memory_gb if model else 0.0)
        )
        rows.append(
            {
                "name": name,
                "state": record.state.value if record else SlotState.OFFLINE.value,
                "idle_reason": record.extra.idle_reason if record else None,
                "model": (
                    record.model_id
                    if record and record.model_id
                    else (spec.model_id if spec else "")
                ),
                "device": spec.device if spec else "-",
                "priority": spec.priority if spec else None,
                "pinned": bool(spec.pinned) if spec else None,
                "autoload": bool(spec.autoload) if spec else None,
                "memory_gb": memory,
                "since": record.updated_at if record else None,
                "message": record.message if record else "",
                "stack": desired.stack if desired else None,
                "declared": desired is not None,
            }
        )
    return rows


def _record(store: StateStore, name: str) -> SlotStateRecord | None:
    try:
        return store.read(name)
    except SlotctlError as exc:  # a corrupt file must not hide the other slots
        print(f"slotctl: warning: {exc.message}", file=sys.stderr)
        return None


def cmd_list(args: argparse.Namespace) -> int:
    rows = _rows(read_config_dir(args.config_dir), StateStore(args.state_dir))
    if args.output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    if args.output == "yaml":
        print(yaml.safe_dump(rows, sort_keys=False), end="")
        return 0
    table = [
        [
            r["name"] + ("" if r["declared"] else " (undeclared)"),
            r["state"] + (f"({r['idle_reason']})" if r["idle_reason"] else ""),
            r["model"] or "-",
            r["device"],
            "-" if r["priority"] is None else str(r["priority"]),
            "yes" if r["pinned"] else "no",
            f"{r['memory_gb']:.1f}G" if r["memory_gb"] else "-",
            _age(r["since"]) if r["since"] else "-",
            (r["message"] or "")[:60],
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(_COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True)).rstrip())
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    if not table:
        print("(no slots: apply a stack with `slotctl stack apply`)", file=sys.stderr)
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    snapshot = read_config_dir(args.config_dir)
    store = StateStore(args.state_dir)
    desired = snapshot.slots.get(args.name)
    record = _record(store, args.name) if args.name in store.names() else None
    if desired is None and record is None:
        raise SlotNotFound(args.name)
    data: dict[str, Any] = {
        "name": args.name,
        "stack": desired.stack if desired else None,
        "file": desired.file if desired else None,
        "spec": slot_effective(desired.spec) if desired else None,
        "status": record.model_dump(mode="json") if record else None,
    }
    if desired and desired.spec.model_id in snapshot.models:
        model = snapshot.models[desired.spec.model_id]
        data["model"] = model.model_dump(mode="json", exclude_none=True)
        data["memory_bytes"] = int(model.memory_gb * GIB)
    if args.output == "json":
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    running = ControllerLock(args.state_dir).running()
    runtime = make_runtime(running.runtime if running else args.runtime, args.state_dir)

    async def show() -> None:
        lines = await runtime.logs(args.name, tail=args.tail)
        for line in lines:
            print(line)
        seen = lines[-1] if lines else None
        while args.follow:
            await asyncio.sleep(0.5)
            fresh = await runtime.logs(args.name, tail=200)
            start = 0
            if seen is not None and seen in fresh:
                start = len(fresh) - fresh[::-1].index(seen)
            for line in fresh[start:]:
                print(line, flush=True)
            if fresh:
                seen = fresh[-1]
        close = getattr(runtime, "close", None)
        if close is not None:
            result = close()
            if asyncio.iscoroutine(result):
                await result

    asyncio.run(show())
    return 0
