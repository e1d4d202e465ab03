"""The write boundary: every writer of slot config passes through this module.

``guard_slot_write_payload`` validates a slot payload (schema, model-owned keys, hardware
and placement flags, cross-slot rules) and :func:`write_slot_config` writes one slot to the
config dir, after the guard, atomically, through tomlkit so a user's comments and layout
survive; :func:`write_slot_configs` does the same for a whole validated set at once (stack
apply: one lock, one cross-slot check, O(N)). The HTTP API and in-process creates call the
first, stack apply the second; ``tests/unit/test_guard_writers.py`` proves nothing else
writes slot config.

The checks themselves are :mod:`controller.spec.rules` (shared with the stack loader and
the config-dir reader, so a stack file and an API payload are judged by the same code);
this module applies them at the write boundary and owns the writers.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.items
from tomlkit.container import Container
from tomlkit.toml_document import TOMLDocument

from controller.model.errors import ServerNotAllowed, SlotConfigError, SlotPinned
from controller.model.names import is_valid_slot_name
from controller.spec.adapters import adapter_tables
from controller.spec.aliases import alias_tables
from controller.spec.configdir import (
    CATALOGUE_FILE,
    MODEL_OWNER_KEY,
    SETTINGS_FILE,
    SLOTS_SUBDIR,
    ParseCache,
    owner_value,
    read_config_dir,
    read_settings,
    stored_owners,
)
from controller.spec.problems import raise_for_problems
from controller.spec.render import toml_table
from controller.spec.rules import (
    SlotEntry,
    check_slot_payload,
    cross_slot_problems,
)
from controller.spec.schema import (
    AdapterSpec,
    AliasSpec,
    ControllerSettings,
    ModelSpec,
    SlotSpec,
)
from controller.store.files import atomic_write_bytes, check_slot_name

__all__ = [
    "check_allowed",
    "config_lock",
    "delete_slot_config",
    "guard_slot_write_payload",
    "write_adapters",
    "write_aliases",
    "write_catalogue",
    "write_slot_config",
    "write_slot_configs",
]

_LOCK_FILE = ".slotctl.lock"


def guard_slot_write_payload(
    payload: object,
    *,
    others: Sequence[SlotSpec] = (),
    catalogue: Mapping[str, ModelSpec] | None = None,
    settings: ControllerSettings | None = None,
) -> SlotSpec:
    """Validate one slot write against the schema, key ownership and the other slots.

    ``others`` are the slots that stay as they are (the one being replaced excluded).
    Raises ``SlotConfigError`` (``NpuExclusivityViolation`` for the NPU rule) naming every
    offending key, ``ServerNotAllowed`` for a server outside ``settings``' allowlists;
    returns the validated spec otherwise. Changes nothing.
    """
    check = check_slot_payload(payload)
    raise_for_problems([p for p, _ in check.errors])
    assert check.spec is not None
    entries = [SlotEntry(spec=o) for o in others] + [SlotEntry(spec=check.spec)]
    problems = [p for p in cross_slot_problems(entries, catalogue) if p.slot == check.spec.name]
    raise_for_problems(problems)
    if settings is not None:
        check_allowed(check.spec, settings)
    return check.spec


def check_allowed(spec: SlotSpec, settings: ControllerSettings) -> None:
    """The controller's allowlists (``allowed_binaries``, ``allowed_images`` in
    ``controller.toml``; None: anything): a slot file chooses what the controller runs,
    so where they are set, ``server.binary`` and ``server.cmd[0]`` must be one of the
    allowed binaries (exactly), ``server.image`` one of the allowed images (exactly, or
    a pattern ending in ``*`` as a prefix: ``ghcr.io/ggml-org/llama.cpp:*``). A provider's
    own default binary or image is the controller's choice, not the file's, and passes.
    Raises :class:`ServerNotAllowed` naming the key."""
    server = spec.server
    binaries = settings.allowed_binaries
    if binaries is not None:
        for key, value in (("server.binary", server.binary), ("server.cmd", _argv0(server.cmd))):
            if value is not None and value not in binaries:
                raise ServerNotAllowed(
                    f"slot {spec.name!r}: {key} {value!r} is not in the controller's "
                    f"allowed_binaries {binaries} (controller.toml)",
                    keys=[key],
                    slot=spec.name,
                )
    images = settings.allowed_images
    if images is not None and server.image is not None and not _image_allowed(server.image, images):
        raise ServerNotAllowed(
            f"slot {spec.name!r}: server.image {server.image!r} is not in the controller's "
            f"allowed_images {images} (controller.toml)",
            keys=["server.image"],
            slot=spec.name,
        )


def _settings(config_dir: Path) -> ControllerSettings:
    """The controller settings the guard judges by. An invalid ``controller.toml`` fails
    closed: it may be hiding allowlists, so nothing is written until it is fixed."""
    settings, problems = read_settings(config_dir)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise SlotConfigError(
            f"{SETTINGS_FILE} is invalid ({errors[0].message}): no slot config is written "
            "until it is fixed (its allowlists cannot be read)",
            keys=[SETTINGS_FILE],
            problems=[p.to_dict() for p in errors],
        )
    return settings


def _argv0(cmd: Sequence[str] | None) -> str | None:
    return cmd[0] if cmd else None


def _image_allowed(image: str, allowed: Sequence[str]) -> bool:
    return any(
        image == pattern or (pattern.endswith("*") and image.startswith(pattern[:-1]))
        for pattern in allowed
    )


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
    create: bool = False,
    cache: ParseCache | None = None,
) -> SlotSpec:
    """The one writer of slot config: guard, then an atomic, layout-preserving write.

    ``create=True`` refuses (``SlotConfigError``) a slot whose file exists, checked under
    the writers' lock (two creates of one name: the second is refused, never an overwrite).
    ``merge=True`` applies ``payload`` as a partial update (PATCH) over the stored slot.
    ``others``: the slots the cross-slot rules compare against, when the caller writes a
    whole validated set (stack apply: a port swap between two slots is legal as a set,
    never as two single writes); default: the other slots on disk. ``cache``: the config
    dir's parse cache (the desired-state cache's), so the disk is read without parsing
    every unchanged file again.
    A slot created without ``autoload`` persists an explicit ``autoload = false``.
    """

    config_dir = Path(config_dir)
    with config_lock(config_dir):
        snapshot = read_config_dir(config_dir, cache)
        name = payload.get("name") if isinstance(payload, Mapping) else None
        if not is_valid_slot_name(name):
            guard_slot_write_payload(payload)  # raises with the located name problem
        assert isinstance(name, str)
        path = slot_config_path(config_dir, name)
        if create and path.exists():
            raise SlotConfigError(
                f"slot {name!r} already exists: PUT its config instead", keys=["name"]
            )
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
        spec = guard_slot_write_payload(
            wanted, others=others, catalogue=snapshot.models, settings=_settings(config_dir)
        )
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
        settings = _settings(config_dir)
        checked: list[tuple[SlotSpec, str | None]] = []
        for payload, stack in writes:
            wanted = dict(payload)
            if wanted.get("autoload") is None:
                wanted["autoload"] = False
            check = check_slot_payload(wanted)
            raise_for_problems([p for p, _ in check.errors])
            assert check.spec is not None
            check_allowed(check.spec, settings)
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


def delete_slot_config(
    config_dir: Path, name: str, *, force: bool = True, cache: ParseCache | None = None
) -> bool:
    """Remove a slot's config file; returns False when there was none.

    ``force=False`` refuses (``SlotPinned``) a slot whose file says it is pinned, checked
    under the writers' lock against the file itself (a hand edit that just pinned it).
    """
    config_dir = Path(config_dir)
    with config_lock(config_dir):
        path = slot_config_path(config_dir, name)
        if not force:
            current = read_config_dir(config_dir, cache).slots.get(name)
            if current is not None and current.pinned:
                raise SlotPinned(name, "delete")
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True


def write_catalogue(
    config_dir: Path,
    models: Sequence[ModelSpec],
    owners: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Write the model catalogue (``models.toml``), keeping comments of unchanged entries.

    ``owners``: model id -> the stacks that declare it, stored as its
    :data:`~controller.spec.configdir.MODEL_OWNER_KEY` (a model absent or with none is
    stored unowned); None keeps each stored model's owners as they are."""
    config_dir = Path(config_dir)
    with config_lock(config_dir):
        path = config_dir / CATALOGUE_FILE
        doc = _read_document(path) or tomlkit.document()
        wanted = [m.model_dump(mode="json", exclude_unset=True, exclude_none=True) for m in models]
        if owners is None:
            stored = doc.get("model")
            kept = {
                t.get("id"): _plain(t.get(MODEL_OWNER_KEY))
                for t in (stored if isinstance(stored, tomlkit.items.AoT) else [])
                if MODEL_OWNER_KEY in t
            }
            owners = {k: o for k, v in kept.items() if (o := stored_owners(v))}
        for entry in wanted:
            value = owner_value(owners.get(entry["id"], ()))
            if value is not None:
                entry[MODEL_OWNER_KEY] = value
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


def write_aliases(config_dir: Path, aliases: Sequence[tuple[AliasSpec, str]]) -> None:
    """Write the ``[[alias]]`` tables of ``models.toml`` (each with its owning stack, see
    :mod:`controller.spec.aliases`), keeping the comments of unchanged entries; the
    caller judged the set (:func:`~controller.spec.aliases.alias_problems`)."""
    _write_catalogue_tables(config_dir, "alias", alias_tables(aliases))


def write_adapters(config_dir: Path, adapters: Sequence[tuple[AdapterSpec, str]]) -> None:
    """Write the ``[[adapter]]`` tables of ``models.toml`` (each with its owning stack, see
    :mod:`controller.spec.adapters`), keeping the comments of unchanged entries; the
    caller judged the set (:func:`~controller.spec.adapters.adapter_problems`)."""
    _write_catalogue_tables(config_dir, "adapter", adapter_tables(adapters))


def _write_catalogue_tables(config_dir: Path, key: str, entries: list[dict[str, Any]]) -> None:
    """Replace ``models.toml``'s ``[[key]]`` array (tables by ``id``) with ``entries``."""
    config_dir = Path(config_dir)
    ids = [entry["id"] for entry in entries]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate {key} ids in a {key} write")
    with config_lock(config_dir):
        path = config_dir / CATALOGUE_FILE
        doc = _read_document(path) or tomlkit.document()
        current = doc.get(key)
        by_id: dict[Any, Any] = (
            {t.get("id"): t for t in current} if isinstance(current, tomlkit.items.AoT) else {}
        )
        doc.pop(key, None)
        if entries:
            tables = tomlkit.aot()
            for entry in entries:
                table = by_id.get(entry["id"]) or tomlkit.table()
                _sync(table, entry)
                tables.append(table)
            doc[key] = tables
        atomic_write_bytes(path, tomlkit.dumps(doc).encode())
