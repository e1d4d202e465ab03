"""``slotctl slot list|get|logs``: read-only views, through the API or from the files.

One backend choice (``cli.client.reachable_api``, the same as ``stack apply|diff``): the
controller's API when ``--server``/``$SLOTCTL_SERVER`` names one or the local controller
answers; otherwise the config dir (desired) and the state dir (observed) — the files are
the contract between the CLI and the controller on one host, so these commands also work
with no controller running. Both backends print the same rows and exit codes; only the
API knows what lives in the controller's memory (a batch hold's expiry).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final

from controller.cli.client import ApiClient, quote_segment, reachable_api
from controller.cli.output import GIB, format_memory, table
from controller.model.errors import SlotctlError, SlotNotFound
from controller.model.exitcode import ExitCode

__all__ = ["cmd_get", "cmd_list", "cmd_logs"]

_COLUMNS: Final = (
    "NAME",
    "STATE",
    "MODEL",
    "DEVICE",
    "GPU",
    "PRIO",
    "PINNED",
    "RESIDENT",
    "MEMORY",
    "SINCE",
    "MESSAGE",
)
_FOLLOW_EVERY_S: Final = 0.5


def _api(args: argparse.Namespace) -> ApiClient | None:
    return reachable_api(
        args.state_dir, getattr(args, "api_server", None), getattr(args, "api_token", None)
    )


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


def _held_until(held_for_s: Any) -> str | None:
    """The wall-clock end of a batch hold, ISO 8601 local time (None: not held)."""
    if not isinstance(held_for_s, int | float) or isinstance(held_for_s, bool):
        return None
    return datetime.fromtimestamp(time.time() + held_for_s).astimezone().isoformat("T", "seconds")


# ====================================================================== rows


def _row_from_view(view: dict[str, Any]) -> dict[str, Any]:
    memory = int(view.get("memory_bytes") or 0)
    return {
        "name": view["name"],
        "state": view["state"],
        "idle_reason": view.get("idle_reason"),
        "residency": view.get("residency") or "awake",
        "sleep_level": int(view.get("sleep_level") or 0),
        "model": view.get("model_id") or "",
        "device": view.get("device", "-"),
        "gpus": list(view.get("gpus") or []),
        "priority": view.get("priority"),
        "pinned": view.get("pinned"),
        "autoload": view.get("autoload"),
        "resident": bool(view.get("resident")),
        "memory_gb": round(memory / GIB, 3),
        "memory_bytes": memory,
        "leases": view.get("leases", 0),
        "requests": int(view.get("leases", 0)) - int(view.get("holds", 0)),
        "held_until": _held_until(view.get("held_for_s")),
        "since": view.get("since"),
        "message": view.get("message") or "",
        "stack": view.get("stack"),
        "declared": True,
        "pull": view.get("pull"),  # pulling: its model's pull (bytes, rate, ETA)
        "replica_of": view.get("replica_of"),  # a replica's slot (issue 38)
        "replica_index": int(view.get("replica_index") or 0),
    }


def _grouped(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each slot's replicas right after it, in index order."""
    replicas: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("replica_of") and row.get("replica_index"):
            replicas.setdefault(row["replica_of"], []).append(row)
    if not replicas:
        return rows
    out: list[dict[str, Any]] = []
    for row in rows:
        if row.get("replica_of") and row.get("replica_index"):
            continue
        out.append(row)
        out.extend(sorted(replicas.pop(row["name"], []), key=lambda r: r["replica_index"]))
    for orphans in replicas.values():  # a replica whose slot is not listed
        out.extend(orphans)
    return out


def _name_cell(row: dict[str, Any]) -> str:
    name = str(row["name"])
    if row.get("replica_of") and row.get("replica_index"):
        name += f" (replica {row['replica_index']} of {row['replica_of']})"
    return name + ("" if row["declared"] else " (undeclared)")


def _rows_from_files(args: argparse.Namespace) -> list[dict[str, Any]]:
    from controller.model.lifecycle import SlotState
    from controller.spec.configdir import read_config_dir
    from controller.store.residency import ResidencyStore
    from controller.store.state import StateStore

    snapshot = read_config_dir(args.config_dir)
    store = StateStore(args.state_dir)
    resident = ResidencyStore(args.config_dir).read()
    declared = _declared(snapshot.slots)
    names = list(declared) + [n for n in store.names() if n not in declared]
    rows = []
    for name in names:
        record = _record(store, name)
        desired = declared.get(name)
        spec = desired.spec if desired else None
        model = snapshot.models.get(spec.model_id) if spec and spec.model_id else None
        memory = (
            spec.memory_gb
            if spec and spec.memory_gb is not None
            else ((model.memory_gb or 0.0) if model else 0.0)
        )
        rows.append(
            {
                "name": name,
                "state": record.state.value if record else SlotState.OFFLINE.value,
                "idle_reason": record.extra.idle_reason if record else None,
                "residency": (record.extra.residency if record else None) or "awake",
                "sleep_level": record.extra.sleep_level if record else 0,
                "model": (
                    record.model_id
                    if record and record.model_id
                    else (spec.model_id if spec else "")
                ),
                "device": spec.device if spec else "-",
                "gpus": _placed_gpus(record),
                "priority": spec.priority if spec else None,
                "pinned": bool(spec.pinned) if spec else None,
                "autoload": bool(spec.autoload) if spec else None,
                "resident": name in resident,
                "memory_gb": memory,
                "memory_bytes": int(memory * GIB),
                "leases": 0,
                "requests": 0,
                "held_until": None,  # a hold lives in the controller's memory only
                "since": record.updated_at if record else None,
                "message": record.message if record else "",
                "stack": desired.stack if desired else None,
                "declared": desired is not None,
                "replica_of": spec.replica_group or None if spec else None,
                "replica_index": spec.replica_index if spec else 0,
            }
        )
    return _grouped(rows)


def _declared(slots: Mapping[str, Any]) -> dict[str, Any]:
    """The declared slots with their replicas, as the controller's desired state expands
    them (``chat-r1`` is declared by ``chat``'s ``replicas``)."""
    from controller.spec.replicas import replica_specs

    declared = dict(slots)
    for slot in slots.values():
        for replica in replica_specs(slot.spec):
            declared.setdefault(replica.name, dataclasses.replace(slot, spec=replica))
    return declared


def _placed_gpus(record: Any) -> list[int]:
    """The GPUs a slot's state.json records it on (while it is admitted)."""
    from controller.slots.records import ADMITTED_STATES

    if record is None or record.state not in ADMITTED_STATES:
        return []
    return [g.index for g in record.extra.gpus]


def _gpu_cell(row: dict[str, Any]) -> str:
    gpus = row.get("gpus") or []
    return ",".join(str(i) for i in gpus) if gpus else "-"


def _record(store: Any, name: str) -> Any:
    try:
        return store.read(name)
    except SlotctlError as exc:  # a corrupt file must not hide the other slots
        print(f"slotctl: warning: {exc.message}", file=sys.stderr)
        return None


def _state_cell(row: dict[str, Any]) -> str:
    if row.get("held_until"):
        return "held until " + str(row["held_until"])[11:16]
    pull = row.get("pull")
    if row["state"] == "pulling" and isinstance(pull, dict):
        percent = pull.get("percent")
        if isinstance(percent, int | float) and not isinstance(percent, bool):
            return f"pulling {percent:.0f}%"
        return f"pulling ({pull.get('phase') or '?'})"
    reason = row.get("idle_reason")
    if reason == "asleep" and row.get("sleep_level"):  # the residency tier: idle(asleep:1)
        reason = f"{row.get('residency') or reason}:{row['sleep_level']}"
    return str(row["state"]) + (f"({reason})" if reason else "")


def _message_cell(row: dict[str, Any]) -> str:
    message = str(row.get("message") or "")
    if row.get("held_until") and message == "request in flight" and not row.get("requests"):
        message = ""  # only holds: no request is in flight
    return message[:60]


def _print_data(data: Any, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")


def cmd_list(args: argparse.Namespace) -> ExitCode:
    api = _api(args)
    if api is not None:
        rows = _grouped([_row_from_view(v) for v in api.get("/api/slots").get("slots", [])])
    else:
        rows = _rows_from_files(args)
    if args.output != "table":
        _print_data(rows, args.output)
        return ExitCode.OK
    cells = [
        [
            _name_cell(r),
            _state_cell(r),
            r["model"] or "-",
            str(r["device"]),
            _gpu_cell(r),
            "-" if r["priority"] is None else str(r["priority"]),
            "yes" if r["pinned"] else "no",
            "yes" if r["resident"] else "no",
            format_memory(r["memory_bytes"]),
            _age(r["since"]) if r["since"] else "-",
            _message_cell(r),
        ]
        for r in rows
    ]
    for line in table(_COLUMNS, cells):
        print(line)
    if not cells:
        print("(no slots: apply a stack with `slotctl stack apply`)", file=sys.stderr)
    return ExitCode.OK


# ====================================================================== get


def cmd_get(args: argparse.Namespace) -> ExitCode:
    api = _api(args)
    data = _get_from_api(api, args.name) if api is not None else _get_from_files(args)
    _print_data(data, args.output)
    return ExitCode.OK


def _get_from_api(api: ApiClient, name: str) -> dict[str, Any]:
    """The same document as from the files; ``status`` is the controller's live view."""
    view: dict[str, Any] = api.get(f"/api/slots/{quote_segment(name)}")
    spec = view.pop("spec", None)
    _explain(view)
    return {
        "name": view.get("name", name),
        "stack": view.get("stack"),
        "resident": bool(view.get("resident")),
        "held_until": _held_until(view.get("held_for_s")),
        "spec": spec,
        "status": view,
        "memory_bytes": view.get("memory_bytes"),
    }


def _get_from_files(args: argparse.Namespace) -> dict[str, Any]:
    from controller.spec.configdir import read_config_dir
    from controller.spec.render import slot_effective
    from controller.store.residency import ResidencyStore
    from controller.store.state import StateStore

    snapshot = read_config_dir(args.config_dir)
    store = StateStore(args.state_dir)
    desired = _declared(snapshot.slots).get(args.name)
    record = _record(store, args.name) if args.name in store.names() else None
    if desired is None and record is None:
        raise SlotNotFound(args.name)
    data: dict[str, Any] = {
        "name": args.name,
        "stack": desired.stack if desired else None,
        "file": desired.file if desired else None,
        "resident": args.name in ResidencyStore(args.config_dir).read(),
        "held_until": None,  # a hold lives in the controller's memory only
        "spec": slot_effective(desired.spec) if desired else None,
        "status": _explain(record.model_dump(mode="json")) if record else None,
    }
    if desired and desired.spec.model_id in snapshot.models:
        model = snapshot.models[desired.spec.model_id]
        data["model"] = model.model_dump(mode="json", exclude_none=True)
        data["memory_bytes"] = model.memory_bytes
    return data


def _explain(status: dict[str, Any]) -> dict[str, Any]:
    """``server`` (up, down, starting, stopping) and ``meaning`` beside the state."""
    from controller.model.lifecycle import describe

    extra = status.get("extra")
    reason = status.get("idle_reason") or (extra.get("idle_reason") if extra else None)
    status["server"], status["meaning"] = describe(str(status.get("state")), reason)
    return status


# ====================================================================== logs


def cmd_logs(args: argparse.Namespace) -> ExitCode:
    """The last ``--tail`` lines; ``-f`` polls for new ones until Ctrl-C (exit 130)."""
    api = _api(args)
    if api is not None:
        path = f"/api/slots/{quote_segment(args.name)}/logs"

        def fetch(tail: int) -> list[str]:
            answer = api.get(path, query={"tail": tail})
            return [str(line) for line in (answer or {}).get("lines", [])]

        _show_logs(fetch, args)
        return ExitCode.OK
    _logs_from_files(args)
    return ExitCode.OK


def _logs_from_files(args: argparse.Namespace) -> None:
    import asyncio

    from controller.runtime.kinds import make_runtime
    from controller.spec.configdir import read_config_dir
    from controller.store.lock import ControllerLock
    from controller.store.state import StateStore

    if (
        args.name not in read_config_dir(args.config_dir).slots
        and args.name not in StateStore(args.state_dir).names()
    ):
        raise SlotNotFound(args.name)
    running = ControllerLock(args.state_dir).running()
    runtime = make_runtime(running.runtime if running else args.runtime, args.state_dir)
    loop = asyncio.new_event_loop()
    try:
        _show_logs(lambda tail: loop.run_until_complete(runtime.logs(args.name, tail=tail)), args)
    finally:
        loop.run_until_complete(runtime.close())
        loop.close()


def _show_logs(fetch: Callable[[int], list[str]], args: argparse.Namespace) -> None:
    lines = fetch(args.tail)
    for line in lines:
        print(line, flush=args.follow)
    seen = lines[-1] if lines else None
    while args.follow:
        time.sleep(_FOLLOW_EVERY_S)
        fresh = fetch(200)
        start = 0
        if seen is not None and seen in fresh:
            start = len(fresh) - fresh[::-1].index(seen)
        for line in fresh[start:]:
            print(line, flush=True)
        if fresh:
            seen = fresh[-1]
