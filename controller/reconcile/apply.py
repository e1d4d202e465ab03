"""Stack apply and diff: a stack's desired state against the config dir and the host.

Used by ``slotctl stack apply|diff`` (and by the daemon in GitOps mode). Planning uses the
reconciler's pure :func:`~controller.reconcile.reconciler.plan_slot`, so ``diff`` prints exactly
what ``apply`` would do. Writing goes through the guard (``write_slot_config``,
``delete_slot_config``, ``write_catalogue``): this module never writes a file itself.

Observation without a running controller reads ``state.json`` and asks the runtime
(``inspect``/``list_managed``); it never changes anything.
"""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch
import tomlkit

from controller.model.errors import SlotctlError, SlotPinned
from controller.model.lifecycle import DISPATCHABLE_STATES, SlotState
from controller.providers.base import BuildContext
from controller.providers.launch import launch_context, launch_hash, with_port
from controller.reconcile.plan import Action, ObservedSlot, plans_for, with_rollout
from controller.runtime.base import Runtime
from controller.runtime.surging import cannot_surge
from controller.scheduling.rollout import RolloutDecision, decide_rollout
from controller.spec.adapters import AdapterEntry, adapter_problems
from controller.spec.aliases import AliasEntry, alias_problems
from controller.spec.configdir import ConfigSnapshot, read_config_dir
from controller.spec.guard import (
    delete_slot_config,
    write_adapters,
    write_aliases,
    write_catalogue,
    write_slot_configs,
)
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.problems import raise_for_problems
from controller.spec.render import slot_effective
from controller.spec.replicas import replica_names
from controller.spec.rules import SlotEntry, cross_slot_problems
from controller.spec.schema import ModelSpec
from controller.store.residency import ResidencyStore
from controller.store.state import StateExtra, StateStore

__all__ = [
    "StackPlan",
    "apply_to_config",
    "changed_models",
    "model_owners",
    "observe_files",
    "plan_stack",
    "pruned_pinned",
]


@dataclass(slots=True)
class StackPlan:
    """Everything ``apply``/``diff`` need to show and do for one desired state."""

    state: DesiredState
    actions: list[Action]
    config_diffs: dict[str, str] = field(default_factory=dict)  # slot -> unified TOML diff
    drift: dict[str, list[str]] = field(default_factory=dict)  # slot -> runtime drift lines
    # slot -> runtime wishes that are no drift (a residency wish being kept): shown, not counted
    notes: dict[str, list[str]] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)  # managed objects nobody declares
    models_changed: list[str] = field(default_factory=list)
    # Catalogue models the stack's slots or aliases used that it no longer declares and
    # nothing left would use: what removing a model from a stack leaves behind;
    # ``--prune`` removes them (issue 40).
    models_unused: list[str] = field(default_factory=list)
    # Without ``--prune``: the slots this stack owns and no longer declares, kept.
    left_behind: list[str] = field(default_factory=list)
    aliases_changed: list[str] = field(default_factory=list)  # "+ id", "- id", "~ id" lines
    adapters_changed: list[str] = field(default_factory=list)  # likewise, for [[adapter]]
    desired_doc: dict[str, Any] = field(default_factory=dict)
    observed_doc: dict[str, Any] = field(default_factory=dict)

    @property
    def in_sync(self) -> bool:
        return (
            all(a.kind == "noop" for a in self.actions)
            and not self.config_diffs
            and not any(self.drift.values())
            and not self.orphans
            and not self.models_changed
            and not self.models_unused
            and not self.aliases_changed
            and not self.adapters_changed
        )

    def kept(self, *, prune: bool) -> list[str]:
        """What an apply of this plan keeps that its stack no longer declares, as
        ``slot NAME`` / ``model ID`` (none with ``prune``: it removes them)."""
        if prune:
            return []
        slots = [f"slot {n}" for n in self.left_behind]
        return slots + [f"model {m}" for m in self.models_unused]

    def json_patch(self) -> list[dict[str, Any]]:
        """RFC 6902 patch that turns the observed document into the desired one."""
        patch: list[dict[str, Any]] = jsonpatch.make_patch(
            self.observed_doc, self.desired_doc
        ).patch
        return patch

    def to_dict(self) -> dict[str, Any]:
        return {
            "in_sync": self.in_sync,
            "actions": [a.to_dict() for a in self.actions],
            "config_diffs": self.config_diffs,
            "drift": {k: v for k, v in self.drift.items() if v},
            "notes": {k: v for k, v in self.notes.items() if v},
            "orphans": self.orphans,
            "models_changed": self.models_changed,
            "models_unused": self.models_unused,
            "left_behind": self.left_behind,
            "aliases_changed": self.aliases_changed,
            "adapters_changed": self.adapters_changed,
        }


async def observe_files(
    names: Iterable[str], state_dir: Path, runtime: Runtime, config_dir: Path | None = None
) -> dict[str, ObservedSlot]:
    """Observed state from state.json, residency.json and the runtime (no controller
    needed)."""
    _require_dir(state_dir, "state dir")
    store = StateStore(state_dir)
    paused = ResidencyStore(config_dir).read_paused() if config_dir is not None else {}
    out: dict[str, ObservedSlot] = {}
    for name in names:
        # An unreadable state file is an error (diff exits 2), never "not started yet".
        record = store.read(name)
        observed = await runtime.inspect(name)
        state = record.state if record else None
        message = record.message if record else ""
        if state in DISPATCHABLE_STATES and not observed.running:
            # state.json says it serves, the host says no server runs: believe the host.
            state, message = SlotState.ERROR, f"server not running ({observed.message or 'gone'})"
        extra = record.extra if record else StateExtra()
        out[name] = ObservedSlot(
            name=name,
            state=state,
            idle_reason=extra.idle_reason,
            running=observed.running,
            config_hash=observed.config_hash if observed.running else None,
            message=message,
            blocked=False,
            retry_after_s=extra.retry_after_s,
            waiting=extra.waiting,
            paused=name in paused,
        )
    return out


def _require_dir(path: Path, what: str) -> None:
    if Path(path).exists() and not Path(path).is_dir():
        raise SlotctlError(f"{what} {path} is not a directory", path=str(path))


def _toml(data: Mapping[str, Any] | None) -> list[str]:
    if data is None:
        return []
    doc = tomlkit.document()
    doc["slot"] = dict(data)
    return tomlkit.dumps(doc).splitlines(keepends=True)


def _config_diff(name: str, have: DesiredSlot | None, want: DesiredSlot | None) -> str:
    old = slot_effective(have.spec) if have else None
    new = slot_effective(want.spec) if want else None
    if old == new:
        return ""
    lines = difflib.unified_diff(
        _toml(old), _toml(new), fromfile=f"live/{name}", tofile=f"declared/{name}"
    )
    return "".join(lines)


def _hash(
    slot: DesiredSlot, models: Mapping[str, ModelSpec], ctx: BuildContext, chosen_port: int | None
) -> str | None:
    """The config hash ``slot`` would run with (:func:`controller.providers.launch_hash`,
    the manager's own); a slot that leaves its port to the controller with the one it
    chose (``chosen_port``, read, never chosen here: a diff changes nothing), so a chosen
    port is no drift. None: it cannot be built (yet)."""
    model = models.get(slot.spec.model_id) if slot.spec.model_id else None
    return launch_hash(with_port(slot.spec, chosen_port), model, ctx)


async def plan_stack(
    state: DesiredState,
    config_dir: Path,
    state_dir: Path,
    runtime: Runtime,
    *,
    prune: bool,
    snapshot: ConfigSnapshot | None = None,
    models_dir: Path | None = None,
    rollout: Callable[[DesiredSlot], RolloutDecision] | None = None,
) -> StackPlan:
    """Plan applying ``state``: config changes, runtime actions and drift, with reasons.
    Config hashes are built as the manager on ``runtime`` builds them (``models_dir``: its
    models dir, None the default). ``rollout``: the running controller's way a change
    rolls out (its memory figures); without one, a surge's room is not known here."""
    _require_dir(config_dir, "config dir")  # else it would read as empty: all "drift"
    if snapshot is None:
        snapshot = await asyncio.to_thread(read_config_dir, config_dir)
    owned = {n for n, s in snapshot.slots.items() if s.stack in state.stacks}
    names = list(state.slots) + sorted(owned - set(state.slots))
    observed = await observe_files(names, state_dir, runtime, config_dir)
    store = StateStore(state_dir)
    adapters = {a.spec.id: a.spec for a in final_adapters(state, snapshot)}
    hashes = {
        n: _hash(
            s,
            state.models,
            launch_context(runtime.kind, s.stack, models_dir, adapters),
            store.read_port(n),
        )
        for n, s in state.slots.items()
    }
    residents = list(ResidencyStore(config_dir).read())
    actions = plans_for(
        names,
        state.slots,
        {n: s.spec for n, s in snapshot.slots.items()},
        observed,
        hashes,
        residents=residents,
        deletable=lambda n: prune and n in owned,
    )
    actions = [_rolled(a, state.slots.get(a.slot), observed, runtime, rollout) for a in actions]
    plan = StackPlan(state=state, actions=actions)
    for name in names:
        want = state.slots.get(name)
        if want is None and not prune:
            continue
        diff = _config_diff(name, snapshot.slots.get(name), want)
        if diff:
            plan.config_diffs[name] = diff
        plan.drift[name] = _drift(want, observed.get(name), name in residents)
        if name in residents and want is not None and not plan.drift[name]:
            plan.notes[name] = ["resident: kept loaded by `slotctl slot load` (residency.json)"]
    pruned = _pruned(state, snapshot)
    plan.left_behind = [] if prune else sorted(pruned)
    plan.models_unused = unused_models(state, snapshot, pruned if prune else set())
    plan.models_changed = changed_models(state, snapshot, plan.models_unused)
    plan.aliases_changed = alias_changes(state, snapshot)
    plan.adapters_changed = adapter_changes(state, snapshot)
    managed = [o.slot for o in await runtime.list_managed()]
    declared = {*state.slots, *snapshot.slots}
    for slots in (state.slots, snapshot.slots):  # a declared slot's replicas are no orphans
        for slot in slots.values():
            declared.update(replica_names(slot.spec))
    plan.orphans = sorted(n for n in managed if n not in declared)
    plan.desired_doc = _document(state.slots)
    plan.observed_doc = _document({n: s for n, s in snapshot.slots.items() if n in names})
    return plan


def _rolled(
    action: Action,
    want: DesiredSlot | None,
    observed: Mapping[str, ObservedSlot],
    runtime: Runtime,
    rollout: Callable[[DesiredSlot], RolloutDecision] | None,
) -> Action:
    """A ``recreate`` with the way it rolls out (:mod:`controller.scheduling.rollout`)."""
    if action.kind != "recreate" or want is None:
        return action
    if rollout is not None:
        return with_rollout(action, rollout(want))
    obs = observed.get(action.slot)
    decision = decide_rollout(
        want.spec,
        running=obs is not None and obs.running,
        cannot_surge=cannot_surge(runtime, want.name),
        load=None,
        needed=0,
    )
    return with_rollout(action, decision)


def _drift(want: DesiredSlot | None, obs: ObservedSlot | None, resident: bool) -> list[str]:
    """Runtime drift of one slot, in words (residency wishes and pauses included)."""
    if want is None or obs is None:
        return []
    lines = []
    state = obs.state.value if obs.state else "never started"
    if obs.idle_reason == "asleep":
        state += ", asleep"
    if obs.waiting:
        state += (
            ", waiting for its GPU"
            if obs.waiting == "waiting_for_device"
            else ", waiting for memory"
        )
    if obs.state is SlotState.ERROR:
        lines.append(f"in error: {obs.message or 'no message'}")
    elif want.autoload and obs.paused and not obs.dispatchable:
        lines.append(
            f"autoload slot paused by `slotctl slot unload` (state: {state}): "
            f"`slotctl slot load {want.name}` resumes it"
        )
    elif want.autoload and want.spec.activated and not obs.dispatchable:
        lines.append(f"autoload slot is not serving (state: {state})")
    elif resident and not obs.dispatchable:
        lines.append(
            f"resident (kept loaded by `slotctl slot load`) but not serving (state: {state})"
        )
    return lines


def _document(slots: Mapping[str, DesiredSlot]) -> dict[str, Any]:
    """The JSON document behind ``-o json-patch``: the slots' effective config only.

    Runtime facts (serving or not, the running config hash) are not config: they show as
    runtime drift in the text and JSON diff, never as a patch op, so the patch of an
    in-sync stack is empty whatever is loaded at the moment.
    """
    return {"slots": {name: slot_effective(slot.spec) for name, slot in slots.items()}}


def _pruned(state: DesiredState, snapshot: ConfigSnapshot) -> set[str]:
    return {
        name
        for name, current in snapshot.slots.items()
        if current.stack in state.stacks and name not in state.slots
    }


def changed_models(
    state: DesiredState, snapshot: ConfigSnapshot, unused: Sequence[str] = ()
) -> list[str]:
    """The catalogue models an apply of ``state`` changes (``unused``: those it leaves or
    prunes, said apart): a definition that differs, or an owner change — but an unowned
    model's first owner (a catalogue written before owners) is not drift: CI's `stack
    diff --exit-code` stays clean after an upgrade, and the next apply writes it."""
    owners = model_owners(state, snapshot)
    return sorted(
        m
        for m in {*state.models, *snapshot.models}
        if m not in unused
        and (
            snapshot.models.get(m) != state.models.get(m, snapshot.models.get(m))
            or (m in snapshot.model_owners and snapshot.model_owners[m] != owners.get(m, ()))
        )
    )


def model_owners(state: DesiredState, snapshot: ConfigSnapshot) -> dict[str, tuple[str, ...]]:
    """Each catalogue model's owner stacks after applying ``state`` (models.toml's
    ``stack``, :data:`~controller.spec.configdir.MODEL_OWNER_KEY`): a model ``state``
    declares is owned by the stack that declared it and by the other stacks that already
    did (one id declared by two stacks is kept until neither declares it; the last apply's
    definition is the one stored); a model ``state``'s stacks no longer declare loses them
    as owners, unless no other stack owns it: then it keeps them (left behind, and said so
    until ``--prune`` removes it). An unowned model (a catalogue written before owners)
    stays unowned until a stack declares it."""
    out: dict[str, tuple[str, ...]] = {}
    for model_id in {*snapshot.models, *state.models}:
        old = snapshot.model_owners.get(model_id, ())
        others = tuple(o for o in old if o not in state.stacks)
        if model_id in state.models:
            mine = state.model_stacks.get(model_id, "")
            new = tuple(sorted({*others, mine} - {""}))
        else:
            new = others or old
        if new:
            out[model_id] = new
    return out


def unused_models(state: DesiredState, snapshot: ConfigSnapshot, pruned: set[str]) -> list[str]:
    """The models of ``state``'s stacks that ``state`` no longer declares and nothing left
    after applying it uses: no slot binds them (the config dir's, less ``pruned``, and the
    state's), no alias names them. A model is the stacks' when the catalogue stores one of
    them as its owner and no other stack (a model declared by two stacks stays until
    neither declares it), or, owned by no stack (a catalogue written before owners), when
    their slots bound it or their aliases named it in the config dir: an unowned model
    that no slot or alias of theirs used (declared alone) is never pruned."""
    ours: set[str] = set()
    foreign: set[str] = set()
    for model_id, owners in snapshot.model_owners.items():
        if set(owners) & set(state.stacks):
            ours.add(model_id)
        if set(owners) - set(state.stacks):
            foreign.add(model_id)
    for current in snapshot.slots.values():
        if current.stack in state.stacks and current.spec.model_id:
            ours.add(current.spec.model_id)
    for alias in snapshot.aliases.values():
        if alias.stack in state.stacks:
            ours.update(alias.spec.models)
    final = {n: s.spec for n, s in snapshot.slots.items() if n not in pruned}
    final.update({n: s.spec for n, s in state.slots.items()})
    used = {spec.model_id for spec in final.values() if spec.model_id}
    for alias in final_aliases(state, snapshot):
        used.update(alias.spec.models)
    return sorted(
        m
        for m in ours - foreign
        if m in snapshot.models and m not in state.models and m not in used
    )


def pruned_pinned(state: DesiredState, snapshot: ConfigSnapshot) -> list[str]:
    """Pinned slots a prune of ``state`` would remove (they need ``force``)."""
    return sorted(n for n in _pruned(state, snapshot) if snapshot.slots[n].pinned)


def apply_to_config(
    state: DesiredState,
    config_dir: Path,
    *,
    prune: bool,
    snapshot: ConfigSnapshot | None = None,
    force: bool = False,
    keep_pinned: bool = False,
) -> list[str]:
    """Write a desired state into the config dir through the guard; returns what changed.

    The catalogue goes first (slots reference it); then every declared slot; then, with
    ``prune``, the slots this stack owns that it no longer declares are removed. A pinned
    slot is pruned only with ``force`` (else the whole apply is refused, changing
    nothing); ``keep_pinned`` (GitOps) keeps such slots instead of refusing.
    """
    snapshot = snapshot or read_config_dir(config_dir)
    changed: list[str] = []
    merged = dict(snapshot.models)
    merged.update(state.models)
    pruned = _pruned(state, snapshot) if prune else set()
    if prune:  # models the stack no longer declares and nothing left uses go too
        for model_id in unused_models(state, snapshot, pruned):
            merged.pop(model_id, None)
    pinned = pruned_pinned(state, snapshot) if prune and not force else []
    if pinned and keep_pinned:
        pruned -= set(pinned)
    elif pinned:
        error = SlotPinned(pinned[0], "removal by --prune")
        error.message = (
            f"pinned slot(s) {', '.join(pinned)} would be removed by --prune: pass --force "
            "to remove them too (nothing was applied)"
        )
        error.details["slots"] = pinned
        raise error
    # The whole resulting set is checked once before anything is written: a stack is
    # applied entirely or not at all (SPEC §8), and a legal port swap between two slots
    # is judged as the set it is, never as two conflicting single writes.
    final = {n: s.spec for n, s in snapshot.slots.items() if n not in pruned}
    final.update({n: s.spec for n, s in state.slots.items()})
    entries = [SlotEntry(spec=spec) for spec in final.values()]
    aliases = final_aliases(state, snapshot)
    problems = cross_slot_problems(entries, merged) + alias_problems(aliases, merged, final)
    adapters = final_adapters(state, snapshot)
    alias_ids = {a.spec.id for a in aliases}
    problems += adapter_problems(adapters, merged, entries, alias_ids)
    raise_for_problems(problems, "desired state")
    owners = {m: o for m, o in model_owners(state, snapshot).items() if m in merged}
    stored = {m: o for m, o in snapshot.model_owners.items() if m in snapshot.models}
    if merged != snapshot.models or owners != stored:
        write_catalogue(config_dir, list(merged.values()), owners)
        changed.append("models")
    if alias_changes(state, snapshot):
        write_aliases(config_dir, [(a.spec, a.stack) for a in aliases])
        changed.append("aliases")
    if adapter_changes(state, snapshot):
        write_adapters(config_dir, [(a.spec, a.stack) for a in adapters])
        changed.append("adapters")
    writes: list[tuple[dict[str, Any], str | None]] = []
    for name, slot in state.slots.items():
        current = snapshot.slots.get(name)
        if current is not None and current.spec == slot.spec and current.stack == slot.stack:
            continue
        payload = slot.spec.model_dump(mode="json", exclude_unset=True, exclude_none=True)
        owner = slot.stack or (current.stack if current is not None else "") or None
        writes.append((payload, owner))
        changed.append(name)
    if writes:  # one lock, one cross-slot check, each file read once: O(N)
        write_slot_configs(config_dir, writes, final=list(final.values()), catalogue=merged)
    for name in sorted(pruned):
        delete_slot_config(config_dir, name)
        changed.append(name)
    return changed


def final_aliases(state: DesiredState, snapshot: ConfigSnapshot) -> list[AliasEntry]:
    """The aliases after applying ``state``: its own, and the config dir's that no stack
    of ``state`` owns (a stack's aliases dropped from its files are removed)."""
    kept = [a for n, a in snapshot.aliases.items() if a.stack not in state.stacks]
    kept = [a for a in kept if a.spec.id not in state.aliases]
    return kept + list(state.aliases.values())


def final_adapters(state: DesiredState, snapshot: ConfigSnapshot) -> list[AdapterEntry]:
    """The adapters after applying ``state``: its own, and the config dir's that no stack
    of ``state`` owns (as :func:`final_aliases`)."""
    kept = [a for a in snapshot.adapters.values() if a.stack not in state.stacks]
    kept = [a for a in kept if a.spec.id not in state.adapters]
    return kept + list(state.adapters.values())


def adapter_changes(state: DesiredState, snapshot: ConfigSnapshot) -> list[str]:
    """What applying ``state`` changes of the adapters: ``+ id``, ``~ id``, ``- id``, each
    with its base model, rank, scale, priority and pinning."""
    out = []
    after = {a.spec.id: a for a in final_adapters(state, snapshot)}
    for adapter_id, entry in after.items():
        spec, have = entry.spec, snapshot.adapters.get(adapter_id)
        shown = (
            f"{adapter_id} -> {spec.base} (rank {spec.rank or '?'}, scale {spec.scale:g}, "
            f"priority {spec.priority}{', pinned' if spec.pinned else ''})"
        )
        if have is None:
            out.append(f"+ {shown}")
        elif have.spec != spec or have.stack != entry.stack:
            out.append(f"~ {shown}")
    out += [f"- {adapter_id}" for adapter_id in snapshot.adapters if adapter_id not in after]
    return out


def alias_changes(state: DesiredState, snapshot: ConfigSnapshot) -> list[str]:
    """What applying ``state`` changes of the aliases: ``+ id`` (new), ``~ id`` (changed),
    ``- id`` (removed), each with its members and ``prefer``."""
    out = []
    after = {a.spec.id: a for a in final_aliases(state, snapshot)}
    for alias_id, entry in after.items():
        have = snapshot.aliases.get(alias_id)
        shown = f"{alias_id} -> {', '.join(entry.spec.models)} (prefer {entry.spec.prefer})"
        if have is None:
            out.append(f"+ {shown}")
        elif have.spec != entry.spec or have.stack != entry.stack:
            out.append(f"~ {shown}")
    out += [f"- {alias_id}" for alias_id in snapshot.aliases if alias_id not in after]
    return out
