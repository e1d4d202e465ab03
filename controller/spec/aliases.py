"""``[[alias]]`` tables: read them (a stack file's, the config dir's ``models.toml``) and
judge them against the rest of a desired state. Pure (no I/O).

An alias is a model id that names catalogue models (``models``); which one serves a
request is the router's choice (:mod:`controller.router.aliases`). The problems:

- ``alias.invalid_value`` / ``alias.unknown_key`` / ``alias.missing_key``: the table
  itself (the schema, :class:`~controller.spec.schema.AliasSpec`);
- ``alias.duplicate_id``: two aliases of one id (across every stack file);
- ``alias.id_taken``: an alias id that is a catalogue model's id or a slot's name (a
  request naming it would be ambiguous);
- ``alias.unknown_member``: a member that is not in the catalogue (an alias of an alias
  included: members are models).

In the config dir each stored alias carries ``stack``, the stack that declared it (a stack
apply replaces its own aliases and leaves the others').
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.spec.locate import LineIndex
from controller.spec.problems import Problem
from controller.spec.rules import Origin
from controller.spec.schema import AliasSpec, ModelSpec
from controller.spec.tables import OWNER_KEY, parse_tables

__all__ = [
    "OWNER_KEY",
    "AliasEntry",
    "alias_problems",
    "alias_tables",
    "parse_aliases",
]


@dataclass(frozen=True, slots=True)
class AliasEntry:
    """A validated alias, where it came from, and the stack that declares it."""

    spec: AliasSpec
    origin: Origin = field(default_factory=Origin)
    stack: str = ""

    def problem(self, code: str, message: str, loc: tuple[str | int, ...], hint: str) -> Problem:
        return self.origin.problem(code, message, loc, hint)


def parse_aliases(
    raw: object, file: str | None, index: LineIndex | None, *, stored: bool = False
) -> tuple[list[AliasEntry], list[Problem]]:
    """The ``alias`` value of a parsed document -> entries and located problems.

    ``stored``: a config dir's ``models.toml``, whose tables carry their owner
    (:data:`OWNER_KEY`); a stack file's may not name one (its stack is the file's)."""
    found, problems = parse_tables(raw, "alias", AliasSpec, file, index, stored=stored)
    return [AliasEntry(spec=d.spec, origin=d.origin, stack=d.stack) for d in found], problems


def alias_problems(
    entries: Sequence[AliasEntry], models: Mapping[str, ModelSpec], slots: Collection[str] = ()
) -> list[Problem]:
    """Ids unique, no id a model's or a slot's, every member a catalogue model."""
    out: list[Problem] = []
    seen: dict[str, AliasEntry] = {}
    for entry in entries:
        spec = entry.spec
        first = seen.get(spec.id)
        if first is not None:
            out.append(
                entry.problem(
                    "alias.duplicate_id",
                    f"alias {spec.id!r} is declared twice (first at {first.origin.where(('id',))})",
                    ("id",),
                    "alias ids are unique across every stack file",
                )
            )
            continue
        seen[spec.id] = entry
        taken = "a catalogue model" if spec.id in models else "a slot" if spec.id in slots else ""
        if taken:
            out.append(
                entry.problem(
                    "alias.id_taken",
                    f"alias id {spec.id!r} is already the id of {taken}",
                    ("id",),
                    "give the alias an id no model or slot has",
                )
            )
        for i, member in enumerate(spec.models):
            if member in models:
                continue
            close = difflib.get_close_matches(member, list(models), n=1)
            out.append(
                entry.problem(
                    "alias.unknown_member",
                    f"alias {spec.id!r} names {member!r}, which is not in the catalogue",
                    ("models", i),
                    f"did you mean {close[0]!r}?"
                    if close
                    else "members are catalogue models: declare it in a [[model]] table",
                )
            )
    return out


def alias_tables(aliases: Sequence[tuple[AliasSpec, str]]) -> list[dict[str, Any]]:
    """What the guard stores for each alias in ``models.toml``: its keys, then its owner."""
    out = []
    for spec, owner in aliases:
        table: dict[str, Any] = spec.model_dump(mode="json")
        if owner:
            table[OWNER_KEY] = owner
        out.append(table)
    return out
