"""Custom resources as a source of desired state: ``Model``, ``Slot``, ``Alias`` and
``Adapter`` held in memory and judged key by key.

kopf's watch is the informer: the operator hands :class:`CrSource` each resource as its
event comes (:meth:`CrSource.apply`, :meth:`CrSource.remove`), the whole listing when it
has one (:meth:`CrSource.prime` at the start, :meth:`CrSource.replace` at each resync),
and the source judges only what a change touches: the resource itself, and the resources
whose verdict depends on it — the Slots and Aliases naming a Model's id, an Alias whose
id a Slot's name takes, the resources refused for a conflict (which a change may settle).
Everything else keeps its verdict; nothing is written anywhere. The source then says
which slots, models and aliases changed (a
:class:`~controller.spec.sources.DesiredChange`) to the desired-state cache
(:class:`~controller.spec.desired.DesiredCache`), which merges it after the config dir's
files and hands it on to the reconciler.

Each resource is judged by the loader's own rules, with the same problem codes as a stack
file: the per-slot checks (:func:`~controller.spec.rules.check_slot_payload`: the schema,
model-owned keys, the hardware-flag screen), ``ModelSpec`` and ``AliasSpec``; across
resources the same :func:`~controller.spec.rules.cross_slot_problems` (unique names and
ports, NPU exclusivity, model references), the units' node rule
(:func:`~controller.spec.units.resolve_units`) and the aliases' (:mod:`.source_aliases`),
run over the touched resources and the ones holding what they ask for (the slot of a
name, of a port, the NPU) — never over the whole set. What the config dir's files hold
comes first: a resource never takes a slot name, a port or an alias id a stack file
holds (a Model of a catalogue entry's id is taken over, as the operator always did).

A resource whose spec fails changes nothing: its last good spec stays in force and its
verdict carries the problems (``Degraded`` and an Event). Of two resources in conflict,
the one whose spec is in force already keeps it: the change is refused.
"""

from __future__ import annotations

import json
import logging
from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

from pydantic import ValidationError

from controller.operator.bodies import CrKey, Essence, JsonObject, cr_key, essence_of
from controller.operator.convert import model_payload, slot_payload
from controller.operator.source_adapters import judge_adapters
from controller.operator.source_aliases import judge_aliases
from controller.operator.status import Verdict
from controller.spec.adapters import AdapterEntry
from controller.spec.aliases import AliasEntry
from controller.spec.loader import DesiredSlot, normalise
from controller.spec.problems import Problem, problems_from_validation
from controller.spec.replicas import replica_name, replica_names, replica_of_name
from controller.spec.rules import SlotCheck, SlotEntry, check_slot_payload, cross_slot_problems
from controller.spec.schema import (
    MAX_REPLICAS,
    AdapterSpec,
    AliasSpec,
    ControllerSettings,
    ModelSpec,
    SlotSpec,
)
from controller.spec.sources import NO_CHANGE, DesiredChange, DesiredView, Publish
from controller.spec.units import resolve_units

__all__ = ["KINDS", "STACK", "CrKey", "CrSource", "cr_key"]

log = logging.getLogger("slotctl.operator")

STACK: Final = "kubernetes"  # the stack (ownership) every CR-declared slot belongs to
KINDS: Final = ("Model", "Slot", "Alias", "Adapter")  # judged in this order: slots name models


@dataclass(frozen=True, slots=True)
class _Nothing:
    """The desired state ahead of a source that stands alone (a test's): nothing."""

    settings: ControllerSettings = field(default_factory=ControllerSettings)
    slots: Mapping[str, DesiredSlot] = field(default_factory=dict)
    models: Mapping[str, ModelSpec] = field(default_factory=dict)
    aliases: Mapping[str, AliasEntry] = field(default_factory=dict)
    adapters: Mapping[str, AdapterEntry] = field(default_factory=dict)


# A resource's verdict, and the slot name, model id, alias id and adapter id it holds.
_Held = tuple[Verdict | None, str | None, str | None, str | None, str | None]


@dataclass(frozen=True, slots=True)
class _Cr:
    """One resource as the source keeps it."""

    key: CrKey
    generation: int
    created: str
    spec: JsonObject
    text: str  # the spec as JSON: 50 == 50.0 == True in Python, not to the checks

    @property
    def order(self) -> tuple[str, str, str]:
        return (self.created, self.key[1], self.key[2])

    @classmethod
    def of(cls, kind: str, essence: Essence) -> _Cr:
        meta = essence["metadata"]
        spec = essence["spec"]
        return cls(
            key=(kind, meta["namespace"], meta["name"]),
            generation=meta["generation"],
            created=meta["creationTimestamp"],
            spec=spec,
            text=json.dumps(spec, sort_keys=True, default=repr),
        )


class _Index:
    """value -> keys and key -> values, so that dropping a key costs only its values."""

    def __init__(self) -> None:
        self._keys: dict[str, set[CrKey]] = {}
        self._values: dict[CrKey, set[str]] = {}

    def add(self, value: str | None, key: CrKey) -> None:
        if value:
            self._keys.setdefault(value, set()).add(key)
            self._values.setdefault(key, set()).add(value)

    def drop(self, key: CrKey) -> None:
        for value in self._values.pop(key, ()):
            keys = self._keys[value]
            keys.discard(key)
            if not keys:
                del self._keys[value]

    def get(self, value: str | None) -> set[CrKey]:
        return set(self._keys.get(value, ())) if value else set()


class CrSource:
    """The custom resources, their verdicts and what they put in force (module docstring).

    A :class:`~controller.spec.sources.DesiredSource`: attached to a desired-state cache
    it judges against what the cache's files hold and publishes every change there;
    alone (a test's) it judges against nothing and returns its changes."""

    def __init__(self, stack: str = STACK) -> None:
        self.name = stack
        self.stack = stack
        self._before: DesiredView = _Nothing()
        self._publish: Publish | None = None
        self._synced = False
        self._crs: dict[CrKey, _Cr] = {}
        self._checks: dict[CrKey, tuple[str, SlotCheck, tuple[Problem, ...]]] = {}
        # Verdicts, and what each resource puts in force (its current or last good spec).
        self.verdicts: dict[CrKey, Verdict] = {}
        self._slots: dict[CrKey, SlotSpec] = {}
        self._models: dict[CrKey, ModelSpec] = {}
        self._aliases: dict[CrKey, AliasSpec] = {}
        self._good_slots: dict[CrKey, SlotSpec] = {}
        self._good_models: dict[CrKey, ModelSpec] = {}
        self._good_aliases: dict[CrKey, AliasSpec] = {}
        self._adapters: dict[CrKey, AdapterSpec] = {}
        self._good_adapters: dict[CrKey, AdapterSpec] = {}
        self.slot_names: dict[CrKey, str] = {}  # Slot CR -> the slot it declares (in force)
        self.model_ids: dict[CrKey, str] = {}
        self.alias_ids: dict[CrKey, str] = {}  # Alias CR -> the alias id it declares
        self.adapter_ids: dict[CrKey, str] = {}  # Adapter CR -> the adapter id it declares
        # The view (what the cache merges), by slot name, model id, alias id.
        self._view_slots: dict[str, DesiredSlot] = {}
        self._view_models: dict[str, ModelSpec] = {}
        self._view_aliases: dict[str, AliasEntry] = {}
        self._view_adapters: dict[str, AdapterEntry] = {}
        # Who holds what, in force: the lookups of the rules across resources.
        self._by_name: dict[str, CrKey] = {}
        self._model_by_id: dict[str, CrKey] = {}
        self._alias_by_id: dict[str, CrKey] = {}
        self._adapter_by_id: dict[str, CrKey] = {}
        self._by_port: dict[int, CrKey] = {}
        self._npu: CrKey | None = None
        self._units: dict[str, set[CrKey]] = {}
        # Who depends on what (in force or not): a change's dependents.
        self._slot_decl = _Index()  # slot name -> the Slots of that name (any namespace)
        self._slot_refs = _Index()  # model id -> Slots naming it
        self._alias_refs = _Index()  # model id -> Aliases naming it
        self._model_decl = _Index()  # model id -> Models declaring it
        self._alias_decl = _Index()  # alias id -> Aliases declaring it
        self._adapter_refs = _Index()  # model id -> Adapters of that base
        self._adapter_decl = _Index()  # adapter id -> Adapters declaring it
        self._refused_keys: set[CrKey] = set()  # resources whose verdict has problems
        # The files' slots by port and on the NPU (the holders a resource never displaces).
        self._foreign_ports: dict[int, set[str]] = {}
        self._foreign_port_of: dict[str, int] = {}
        self._foreign_npu: set[str] = set()
        self._foreign_indexed = True  # (nothing ahead yet: nothing to index)
        self.judged = 0  # resources judged since the start (the bench's count)
        # The slots (old and new names) of the Slots whose verdict or slot the last
        # judging moved: the status timers to wake.
        self.woken: set[str] = set()
        # Told after every judging that moved a verdict or what a resource puts in force
        # (any kind), with :attr:`woken`: the operator wakes its status timers there, so a
        # status follows every judging at once — a resource's own event, a resync, the
        # config dir's files (:meth:`before_changed`), whichever judged it.
        self.on_moved: Callable[[set[str]], None] | None = None

    # ------------------------------------------------------------------ the seam

    @property
    def synced(self) -> bool:
        """The first listing is in (:meth:`prime`)."""
        return self._synced

    @property
    def settings(self) -> ControllerSettings:
        return self._before.settings

    @property
    def slots(self) -> Mapping[str, DesiredSlot]:
        return self._view_slots

    @property
    def models(self) -> Mapping[str, ModelSpec]:
        return self._view_models

    @property
    def aliases(self) -> Mapping[str, AliasEntry]:
        return self._view_aliases

    @property
    def adapters(self) -> Mapping[str, AdapterEntry]:
        return self._view_adapters

    def attach(self, before: DesiredView, publish: Publish) -> None:
        """Judge against ``before`` from now on (read at the first judging, not here: the
        config dir may not be there yet) and publish through ``publish``."""
        self._before, self._publish = before, publish
        self._foreign_indexed = False

    def before_changed(self, change: DesiredChange) -> DesiredChange:
        """The files changed ``change``: judge again the resources it touches."""
        if change.settings or not self._foreign_indexed:
            self._foreign_index()
            return self._judge(set(self._crs))
        dirty: set[CrKey] = set()
        for name in change.slots:
            old_port = self._foreign_port_of.get(name)
            dirty |= self._port_holders(old_port)
            self._foreign_drop(name)
            slot = self._before.slots.get(name)
            if slot is not None:
                self._foreign_add(name, slot.spec)
                dirty |= self._port_holders(slot.spec.port)
            dirty |= self._slot_decl.get(name)
            dirty |= self._alias_decl.get(name)
            for index in range(1, MAX_REPLICAS):  # the Slots named as its replicas
                dirty |= self._slot_decl.get(replica_name(name, index))
            owner = replica_of_name(name)  # the Slot whose replica it is named as
            if owner is not None:
                dirty |= self._slot_decl.get(owner[0])
            if name in self._foreign_npu or old_port is not None or slot is not None:
                dirty |= {self._npu} if self._npu is not None else set()
        for model_id in change.models:
            dirty |= self._slot_refs.get(model_id) | self._alias_refs.get(model_id)
            dirty |= self._alias_decl.get(model_id)
            dirty |= self._adapter_refs.get(model_id)
        for alias_id in change.aliases:
            dirty |= self._alias_decl.get(alias_id)
        for adapter_id in change.adapters:
            dirty |= self._adapter_decl.get(adapter_id)
        if change.slots or change.aliases or change.adapters:
            dirty |= self._refused()
        return self._judge(dirty) if dirty else NO_CHANGE

    def _foreign_index(self) -> None:
        """Index the files' slots by port and on the NPU, afresh."""
        self._foreign_ports.clear()
        self._foreign_port_of.clear()
        self._foreign_npu.clear()
        for name, slot in self._before.slots.items():
            self._foreign_add(name, slot.spec)
        self._foreign_indexed = True

    def _foreign_add(self, name: str, spec: SlotSpec) -> None:
        if spec.port is not None:
            self._foreign_ports.setdefault(spec.port, set()).add(name)
            self._foreign_port_of[name] = spec.port
        if _on_npu(spec):
            self._foreign_npu.add(name)

    def _foreign_drop(self, name: str) -> None:
        port = self._foreign_port_of.pop(name, None)
        if port is not None:
            holders = self._foreign_ports.get(port, set())
            holders.discard(name)
            if not holders:
                self._foreign_ports.pop(port, None)
        self._foreign_npu.discard(name)

    def _port_holders(self, port: int | None) -> set[CrKey]:
        if port is None:
            return set()
        holder = self._by_port.get(port)
        return {holder} if holder is not None else set()

    # ------------------------------------------------------------------ the store

    def apply(self, kind: str, body: Mapping[str, object]) -> DesiredChange:
        """A resource was created or changed (its body, or its essence): judge it and
        what it touches; published, and returned."""
        cr = _Cr.of(kind, essence_of(body))
        if self._crs.get(cr.key) == cr:
            self.woken = set()
            return NO_CHANGE  # the same resource again (a resume, an index refresh)
        self._put(cr)
        return self._published(self._judge({cr.key}))

    def remove(self, key: CrKey) -> DesiredChange:
        """A resource was deleted (or is being deleted: its finalizer waits)."""
        if key not in self._crs:
            self.woken = set()
            return NO_CHANGE
        self._drop(key)
        return self._published(self._judge({key}))

    def replace(self, kind: str, bodies: Iterable[Mapping[str, object]]) -> DesiredChange:
        """Every resource of ``kind`` as a listing has them (what is missing is gone): the
        informer's resync. Judges only the resources that differ."""
        return self._published(self._judge(self._load(kind, bodies)))

    def prime(self, listings: Mapping[str, Iterable[Mapping[str, object]]]) -> DesiredChange:
        """The first listing of every kind: held and judged, and the source is synced."""
        dirty: set[CrKey] = set()
        for kind in KINDS:
            dirty |= self._load(kind, listings.get(kind, ()))
        self._synced = True
        return self._published(self._judge(dirty), always=True)

    def _load(self, kind: str, bodies: Iterable[Mapping[str, object]]) -> set[CrKey]:
        dirty: set[CrKey] = set()
        seen: set[CrKey] = set()
        for body in bodies:
            cr = _Cr.of(kind, essence_of(body))
            seen.add(cr.key)
            if self._crs.get(cr.key) != cr:
                self._put(cr)
                dirty.add(cr.key)
        for key in [k for k in self._crs if k[0] == kind and k not in seen]:
            self._drop(key)
            dirty.add(key)
        return dirty

    def _put(self, cr: _Cr) -> None:
        self._crs[cr.key] = cr
        if cr.key[0] == "Slot":
            self._slot_decl.add(cr.key[2], cr.key)

    def _drop(self, key: CrKey) -> None:
        del self._crs[key]
        self._slot_decl.drop(key)

    def _published(self, change: DesiredChange, *, always: bool = False) -> DesiredChange:
        if self._publish is not None and (change or always):
            self._publish(change)
        return change

    def slot_of(self, key: CrKey) -> str | None:
        return self.slot_names.get(key)

    # ------------------------------------------------------------------ judging

    def _refused(self, kind: str | None = None) -> set[CrKey]:
        return {k for k in self._refused_keys if kind is None or k[0] == kind}

    def _closure(self, dirty: set[CrKey]) -> set[CrKey]:
        """``dirty`` and every resource whose verdict may depend on them."""
        work = set(dirty)
        model_ids = set()
        for key in (k for k in dirty if k[0] == "Model"):
            model_ids.add(self.model_ids.get(key))
            cr = self._crs.get(key)
            if cr is not None:
                model_ids.add(_declared_id(cr))
        for model_id in model_ids - {None, ""}:
            assert model_id is not None
            work |= self._slot_refs.get(model_id)
            work |= self._alias_refs.get(model_id)
            work |= self._model_decl.get(model_id)
            work |= self._alias_decl.get(model_id)
            work |= self._adapter_refs.get(model_id)
        if any(k[0] == "Model" for k in work):
            work |= self._refused("Model")
        if any(k[0] == "Slot" for k in work):
            work |= self._refused("Slot")
            for key in [k for k in work if k[0] == "Slot"]:
                for name in (key[2], self.slot_names.get(key)):
                    work |= self._alias_decl.get(name)
        if any(k[0] == "Alias" for k in work):
            work |= self._refused("Alias")
            for key in [k for k in work if k[0] == "Alias"]:
                for alias_id in (self.alias_ids.get(key), _declared_id(self._crs.get(key))):
                    work |= self._alias_decl.get(alias_id)
        if any(k[0] in ("Slot", "Alias") for k in work):
            work |= self._refused("Adapter")  # a name or a rank limit may settle them
            for key in [k for k in work if k[0] == "Slot"]:
                spec = self._slots.get(key)
                if spec is not None:  # its rank limit judges its base's adapters
                    work |= self._adapter_refs.get(spec.model_id)
        if any(k[0] == "Adapter" for k in work):
            work |= self._refused("Adapter")
            for key in [k for k in work if k[0] == "Adapter"]:
                for adapter_id in (self.adapter_ids.get(key), _declared_id(self._crs.get(key))):
                    work |= self._adapter_decl.get(adapter_id)
        return work

    def _judge(self, dirty: set[CrKey]) -> DesiredChange:
        """Judge ``dirty`` and what depends on them; returns what changed in the view."""
        if not self._foreign_indexed:
            self._foreign_index()
        work = self._closure(dirty)
        self.judged += len(work)
        was = {k: self._held(k) for k in work}
        held_slots = {k: self._slots[k] for k in work if k in self._slots}
        held_models = {k: self._models[k] for k in work if k in self._models}
        held_aliases = {k: self._aliases[k] for k in work if k in self._aliases}
        held_adapters = {k: self._adapters[k] for k in work if k in self._adapters}
        names = {k[2] for k in work if k[0] == "Slot"} | {self.slot_names[k] for k in held_slots}
        ids = {self.model_ids[k] for k in held_models}
        alias_ids = {self.alias_ids[k] for k in held_aliases}
        adapter_ids = {self.adapter_ids[k] for k in held_adapters}
        for key in work:
            self._release(key)
        problems: dict[CrKey, list[Problem]] = {}
        of = {kind: [k for k in work if k[0] == kind and k in self._crs] for kind in KINDS}
        self._judge_models(of["Model"], held_models, problems)
        models = self._view_put_models(
            ids | {self.model_ids[k] for k in of["Model"] if k in self.model_ids}
        )
        self._judge_slots(of["Slot"], held_slots, problems)
        self._judge_aliases(of["Alias"], held_aliases, problems)
        self._judge_adapters(of["Adapter"], held_adapters, problems)
        for key in work:
            self._record(key, problems.get(key, []))
        moved = [k for k, held in was.items() if self._held(k) != held]
        self.woken = {
            name
            for k in moved
            if k[0] == "Slot"
            for name in (was[k][1], self.slot_names.get(k))
            if name
        }
        if moved and self.on_moved is not None:
            self.on_moved(self.woken)
        alias_ids |= {self.alias_ids[k] for k in of["Alias"] if k in self.alias_ids}
        adapter_ids |= {self.adapter_ids[k] for k in of["Adapter"] if k in self.adapter_ids}
        return DesiredChange.of(
            self._view_put_slots(names),
            models,
            self._view_put_aliases(alias_ids),
            adapters=self._view_put_adapters(adapter_ids),
        )

    def _held(self, key: CrKey) -> _Held:
        """What a status shows of ``key``'s judging: its verdict and what it holds."""
        return (
            self.verdicts.get(key),
            self.slot_names.get(key),
            self.model_ids.get(key),
            self.alias_ids.get(key),
            self.adapter_ids.get(key),
        )

    def _release(self, key: CrKey) -> None:
        """``key`` holds nothing in force (it is judged again)."""
        spec = self._slots.pop(key, None)
        if spec is not None:
            if self._by_name.get(spec.name) == key:
                del self._by_name[spec.name]
            if spec.port is not None and self._by_port.get(spec.port) == key:
                del self._by_port[spec.port]
            if self._npu == key:
                self._npu = None
            if spec.unit:
                self._units.get(spec.unit, set()).discard(key)
        self.slot_names.pop(key, None)
        self._models.pop(key, None)
        model_id = self.model_ids.pop(key, None)
        if model_id is not None and self._model_by_id.get(model_id) == key:
            del self._model_by_id[model_id]
        self._aliases.pop(key, None)
        alias_id = self.alias_ids.pop(key, None)
        if alias_id is not None and self._alias_by_id.get(alias_id) == key:
            del self._alias_by_id[alias_id]
        self._adapters.pop(key, None)
        adapter_id = self.adapter_ids.pop(key, None)
        if adapter_id is not None and self._adapter_by_id.get(adapter_id) == key:
            del self._adapter_by_id[adapter_id]
        if key not in self._crs:  # gone: forget it whole
            for index in (
                self._slot_refs,
                self._alias_refs,
                self._model_decl,
                self._alias_decl,
                self._adapter_refs,
                self._adapter_decl,
            ):
                index.drop(key)
            self._refused_keys.discard(key)
            self._checks.pop(key, None)
            self._good_slots.pop(key, None)
            self._good_models.pop(key, None)
            self._good_aliases.pop(key, None)
            self._good_adapters.pop(key, None)
            self.verdicts.pop(key, None)

    def _record(self, key: CrKey, found: list[Problem]) -> None:
        cr = self._crs.get(key)
        if cr is None:
            return
        in_force = (
            key in self.slot_names
            or key in self.model_ids
            or key in self.alias_ids
            or key in self.adapter_ids
        )
        if found:
            self._refused_keys.add(key)
        else:
            self._refused_keys.discard(key)
        self.verdicts[key] = Verdict(
            generation=cr.generation,
            problems=tuple(found),
            accepted=in_force,
            current=in_force and not found,
        )

    # ------------------------------------------------------------------ models

    def _judge_models(
        self,
        keys: list[CrKey],
        held: Mapping[CrKey, ModelSpec],
        problems: dict[CrKey, list[Problem]],
    ) -> None:
        keys.sort(key=lambda k: (k not in held, self._crs[k].order))
        for key in keys:
            cr = self._crs[key]
            self._model_decl.drop(key)
            try:
                model = ModelSpec.model_validate(
                    model_payload({"metadata": {"name": key[2]}, "spec": cr.spec})
                )
            except ValidationError as exc:
                found = problems_from_validation(exc, scope="model", fields=ModelSpec.model_fields)
                problems[key] = [p for p, _ in found]
                good = self._good_models.get(key)
                if good is None:
                    self._model_decl.add(_declared_id(cr), key)
                    continue
                model = good
            self._model_decl.add(model.id, key)
            first = self._model_by_id.get(model.id)
            if first is not None:
                problems.setdefault(key, []).append(
                    Problem(
                        code="model.duplicate_id",
                        message=f"model {model.id!r} is declared twice (first by Model "
                        f"{first[1]}/{first[2]})",
                        key="id",
                        hint="model ids are unique across every namespace the operator watches",
                    )
                )
                continue
            self._model_by_id[model.id] = key
            self._models[key] = model
            self.model_ids[key] = model.id
            self._good_models[key] = model

    # ------------------------------------------------------------------ slots

    def _checked_slot(self, cr: _Cr) -> tuple[SlotCheck, list[Problem]]:
        """The loader's check of one Slot's spec, and its problems; a spec judged before
        is not judged again."""
        known = self._checks.get(cr.key)
        if known is not None and known[0] == cr.text:
            return known[1], list(known[2])
        payload, found = slot_payload({"metadata": {"name": cr.key[2]}, "spec": cr.spec})
        check = check_slot_payload(payload)
        found += [p for p, _ in check.errors]
        self._checks[cr.key] = (cr.text, check, tuple(found))
        return check, found

    def _judge_slots(
        self,
        keys: list[CrKey],
        held: Mapping[CrKey, SlotSpec],
        problems: dict[CrKey, list[Problem]],
    ) -> None:
        """The per-slot checks, then the rules across slots over these and the holders of
        what they ask for; the change of a conflict is the one refused."""
        current: dict[CrKey, tuple[SlotSpec, bool]] = {}  # spec tried, is the CR's current
        for key in keys:
            cr = self._crs[key]
            check, found = self._checked_slot(cr)
            self._slot_refs.drop(key)
            model = cr.spec.get("model")
            if isinstance(model, Mapping) and isinstance(model.get("default"), str):
                self._slot_refs.add(str(model["default"]), key)
            good = self._good_slots.get(key)
            if good is not None:
                self._slot_refs.add(good.model_id, key)
            if check.spec is not None and not found:
                current[key] = (check.spec, True)
                continue
            problems[key] = found
            if good is not None:
                current[key] = (good, False)
        catalogue = self._catalogue()
        for _ in range(len(current) + 1):
            # What is in force already goes first: a conflict is charged to the change.
            order = sorted(
                current, key=lambda k: (held.get(k) != current[k][0], self._crs[k].order)
            )
            entries = [SlotEntry(spec=current[k][0]) for k in order]
            fixed = self._holders_of(entries, set(keys))
            mine = {e.spec.name for e in entries}
            theirs = cross_slot_problems(fixed, catalogue) if fixed else []
            found = [
                p
                for p in cross_slot_problems(fixed + entries, catalogue)
                if p.slot in mine and p not in theirs
            ]
            found += self._unit_problems(entries, set(keys))
            found += self._replica_problems(entries, set(keys))
            if not found:
                break
            by_name: dict[str, list[Problem]] = {}
            for problem in found:
                by_name.setdefault(problem.slot or "", []).append(problem)
            last = {current[k][0].name: k for k in order}
            for name, items in by_name.items():
                charged = last.get(name)
                if charged is None:
                    continue
                said = problems.setdefault(charged, [])
                said.extend(p for p in items if p not in said)
                spec, is_new = current.pop(charged)
                good = self._good_slots.get(charged)
                if is_new and good is not None and good != spec:
                    current[charged] = (good, False)
        for key, (spec, is_new) in current.items():
            self._hold_slot(key, spec)
            if is_new:
                self._good_slots[key] = spec

    def _catalogue(self) -> Mapping[str, ModelSpec]:
        """The models a slot may name: the Models' in force (a Model replaces the
        catalogue entry of its id) and the files'."""
        return ChainMap(self._view_models, self._before.models)  # type: ignore[arg-type]

    def _holders_of(self, entries: list[SlotEntry], judged: set[CrKey]) -> list[SlotEntry]:
        """The slots not judged now that hold a name, a port or the NPU ``entries`` ask
        for: the files' first (they are never displaced), then the resources'."""
        out: dict[str, SlotEntry] = {}
        files = self._before.slots
        for entry in entries:
            spec = entry.spec
            names: list[str] = []
            if spec.name in files:
                names.append(spec.name)
            if spec.port is not None:
                names += sorted(self._foreign_ports.get(spec.port, ()))
            if _on_npu(spec):
                names += sorted(self._foreign_npu)
            for name in names:
                slot = files.get(name)
                if slot is not None:
                    out.setdefault(f"files/{name}", SlotEntry(spec=slot.spec))
            keys = [self._by_name[spec.name]] if spec.name in self._by_name else []
            if spec.port is not None and spec.port in self._by_port:
                keys.append(self._by_port[spec.port])
            if _on_npu(spec) and self._npu is not None:
                keys.append(self._npu)
            for key in keys:
                if key not in judged and key in self._slots:
                    out.setdefault(f"{key}", SlotEntry(spec=self._slots[key]))
        return list(out.values())

    def _replica_problems(self, entries: list[SlotEntry], judged: set[CrKey]) -> list[Problem]:
        """A replica's name (``<slot>-r<i>``) taken across sources: a Slot with the name of
        a replica of a stack file's slot or of a Slot in force, or a Slot whose replicas
        would have the name of a slot one of them declares (the loader's
        ``slot.replica_name_taken`` judges one source's slots; this, the others')."""
        files = self._before.slots
        out: list[Problem] = []

        def held(name: str) -> tuple[SlotSpec, str] | None:
            slot = files.get(name)
            if slot is not None:
                return slot.spec, "a stack file"
            key = self._by_name.get(name)
            if key is not None and key not in judged and key in self._slots:
                return self._slots[key], f"Slot {key[1]}/{key[2]}"
            return None

        for entry in entries:
            spec = entry.spec
            owner = replica_of_name(spec.name)
            if owner is not None:
                base, index = owner
                found = held(base)
                if found is not None and index < found[0].max_count:
                    out.append(
                        entry.problem(
                            "slot.replica_name_taken",
                            f"slot {spec.name!r} has the name of replica {index} of slot "
                            f"{base!r} ({found[1]})",
                            ("name",),
                            "rename the Slot, or lower the other slot's max_replicas",
                        )
                    )
            for index, name in enumerate(replica_names(spec), start=1):
                found = held(name)
                if found is not None:
                    out.append(
                        entry.problem(
                            "slot.replica_name_taken",
                            f"replica {index} of slot {spec.name!r} would be named {name!r}, "
                            f"which {found[1]} declares",
                            ("max_replicas" if spec.max_replicas else "replicas",),
                            "rename that slot, or lower this Slot's replicas",
                        )
                    )
        return out

    def _unit_problems(self, entries: list[SlotEntry], judged: set[CrKey]) -> list[Problem]:
        """A unit's members pinned to two nodes (:func:`resolve_units`'s rule), over the
        units these entries name and their members in force."""
        units = sorted({e.spec.unit for e in entries if e.spec.unit is not None})
        if not units:
            return []
        members = [
            SlotEntry(spec=self._slots[k])
            for unit in units
            for k in sorted(self._units.get(unit, ()))
            if k not in judged and k in self._slots
        ]
        mine = {e.spec.name for e in entries}
        _, before, _ = resolve_units(members, [])
        _, after, _ = resolve_units(members + entries, [])
        return [p for p in after if p.slot in mine and p not in before]

    def _hold_slot(self, key: CrKey, spec: SlotSpec) -> None:
        self._slots[key] = spec
        self.slot_names[key] = spec.name
        self._by_name[spec.name] = key
        if spec.port is not None:
            self._by_port[spec.port] = key
        if _on_npu(spec):
            self._npu = key
        if spec.unit:
            self._units.setdefault(spec.unit, set()).add(key)

    # ------------------------------------------------------------------ aliases

    def _judge_aliases(
        self,
        keys: list[CrKey],
        held: Mapping[CrKey, AliasSpec],
        problems: dict[CrKey, list[Problem]],
    ) -> None:
        keys.sort(key=lambda k: (k not in held, self._crs[k].order))
        for key in keys:
            cr = self._crs[key]
            self._alias_refs.drop(key)
            self._alias_decl.drop(key)
            members = cr.spec.get("models")
            for member in members if isinstance(members, list) else []:
                if isinstance(member, str):
                    self._alias_refs.add(member, key)
            self._alias_decl.add(_declared_id(cr), key)
            good = self._good_aliases.get(key)
            if good is not None:
                for member in good.models:
                    self._alias_refs.add(member, key)
                self._alias_decl.add(good.id, key)
        slots = _Names(self._before.slots, self._view_slots)
        taken = _Names(self._before.aliases)
        chosen = judge_aliases(
            ((k, self._crs[k].spec) for k in keys),
            self._good_aliases,
            self._catalogue(),
            slots,
            taken,
            problems,
            owners=dict(self._alias_by_id),
        )
        for key, alias in chosen.items():
            self._aliases[key] = alias
            self.alias_ids[key] = alias.id
            self._alias_by_id[alias.id] = key
            self._good_aliases[key] = alias

    # ------------------------------------------------------------------ adapters

    def _judge_adapters(
        self,
        keys: list[CrKey],
        held: Mapping[CrKey, AdapterSpec],
        problems: dict[CrKey, list[Problem]],
    ) -> None:
        keys.sort(key=lambda k: (k not in held, self._crs[k].order))
        for key in keys:
            cr = self._crs[key]
            self._adapter_refs.drop(key)
            self._adapter_decl.drop(key)
            base = cr.spec.get("base")
            self._adapter_refs.add(base if isinstance(base, str) else None, key)
            self._adapter_decl.add(_declared_id(cr), key)
            good = self._good_adapters.get(key)
            if good is not None:
                self._adapter_refs.add(good.base, key)
                self._adapter_decl.add(good.id, key)
        chosen = judge_adapters(
            ((k, self._crs[k].spec) for k in keys),
            self._good_adapters,
            self._catalogue(),
            self._slots_of,
            _Names(self._before.slots, self._view_slots, self._before.aliases, self._view_aliases),
            _Names(self._before.adapters),
            problems,
            owners=dict(self._adapter_by_id),
        )
        for key, adapter in chosen.items():
            self._adapters[key] = adapter
            self.adapter_ids[key] = adapter.id
            self._adapter_by_id[adapter.id] = key
            self._good_adapters[key] = adapter

    def _slots_of(self, base: str) -> list[SlotEntry]:
        """The slots in force serving ``base`` (the files' first): their rank limits."""
        out = [
            SlotEntry(spec=s.spec) for s in self._before.slots.values() if s.spec.model_id == base
        ]
        files = self._before.slots
        return out + [
            SlotEntry(spec=spec)
            for spec in self._slots.values()
            if spec.model_id == base and spec.name not in files
        ]

    # ------------------------------------------------------------------ the view

    def _view_put_slots(self, names: set[str]) -> set[str]:
        """The view's slots of ``names`` as now in force; returns those that changed."""
        settings = self._before.settings
        changed = set()
        for name in names:
            key = self._by_name.get(name)
            old = self._view_slots.get(name)
            if key is None:
                if old is not None:
                    del self._view_slots[name]
                    changed.add(name)
                continue
            spec = normalise(self._slots[key], settings)
            if old is None or old.spec != spec:
                self._view_slots[name] = DesiredSlot(spec=spec, stack=self.stack)
                changed.add(name)
        return changed

    def _view_put_models(self, ids: set[str]) -> set[str]:
        changed = set()
        for model_id in ids:
            key = self._model_by_id.get(model_id)
            new = self._models[key] if key is not None else None
            old = self._view_models.get(model_id)
            if new == old:
                continue
            if new is None:
                del self._view_models[model_id]
            else:
                self._view_models[model_id] = new
            changed.add(model_id)
        return changed

    def _view_put_aliases(self, ids: set[str]) -> set[str]:
        changed = set()
        for alias_id in ids:
            key = self._alias_by_id.get(alias_id)
            new = self._aliases[key] if key is not None else None
            old = self._view_aliases.get(alias_id)
            if new is None:
                if old is not None:
                    del self._view_aliases[alias_id]
                    changed.add(alias_id)
                continue
            if old is None or old.spec != new:
                self._view_aliases[alias_id] = AliasEntry(spec=new, stack=self.stack)
                changed.add(alias_id)
        return changed

    def _view_put_adapters(self, ids: set[str]) -> set[str]:
        changed = set()
        for adapter_id in ids:
            key = self._adapter_by_id.get(adapter_id)
            new = self._adapters[key] if key is not None else None
            old = self._view_adapters.get(adapter_id)
            if new is None:
                if old is not None:
                    del self._view_adapters[adapter_id]
                    changed.add(adapter_id)
                continue
            if old is None or old.spec != new:
                self._view_adapters[adapter_id] = AdapterEntry(spec=new, stack=self.stack)
                changed.add(adapter_id)
        return changed


@dataclass(frozen=True, slots=True)
class _Names:
    """The keys of some mappings, for ``in`` (no set built: a judging stays O(touched))."""

    first: Mapping[str, object]
    second: Mapping[str, object] = field(default_factory=dict)
    third: Mapping[str, object] = field(default_factory=dict)
    fourth: Mapping[str, object] = field(default_factory=dict)

    def __contains__(self, name: object) -> bool:
        return any(name in m for m in (self.first, self.second, self.third, self.fourth))

    def __iter__(self) -> Iterator[str]:
        seen: set[str] = set()
        for mapping in (self.first, self.second, self.third, self.fourth):
            for name in mapping:
                if name not in seen:
                    seen.add(name)
                    yield name

    def __len__(self) -> int:
        return len(set(self))


def _declared_id(cr: _Cr | None) -> str | None:
    """The id a Model, Alias or Adapter resource declares (``spec.id``, else its name)."""
    if cr is None:
        return None
    value = cr.spec.get("id")
    return value if isinstance(value, str) and value else cr.key[2]


def _on_npu(spec: SlotSpec) -> bool:
    """The one slot the NPU rule allows: activated, ``device="npu"``, ``type="llm"``."""
    return bool(spec.activated and spec.device == "npu" and spec.type == "llm")
