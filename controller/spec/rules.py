"""The validation rules every desired-state source is judged by. Pure (no I/O).

Per slot (:func:`check_slot_payload`: the schema, model-owned keys, hardware and
placement flags) and across slots (:func:`cross_slot_problems`: unique names and ports,
NPU exclusivity, model references). The stack loader, the config-dir reader and the write
guard all call these, so a stack file, the live config dir and an API payload are judged
by the same code. Problems carry their location (:class:`Origin`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from controller.spec.locate import LineIndex
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.replicas import replica_name
from controller.spec.schema import (
    HARDWARE_ENV_VARS,
    HARDWARE_FLAGS,
    MODEL_OWNED_FLAGS,
    MODEL_OWNED_KEYS,
    ModelSpec,
    SlotSpec,
)

__all__ = [
    "Loc",
    "Origin",
    "SlotCheck",
    "SlotEntry",
    "check_slot_payload",
    "cross_slot_problems",
]

Loc = tuple[str | int, ...]


@dataclass(slots=True)
class SlotCheck:
    """Outcome of the per-slot checks; problems carry paths relative to the slot table."""

    spec: SlotSpec | None
    errors: list[tuple[Problem, Loc]] = field(default_factory=list)
    warnings: list[tuple[Problem, Loc]] = field(default_factory=list)


def _flag_name(arg: str) -> str | None:
    if not arg.startswith("-") or arg == "-" or arg == "--":
        return None
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def _owner_of(flag: str) -> str:
    """Which slot field sets what a hardware flag would (the hint of its refusal)."""
    if flag in ("--port", "--host"):
        return "set `port` on the slot instead (the controller binds the server to it)"
    return (
        'set `device` ("cpu", "gpu" for any GPU, "gpu:1" or "gpu:GPU-…" to pin) and `gpus` '
        "(GPUs to span) on the slot instead: the controller sets the GPU layers, split mode, "
        "tensor-parallel size and visible GPUs from them"
    )


def _screen_server(server: Mapping[str, Any], owner: str) -> list[tuple[Problem, Loc]]:
    out: list[tuple[Problem, Loc]] = []
    args = server.get("extra_args")
    if isinstance(args, list):
        for i, arg in enumerate(args):
            flag = _flag_name(arg) if isinstance(arg, str) else None
            if flag in HARDWARE_FLAGS:
                problem = Problem(
                    code="slot.hardware_flag",
                    message=f"server.extra_args[{i}] sets {flag!r}: hardware and placement "
                    "flags are owned by the slot's `device` field and the controller",
                    key=f"server.extra_args[{i}]",
                    hint=f"remove {arg!r}; {_owner_of(flag)}",
                )
                out.append((problem, ("server", "extra_args", i)))
            elif flag in MODEL_OWNED_FLAGS:
                model_key = MODEL_OWNED_FLAGS[flag]
                problem = Problem(
                    code="slot.model_owned_key",
                    message=f"server.extra_args[{i}] sets {flag!r}, which the model owns "
                    f"({model_key!r}{owner})",
                    key=f"server.extra_args[{i}]",
                    hint=f"set `{model_key}` on the [[model]] entry instead",
                )
                out.append((problem, ("server", "extra_args", i)))
    env = server.get("env")
    if isinstance(env, Mapping):
        for name in env:
            if name in HARDWARE_ENV_VARS:
                problem = Problem(
                    code="slot.hardware_flag",
                    message=f"server.env sets {name}: device visibility is owned by the "
                    "slot's `device` field and the controller",
                    key=f"server.env.{name}",
                    hint=f"remove {name}; the controller sets it to the GPUs it places the "
                    'slot on: choose them with `device` ("gpu" any, "gpu:1", "gpu:GPU-…") '
                    "and `gpus` (how many)",
                )
                out.append((problem, ("server", "env", name)))
    return out


def check_slot_payload(payload: object) -> SlotCheck:
    """Per-slot checks shared by the guard and the loader. Never raises."""
    if not isinstance(payload, Mapping):
        problem = Problem(
            code="slot.invalid_value",
            message=f"a slot must be a table, got {type(payload).__name__}",
        )
        return SlotCheck(spec=None, errors=[(problem, ())])
    data = dict(payload)
    check = SlotCheck(spec=None)
    slot_name = data.get("name") if isinstance(data.get("name"), str) else None
    if "lru" in data:
        del data["lru"]
        problem = Problem(
            code="slot.lru_flag_retired",
            message="the `lru` key is retired and ignored: every non-pinned slot is an "
            "eviction candidate",
            key="lru",
            hint="remove `lru`; use `priority` (0..100) and `pinned` instead",
            severity="warning",
        )
        check.warnings.append((problem, ("lru",)))
    for key in ("replica_of", "replica_index"):
        if key in data:  # the desired state's expansion sets them, never a source
            del data[key]
            problem = Problem(
                code="slot.replica_internal",
                message=f"{key!r} is set by the controller on a replica, not by a stack",
                key=key,
                hint="declare `replicas` (or min_replicas/max_replicas) on the slot instead",
            )
            check.errors.append((problem, (key,)))
    model = data.get("model")
    model_id = model.get("default") if isinstance(model, Mapping) else None
    owner = f" of model {model_id!r}" if isinstance(model_id, str) and model_id else ""
    for key in sorted(MODEL_OWNED_KEYS & set(data)):
        del data[key]
        check.errors.append((_model_owned(key, key, owner), (key,)))
    if isinstance(model, Mapping):
        owned = sorted(MODEL_OWNED_KEYS & set(model))
        if owned:
            data["model"] = {k: v for k, v in model.items() if k not in MODEL_OWNED_KEYS}
        for key in owned:
            check.errors.append((_model_owned(key, f"model.{key}", owner), ("model", key)))
    server = data.get("server")
    if isinstance(server, Mapping):
        check.errors.extend(_screen_server(server, owner))
    try:
        spec = SlotSpec.model_validate(data)
    except ValidationError as exc:
        located = problems_from_validation(exc, scope="slot", fields=SlotSpec.model_fields)
        check.errors.extend(located)
    else:
        if not check.errors:
            check.spec = spec
    if slot_name:
        check.errors = [(replace(p, slot=slot_name), loc) for p, loc in check.errors]
        check.warnings = [(replace(p, slot=slot_name), loc) for p, loc in check.warnings]
    return check


def _model_owned(key: str, shown: str, owner: str) -> Problem:
    return Problem(
        code="slot.model_owned_key",
        message=f"{shown!r} is model-owned{owner}: a slot cannot set it",
        key=shown,
        hint=f"set `{key}` on the [[model]] entry in the catalogue instead",
    )


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a table came from (file, path of the table, line index), for locating problems."""

    file: str | None = None
    base: Loc = ()
    index: LineIndex | None = None

    def line(self, loc: Loc = ()) -> int | None:
        return self.index.line_of((*self.base, *loc)) if self.index else None

    def where(self, loc: Loc = ("name",)) -> str:
        line = self.line(loc)
        return f"{self.file}:{line}" if self.file and line else (self.file or "the config dir")

    def problem(
        self, code: str, message: str, loc: Loc, hint: str | None = None, slot: str | None = None
    ) -> Problem:
        """A problem at ``loc`` of this table: its file, dotted key and line."""
        return Problem(
            code=code,
            message=message,
            file=self.file,
            slot=slot,
            key=".".join(str(p) for p in loc) or None,
            line=self.line(loc),
            hint=hint,
        )


@dataclass(frozen=True, slots=True)
class SlotEntry:
    """A validated slot with its origin, so cross-slot problems can be located."""

    spec: SlotSpec
    origin: Origin = Origin()

    def where(self) -> str:
        return self.origin.where()

    def problem(self, code: str, message: str, loc: Loc, hint: str | None = None) -> Problem:
        return self.origin.problem(code, message, loc, hint, slot=self.spec.name)


def cross_slot_problems(
    entries: Sequence[SlotEntry], catalogue: Mapping[str, ModelSpec] | None
) -> list[Problem]:
    """Unique names and ports, NPU exclusivity, and (with a catalogue) model references."""
    out: list[Problem] = []
    names: dict[str, SlotEntry] = {}
    ports: dict[int, SlotEntry] = {}
    npu_llm: SlotEntry | None = None
    for entry in entries:
        spec = entry.spec
        if spec.name in names:
            first = names[spec.name]
            out.append(
                entry.problem(
                    "slot.duplicate_name",
                    f"slot {spec.name!r} is declared twice (first at {first.where()})",
                    ("name",),
                    "slot names are unique across every stack file of a desired state",
                )
            )
            continue
        names[spec.name] = entry
        if spec.port is None:
            pass  # auto: the controller gives each such slot a port of its own
        elif spec.port in ports:
            first = ports[spec.port]
            out.append(
                entry.problem(
                    "slot.duplicate_port",
                    f"port {spec.port} is already used by slot {first.spec.name!r} "
                    f"({first.where()})",
                    ("port",),
                    "give every slot its own port",
                )
            )
        else:
            ports[spec.port] = entry  # (a port taken by an auto slot is its to give up)
        if spec.activated and spec.device == "npu" and spec.type == "llm":
            if npu_llm is not None:
                out.append(
                    entry.problem(
                        "slot.npu_exclusive",
                        f'only one activated device="npu" type="llm" slot is allowed; '
                        f"{npu_llm.spec.name!r} ({npu_llm.where()}) already is",
                        ("device",),
                        "clear model.default on one of them or move it to another device",
                    )
                )
            else:
                npu_llm = entry
        if catalogue is not None and spec.model_id and spec.model_id not in catalogue:
            close = difflib.get_close_matches(spec.model_id, list(catalogue), n=1)
            out.append(
                entry.problem(
                    "slot.unknown_model",
                    f"model.default names {spec.model_id!r}, which is not in the catalogue",
                    ("model", "default"),
                    f"did you mean {close[0]!r}?" if close else "declare it in a [[model]] table",
                )
            )
    out.extend(_replica_problems(entries))
    return out


def _replica_problems(entries: Sequence[SlotEntry]) -> list[Problem]:
    """A replica's name (``<slot>-r<i>``) taken by a declared slot."""
    out: list[Problem] = []
    declared = {e.spec.name: e for e in entries}
    for entry in entries:
        spec = entry.spec
        for index in range(1, spec.max_count):
            other = declared.get(replica_name(spec.name, index))
            if other is not None:
                out.append(
                    other.problem(
                        "slot.replica_name_taken",
                        f"slot {other.spec.name!r} has the name of replica {index} of slot "
                        f"{spec.name!r} ({entry.where()})",
                        ("name",),
                        "rename the slot, or lower the other slot's max_replicas",
                    )
                )
    return out
