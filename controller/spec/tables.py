"""The arrays of tables a stack declares beside its slots (``[[alias]]``, ``[[adapter]]``):
each table validated against its schema and located, its owner read in a config dir's
``models.toml`` (where the guard writes each table with the stack that declared it, under
:data:`OWNER_KEY`). Used by :mod:`controller.spec.aliases` and
:mod:`controller.spec.adapters`, which judge the entries across the catalogue."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from controller.spec.locate import LineIndex
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.rules import Origin

__all__ = ["OWNER_KEY", "Declared", "parse_tables"]

OWNER_KEY: Final = "stack"  # in models.toml: the stack that declared the table

S = TypeVar("S", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Declared(Generic[S]):
    """One valid table: its spec, where it was written, and (stored) its owner stack."""

    spec: S
    origin: Origin
    stack: str


def parse_tables(
    raw: object,
    kind: str,
    schema: type[S],
    file: str | None,
    index: LineIndex | None,
    *,
    stored: bool,
) -> tuple[list[Declared[S]], list[Problem]]:
    """The ``kind`` value of a parsed document -> its valid tables and located problems
    (``kind.invalid_value`` when it is not an array of tables; each invalid table's
    problems, the table skipped)."""
    found: list[Declared[S]] = []
    problems: list[Problem] = []
    if raw is None:
        return found, problems
    if not isinstance(raw, list):
        problem = Problem(
            code=f"{kind}.invalid_value",
            message=f"`{kind}` must be an array of tables",
            file=file,
            key=kind,
            line=index.line_of((kind,)) if index else None,
            hint=f"write [[{kind}]] (double brackets), one per {kind}",
        )
        return found, [problem]
    for i, table in enumerate(raw):
        origin = Origin(file=file, base=(kind, i), index=index)
        data = dict(table) if isinstance(table, Mapping) else table
        owner = ""
        if stored and isinstance(data, dict) and isinstance(data.get(OWNER_KEY), str):
            owner = data.pop(OWNER_KEY)
        try:
            spec = schema.model_validate(data)
        except ValidationError as exc:
            for problem, loc in problems_from_validation(
                exc, scope=kind, fields=schema.model_fields
            ):
                problems.append(replace(problem, file=file, line=origin.line(loc)))
            continue
        found.append(Declared(spec, origin, owner))
    return found, problems
