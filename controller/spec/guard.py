"""The write boundary: every writer of slot config passes through this module.

``guard_slot_write_payload`` validates a slot payload (schema, model-owned keys, hardware
and placement flags, cross-slot rules) and :func:`write_slot_config` writes one slot to the
config dir, after the guard, atomically, through tomlkit so a user's comments and layout
survive; :func:`write_slot_configs` does the same for a whole validated set at once (stack
apply: one lock, one cross-slot check, O(N)). The HTTP API and in-process creates call the
first, stack apply the second; ``tests/unit/test_guard_writers.py`` proves nothing else
writes slot config.

The per-slot checks (:func:`check_slot_payload`) and the cross-slot rules
(:func:`cross_slot_problems`) are shared with the stack loader, so a stack file and an API
payload are judged by the same code.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import fcntl
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.items
from pydantic import ValidationError
from tomlkit.container import Container
from tomlkit.toml_document import TOMLDocument

from controller.names import is_valid_slot_name
from controller.spec.locate import LineIndex
from controller.spec.problems import Problem, problems_from_validation, raise_for_problems
from controller.spec.schema import (
    HARDWARE_ENV_VARS,
    HARDWARE_FLAGS,
    MODEL_OWNED_FLAGS,
    MODEL_OWNED_KEYS,
    ModelSpec,
    SlotSpec,
)
from controller.store import atomic_write_bytes, check_slot_name

__all__ = [
    "Origin",
    "SlotCheck",
    "SlotEntry",
    "check_slot_payload",
    "cross_slot_problems",
    "delete_slot_config",
    "guard_slot_write_payload",
    "write_catalogue",
    "write_slot_config",
    "write_slot_configs",
]

Loc = tuple[str | int, ...]
SLOTS_SUBDIR = "slots"
CATALOGUE_FILE = "models.toml"
_LOCK_FILE = ".slotctl.lock"


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
                    hint=f"remove {arg!r}; set `device`/`port` on the slot instead",
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
                    hint=f"remove {name}; the controller sets it from `device`",
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


@dataclass(frozen=True, slots=True)
class SlotEntry:
    """A validated slot with its origin, so cross-slot problems can be located."""

    spec: SlotSpec
    origin: Origin = Origin()

    def where(self) -> str:
        return self.origin.where()

    def problem(self, code: str, message: str, loc: Loc, hint: str | None = None) -> Problem:
        return Problem(
            code=code,
            message=message,
            file=self.origin.file,
            slot=self.spec.name,
            key=".".join(str(p) for p in loc) or None,
            line=self.origin.line(loc),
            hint=hint,
        )


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
        if spec.port in ports:
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
            ports[spec.port] = entry
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
    return out


def guard_slot_write_payload(
    payload: object,
    *,
    others: Sequence[SlotSpec] = (),
    catalogue: Mapping[str, ModelSpec] | None = None,
) -> SlotSpec:
    """Validate one slot write against the schema, key ownership and the other slots.

    ``others`` are the slots that stay as they are (the one being replaced excluded).
    Raises ``SlotConfigError`` (``NpuExclusivityViolation`` for the NPU rule) naming every
    offending key; returns the validated spec otherwise. Changes nothing.
    """
    check = check_slot_payload(payload)
    raise_for_problems([p for p, _ in check.errors])
    assert check.spec is not None
    entries = [SlotEntry(spec=o) for o in others] + [SlotEntry(spec=check.spec)]
    problems = [p for p in cross_slot_problems(entries, catalogue) if p.slot == check.spec.name]
    raise_for_problems(problems)
    return check.spec


# --------------------------------------------------------------------------- writing


@contextlib.contextmanager
def config_lock(config_dir: Path) -> Iterator[None]:
    """Serialise writers of one config dir across processes (CLI and daemon)."""
    config_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(config_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def slot_config_path(config_dir: Path, name: str) -> Path:
    return Path(config_dir) / SLOTS_SUBDIR / f"{check_slot_name(name)}.toml"


def _sync(
    container: Container | tomlkit.items.Table | tomlkit.items.InlineTable,
    wanted: Mapping[str, Any],
) -> None:
    """Make ``container`` equal ``wanted`` while touching only what differs.

    Unchanged keys keep their comments, position and formatting byte for byte.
    """
    for key in [k for k in container if k not in wanted]:
        del container[key]
    for key, value in wanted.items():
        if key not in container:
            container[key] = value
            continue
        current = container[key]
        if isinstance(value, Mapping) and isinstance(
            current, tomlkit.items.Table | tomlkit.items.InlineTable
        ):
            _sync(current, value)
        elif _plain(current) != value:
            container[key] = value


def _plain(item: Any) -> Any:
    return item.unwrap() if hasattr(item, "unwrap") else item


def toml_table(data: Mapping[str, Any]) -> tomlkit.items.Table:
    """A readable TOML table: scalars first, ``model`` inline, other sub-tables after."""
    table = tomlkit.table()
    for key, value in data.items():
        if key == "model" and isinstance(value, Mapping):
            inline = tomlkit.inline_table()
            inline.update(value)
            table[key] = inline
        elif not isinstance(value, Mapping):
            table[key] = value
    for key, value in data.items():
        if key != "model" and isinstance(value, Mapping):
            sub = tomlkit.table()
            for k, v in value.items():
                sub[k] = v
            table[key] = sub
    return table


def _render_new(slot_doc: Mapping[str, Any], stack: str | None) -> TOMLDocument:
    doc = tomlkit.document()
    doc.add(tomlkit.comment("slot config written by slotctl (through its write guard)."))
    doc.add(tomlkit.comment("Hand edits are fine while the file stays valid; comments survive."))
    if stack:
        origin = tomlkit.table()
        origin["stack"] = stack
        doc["origin"] = origin
    doc["slot"] = toml_table(slot_doc)
    return doc


def _small_integral(value: float) -> bool:
    return value.is_integer() and abs(value) < 2**53


def slot_document(spec: SlotSpec) -> dict[str, Any]:
    """What is persisted for a slot: the keys that were set, autoload always explicit."""
    data = spec.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    data["autoload"] = bool(spec.autoload)
    # `idle_timeout_s = 900` stays 900, not 900.0 (the schema reads either as a float).
    return {
        k: int(v) if isinstance(v, float) and _small_integral(v) else v for k, v in data.items()
    }


def write_slot_config(
    config_dir: Path,
    payload: Mapping[str, Any],
    *,
    stack: str | None = None,
    merge: bool = False,
    others: Sequence[SlotSpec] | None = None,
) -> SlotSpec:
    """The one writer of slot config: guard, then an atomic, layout-preserving write.

    ``merge=True`` applies ``payload`` as a partial update (PATCH) over the stored slot.
    ``others``: the slots the cross-slot rules compare against, when the caller writes a
    whole validated set (stack apply: a port swap between two slots is legal as a set,
    never as two single writes); default: the other slots on disk.
    A slot created without ``autoload`` persists an explicit ``autoload = false``.
    """
    from controller.spec.configdir import read_config_dir  # reader, not a writer

    config_dir = Path(config_dir)
    with config_lock(config_dir):
        snapshot = read_config_dir(config_dir)
        name = payload.get("name") if isinstance(payload, Mapping) else None
        if not is_valid_slot_name(name):
            guard_slot_write_payload(payload)  # raises with the located name problem
        assert isinstance(name, str)
        path = slot_config_path(config_dir, name)
        existing = _read_document(path)
        wanted = dict(payload)
        stored = snapshot.slots.get(name)
        if merge and existing is not None and isinstance(existing.get("slot"), Mapping):
            wanted = _deep_merge(existing["slot"].unwrap(), payload)
            if wanted.get("autoload") is None and stored is not None:
                # A hand-written file without the key: keep what the reader migrated it
                # to (true when a model is bound), not the create-time default.
                wanted["autoload"] = stored.autoload
        if wanted.get("autoload") is None:  # absent or null: never persist "unset"
            wanted["autoload"] = False
        if others is None:
            others = [s.spec for n, s in snapshot.slots.items() if n != name]
        spec = guard_slot_write_payload(wanted, others=others, catalogue=snapshot.models)
        owner = stack if stack is not None else snapshot.owner(name)
        _write_slot_file(path, spec, owner, existing)
        return spec


def write_slot_configs(
    config_dir: Path,
    writes: Sequence[tuple[Mapping[str, Any], str | None]],
    *,
    final: Sequence[SlotSpec],
    catalogue: Mapping[str, ModelSpec],
) -> list[SlotSpec]:
    """Write many slots of one desired state under one lock: stack apply, O(N).

    ``writes``: (payload, owning stack) per slot to write; ``final``: every slot of the
    resulting set, which the cross-slot rules judge once, as the set it is (a port swap
    between two slots is legal). Each payload passes the per-slot checks; nothing is
    written unless all pass. Each file is read once, and the config dir is not re-read
    per slot (which made applying N slots O(N²)).
    """
    config_dir = Path(config_dir)
    with config_lock(config_dir):
        raise_for_problems(
            cross_slot_problems([SlotEntry(spec=spec) for spec in final], catalogue),
            "desired state",
        )
        checked: list[tuple[SlotSpec, str | None]] = []
        for payload, stack in writes:
            wanted = dict(payload)
            if wanted.get("autoload") is None:
                wanted["autoload"] = False
            check = check_slot_payload(wanted)
            raise_for_problems([p for p, _ in check.errors])
            assert check.spec is not None
            checked.append((check.spec, stack))
        for spec, stack in checked:
            path = slot_config_path(config_dir, spec.name)
            _write_slot_file(path, spec, stack, _read_document(path))
        return [spec for spec, _ in checked]


def _write_slot_file(
    path: Path, spec: SlotSpec, owner: str | None, existing: TOMLDocument | None
) -> None:
    """Render a validated slot into its file (keeping the layout of ``existing``)."""
    document = slot_document(spec)
    if existing is None:
        doc = _render_new(document, owner)
    else:
        doc = existing
        for table in ("origin", "slot"):
            if not isinstance(doc.get(table), tomlkit.items.Table):
                doc.pop(table, None)  # absent or hand-broken (`origin = "x"`): rebuilt
                doc[table] = tomlkit.table()
        if owner and doc["origin"].get("stack") != owner:
            doc["origin"]["stack"] = owner
        _sync(doc["slot"], document)
    atomic_write_bytes(path, tomlkit.dumps(doc).encode())


def _read_document(path: Path) -> TOMLDocument | None:
    try:
        return tomlkit.parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, tomlkit.exceptions.TOMLKitError):
        return None  # an unreadable file is rewritten whole; the loader reports it


def _deep_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def delete_slot_config(config_dir: Path, name: str) -> bool:
    """Remove a slot's config file; returns False when there was none."""
    config_dir = Path(config_dir)
    with config_lock(config_dir):
        path = slot_config_path(config_dir, name)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True


def write_catalogue(config_dir: Path, models: Sequence[ModelSpec]) -> None:
    """Write the model catalogue (``models.toml``), keeping comments of unchanged entries."""
    config_dir = Path(config_dir)
    with config_lock(config_dir):
        path = config_dir / CATALOGUE_FILE
        doc = _read_document(path) or tomlkit.document()
        wanted = [m.model_dump(mode="json", exclude_unset=True, exclude_none=True) for m in models]
        wanted_ids = [w["id"] for w in wanted]
        if len(set(wanted_ids)) != len(wanted_ids):
            raise ValueError("duplicate model ids in catalogue write")
        current = doc.get("model")
        if not isinstance(current, tomlkit.items.AoT):
            doc.pop("model", None)
            current = tomlkit.aot()
        by_id: dict[str, Any] = {t.get("id"): t for t in current}
        tables = []
        for entry in wanted:
            table = by_id.get(entry["id"])
            if table is None:
                table = tomlkit.table()
            _sync(table, entry)
            tables.append(table)
        # Re-fill the array in place: removing and re-adding it would add a blank line
        # on every write; in place, an unchanged catalogue is rewritten byte for byte.
        while len(current):
            del current[0]
        for table in tables:
            current.append(table)
        if tables and "model" not in doc:
            doc["model"] = current
        elif not tables:
            doc.pop("model", None)
        atomic_write_bytes(path, tomlkit.dumps(doc).encode())
