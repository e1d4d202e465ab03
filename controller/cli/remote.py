"""Imperative commands through the controller's API.

``slotctl slot load|unload|swap|reset|hold NAME`` and ``slotctl model list|load|unload``
talk to a running controller (``cli.client`` finds it: ``--server`` /
``$SLOTCTL_SERVER``, else the local one of ``--state-dir``). ``-o json`` prints the API's
answer as it came; the text output is one line per result.

Exit codes: 0 done; 1 the negative answer of ``slot load --dry-run`` (the load would be
refused) and of ``--wait`` when the slot ends in ``error`` or the wait times out; 2 any
error: no controller reachable, or a typed API error (``slotctl: error [code]: message``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, cast

from controller.cli.client import ApiClient, find_controller, quote_segment
from controller.cli.flags import parse_duration
from controller.cli.output import GIB, Style, format_memory, table
from controller.cli.pull import files_by_model, files_cell
from controller.model.exitcode import ExitCode

if TYPE_CHECKING:  # the dry run's JSON, declared where the API renders it
    from controller.api.dryrun import PlanJson

__all__ = ["parse_duration"]

# Loads, unloads (drain + stop), swaps and holds (a cold load) can take minutes.
_ACTION_TIMEOUT_S: Final = 900.0


def _human_duration(seconds: float) -> str:
    seconds = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"


def _bytes(value: Any) -> str:
    return format_memory(value) if value != 0 else "0.00 GiB"


# ====================================================================== helpers


def _client(args: argparse.Namespace, timeout: float = _ACTION_TIMEOUT_S) -> ApiClient:
    endpoint = find_controller(
        args.state_dir, getattr(args, "api_server", None), getattr(args, "api_token", None)
    )
    return ApiClient(endpoint, timeout=timeout)


def _print(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2))
    elif args.output == "yaml":
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
    else:
        print(text)


def _state(slot: Any) -> str:
    if not isinstance(slot, dict):
        return "?"
    state = str(slot.get("state", "?"))
    return f"{state}({slot['idle_reason']})" if slot.get("idle_reason") else state


def _wait_slot(
    client: ApiClient, name: str, timeout: float, quiet: bool
) -> tuple[bool, dict[str, Any]]:
    """Poll the slot until it is dispatchable (True), or failed / out of time (False)."""
    from controller.cli.progress import Progress

    progress = Progress(quiet=quiet)
    path = f"/api/slots/{quote_segment(name)}"
    while True:
        view = client.get(path)
        pull = view.get("pull") if isinstance(view.get("pull"), dict) else None
        progress.seen(name, _state(view), str(view.get("message") or ""), pull)
        if view.get("dispatchable"):
            progress.close()
            return True, view
        if view.get("state") == "error" or view.get("idle_reason") == "no_model":
            progress.close()
            return False, view  # failed, or up without a model: waiting will not help
        if progress.elapsed > timeout:
            progress.close()
            return False, view
        time.sleep(0.2)


def _load_and_wait(
    args: argparse.Namespace, client: ApiClient, answer: Any, what: str, started: float
) -> ExitCode:
    """Print a load's answer; with ``--wait`` follow its slot until ready (or not).

    ``-o json`` prints one document: the API's answer, or with ``--wait`` the final
    ``{"status": "ready"|"error"|"timeout", "slot": view}``.
    """
    slot = answer.get("slot") if isinstance(answer, dict) else None
    verdict = answer.get("status", "?") if isinstance(answer, dict) else "?"
    model = what.startswith("model ")
    where = f" on slot {slot.get('name')}" if isinstance(slot, dict) and model else ""
    resident = _resident_note(slot)
    if not args.wait or not isinstance(slot, dict):
        _print(args, answer, f"{what}: {verdict}{where} ({_state(slot)}){resident}")
        return ExitCode.OK
    text = args.output == "text"
    if text:
        print(f"{what}: {verdict}{where}{resident}; waiting until it is ready ...", flush=True)
    ok, view = _wait_slot(client, str(slot.get("name")), args.timeout, quiet=not text)
    if not text:
        status = "ready" if ok else ("error" if view.get("state") == "error" else "timeout")
        _print(args, {"status": status, "slot": view}, "")
    return _finish_wait(args, ok, view, started)


def _resident_note(slot: Any) -> str:
    """An explicit load makes its slot resident (issue 40: it did so silently): said
    with what that means, and how it ends."""
    if not isinstance(slot, dict) or not slot.get("resident"):
        return ""
    name = slot.get("name", "?")
    return (
        f"; resident: kept loaded until `slotctl slot unload {name}` (its ttl_s no longer "
        "unloads it, and a failed load is tried again until the crash breaker opens)"
    )


def _finish_wait(
    args: argparse.Namespace, ok: bool, view: dict[str, Any], started: float
) -> ExitCode:
    name = view.get("name", "?")
    if ok:
        if args.output == "text":
            print(f"slot {name}: {_state(view)} after {time.monotonic() - started:.1f}s")
        return ExitCode.OK
    reason = view.get("message") or "still " + _state(view)
    if view.get("state") == "error":
        print(f"slotctl: slot {name} failed to load: {reason}", file=sys.stderr)
    else:
        print(f"slotctl: slot {name} not ready after {args.timeout:g}s ({reason})", file=sys.stderr)
    return ExitCode.NEGATIVE


# ====================================================================== slot commands


def cmd_slot_load(args: argparse.Namespace) -> ExitCode:
    client = _client(args)
    path = f"/api/slots/{quote_segment(args.name)}/load"
    if args.dry_run:
        _, answer = client.post(path, query={"dry_run": True})
        plan = cast("PlanJson", (answer.get("plan") or {}) if isinstance(answer, dict) else {})
        style = Style(sys.stdout)
        lines = _explain(args.name, plan, style) + _unit_lines(plan, style)
        _print(args, answer, "\n".join(lines))
        return ExitCode.NEGATIVE if plan.get("action") == "refuse" else ExitCode.OK
    started = time.monotonic()
    _, answer = client.post(path)
    return _load_and_wait(args, client, answer, f"slot {args.name}", started)


def _explain(name: str, plan: PlanJson, style: Style) -> list[str]:
    """The dry-run plan in words: what would be evicted and why, or why it is refused."""
    action = plan.get("action")
    what = "wake" if plan.get("wake") else "load"
    lines = [style.bold(f"dry run: {what} of slot {name}") + " (nothing changes)"]
    if plan.get("fallback"):  # asleep, but its wake cannot happen where it sleeps
        lines.append(f"  asleep: {plan['fallback']} (its server is stopped first)")
    if action == "none":
        lines.append(f"  nothing to do: {plan.get('reason', 'already loaded')}")
        return lines
    if "needed_bytes" in plan:
        lines += _placement_lines(plan)
    footprint = plan.get("footprint")
    if footprint:
        lines.append("  footprint: " + footprint_summary(footprint))
    pull = plan.get("pull")
    if pull:
        lines.append(f"  model files: {pull.get('message', '')}")
        error = pull.get("error")
        if error and action != "refuse":
            lines.append(
                style.yellow("  the pull would fail now")
                + f": [{error.get('code', '?')}] {error.get('message', '')}"
            )
    adapters = plan.get("adapters")
    if adapters:
        reserved = format_memory(adapters.get("reserved_bytes", 0) / GIB, GIB)
        lines.append(
            f"  adapters ({adapters.get('api')}): {adapters.get('places')} places, {reserved} "
            f"reserved, serves {', '.join(adapters.get('serves') or []) or 'none declared'}"
        )
        if adapters.get("reapply"):
            lines.append(f"  adapters loaded again before ready: {', '.join(adapters['reapply'])}")
    peers = plan.get("exclusive_peers") or []
    if peers:
        lines.append(f"  exclusive group: would first unload {', '.join(peers)}")
    if action == "refuse":
        body: dict[str, Any] = plan.get("error") or {}
        error = body.get("error", body) if isinstance(body, dict) else {}
        lines.append(
            style.red("  would be refused")
            + f": [{error.get('code', '?')}] {error.get('message', '')}"
        )
        return lines
    victims = plan.get("evict") or []
    if not victims:
        lines.append(style.green("  would load") + ": it fits, nothing is evicted")
        return lines
    lines.append(style.yellow(f"  would evict {len(victims)} slot(s) first") + ":")
    for victim in victims:
        where = ", ".join(victim.get("devices") or [])
        how = "sleep" if victim.get("action") == "sleep" else "unload"
        lines.append(
            f"    {how} {victim.get('slot')}: priority {victim.get('priority')}, idle "
            f"{victim.get('idle_s')}s, frees {_bytes(victim.get('bytes'))}"
            + (f" on {where}" if where else "")
            + (f" ({victim['reason']})" if victim.get("reason") else "")
        )
    freed = plan.get("freed") or {}
    if freed:
        parts = [
            f"{key} {'+' if int(n) >= 0 else '-'}{_bytes(abs(int(n)))}"
            for key, n in sorted(freed.items())
        ]
        lines.append("  memory given back: " + ", ".join(parts))
    return lines


def _unit_lines(plan: PlanJson, style: Style) -> list[str]:
    """A unit member's dry run: the unit, how its members would load, what it evicts."""
    unit = plan.get("unit")
    if not isinstance(unit, dict):
        return []
    members = [m for m in unit.get("members") or [] if isinstance(m, dict)]
    order = unit.get("order") or [m.get("slot", "") for m in members]
    lines = [style.bold(f"  unit {unit.get('name')}") + f": {', '.join(order)} load together"]
    if unit.get("failed"):
        lines.append(style.red(f"    {unit['failed']} does not fit beside the other members"))
    if unit.get("evict"):
        lines.append(f"    the unit would evict {', '.join(unit['evict'])}")
    for m in members:
        together = m.get("together")
        where = (together.get("where", "") if together else "") or m.get("reason") or ""
        lines.append(
            f"    member {m.get('slot')}: {m.get('action')}" + (f", {where}" if where else "")
        )
    return lines


def _placement_lines(plan: PlanJson) -> list[str]:
    """Where the load would go: each device of its placement with its figures (a refused
    load: the device set that came closest)."""
    placement = plan.get("placement")
    devices: list[Mapping[str, Any]] = [*placement] if placement else [plan]
    chosen = plan.get("devices") or []
    lines = []
    if chosen:
        lines.append(
            f"  {plan.get('device')}: would go on {', '.join(chosen)}, needs "
            f"{_bytes(plan.get('needed_bytes'))} in all"
        )
    for device in devices:
        budget = device.get("budget_bytes")
        evict = device.get("evict") or []
        lines.append(
            f"  device {device.get('device')}: needs {_bytes(device.get('needed_bytes'))}; "
            f"free {_bytes(device.get('free_bytes'))} ({device.get('probe')}), "
            f"budget {_bytes(budget) if budget is not None else 'none'}, "
            f"admitted {_bytes(device.get('admitted_bytes'))}"
            + (f"; evicts {', '.join(evict)}" if evict else "")
        )
    return lines


def cmd_slot_unload(args: argparse.Namespace) -> ExitCode:
    _, answer = _client(args).post(
        f"/api/slots/{quote_segment(args.name)}/unload", query={"force": args.force or None}
    )
    message = answer.get("message") if isinstance(answer, dict) else None
    said = f"slot {args.name}: unloaded ({_state(answer.get('slot'))})"
    _print(args, answer, f"{said}; {message}" if message else said)
    return ExitCode.OK


def cmd_slot_swap(args: argparse.Namespace) -> ExitCode:
    _, answer = _client(args).post(
        f"/api/slots/{quote_segment(args.name)}/swap", {"model": args.model}
    )
    slot = answer.get("slot") or {}
    _print(
        args,
        answer,
        f"slot {args.name}: serves {slot.get('model_id', args.model)} ({_state(slot)})",
    )
    return ExitCode.OK


def cmd_slot_reset(args: argparse.Namespace) -> ExitCode:
    _, answer = _client(args).post(f"/api/slots/{quote_segment(args.name)}/reset")
    _print(
        args,
        answer,
        f"slot {args.name}: crash-loop breaker reset ({_state(answer.get('slot'))})",
    )
    return ExitCode.OK


def cmd_slot_hold(args: argparse.Namespace) -> ExitCode:
    _, answer = _client(args).post(
        f"/api/slots/{quote_segment(args.name)}/hold", {"ttl_s": args.duration}
    )
    _print(
        args,
        answer,
        f"slot {args.name}: held for {_human_duration(args.duration)} "
        f"(lease {answer.get('lease')}); it stays loaded and is not evicted until then",
    )
    return ExitCode.OK


# ====================================================================== model commands

_MODEL_COLUMNS: Final = ("MODEL", "KIND", "STATE", "MEMORY", "RESIDENT", "LOADABLE", "SLOTS")


def cmd_model_list(args: argparse.Namespace) -> ExitCode:
    client = _client(args, timeout=30.0)
    answer = client.get("/api/models")
    models = answer.get("models", []) if isinstance(answer, dict) else []
    files = files_by_model(client)  # None: this controller manages no model files
    if files is not None:
        for m in models:
            m["files"] = files.get(str(m.get("id")))
    if args.output != "table":
        _print(args, answer, "")
        return ExitCode.OK
    rows = [
        [
            str(m.get("id")),
            str(m.get("kind")),
            str(m.get("state")),
            format_memory(m.get("memory_gb"), GIB),
            "yes" if m.get("resident") else "no",
            "yes" if m.get("loadable") else "no",
            ",".join(m.get("slots") or []) or "-",
            *(files_cell(m.get("files")) if files is not None else ()),
        ]
        for m in models
    ]
    columns = _MODEL_COLUMNS + (("FILES", "SIZE") if files is not None else ())
    for line in table(columns, rows):
        print(line)
    if not rows:
        print("(no models: apply a stack with `slotctl stack apply`)", file=sys.stderr)
    aliases = answer.get("aliases") or [] if isinstance(answer, dict) else []
    if aliases:
        print()
        alias_rows = [
            [
                str(a.get("id")),
                ",".join(a.get("models") or []) or "-",
                str(a.get("prefer")),
                str(a.get("serves") or "-"),
            ]
            for a in aliases
        ]
        for line in table(("ALIAS", "MODELS", "PREFER", "SERVES"), alias_rows):
            print(line)
    return ExitCode.OK


def cmd_model_load(args: argparse.Namespace) -> ExitCode:
    client = _client(args)
    started = time.monotonic()
    _, answer = client.post(f"/api/models/{quote_segment(args.model_id)}/load")
    return _load_and_wait(args, client, answer, f"model {args.model_id}", started)


def cmd_model_unload(args: argparse.Namespace) -> ExitCode:
    _, answer = _client(args).post(f"/api/models/{quote_segment(args.model_id)}/unload")
    verdict = answer.get("status", "?") if isinstance(answer, dict) else "?"
    message = answer.get("message") if isinstance(answer, dict) else None
    _print(args, answer, f"model {args.model_id}: {message or verdict}")
    return ExitCode.OK


def _gib(value: object) -> str:
    return format_memory(value if isinstance(value, int | float) else None)


def footprint_summary(fp: Mapping[str, Any]) -> str:
    """One line: what admission counts, on what basis, and the figures beside it."""
    parts = [f"{_gib(fp.get('admitted_bytes'))} ({fp.get('basis', '?')})"]
    for key, word in (
        ("declared_bytes", "declared"),
        ("estimated_bytes", "estimated"),
        ("observed_bytes", "observed"),
    ):
        if fp.get(key) is not None:
            parts.append(f"{word} {_gib(fp.get(key))}")
    return "; ".join(parts)


def footprint_lines(fp: Mapping[str, Any]) -> list[str]:
    """A slot's footprint, part by part (``slotctl model footprint``)."""
    lines = [
        f"slot {fp.get('slot')} ({fp.get('provider')}, device {fp.get('device')}): "
        + footprint_summary(fp)
    ]
    if fp.get("source"):
        by_type = ", ".join(
            f"{name} {_gib(size)}" for name, size in (fp.get("weights_by_type") or {}).items()
        )
        lines += [
            f"  weights      {_gib(fp.get('weights_bytes'))} ({by_type}); "
            f"{fp.get('layers_on_device')}/{fp.get('layers')} layers on the device, "
            f"{_gib(fp.get('weights_host_bytes'))} in host memory",
            f"  KV cache     {_gib(fp.get('kv_bytes'))} at context {fp.get('context')} "
            f"(parallel {fp.get('parallel')}, cache {fp.get('cache_type')}); "
            f"{_gib(fp.get('kv_host_bytes'))} in host memory",
            f"  buffers      {_gib(fp.get('buffers_bytes'))}",
            f"  host memory  {_gib(fp.get('host_bytes'))} (prompt cache "
            f"{_gib(fp.get('prompt_cache_bytes'))}, engine {_gib(fp.get('engine_bytes'))})",
        ]
    else:
        lines.append(f"  no estimate: {fp.get('why_not') or '?'}")
    if fp.get("observed_bytes") is not None:
        lines.append(
            f"  observed     {_gib(fp.get('observed_bytes'))} on the device, "
            f"{_gib(fp.get('observed_host_bytes'))} RSS ({fp.get('observed_source')}, "
            f"peak at {fp.get('observed_at') or '?'})"
        )
    lines += [f"  note: {note}" for note in fp.get("notes") or []]
    if fp.get("warning"):
        lines.append(f"  warning: {fp['warning']}")
    return lines


def cmd_model_footprint(args: argparse.Namespace) -> ExitCode:
    answer = _client(args).get(f"/api/models/{quote_segment(args.model_id)}/footprint")
    slots = answer.get("slots", []) if isinstance(answer, dict) else []
    lines = [line for fp in slots for line in footprint_lines(fp)]
    if not slots:
        lines = [f"model {args.model_id}: no slot binds it (its launch decides the footprint)"]
    _print(args, answer, "\n".join(lines))
    return ExitCode.OK


# ====================================================================== dashboard


def cmd_dashboard(args: argparse.Namespace) -> ExitCode:
    """A one-time login link: the URL alone on stdout (scriptable), a note on stderr."""
    client = _client(args, timeout=30.0)
    _, answer = client.post("/api/login-codes")
    print(f"{client.endpoint.base}{answer['path']}")
    minutes = float(answer.get("expires_in_s", 0)) / 60
    print(f"(one-time link, valid {minutes:g} min)", file=sys.stderr)
    return ExitCode.OK


# For the other command modules that talk to the API (:mod:`controller.cli.keys`).
client_of = _client
print_data = _print
