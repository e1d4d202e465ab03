"""Reads the live desired state from the config dir (never writes: that is the guard's).

Layout::

    <config_dir>/controller.toml     controller settings (optional)
    <config_dir>/models.toml         the model catalogue ([[model]] tables, each with
                                     ``stack``: the stack(s) that declared it)
    <config_dir>/slots/<name>.toml   one slot: [origin] stack = "...", then [slot]
    <config_dir>/residency.json      runtime residency wishes (controller.store)

What a slot file said is kept by a :class:`ParseCache` that its owner passes in (the
files source of :class:`~controller.spec.desired.DesiredCache` keeps one: a member, not a
process-wide store), so a file is parsed again only when it changed; a reader without one
(a CLI command's one look, the guard's read under its lock) parses every file.
:func:`read_slot` reads one slot's file, for a source that re-reads only the slots a write
named.
"""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from controller.model.names import is_valid_slot_name
from controller.spec.adapters import AdapterEntry, adapter_problems, parse_adapters
from controller.spec.aliases import AliasEntry, alias_problems, parse_aliases
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.rules import Origin, SlotEntry, check_slot_payload, cross_slot_problems
from controller.spec.schema import ControllerSettings, ModelSpec
from controller.spec.tables import OWNER_KEY
from controller.spec.tomlfile import parse_toml_file

SLOTS_SUBDIR = "slots"
CATALOGUE_FILE = "models.toml"

__all__ = [
    "CATALOGUE_FILE",
    "MODEL_OWNER_KEY",
    "SETTINGS_FILE",
    "SLOTS_SUBDIR",
    "ConfigSnapshot",
    "ParseCache",
    "SlotFileRead",
    "cross_problems",
    "desired_slot",
    "read_config_dir",
    "read_settings",
    "read_slot",
    "slot_file",
]

SETTINGS_FILE = "controller.toml"

# In models.toml: the stack that declared a [[model]] (a string), or the stacks (an array)
# when several declare one id. Written by the guard, never by hand: a stack file's
# [[model]] may not name it (its stack is the file's). A model without one (a catalogue
# written before owners, or by hand) is owned by no stack: a prune never removes it for
# being declared by none (see controller.reconcile.apply.unused_models).
MODEL_OWNER_KEY: Final = OWNER_KEY  # the key aliases and adapters carry their owner in


def stored_owners(value: object) -> tuple[str, ...] | None:
    """The owners a stored ``[[model]]``'s :data:`MODEL_OWNER_KEY` names; None: not an
    owner value (left in the table, so the schema reports it)."""
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return tuple(sorted(set(value)))
    return None


def owner_value(owners: Sequence[str]) -> str | list[str] | None:
    """What the guard stores for ``owners``: one stack as a string, several as a sorted
    array, none as nothing (None)."""
    unique = sorted(set(owners))
    if not unique:
        return None
    return unique[0] if len(unique) == 1 else unique


@dataclass(slots=True)
class ConfigSnapshot:
    settings: ControllerSettings
    models: dict[str, ModelSpec] = field(default_factory=dict)
    slots: dict[str, DesiredSlot] = field(default_factory=dict)
    aliases: dict[str, AliasEntry] = field(default_factory=dict)  # models.toml's [[alias]]
    adapters: dict[str, AdapterEntry] = field(default_factory=dict)  # and its [[adapter]]
    # models.toml's [[model]] owners (MODEL_OWNER_KEY), by id; an unowned model is absent
    model_owners: dict[str, tuple[str, ...]] = field(default_factory=dict)
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    catalogue_ok: bool = True  # False: models.toml (or an entry) is invalid
    # False: the config dir (or its slots/ dir) is missing or cannot be listed. Such a
    # snapshot says nothing about what is desired: the reconciler keeps the last good one.
    readable: bool = True
    # The validated slot entries with their origins (each file's location), by slot name:
    # what a source re-judges the cross-slot rules over when it re-reads a few files.
    entries: dict[str, SlotEntry] = field(default_factory=dict, repr=False, compare=False)
    cross: list[Problem] = field(default_factory=list, repr=False, compare=False)  # in errors

    def owner(self, name: str) -> str | None:
        slot = self.slots.get(name)
        return slot.stack or None if slot else None

    def desired(self) -> DesiredState:
        stacks = tuple(sorted({s.stack for s in self.slots.values() if s.stack}))
        return DesiredState(
            stacks=stacks,
            models=self.models,
            slots=self.slots,
            aliases=self.aliases,
            adapters=self.adapters,
        )


def _located(
    problems: list[tuple[Problem, tuple[str | int, ...]]], origin: Origin
) -> list[Problem]:
    return [
        Problem(
            **{**p.to_dict(), "file": origin.file, "line": origin.line(loc)}, severity=p.severity
        )
        for p, loc in problems
    ]


def read_settings(config_dir: Path) -> tuple[ControllerSettings, list[Problem]]:
    path = Path(config_dir) / SETTINGS_FILE
    if not path.exists():
        return ControllerSettings(), []
    data, index, problems = parse_toml_file(path)
    if data is None:
        return ControllerSettings(), problems
    try:
        return ControllerSettings.model_validate(data), []
    except ValidationError as exc:
        located = problems_from_validation(
            exc, scope="settings", fields=ControllerSettings.model_fields
        )
        return ControllerSettings(), _located(located, Origin(file=str(path), index=index))


def _read_catalogue(config_dir: Path, snap: ConfigSnapshot) -> None:
    path = config_dir / CATALOGUE_FILE
    if not path.exists():
        return
    data, index, problems = parse_toml_file(path)
    snap.errors.extend(problems)
    if data is None:
        snap.catalogue_ok = False
        return
    raw_models = data.get("model", [])
    for i, raw in enumerate(raw_models if isinstance(raw_models, list) else []):
        owners = stored_owners(raw.get(MODEL_OWNER_KEY)) if isinstance(raw, Mapping) else None
        if owners is not None:
            raw = {k: v for k, v in raw.items() if k != MODEL_OWNER_KEY}
        try:
            model = ModelSpec.model_validate(raw)
        except ValidationError as exc:
            located = problems_from_validation(
                exc, scope="model", fields=ModelSpec.model_fields, prefix=("model", i)
            )
            snap.errors.extend(_located(located, Origin(file=str(path), index=index)))
            snap.catalogue_ok = False
            continue
        snap.models[model.id] = model
        if owners:
            snap.model_owners[model.id] = owners
    entries, problems = parse_aliases(data.get("alias"), str(path), index, stored=True)
    snap.errors.extend(problems)
    snap.errors.extend(p for p in alias_problems(entries, snap.models) if p.code.endswith("_id"))
    for entry in entries:
        snap.aliases.setdefault(entry.spec.id, entry)  # a second one is reported, not kept
    adapters, problems = parse_adapters(data.get("adapter"), str(path), index, stored=True)
    snap.errors.extend(problems)
    snap.errors.extend(
        p for p in adapter_problems(adapters, snap.models) if p.code == "adapter.duplicate_id"
    )
    for adapter in adapters:
        snap.adapters.setdefault(adapter.spec.id, adapter)


SlotFileRead = tuple[SlotEntry | None, str, list[Problem], list[Problem]]
FileKey = tuple[int, int, int, int, int]

# A file changed this recently may change again within the file system's time tick
# without its times moving (a same-size edit in place): it is read again until older
# (git's "racy clean" rule). The guard's writes are renames: a new inode each.
RACY_S = 2.0
READ_MAX = 20_000


def _file_key(path: Path) -> FileKey | None:
    try:
        st = path.stat()
    except OSError:
        return None
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_S * 1e9:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ParseCache:
    """What each slot file said when it was last parsed, by path, with the file it said
    it of (device, inode, size, modification and change times): an unchanged file is not
    parsed again. Owned by whoever reads one config dir again and again (the desired
    state's files source); safe for readers on worker threads, some at once."""

    def __init__(self, limit: int = READ_MAX) -> None:
        self.limit = limit
        self._read: dict[Path, tuple[FileKey, SlotFileRead]] = {}
        self._lock = threading.Lock()

    def __contains__(self, path: object) -> bool:
        with self._lock:
            return path in self._read

    def __len__(self) -> int:
        return len(self._read)

    def read(self, path: Path) -> SlotFileRead:
        """:func:`_read_slot_file`, or what it gave for the same file before (its results
        are only read: the snapshot copies the problems, ``normalise`` copies the spec)."""
        key = _file_key(path)
        with self._lock:
            known = self._read.get(path)
        if key is not None and known is not None and known[0] == key:
            return known[1]
        result = _read_slot_file(path)
        with self._lock:
            if key is not None:
                if len(self._read) >= self.limit:  # a pathological dir: start again
                    self._read.clear()
                self._read[path] = (key, result)
            else:
                self._read.pop(path, None)
        return result

    def forget_others(self, slots_dir: Path, paths: list[Path]) -> None:
        """Drop what is remembered of this dir's files that are gone."""
        kept = set(paths)
        with self._lock:
            for path in [p for p in self._read if p.parent == slots_dir and p not in kept]:
                del self._read[path]

    def forget(self, path: Path) -> None:
        with self._lock:
            self._read.pop(path, None)


def _read_slot_file(path: Path) -> SlotFileRead:
    data, index, problems = parse_toml_file(path)
    if data is None:
        return None, "", problems, []
    origin = Origin(file=str(path), base=("slot",), index=index)
    check = check_slot_payload(data.get("slot"))
    errors = _located(check.errors, origin)
    warnings = _located(check.warnings, origin)
    stack = ""
    meta: Any = data.get("origin", {})
    if isinstance(meta, Mapping) and isinstance(meta.get("stack"), str):
        stack = meta["stack"]
    if check.spec is not None and check.spec.name != path.stem:
        errors.append(
            Problem(
                code="slot.invalid_value",
                message=f"file {path.name} declares slot {check.spec.name!r}",
                file=str(path),
                slot=check.spec.name,
                key="name",
                line=origin.line(("name",)),
                hint=f"rename the file to {check.spec.name}.toml",
            )
        )
    entry = SlotEntry(spec=check.spec, origin=origin) if check.spec and not errors else None
    return entry, stack, errors, warnings


def _ignored_file(path: Path) -> Problem:
    return Problem(
        code="slot.ignored_file",
        message=f"{path.name} is ignored: {path.stem!r} is not a valid slot name",
        file=str(path),
        hint="slot files are named <slot-name>.toml, a DNS-1123 label such as my-slot.toml",
        severity="warning",
    )


def _unreadable(path: Path, why: str) -> ConfigSnapshot:
    problem = Problem(
        code="config.unreadable",
        message=f"{path} {why}: the last good desired state stays in force",
        file=str(path),
        hint="restore the directory (in GitOps mode the controller rebuilds it)",
    )
    return ConfigSnapshot(settings=ControllerSettings(), errors=[problem], readable=False)


def read_config_dir(config_dir: Path, cache: ParseCache | None = None) -> ConfigSnapshot:
    """The live desired state; invalid files are reported and left out, never fatal.
    ``cache``: the caller's :class:`ParseCache` (None: every file parsed)."""
    config_dir = Path(config_dir)
    before = _identities(config_dir)
    if before[0] is None:
        return _unreadable(config_dir, "is missing or not a directory")
    snap = _read(config_dir, cache)
    if _identities(config_dir) != before:
        # Deleted or replaced while we read (`rm -rf` removes the slot files one by one):
        # what was read is a half-deleted dir, which must not read as "slots removed".
        return _unreadable(config_dir, "changed while it was read (deleted or replaced)")
    return snap


def slot_file(config_dir: Path, name: str) -> Path:
    """Where the reader finds the file of slot ``name``."""
    return Path(config_dir) / SLOTS_SUBDIR / f"{name}.toml"


def read_slot(config_dir: Path, name: str, cache: ParseCache | None = None) -> SlotFileRead | None:
    """One slot's file as :func:`read_config_dir` reads it (None: there is no such file,
    or ``name`` is no slot name)."""
    if not is_valid_slot_name(name):
        return None
    path = slot_file(config_dir, name)
    if not path.is_file():
        if cache is not None:
            cache.forget(path)
        return None
    return cache.read(path) if cache is not None else _read_slot_file(path)


def desired_slot(entry: SlotEntry, stack: str, settings: ControllerSettings) -> DesiredSlot:
    """A read slot entry as the desired state holds it (migrations applied)."""
    return DesiredSlot(
        spec=normalise(entry.spec, settings),
        stack=stack,
        file=entry.origin.file,
        line=entry.origin.line(),
    )


def cross_problems(
    entries: list[SlotEntry],
    models: Mapping[str, ModelSpec],
    aliases: list[AliasEntry],
    adapters: Sequence[AdapterEntry] = (),
) -> list[Problem]:
    """What the rules across slots say of a config dir's slots (reported, never dropped:
    the writes are guarded, these are hand edits): names, ports, the NPU, model
    references, and an alias id that is a slot's name."""
    found = cross_slot_problems(entries, models)
    slots = {e.spec.name for e in entries}
    found.extend(
        p
        for p in alias_problems(aliases, models, slots)
        if not p.code.endswith("_id")  # (a duplicate id: reported with the catalogue)
    )
    alias_ids = {a.spec.id for a in aliases}
    found.extend(
        p
        for p in adapter_problems(adapters, models, entries, alias_ids)
        if p.code != "adapter.duplicate_id"
    )
    return found


def _identities(config_dir: Path) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(device, inode) of the config dir and of its ``slots/`` (None: absent)."""

    def one(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except (OSError, ValueError):
            return None
        return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

    return one(config_dir), one(config_dir / SLOTS_SUBDIR)


def _read(config_dir: Path, cache: ParseCache | None) -> ConfigSnapshot:
    settings, problems = read_settings(config_dir)
    snap = ConfigSnapshot(settings=settings, errors=list(problems))
    _read_catalogue(config_dir, snap)
    slots_dir = config_dir / SLOTS_SUBDIR
    entries: list[tuple[SlotEntry, str]] = []
    if slots_dir.exists() and not slots_dir.is_dir():
        return _unreadable(slots_dir, "is not a directory")
    try:
        paths = sorted(slots_dir.glob("*.toml")) if slots_dir.is_dir() else []
    except OSError as exc:
        return _unreadable(slots_dir, f"cannot be listed: {exc}")
    if cache is not None:
        cache.forget_others(slots_dir, paths)
    for path in paths:
        if not is_valid_slot_name(path.stem):
            if not path.name.startswith("."):  # hidden files are an editor's business
                snap.warnings.append(_ignored_file(path))
            continue
        entry, stack, errors, warnings = (
            cache.read(path) if cache is not None else _read_slot_file(path)
        )
        snap.errors.extend(errors)
        snap.warnings.extend(warnings)
        if entry is not None:
            entries.append((entry, stack))
    # Cross-slot rules are enforced at write time; report (not drop) anything hand-edited.
    snap.cross = cross_problems(
        [e for e, _ in entries],
        snap.models,
        list(snap.aliases.values()),
        list(snap.adapters.values()),
    )
    snap.errors.extend(snap.cross)
    for entry, stack in entries:
        snap.slots[entry.spec.name] = desired_slot(entry, stack, settings)
        snap.entries[entry.spec.name] = entry
    return snap
