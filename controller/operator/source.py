"""Custom resources as a source of desired state: ``Model``/``Slot`` CRs -> the config dir.

The operator keeps every CR it sees here. :meth:`CrSource.sync` judges them with the
loader's own checks (``check_slot_payload``, ``ModelSpec``, ``cross_slot_problems``, the
same codes as a stack file), builds the same :class:`DesiredState` a stack file loads to,
and writes it into the config dir through the guard (:func:`apply_to_config`, one stack
named :data:`STACK`, pruned like GitOps). The reconciler then does what it does for TOML.

A CR whose spec fails validation changes nothing: its last good spec stays in force and
its verdict carries the problems (``Degraded`` and an Event). A new CR that conflicts with
one already in force (a port, a name in another namespace) is the one refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from controller.model.errors import SlotctlError
from controller.operator.convert import model_payload, slot_payload
from controller.operator.source_aliases import judge_aliases
from controller.operator.status import Verdict
from controller.reconcile.apply import apply_to_config
from controller.spec.aliases import AliasEntry
from controller.spec.configdir import ConfigSnapshot
from controller.spec.desired import DesiredCache
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.rules import SlotCheck, SlotEntry, check_slot_payload, cross_slot_problems
from controller.spec.schema import AliasSpec, ModelSpec, SlotSpec

__all__ = ["STACK", "CrKey", "CrSource", "SyncResult"]

log = logging.getLogger("slotctl.operator")

STACK: Final = "kubernetes"  # the stack (ownership) every CR-declared slot belongs to

CrKey = tuple[str, str, str]  # (kind, namespace, name)


@dataclass(slots=True)
class _Cr:
    key: CrKey
    generation: int
    created: str
    spec: dict[str, Any]

    @property
    def order(self) -> tuple[str, str, str]:
        return (self.created, self.key[1], self.key[2])


@dataclass(slots=True)
class SyncResult:
    changed: list[str] = field(default_factory=list)  # what apply_to_config wrote
    verdicts: dict[CrKey, Verdict] = field(default_factory=dict)


def cr_key(kind: str, body: Mapping[str, Any]) -> CrKey:
    meta = body.get("metadata") or {}
    return (kind, str(meta.get("namespace") or ""), str(meta.get("name") or ""))


class CrSource:
    """Every known CR, the last good spec of each, and the verdicts of the last sync."""

    def __init__(
        self, config_dir: Path, stack: str = STACK, *, desired: DesiredCache | None = None
    ) -> None:
        self.config_dir = Path(config_dir)
        self.stack = stack
        # The desired state's owner (the controller's): the disk read through it.
        self.desired = desired if desired is not None else DesiredCache(self.config_dir)
        self._crs: dict[CrKey, _Cr] = {}
        self._good_slots: dict[CrKey, SlotSpec] = {}
        self._checks: dict[CrKey, tuple[str, SlotCheck, tuple[Problem, ...]]] = {}
        self._good_models: dict[CrKey, ModelSpec] = {}
        self.verdicts: dict[CrKey, Verdict] = {}
        self.slot_names: dict[CrKey, str] = {}  # Slot CR -> the slot it declares (in force)
        self.model_ids: dict[CrKey, str] = {}
        self._good_aliases: dict[CrKey, AliasSpec] = {}
        self.alias_ids: dict[CrKey, str] = {}  # Alias CR -> the alias id it declares

    # ------------------------------------------------------------------ the store

    def upsert(self, kind: str, body: Mapping[str, Any]) -> CrKey:
        key = cr_key(kind, body)
        meta = body.get("metadata") or {}
        spec = body.get("spec")
        self._crs[key] = _Cr(
            key=key,
            generation=int(meta.get("generation") or 0),
            created=str(meta.get("creationTimestamp") or ""),
            spec=dict(spec) if isinstance(spec, Mapping) else {},
        )
        return key

    def load(self, kind: str, bodies: Iterable[Mapping[str, Any]]) -> None:
        """Replace every CR of ``kind`` with ``bodies`` (the operator's kopf index)."""
        wanted = {self.upsert(kind, body) for body in bodies}
        for key in [k for k in self._crs if k[0] == kind and k not in wanted]:
            self.remove(key)

    def remove(self, key: CrKey) -> None:
        self._crs.pop(key, None)
        self._good_slots.pop(key, None)
        self._checks.pop(key, None)
        self._good_models.pop(key, None)
        self.verdicts.pop(key, None)
        self.slot_names.pop(key, None)
        self.model_ids.pop(key, None)
        self._good_aliases.pop(key, None)
        self.alias_ids.pop(key, None)

    def slot_of(self, key: CrKey) -> str | None:
        return self.slot_names.get(key)

    # ------------------------------------------------------------------ judging

    def _models(self, problems: dict[CrKey, list[Problem]]) -> dict[CrKey, ModelSpec]:
        chosen: dict[CrKey, ModelSpec] = {}
        owners: dict[str, CrKey] = {}
        crs = sorted((c for c in self._crs.values() if c.key[0] == "Model"), key=_model_order(self))
        for cr in crs:
            try:
                model = ModelSpec.model_validate(
                    model_payload({"metadata": {"name": cr.key[2]}, "spec": cr.spec})
                )
            except ValidationError as exc:
                found = problems_from_validation(exc, scope="model", fields=ModelSpec.model_fields)
                problems[cr.key] = [p for p, _ in found]
                good = self._good_models.get(cr.key)
                if good is None:
                    continue
                model = good
            first = owners.get(model.id)
            if first is not None:
                problems.setdefault(cr.key, []).append(
                    Problem(
                        code="model.duplicate_id",
                        message=f"model {model.id!r} is declared twice (first by Model "
                        f"{first[1]}/{first[2]})",
                        key="id",
                        hint="model ids are unique across every namespace the operator watches",
                    )
                )
                continue
            owners[model.id] = cr.key
            chosen[cr.key] = model
        return chosen

    def _slot_candidates(
        self, problems: dict[CrKey, list[Problem]]
    ) -> dict[CrKey, tuple[SlotSpec, bool]]:
        """Each Slot CR -> (spec in force, whether it is the CR's current spec)."""
        out: dict[CrKey, tuple[SlotSpec, bool]] = {}
        for cr in (c for c in self._crs.values() if c.key[0] == "Slot"):
            check, found = self._checked_slot(cr)
            if check.spec is not None and not found:
                out[cr.key] = (check.spec, True)
                continue
            problems[cr.key] = found
            good = self._good_slots.get(cr.key)
            if good is not None:
                out[cr.key] = (good, False)
        return out

    def _checked_slot(self, cr: _Cr) -> tuple[SlotCheck, list[Problem]]:
        """The loader's check of one Slot CR's spec, and its problems; a spec judged before
        is not judged again (a sync judges every CR: at 1,000 Slots, a burst's syncs spent
        most of their time validating specs that had not changed)."""
        # The spec as JSON, not the dict: ``50 == 50.0 == True`` in Python, not to the check.
        text = json.dumps(cr.spec, sort_keys=True, default=repr)
        known = self._checks.get(cr.key)
        if known is not None and known[0] == text:
            return known[1], list(known[2])
        payload, found = slot_payload({"metadata": {"name": cr.key[2]}, "spec": cr.spec})
        check = check_slot_payload(payload)
        found += [p for p, _ in check.errors]
        self._checks[cr.key] = (text, check, tuple(found))
        return check, found

    def _resolve_conflicts(
        self,
        candidates: dict[CrKey, tuple[SlotSpec, bool]],
        catalogue: Mapping[str, ModelSpec],
        snapshot: ConfigSnapshot,
        problems: dict[CrKey, list[Problem]],
    ) -> dict[CrKey, SlotSpec]:
        """Cross-slot rules over the whole set; the newcomer of a conflict is refused."""
        applied = {n: s.spec for n, s in snapshot.slots.items()}
        # Slots another source put in the config dir (a stack file) keep what they hold.
        others = [SlotEntry(spec=s.spec) for s in snapshot.slots.values() if s.stack != self.stack]
        current = dict(candidates)
        for _ in range(len(candidates) + 1):
            # What is in force already goes first: a conflict is charged to the change.
            order = sorted(
                current,
                key=lambda k: (
                    applied.get(current[k][0].name) != normalise(current[k][0], snapshot.settings),
                    self._crs[k].order,
                ),
            )
            entries = [SlotEntry(spec=current[k][0]) for k in order]
            mine = {current[k][0].name for k in order}
            found = [p for p in cross_slot_problems(others + entries, catalogue) if p.slot in mine]
            if not found:
                break
            by_name: dict[str, list[Problem]] = {}
            for problem in found:
                by_name.setdefault(problem.slot or "", []).append(problem)
            for key, items in self._charge(order, current, by_name).items():
                problems.setdefault(key, []).extend(items)
                spec, is_new = current.pop(key)
                good = self._good_slots.get(key)
                if is_new and good is not None and good != spec:
                    current[key] = (good, False)
        return {k: v[0] for k, v in current.items()}

    def _charge(
        self,
        order: list[CrKey],
        current: dict[CrKey, tuple[SlotSpec, bool]],
        by_name: dict[str, list[Problem]],
    ) -> dict[CrKey, list[Problem]]:
        """Which CR each cross-slot problem belongs to (for a name: the last of that name)."""
        last: dict[str, CrKey] = {}
        for key in order:
            last[current[key][0].name] = key
        return {last[name]: items for name, items in by_name.items() if name in last}

    # ------------------------------------------------------------------ sync

    def sync(self) -> SyncResult:
        """Judge every CR and write the resulting desired state through the guard."""
        problems: dict[CrKey, list[Problem]] = {}
        snapshot = self.desired.read_fresh()
        models = self._models(problems)
        catalogue = {**snapshot.models, **{m.id: m for m in models.values()}}
        candidates = self._slot_candidates(problems)
        slots = self._resolve_conflicts(candidates, catalogue, snapshot, problems)
        aliases = self._aliases(catalogue, snapshot, {s.name for s in slots.values()}, problems)
        state = DesiredState(
            aliases={a.id: AliasEntry(spec=a, stack=self.stack) for a in aliases.values()},
            stacks=(self.stack,),
            models={m.id: m for m in models.values()},
            slots={
                spec.name: DesiredSlot(spec=normalise(spec, snapshot.settings), stack=self.stack)
                for spec in slots.values()
            },
        )
        result = SyncResult()
        try:
            result.changed = apply_to_config(state, self.config_dir, prune=True, snapshot=snapshot)
        except SlotctlError as exc:  # refused as a whole: nothing changed, nothing in force moves
            log.warning("CR desired state refused by the guard: [%s] %s", exc.code, exc.message)
            for key, (_, is_new) in candidates.items():
                if is_new:
                    problems.setdefault(key, []).append(Problem(code=exc.code, message=exc.message))
            result.verdicts = self._record(problems)
            return result
        for key, spec in slots.items():
            if candidates[key][1]:
                self._good_slots[key] = spec
        self._good_models.update(models)
        self.slot_names = {k: s.name for k, s in slots.items()}
        self.model_ids = {k: m.id for k, m in models.items()}
        self._good_aliases.update(aliases)
        self.alias_ids = {k: a.id for k, a in aliases.items()}
        result.verdicts = self._record(problems)
        return result

    def _aliases(
        self,
        catalogue: Mapping[str, ModelSpec],
        snapshot: ConfigSnapshot,
        slots: set[str],
        problems: dict[CrKey, list[Problem]],
    ) -> dict[CrKey, AliasSpec]:
        """The Alias CRs' specs in force (:mod:`.source_aliases`)."""
        crs = sorted(
            (c for c in self._crs.values() if c.key[0] == "Alias"),
            key=lambda c: (c.key not in self._good_aliases, c.order),
        )
        others = {n for n, s in snapshot.slots.items() if s.stack != self.stack}
        taken = {i for i, a in snapshot.aliases.items() if a.stack != self.stack}
        return judge_aliases(
            ((c.key, c.spec) for c in crs),
            self._good_aliases,
            catalogue,
            slots | others,
            taken,
            problems,
        )

    def _record(self, problems: dict[CrKey, list[Problem]]) -> dict[CrKey, Verdict]:
        for key, cr in self._crs.items():
            found = tuple(problems.get(key, ()))
            in_force = key in self.slot_names or key in self.model_ids or key in self.alias_ids
            self.verdicts[key] = Verdict(
                generation=cr.generation,
                problems=found,
                accepted=in_force,
                current=in_force and not found,
            )
        return dict(self.verdicts)


def _model_order(source: CrSource) -> Any:
    def order(cr: _Cr) -> tuple[bool, tuple[str, str, str]]:
        return (cr.key not in source._good_models, cr.order)

    return order
