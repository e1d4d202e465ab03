"""Co-loaded units in stack files: ``[[unit]]`` tables and a slot's ``with``. Pure.

A *unit* is a set of slots that load, evict, sleep and restore together (a chat model
with its embedder, a model with its draft or reranker; docs/design/0013). A stack says
so in one of two ways::

    [[unit]]                      [[slot]]
    name = "rag"                  name = "chat"
    slots = ["chat", "embed"]     with = ["embed"]     # the unit is named "chat"

Either way the loader ends with each member's :attr:`SlotSpec.unit` set to the unit's
name (that is what the config dir and a ``Slot`` resource carry: one field, so the TOML
↔ CRD round trip is lossless); a slot may also say ``unit = "rag"`` itself.
:func:`take_with` takes ``with`` out of a slot table before the slot is validated,
:func:`parse_units` reads the ``[[unit]]`` tables, and :func:`resolve_units` judges the
whole: a member nobody declares, a slot in two units, a ``with`` naming its own slot or
going round in a cycle, two units of one name, members pinned to different nodes — each a
typed, located :class:`Problem` (``stack validate`` shows them), nothing resolved then.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from controller.model.names import SLOT_NAME_PATTERN
from controller.spec.problems import Problem
from controller.spec.rules import Origin, SlotEntry

__all__ = ["UNIT_KEYS", "UnitDecl", "parse_units", "resolve_units", "take_with"]

UNIT_KEYS: Final = ("name", "slots")
_NAME_RE: Final = re.compile(SLOT_NAME_PATTERN)


@dataclass(frozen=True, slots=True)
class UnitDecl:
    """One declaration of a unit: a ``[[unit]]`` table, or a slot's ``with``."""

    name: str
    slots: tuple[str, ...]
    origin: Origin
    via: str = "unit"  # "unit" ([[unit]]) or "with" (the declaring slot is slots[0])

    def problem(self, code: str, message: str, key: str, hint: str | None = None) -> Problem:
        return Problem(
            code=code,
            message=message,
            file=self.origin.file,
            slot=self.slots[0] if self.via == "with" and self.slots else None,
            key=key,
            line=self.origin.line((key,)),
            hint=hint,
        )


def _names_list(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def take_with(raw: Any, origin: Origin) -> tuple[Any, UnitDecl | None, list[Problem]]:
    """A slot table without its ``with`` key, the unit it declares, and its problems."""
    if not isinstance(raw, dict) or "with" not in raw:
        return raw, None, []
    rest = {k: v for k, v in raw.items() if k != "with"}
    members = _names_list(raw["with"])
    name = raw.get("name")
    if members is None or not members:
        problem = Problem(
            code="unit.invalid_with",
            message="`with` must be a non-empty array of slot names",
            file=origin.file,
            slot=name if isinstance(name, str) else None,
            key="with",
            line=origin.line(("with",)),
            hint='with = ["embed"]: the slots that load together with this one',
        )
        return rest, None, [problem]
    if not isinstance(name, str):
        return rest, None, []  # the slot's own validation says its name is missing
    return rest, UnitDecl(name, (name, *members), origin, via="with"), []


def parse_units(
    tables: Sequence[Any], file: str, origin: Origin
) -> tuple[list[UnitDecl], list[Problem]]:
    """The ``[[unit]]`` tables of one file (``origin``: the file's, base ``("unit",)``)."""
    decls: list[UnitDecl] = []
    problems: list[Problem] = []
    for i, raw in enumerate(tables):
        where = replace(origin, base=("unit", i))

        def bad(key: str, message: str, hint: str, i: int = i, where: Origin = where) -> Problem:
            return _invalid(file, i, where, key, message, hint)

        if not isinstance(raw, dict):
            problems.append(bad("", "a [[unit]] entry must be a table", "[[unit]] name = ..."))
            continue
        unknown = sorted(set(raw) - set(UNIT_KEYS))
        for key in unknown:
            problems.append(bad(key, f"unknown key {key!r} in [[unit]]", "a unit has name, slots"))
        name, members = raw.get("name"), _names_list(raw.get("slots"))
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            problems.append(
                bad("name", f"unit name {name!r} is not a DNS-1123 label", 'name = "rag"')
            )
        elif members is None or not members:
            problems.append(
                bad(
                    "slots", "`slots` must be a non-empty array of slot names", 'slots = ["a", "b"]'
                )
            )
        elif not unknown:
            decls.append(UnitDecl(name, tuple(members), where))
    return decls, problems


def _invalid(file: str, i: int, where: Origin, key: str, message: str, hint: str) -> Problem:
    return Problem(
        code="unit.invalid",
        message=message,
        file=file,
        key=f"unit[{i}].{key}" if key else f"unit[{i}]",
        line=where.line((key,) if key else ()),
        hint=hint,
    )


def _with_units(
    decls: Sequence[UnitDecl], known: Mapping[str, SlotEntry]
) -> tuple[dict[str, str], list[Problem]]:
    """Each slot's unit from the ``with`` declarations: chains (a with b, b with c) are one
    unit, named after the slot nobody lists; a slot two slots list, a slot listing itself
    or a cycle is a problem."""
    problems: list[Problem] = []
    parent: dict[str, str] = {}
    for d in decls:
        owner = d.slots[0]
        for member in d.slots[1:]:
            if member == owner:
                problems.append(
                    d.problem(
                        "unit.with_self",
                        f"slot {owner!r} lists itself in `with`",
                        "with",
                        "list the other slots of the unit",
                    )
                )
            elif member not in known:
                problems.append(_unknown(d, member, "with"))
            elif member in parent and parent[member] != owner:
                problems.append(_twice(d, member, parent[member], owner, "with"))
            else:
                parent[member] = owner
    unit: dict[str, str] = {}
    for d in decls:
        for slot in d.slots:
            seen = [slot]
            root = slot
            while root in parent:
                root = parent[root]
                if root in seen:
                    problems.append(
                        d.problem(
                            "unit.with_cycle",
                            f"`with` goes round in a cycle: {' -> '.join([*seen, root])}",
                            "with",
                            "name the unit's members in one slot's `with` (or a [[unit]])",
                        )
                    )
                    return {}, problems
                seen.append(root)
            unit[slot] = root
    return unit, problems


def _unknown(d: UnitDecl, member: str, key: str) -> Problem:
    where = f"unit {d.name!r}" if d.via == "unit" else f"`with` of slot {d.slots[0]!r}"
    return d.problem(
        "unit.unknown_member",
        f"{where} names slot {member!r}, which no stack file declares",
        key,
        "declare the slot, or take it out of the unit",
    )


def _twice(d: UnitDecl, slot: str, first: str, second: str, key: str) -> Problem:
    return d.problem(
        "unit.slot_in_two_units",
        f"slot {slot!r} is in two units: {first!r} and {second!r}",
        key,
        "a slot loads with one unit: merge the units or take it out of one",
    )


def resolve_units(
    entries: Sequence[SlotEntry], decls: Sequence[UnitDecl]
) -> tuple[list[SlotEntry], list[Problem], list[Problem]]:
    """Every entry with its ``unit`` set, and the errors and warnings (the entries as
    given when there is an error)."""
    known = {e.spec.name: e for e in entries}
    unit, problems = _with_units([d for d in decls if d.via == "with"], known)
    named: dict[str, UnitDecl] = {}
    roots = set(unit.values())
    for d in (d for d in decls if d.via == "unit"):
        if d.name in named or d.name in roots:
            problems.append(
                d.problem(
                    "unit.duplicate",
                    f"unit {d.name!r} is declared twice",
                    "name",
                    "unit names are unique across every stack file (a `with` names its "
                    "unit after its slot)",
                )
            )
            continue
        named[d.name] = d
        for member in d.slots:
            if member not in known:
                problems.append(_unknown(d, member, "slots"))
            elif unit.get(member, d.name) != d.name:
                problems.append(_twice(d, member, unit[member], d.name, "slots"))
            else:
                unit[member] = d.name
    for e in entries:  # a slot's own `unit = "..."` (the config dir, a Slot resource)
        own = e.spec.unit
        if own is not None and unit.setdefault(e.spec.name, own) != own:
            problems.append(
                e.problem(
                    "unit.slot_in_two_units",
                    f"slot {e.spec.name!r} says unit = {own!r} but is a member of unit "
                    f"{unit[e.spec.name]!r}",
                    ("unit",),
                    "drop its `unit` key, or take it out of the other unit",
                )
            )
    problems += _split_nodes(entries, unit)
    if problems:
        return list(entries), problems, []
    resolved = [
        replace(e, spec=e.spec.model_copy(update={"unit": unit[e.spec.name]}))
        if unit.get(e.spec.name) != e.spec.unit
        else e
        for e in entries
    ]
    return resolved, [], _too_small(resolved, named)


def _split_nodes(entries: Sequence[SlotEntry], unit: Mapping[str, str]) -> list[Problem]:
    """Members pinned to different nodes cannot be admitted together on one box."""
    nodes: dict[str, dict[str, str]] = {}
    out: list[Problem] = []
    for e in entries:
        name = unit.get(e.spec.name)
        if name is None or e.spec.node is None:
            continue
        seen = nodes.setdefault(name, {})
        other = next((s for s, n in seen.items() if n != e.spec.node), None)
        if other is not None:
            out.append(
                e.problem(
                    "unit.split_nodes",
                    f"unit {name!r}: slot {e.spec.name!r} is pinned to node {e.spec.node!r}, "
                    f"slot {other!r} to node {seen[other]!r}; a unit loads on one node",
                    ("node",),
                    "pin the members to one node, or leave `node` out",
                )
            )
        seen[e.spec.name] = e.spec.node
    return out


def _too_small(entries: Sequence[SlotEntry], named: Mapping[str, UnitDecl]) -> list[Problem]:
    sizes: dict[str, int] = {}
    for e in entries:
        if e.spec.unit is not None:
            sizes[e.spec.unit] = sizes.get(e.spec.unit, 0) + 1
    return [
        replace(
            d.problem(
                "unit.single_member",
                f"unit {name!r} has one member: it loads as a slot of its own",
                "slots",
                "list the slots that load together",
            ),
            severity="warning",
        )
        for name, d in named.items()
        if sizes.get(name, 0) < 2
    ]
