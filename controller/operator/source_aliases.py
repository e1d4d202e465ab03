"""``Alias`` CRs judged as :class:`~controller.operator.source.CrSource` judges Models and
Slots: with the loader's own checks (:class:`~controller.spec.schema.AliasSpec`,
:func:`~controller.spec.aliases.alias_problems`: the same codes as a stack file's
``[[alias]]``), a CR that fails them keeping its last good spec (if that still passes),
the newcomer of two Aliases of one id the one refused. Pure (no I/O, no kopf).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from pydantic import ValidationError

from controller.operator.bodies import AliasStatus, CrKey
from controller.operator.convert import alias_payload
from controller.operator.status import Verdict, condition, old_conditions
from controller.spec.aliases import AliasEntry, alias_problems
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.schema import AliasSpec, ModelSpec

__all__ = ["alias_status", "judge_aliases"]

Key = CrKey


def judge_aliases(
    crs: Iterable[tuple[Key, Mapping[str, object]]],
    good: Mapping[Key, AliasSpec],
    catalogue: Mapping[str, ModelSpec],
    slots: Collection[str],
    taken: Collection[str],
    problems: dict[Key, list[Problem]],
    *,
    owners: dict[str, Key] | None = None,
) -> dict[Key, AliasSpec]:
    """The Alias CRs (in the order they count: those in force, then the oldest first) ->
    the spec each puts in force; ``taken``: alias ids another source declares already;
    ``owners``: the ids Alias CRs not judged now hold (in force), by CR. Each refusal
    goes into ``problems`` under its CR."""
    chosen: dict[Key, AliasSpec] = {}
    owners = {} if owners is None else owners
    for key, spec in crs:
        candidates: list[AliasSpec] = []
        try:
            candidates.append(
                AliasSpec.model_validate(
                    alias_payload({"metadata": {"name": key[2]}, "spec": dict(spec)})
                )
            )
        except ValidationError as exc:
            found = problems_from_validation(exc, scope="alias", fields=AliasSpec.model_fields)
            problems[key] = [p for p, _ in found]
        last = good.get(key)
        if last is not None and last not in candidates:
            candidates.append(last)
        for alias in candidates:
            refused = _refusals(alias, owners, catalogue, slots, taken)
            if not refused:
                owners[alias.id] = key
                chosen[key] = alias
                break
            problems.setdefault(key, []).extend(p for p in refused if p not in problems[key])
    return chosen


def _refusals(
    alias: AliasSpec,
    owners: Mapping[str, Key],
    catalogue: Mapping[str, ModelSpec],
    slots: Collection[str],
    taken: Collection[str],
) -> list[Problem]:
    first = owners.get(alias.id)
    if first is not None or alias.id in taken:
        by = f"Alias {first[1]}/{first[2]}" if first is not None else "a stack file"
        return [
            Problem(
                code="alias.duplicate_id",
                message=f"alias {alias.id!r} is declared twice (first by {by})",
                key="id",
                hint="alias ids are unique across every namespace and stack file",
            )
        ]
    return alias_problems([AliasEntry(spec=alias)], catalogue, slots)


def alias_status(
    alias_id: str | None, verdict: Verdict, old: Mapping[str, object] | None, now: str | None = None
) -> AliasStatus:
    """The whole ``status`` of an Alias: declared (its spec, or its last good one, in force)
    or not, and why not (``Degraded``: the loader's code)."""
    conditions = old_conditions(old or {})
    gen = verdict.generation
    if verdict.accepted:
        ready = (True, "Declared", f"alias {alias_id} is declared")
    else:
        ready = (False, "Invalid", "not declared")
    degraded = (
        (True, "InvalidSpec", _text(verdict)) if verdict.problems else (False, "AsExpected", "")
    )
    status: AliasStatus = {
        "observedGeneration": gen,
        "id": alias_id or "",
        "conditions": [
            condition("Ready", *ready, gen, conditions, now),
            condition("Progressing", False, "Stable", "", gen, conditions, now),
            condition("Degraded", *degraded, gen, conditions, now),
        ],
    }
    if verdict.problems:
        status["lastError"] = {"code": verdict.problems[0].code, "message": _text(verdict)}
    return status


def _text(verdict: Verdict) -> str:
    return "; ".join(f"[{p.code}] {p.message}" for p in verdict.problems)
