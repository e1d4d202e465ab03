"""``Adapter`` CRs judged as :class:`~controller.operator.source.CrSource` judges Aliases:
with the loader's own checks (:class:`~controller.spec.schema.AdapterSpec`,
:func:`~controller.spec.adapters.adapter_problems`: the same codes as a stack file's
``[[adapter]]``), a CR that fails them keeping its last good spec (if that still passes),
the newcomer of two Adapters of one id the one refused. Pure (no I/O, no kopf).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from pydantic import ValidationError

from controller.operator.bodies import AliasStatus, CrKey
from controller.operator.convert import adapter_payload
from controller.operator.status import Verdict, condition, old_conditions
from controller.spec.adapters import AdapterEntry, adapter_problems
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.rules import SlotEntry
from controller.spec.schema import AdapterSpec, ModelSpec

__all__ = ["adapter_status", "judge_adapters"]

Key = CrKey


def judge_adapters(
    crs: Iterable[tuple[Key, Mapping[str, object]]],
    good: Mapping[Key, AdapterSpec],
    catalogue: Mapping[str, ModelSpec],
    slots_of: Callable[[str], Sequence[SlotEntry]],
    names: Collection[str],
    taken: Collection[str],
    problems: dict[Key, list[Problem]],
    *,
    owners: dict[str, Key] | None = None,
) -> dict[Key, AdapterSpec]:
    """The Adapter CRs (those in force first, then the oldest) -> the spec each puts in
    force. ``slots_of(base)``: the slots serving a base model (their rank limits);
    ``names``: slot names and alias ids an adapter id may not take; ``taken``: adapter ids
    another source declares already; ``owners``: the ids Adapter CRs not judged now hold.
    Each refusal goes into ``problems`` under its CR."""
    chosen: dict[Key, AdapterSpec] = {}
    owners = {} if owners is None else owners
    for key, spec in crs:
        candidates: list[AdapterSpec] = []
        try:
            candidates.append(
                AdapterSpec.model_validate(
                    adapter_payload({"metadata": {"name": key[2]}, "spec": dict(spec)})
                )
            )
        except ValidationError as exc:
            found = problems_from_validation(exc, scope="adapter", fields=AdapterSpec.model_fields)
            problems[key] = [p for p, _ in found]
        last = good.get(key)
        if last is not None and last not in candidates:
            candidates.append(last)
        for adapter in candidates:
            refused = _refusals(adapter, owners, catalogue, slots_of, names, taken)
            if not refused:
                owners[adapter.id] = key
                chosen[key] = adapter
                break
            said = problems.setdefault(key, [])
            said.extend(p for p in refused if p not in said)
    return chosen


def _refusals(
    adapter: AdapterSpec,
    owners: Mapping[str, Key],
    catalogue: Mapping[str, ModelSpec],
    slots_of: Callable[[str], Sequence[SlotEntry]],
    names: Collection[str],
    taken: Collection[str],
) -> list[Problem]:
    first = owners.get(adapter.id)
    if first is not None or adapter.id in taken:
        by = f"Adapter {first[1]}/{first[2]}" if first is not None else "a stack file"
        return [
            Problem(
                code="adapter.duplicate_id",
                message=f"adapter {adapter.id!r} is declared twice (first by {by})",
                key="id",
                hint="adapter ids are unique across every namespace and stack file",
            )
        ]
    entry = AdapterEntry(spec=adapter)
    out = [
        p
        for p in adapter_problems([entry], catalogue, slots_of(adapter.base), ())
        if p.code.startswith("adapter.")
    ]
    if adapter.id in names and not any(p.code == "adapter.id_taken" for p in out):
        out.append(
            entry.problem(
                "adapter.id_taken",
                f"adapter id {adapter.id!r} is already the id of an alias or a slot",
                ("id",),
                "give the adapter an id no model, alias or slot has",
            )
        )
    return out


def adapter_status(
    adapter_id: str | None,
    verdict: Verdict,
    old: Mapping[str, object] | None,
    now: str | None = None,
) -> AliasStatus:
    """The whole ``status`` of an Adapter (the Alias status' schema): declared (its spec,
    or its last good one, in force) or not, and why not (``Degraded``: the loader's code)."""
    conditions = old_conditions(old or {})
    gen = verdict.generation
    if verdict.accepted:
        ready = (True, "Declared", f"adapter {adapter_id} is declared")
    else:
        ready = (False, "Invalid", "not declared")
    text = "; ".join(f"[{p.code}] {p.message}" for p in verdict.problems)
    degraded = (True, "InvalidSpec", text) if verdict.problems else (False, "AsExpected", "")
    status: AliasStatus = {
        "observedGeneration": gen,
        "id": adapter_id or "",
        "conditions": [
            condition("Ready", *ready, gen, conditions, now),
            condition("Progressing", False, "Stable", "", gen, conditions, now),
            condition("Degraded", *degraded, gen, conditions, now),
        ],
    }
    if verdict.problems:
        status["lastError"] = {"code": verdict.problems[0].code, "message": text}
    return status
