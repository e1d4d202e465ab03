"""Stack files -> desired state, with every problem located (file, line, slot, key).

Reads TOML through ``tomlfile`` (tomllib, tomlkit for what tomllib refuses), validates
through the same per-slot checks the guard uses, merges a directory of stack files in
name order, applies migrations (``autoload``, default-pinned anchors) and resolves model
references. Reads only; never writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from controller.spec.adapters import AdapterEntry, adapter_problems, parse_adapters
from controller.spec.aliases import AliasEntry, alias_problems, parse_aliases
from controller.spec.locate import LineIndex
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.rules import Origin, SlotEntry, check_slot_payload, cross_slot_problems
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec, StackMeta
from controller.spec.tomlfile import MAX_FILE_BYTES, Parsed, parse_toml_file, parse_toml_text
from controller.spec.units import UnitDecl, parse_units, resolve_units, take_with

GIB = 1024**3

__all__ = [
    "MAX_FILE_BYTES",
    "DesiredSlot",
    "DesiredState",
    "LoadReport",
    "expand_paths",
    "load_stack_texts",
    "load_stacks",
    "normalise",
    "parse_toml_file",
    "parse_toml_text",
]

_TOP_LEVEL = ("stack", "model", "slot", "unit", "alias", "adapter")


@dataclass(frozen=True, slots=True)
class DesiredSlot:
    """A normalised slot (``autoload`` and ``pinned`` resolved) and where it came from."""

    spec: SlotSpec
    stack: str = ""
    file: str | None = None
    line: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def autoload(self) -> bool:
        return bool(self.spec.autoload)

    @property
    def pinned(self) -> bool:
        return bool(self.spec.pinned)


@dataclass(frozen=True, slots=True)
class DesiredState:
    stacks: tuple[str, ...]
    models: Mapping[str, ModelSpec]
    slots: Mapping[str, DesiredSlot]
    aliases: Mapping[str, AliasEntry] = field(default_factory=dict)  # [[alias]], by id
    adapters: Mapping[str, AdapterEntry] = field(default_factory=dict)  # [[adapter]], by id
    # [[model]] id -> the stack whose file declared it ("": a file without [stack]); what
    # the guard stores as the model's owner, so a model dropped from its stack is known
    model_stacks: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class LoadReport:
    state: DesiredState | None
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and self.state is not None


def normalise(spec: SlotSpec, settings: ControllerSettings) -> SlotSpec:
    """Apply migrations: ``autoload`` absent -> bound model?; ``pinned`` absent -> anchors."""
    updates: dict[str, Any] = {}
    if spec.autoload is None:
        updates["autoload"] = bool(spec.model_id)
    if spec.pinned is None:
        updates["pinned"] = spec.name in settings.default_pinned
    return spec.model_copy(update=updates) if updates else spec


def expand_paths(paths: Iterable[Path]) -> tuple[list[Path], list[Problem]]:
    """Files as given; directories contribute their ``*.toml`` files in name order."""
    files: list[Path] = []
    problems: list[Problem] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.glob("*.toml") if not p.name.startswith("."))
            if not found:
                problems.append(
                    Problem(code="stack.empty_dir", message="no *.toml files", file=str(path))
                )
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            problems.append(
                Problem(
                    code="stack.unreadable", message="no such file or directory", file=str(path)
                )
            )
    return files, problems


@dataclass(slots=True)
class _FileResult:
    stack: str | None = None
    models: list[tuple[ModelSpec, Origin]] = field(default_factory=list)
    slots: list[SlotEntry] = field(default_factory=list)
    aliases: list[AliasEntry] = field(default_factory=list)
    adapters: list[AdapterEntry] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    units: list[UnitDecl] = field(default_factory=list)  # co-loaded units (spec.coload)


def _locate(problem: Problem, file: str, index: LineIndex, loc: Sequence[str | int]) -> Problem:
    return replace(problem, file=file, line=problem.line or index.line_of(loc))


def _table_list(
    data: Mapping[str, Any], key: str, res: _FileResult, file: str, index: LineIndex
) -> list[Any]:
    value = data.get(key, [])
    if isinstance(value, list):
        return value
    res.errors.append(
        Problem(
            code="stack.invalid_value",
            message=f"`{key}` must be an array of tables",
            file=file,
            key=key,
            line=index.line_of((key,)),
            hint=f"write [[{key}]] (double brackets), one per {key}",
        )
    )
    return []


def _load_document(file: str, parsed: Parsed) -> _FileResult:
    res = _FileResult()
    data, index, problems = parsed
    if data is None or index is None:
        res.errors.extend(problems)
        return res
    for key in data:
        if key not in _TOP_LEVEL:
            res.errors.append(
                Problem(
                    code="stack.unknown_key",
                    message=f"unknown top-level key {key!r}",
                    file=file,
                    key=key,
                    line=index.line_of((key,)),
                    hint="a stack file has [stack], [[model]], [[slot]], [[unit]], [[alias]] and "
                    "[[adapter]] tables",
                )
            )
    _load_meta(data, res, file, index)
    for i, raw in enumerate(_table_list(data, "model", res, file, index)):
        try:
            model = ModelSpec.model_validate(raw)
        except ValidationError as exc:
            for problem, loc in problems_from_validation(
                exc, scope="model", fields=ModelSpec.model_fields, prefix=("model", i)
            ):
                res.errors.append(_locate(problem, file, index, loc))
            continue
        res.models.append((model, Origin(file=file, base=("model", i), index=index)))
    units, unit_problems = parse_units(
        _table_list(data, "unit", res, file, index), file, Origin(file=file, index=index)
    )
    res.units.extend(units)
    res.errors.extend(unit_problems)
    for i, raw in enumerate(_table_list(data, "slot", res, file, index)):
        base = ("slot", i)
        raw, unit, unit_problems = take_with(raw, Origin(file=file, base=base, index=index))
        res.units.extend([unit] if unit is not None else [])
        res.errors.extend(unit_problems)
        check = check_slot_payload(raw)
        res.errors.extend(_locate(p, file, index, (*base, *loc)) for p, loc in check.errors)
        res.warnings.extend(_locate(p, file, index, (*base, *loc)) for p, loc in check.warnings)
        if check.spec is not None:
            origin = Origin(file=file, base=base, index=index)
            res.slots.append(SlotEntry(spec=check.spec, origin=origin))
    res.aliases, alias_errors = parse_aliases(data.get("alias"), file, index)
    res.errors.extend(alias_errors)
    res.adapters, adapter_errors = parse_adapters(data.get("adapter"), file, index)
    res.errors.extend(adapter_errors)
    return res


def _load_meta(data: Mapping[str, Any], res: _FileResult, file: str, index: LineIndex) -> None:
    raw = data.get("stack")
    if raw is None:
        res.errors.append(
            Problem(
                code="stack.missing_key",
                message="missing [stack] table with the stack's name",
                file=file,
                key="stack.name",
                line=1,
                hint='add:  [stack]\n        name = "my-stack"',
            )
        )
        return
    try:
        res.stack = StackMeta.model_validate(raw).name
    except ValidationError as exc:
        for problem, loc in problems_from_validation(
            exc, scope="stack", fields=StackMeta.model_fields, prefix=("stack",)
        ):
            res.errors.append(_locate(problem, file, index, loc))


def load_stacks(
    paths: Sequence[Path | str], settings: ControllerSettings | None = None
) -> LoadReport:
    """Load and merge stack files/directories into one normalised desired state."""
    files, problems = expand_paths(Path(p) for p in paths)
    documents = [(str(f), parse_toml_file(f)) for f in files]
    return _merge(documents, settings or ControllerSettings(), problems)


def _exclusive_autoload(
    entries: Sequence[SlotEntry], models: dict[str, ModelSpec], settings: ControllerSettings
) -> list[Problem]:
    """Two autoload slots in one exclusive group cannot both stay loaded: warn."""
    holders: dict[str, SlotEntry] = {}
    out = []
    for entry in entries:
        spec = normalise(entry.spec, settings)
        model = models.get(spec.model_id)
        group = model.exclusive_group if model else None
        if not group or not spec.autoload:
            continue
        first = holders.setdefault(group, entry)
        if first is entry:
            continue
        problem = entry.problem(
            "slot.exclusive_autoload",
            f"autoload slots {first.spec.name!r} and {spec.name!r} share exclusive group "
            f"{group!r}: only one can be loaded; whichever holds the group keeps it",
            ("autoload",),
            "set autoload = false on all but one member of the group",
        )
        out.append(replace(problem, severity="warning"))
    return out


def _autoload_over_budget(
    entries: Sequence[SlotEntry], models: dict[str, ModelSpec], settings: ControllerSettings
) -> list[Problem]:
    """Autoload slots that cannot all stay loaded within a device's configured budget.

    Greedy by priority (then declaration order), as the restore at start loads them: the
    slots that do not fit after the ones before them will wait for memory. GPUs are judged
    as the controller sees a host without a probe: the GPUs the budgets name (``"gpu:N"``;
    a bare ``gpu`` budget is one GPU). A slot pinned to GPUs counts its share on each of
    them; unpinned GPU slots count on the one GPU, or, with several, against all of them
    together with the pinned ones (how they pack is the placement's, at run time).
    """
    groups: dict[str, list[tuple[SlotEntry, int]]] = {}
    gpus = _budget_gpus(settings)
    pinned: set[str] = set()  # counted in the GPUs' total, warned about on their own GPU
    for entry in entries:
        spec = normalise(entry.spec, settings)
        if not spec.autoload or not spec.activated:
            continue
        model = models.get(spec.model_id)
        needed = (
            spec.memory_gb
            if spec.memory_gb is not None
            else ((model.memory_gb or 0.0) if model else 0.0)
        )
        for key, share in _budget_keys(spec, int(needed * GIB), gpus):
            groups.setdefault(key, []).append((entry, share))
        if spec.device_kind == "gpu" and spec.device_ref.pins and len(gpus) > 1:
            groups.setdefault("gpu", []).append((entry, int(needed * GIB)))
            pinned.add(spec.name)
    out: list[Problem] = []
    for key, slots in sorted(groups.items()):
        room = _room(key, gpus, settings)
        if room is not None and (key != "gpu" or any(e.spec.name not in pinned for e, _ in slots)):
            out += [p for p in _over(key, slots, room) if key != "gpu" or p.slot not in pinned]
    return out


def _budget_gpus(settings: ControllerSettings) -> list[int]:
    """The GPU indices the budgets name (a bare ``gpu`` budget: GPU 0)."""
    budgets = settings.memory_budget_gb
    named = {int(k[4:]) for k in budgets if k.startswith("gpu:")}
    return sorted(named | ({0} if "gpu" in budgets else set()))


def _budget_keys(spec: SlotSpec, needed: int, gpus: list[int]) -> list[tuple[str, int]]:
    """Where a slot's bytes count for the budget check: (key, bytes) pairs."""
    if spec.device_kind != "gpu":
        return [(spec.device, needed)]
    pins = spec.device_ref.pins
    if pins:
        if not all(p.isdigit() for p in pins):
            return []  # a UUID names a GPU only the host's probe knows
        share = -(-needed // len(pins))
        return [(f"gpu:{p}", share) for p in pins]
    if len(gpus) == 1:
        return [(f"gpu:{gpus[0]}", needed)]
    return [("gpu", needed)] if gpus else []


def _room(key: str, gpus: list[int], settings: ControllerSettings) -> int | None:
    """Bytes a key's budget leaves after the safety margin (``gpu``: every named GPU)."""
    budgets, margin = settings.memory_budget_gb, settings.safety_margin_gb
    keys = [f"gpu:{i}" for i in gpus] if key == "gpu" else [key]
    rooms = []
    for one in keys:
        budget_gb = budgets.get(one, budgets.get(one.split(":", 1)[0]))
        if budget_gb is None:
            return None  # judged against the probed device memory at run time only
        rooms.append(int((budget_gb - margin) * GIB))
    return sum(rooms)


def _over(key: str, slots: list[tuple[SlotEntry, int]], room: int) -> list[Problem]:
    out: list[Problem] = []
    total = sum(needed for _, needed in slots)
    if total <= room:
        return out
    where = "the GPUs together" if key == "gpu" else key
    ranked = sorted(enumerate(slots), key=lambda i_s: (-i_s[1][0].spec.priority, i_s[0]))
    used = 0
    for _, (entry, needed) in ranked:
        if used + needed <= room:
            used += needed
            continue
        problem = entry.problem(
            "slot.autoload_over_budget",
            f"the autoload slots on {where} need {total / GIB:.1f} GiB together, the "
            f"budget leaves {room / GIB:.1f} GiB (memory_budget_gb minus "
            f"safety_margin_gb): {entry.spec.name!r} (priority {entry.spec.priority}, "
            f"{needed / GIB:.1f} GiB) will wait for memory",
            ("autoload",),
            "raise the budget, lower memory estimates, pin slots to other GPUs, or set "
            "autoload = false on a slot that can load on demand",
        )
        out.append(replace(problem, severity="warning"))
    return out


def _units(
    entries: list[SlotEntry], units: list[UnitDecl], owners: dict[int, str]
) -> tuple[list[SlotEntry], list[Problem], list[Problem]]:
    """Each member's ``unit`` set (:func:`controller.spec.units.resolve_units`), owners kept."""
    resolved, errors, warnings = resolve_units(entries, units)
    for old, new in zip(entries, resolved, strict=True):
        owners[id(new)] = owners[id(old)]
    return resolved, errors, warnings


def load_stack_texts(
    texts: Sequence[tuple[str, str]], settings: ControllerSettings | None = None
) -> LoadReport:
    """Like :func:`load_stacks` for in-memory documents ``(name, toml_text)`` (the API)."""
    documents = [(name, parse_toml_text(text, name)) for name, text in texts]
    return _merge(documents, settings or ControllerSettings(), [])


def _merge(
    documents: Sequence[tuple[str, Parsed]],
    settings: ControllerSettings,
    problems: list[Problem],
) -> LoadReport:
    report = LoadReport(state=None, errors=list(problems), files=[n for n, _ in documents])
    models: dict[str, ModelSpec] = {}
    model_where: dict[str, str] = {}
    model_stacks: dict[str, str] = {}
    entries: list[SlotEntry] = []
    units: list[UnitDecl] = []
    aliases: list[AliasEntry] = []
    adapters: list[AdapterEntry] = []
    owners: dict[int, str] = {}
    stacks: list[str] = []
    for file, parsed in documents:
        res = _load_document(file, parsed)
        report.errors.extend(res.errors)
        report.warnings.extend(res.warnings)
        if res.stack and res.stack not in stacks:
            stacks.append(res.stack)
        for model, where in res.models:
            if model.id in models:
                report.errors.append(
                    Problem(
                        code="model.duplicate_id",
                        message=f"model {model.id!r} is declared twice "
                        f"(first at {model_where[model.id]})",
                        file=where.file,
                        key="id",
                        line=where.line(("id",)),
                        hint="model ids are unique across every stack file",
                    )
                )
                continue
            models[model.id] = model
            model_where[model.id] = where.where(("id",))
            model_stacks[model.id] = res.stack or ""
        units.extend(res.units)
        for entry in res.slots:
            owners[id(entry)] = res.stack or ""
            entries.append(entry)
        aliases += [replace(a, stack=res.stack or "") for a in res.aliases]
        adapters += [replace(a, stack=res.stack or "") for a in res.adapters]
    report.errors.extend(cross_slot_problems(entries, models))
    entries, unit_errors, unit_warnings = _units(entries, units, owners)
    report.errors.extend(unit_errors)
    report.warnings.extend(unit_warnings)
    report.errors.extend(alias_problems(aliases, models, {e.spec.name for e in entries}))
    alias_ids = {a.spec.id for a in aliases}
    report.errors.extend(adapter_problems(adapters, models, entries, alias_ids))
    report.warnings.extend(_exclusive_autoload(entries, models, settings))
    report.warnings.extend(_autoload_over_budget(entries, models, settings))
    if report.errors:
        return report
    slots = {
        e.spec.name: DesiredSlot(
            spec=normalise(e.spec, settings),
            stack=owners[id(e)],
            file=e.origin.file,
            line=e.origin.line(),
        )
        for e in entries
    }
    by_id = {a.spec.id: a for a in aliases}
    report.state = DesiredState(
        stacks=tuple(stacks),
        models=models,
        slots=slots,
        aliases=by_id,
        adapters={a.spec.id: a for a in adapters},
        model_stacks=model_stacks,
    )
    return report
