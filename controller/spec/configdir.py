"""Reads the live desired state from the config dir (never writes: that is the guard's).

Layout::

    <config_dir>/controller.toml     controller settings (optional)
    <config_dir>/models.toml         the model catalogue ([[model]] tables)
    <config_dir>/slots/<name>.toml   one slot: [origin] stack = "...", then [slot]
    <config_dir>/residency.json      runtime residency wishes (controller.store)
"""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from controller.model.names import is_valid_slot_name
from controller.spec.aliases import AliasEntry, alias_problems, parse_aliases
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.rules import Origin, SlotEntry, check_slot_payload, cross_slot_problems
from controller.spec.schema import ControllerSettings, ModelSpec
from controller.spec.tomlfile import parse_toml_file

SLOTS_SUBDIR = "slots"
CATALOGUE_FILE = "models.toml"

__all__ = ["SETTINGS_FILE", "ConfigSnapshot", "read_config_dir", "read_settings"]

SETTINGS_FILE = "controller.toml"


@dataclass(slots=True)
class ConfigSnapshot:
    settings: ControllerSettings
    models: dict[str, ModelSpec] = field(default_factory=dict)
    slots: dict[str, DesiredSlot] = field(default_factory=dict)
    aliases: dict[str, AliasEntry] = field(default_factory=dict)  # models.toml's [[alias]]
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    catalogue_ok: bool = True  # False: models.toml (or an entry) is invalid
    # False: the config dir (or its slots/ dir) is missing or cannot be listed. Such a
    # snapshot says nothing about what is desired: the reconciler keeps the last good one.
    readable: bool = True

    def owner(self, name: str) -> str | None:
        slot = self.slots.get(name)
        return slot.stack or None if slot else None

    def desired(self) -> DesiredState:
        stacks = tuple(sorted({s.stack for s in self.slots.values() if s.stack}))
        return DesiredState(
            stacks=stacks, models=self.models, slots=self.slots, aliases=self.aliases
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
    entries, problems = parse_aliases(data.get("alias"), str(path), index, stored=True)
    snap.errors.extend(problems)
    snap.errors.extend(p for p in alias_problems(entries, snap.models) if p.code.endswith("_id"))
    for entry in entries:
        snap.aliases.setdefault(entry.spec.id, entry)  # a second one is reported, not kept


SlotFileRead = tuple[SlotEntry | None, str, list[Problem], list[Problem]]
FileKey = tuple[int, int, int, int, int]

# A slot file read before, by path: what it said, and the file it said it of (device,
# inode, size, modification and change times). An operator with 1,000 Slots reads the
# config dir on every CR change; parsing each unchanged file again was half its CPU.
_READ: dict[Path, tuple[FileKey, SlotFileRead]] = {}
_READ_LOCK = threading.Lock()  # readers run on worker threads, some at once
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


def _read_slot_file_once(path: Path) -> SlotFileRead:
    """:func:`_read_slot_file`, or what it gave for the same file before (its results are
    only read: the snapshot copies the problems, ``normalise`` copies the spec)."""
    key = _file_key(path)
    with _READ_LOCK:
        known = _READ.get(path)
    if key is not None and known is not None and known[0] == key:
        return known[1]
    result = _read_slot_file(path)
    with _READ_LOCK:
        if key is not None:
            if len(_READ) >= READ_MAX:  # many config dirs read by one process (tests)
                _READ.clear()
            _READ[path] = (key, result)
        else:
            _READ.pop(path, None)
    return result


def _forget_others(slots_dir: Path, paths: list[Path]) -> None:
    """Drop what is remembered of this dir's files that are gone."""
    kept = set(paths)
    with _READ_LOCK:
        for path in [p for p in _READ if p.parent == slots_dir and p not in kept]:
            del _READ[path]


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


def read_config_dir(config_dir: Path) -> ConfigSnapshot:
    """The live desired state; invalid files are reported and left out, never fatal."""
    config_dir = Path(config_dir)
    before = _identities(config_dir)
    if before[0] is None:
        return _unreadable(config_dir, "is missing or not a directory")
    snap = _read(config_dir)
    if _identities(config_dir) != before:
        # Deleted or replaced while we read (`rm -rf` removes the slot files one by one):
        # what was read is a half-deleted dir, which must not read as "slots removed".
        return _unreadable(config_dir, "changed while it was read (deleted or replaced)")
    return snap


def _identities(config_dir: Path) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(device, inode) of the config dir and of its ``slots/`` (None: absent)."""

    def one(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except (OSError, ValueError):
            return None
        return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

    return one(config_dir), one(config_dir / SLOTS_SUBDIR)


def _read(config_dir: Path) -> ConfigSnapshot:
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
    _forget_others(slots_dir, paths)
    for path in paths:
        if not is_valid_slot_name(path.stem):
            if not path.name.startswith("."):  # hidden files are an editor's business
                snap.warnings.append(_ignored_file(path))
            continue
        entry, stack, errors, warnings = _read_slot_file_once(path)
        snap.errors.extend(errors)
        snap.warnings.extend(warnings)
        if entry is not None:
            entries.append((entry, stack))
    # Cross-slot rules are enforced at write time; report (not drop) anything hand-edited.
    snap.errors.extend(cross_slot_problems([e for e, _ in entries], snap.models))
    slots = {e.spec.name for e, _ in entries}
    snap.errors.extend(
        p
        for p in alias_problems(list(snap.aliases.values()), snap.models, slots)
        if not p.code.endswith("_id")  # (a duplicate id: reported with the catalogue)
    )
    for entry, stack in entries:
        snap.slots[entry.spec.name] = DesiredSlot(
            spec=normalise(entry.spec, settings),
            stack=stack,
            file=entry.origin.file,
            line=entry.origin.line(),
        )
    return snap
