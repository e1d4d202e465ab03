"""``[[adapter]]`` tables: read them (a stack file's, the config dir's ``models.toml``) and
judge them against the rest of a desired state. Pure (no I/O).

An adapter is a LoRA adapter of one catalogue model (``base``): a request names it by its
id (or ``base:id``) and is served by a slot of the base model that holds it
(docs/adapters.md). The problems:

- ``adapter.invalid_value`` / ``adapter.unknown_key`` / ``adapter.missing_key``: the table
  itself (the schema, :class:`~controller.spec.schema.AdapterSpec`);
- ``adapter.duplicate_id``: two adapters of one id (across every stack file);
- ``adapter.id_taken``: an id that is a catalogue model's, an alias' or a slot's name (a
  request naming it would be ambiguous);
- ``adapter.unknown_base``: a base that is not in the catalogue;
- ``adapter.rank_over_limit``: a rank above the ``max_lora_rank`` of every slot that could
  load it at run time (refused here, not at the first request);
- ``slot.unknown_adapter``: a slot's start-time ``adapters`` names an adapter that is not
  declared, or one of another base;
- ``slot.adapters_over_capacity``: a llama-cpp-python slot given more than one adapter (its
  server takes one), or a slot given more than its ``max_loras``.

In the config dir each stored adapter carries ``stack``, the stack that declared it.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from controller.spec.locate import LineIndex
from controller.spec.problems import Problem
from controller.spec.rules import Origin, SlotEntry
from controller.spec.schema import AdapterSpec, ModelSpec, SlotSpec
from controller.spec.tables import OWNER_KEY, parse_tables

__all__ = [
    "OWNER_KEY",
    "RUNTIME_APIS",
    "AdapterEntry",
    "adapter_problems",
    "adapter_tables",
    "parse_adapters",
    "serves_adapter",
]

RUNTIME_APIS: Final = frozenset({"vllm", "sglang"})  # load and unload while serving


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    """A validated adapter, where it came from, and the stack that declares it."""

    spec: AdapterSpec
    origin: Origin = field(default_factory=Origin)
    stack: str = ""

    def problem(self, code: str, message: str, loc: tuple[str | int, ...], hint: str) -> Problem:
        return self.origin.problem(code, message, loc, hint)


def serves_adapter(slot: SlotSpec, adapter: AdapterSpec) -> bool:
    """``slot`` can serve ``adapter``: it serves the base model and either loads adapters
    at run time (within its rank limit) or is started with this one."""
    if slot.model_id != adapter.base or slot.lora_api is None:
        return False
    if adapter.id in slot.adapters:
        return True
    return slot.lora_api in RUNTIME_APIS and slot.max_loras > 0


def parse_adapters(
    raw: object, file: str | None, index: LineIndex | None, *, stored: bool = False
) -> tuple[list[AdapterEntry], list[Problem]]:
    """The ``adapter`` value of a parsed document -> entries and located problems.

    ``stored``: a config dir's ``models.toml``, whose tables carry their owner."""
    found, problems = parse_tables(raw, "adapter", AdapterSpec, file, index, stored=stored)
    return [AdapterEntry(spec=d.spec, origin=d.origin, stack=d.stack) for d in found], problems


def adapter_problems(
    entries: Sequence[AdapterEntry],
    models: Mapping[str, ModelSpec],
    slots: Sequence[SlotEntry] = (),
    aliases: Collection[str] = (),
) -> list[Problem]:
    """Ids unique and not taken, bases in the catalogue, ranks within a slot's limit, and
    the slots' start-time ``adapters`` declared (see the module docstring)."""
    out: list[Problem] = []
    seen: dict[str, AdapterEntry] = {}
    names = {s.spec.name for s in slots}
    for entry in entries:
        spec = entry.spec
        first = seen.get(spec.id)
        if first is not None:
            out.append(
                entry.problem(
                    "adapter.duplicate_id",
                    f"adapter {spec.id!r} is declared twice "
                    f"(first at {first.origin.where(('id',))})",
                    ("id",),
                    "adapter ids are unique across every stack file",
                )
            )
            continue
        seen[spec.id] = entry
        taken = (
            "a catalogue model"
            if spec.id in models
            else "an alias"
            if spec.id in aliases
            else "a slot"
            if spec.id in names
            else ""
        )
        if taken:
            out.append(
                entry.problem(
                    "adapter.id_taken",
                    f"adapter id {spec.id!r} is already the id of {taken}",
                    ("id",),
                    "give the adapter an id no model, alias or slot has",
                )
            )
        if spec.base not in models:
            close = difflib.get_close_matches(spec.base, list(models), n=1)
            out.append(
                entry.problem(
                    "adapter.unknown_base",
                    f"adapter {spec.id!r} names base {spec.base!r}, which is not in the catalogue",
                    ("base",),
                    f"did you mean {close[0]!r}?"
                    if close
                    else "an adapter's base is a catalogue model: declare it in a [[model]] table",
                )
            )
            continue
        out += _rank_problems(entry, slots)
    out += _slot_problems(slots, seen)
    return out


def _rank_problems(entry: AdapterEntry, slots: Sequence[SlotEntry]) -> list[Problem]:
    spec = entry.spec
    runtime = [
        s.spec
        for s in slots
        if s.spec.model_id == spec.base and s.spec.lora_api in RUNTIME_APIS and s.spec.max_loras > 0
    ]
    if spec.rank is None or not runtime or any(spec.rank <= s.max_lora_rank for s in runtime):
        return []
    limits = ", ".join(f"{s.name}: {s.max_lora_rank}" for s in runtime)
    return [
        entry.problem(
            "adapter.rank_over_limit",
            f"adapter {spec.id!r} has rank {spec.rank}, above the max_lora_rank of every slot "
            f"that loads {spec.base!r}'s adapters ({limits})",
            ("rank",),
            "raise max_lora_rank on a slot of the base model (its server restarts with the "
            "larger limit), or use an adapter of a lower rank",
        )
    ]


def _slot_problems(
    slots: Sequence[SlotEntry], adapters: Mapping[str, AdapterEntry]
) -> list[Problem]:
    out: list[Problem] = []
    for slot in slots:
        spec = slot.spec
        for i, name in enumerate(spec.adapters):
            entry = adapters.get(name)
            if entry is None or entry.spec.base != spec.model_id:
                why = (
                    "is not declared"
                    if entry is None
                    else f"is an adapter of {entry.spec.base!r}, not of {spec.model_id!r}"
                )
                out.append(
                    slot.problem(
                        "slot.unknown_adapter",
                        f"slot {spec.name!r} is started with adapter {name!r}, which {why}",
                        ("adapters", i),
                        "declare it in an [[adapter]] table whose base is the slot's model",
                    )
                )
        one = spec.lora_api == "llama-cpp-python" and len(spec.adapters) > 1
        over = spec.max_loras and len(spec.adapters) > spec.max_loras
        if one or over:
            limit = (
                "llama-cpp-python's server takes one" if one else f"max_loras is {spec.max_loras}"
            )
            out.append(
                slot.problem(
                    "slot.adapters_over_capacity",
                    f"slot {spec.name!r} is started with {len(spec.adapters)} adapters: {limit}",
                    ("adapters",),
                    "give the slot fewer adapters (or declare another slot for the others)",
                )
            )
    return out


def adapter_tables(adapters: Sequence[tuple[AdapterSpec, str]]) -> list[dict[str, Any]]:
    """What the guard stores for each adapter in ``models.toml``: its keys, then its owner."""
    out = []
    for spec, owner in adapters:
        table: dict[str, Any] = spec.model_dump(mode="json", exclude_none=True)
        if owner:
            table[OWNER_KEY] = owner
        out.append(table)
    return out
