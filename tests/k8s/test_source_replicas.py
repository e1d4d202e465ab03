"""A replica's name across sources: the clash rule (``slot.replica_name_taken``) judges
every source's names, not only one stack's — a Slot never takes the name of a file's
slot's replica, nor gives its replicas the name of a slot a file or another Slot holds,
and one that held a name before a file's slot gained replicas is refused then."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.reconcile.apply import apply_to_config
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.replicas import replica_of_name
from controller.spec.schema import SlotSpec
from tests.k8s.test_source import cr, slot_spec, source_with


def _file_slots(crs: Any, **slots: dict[str, Any]) -> None:
    files = DesiredState(
        stacks=("files",),
        models=crs.cache.snapshot.models,
        slots={
            name: DesiredSlot(spec=SlotSpec.model_validate({"name": name, **spec}), stack="files")
            for name, spec in slots.items()
        },
    )
    apply_to_config(files, crs.config, prune=True)
    crs.cache.refresh()


def test_replica_of_name() -> None:
    assert replica_of_name("chat-r2") == ("chat", 2)
    assert replica_of_name("a-b-r10") == ("a-b", 10)
    for name in ("chat", "chat-r0", "chat-r02", "-r1", "chat-rx", "chat-r"):
        assert replica_of_name(name) is None, name


def test_a_slot_cannot_take_a_files_replica_name(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [])
    _file_slots(crs, chat=slot_spec(18081, replicas=2))
    assert {"chat", "chat-r1"} <= set(crs.slots)
    crs.source.apply("Slot", cr("chat-r1", slot_spec(18082)))
    assert crs.codes("Slot", "chat-r1") == ["slot.replica_name_taken"]
    held = crs.slots["chat-r1"]
    assert held.stack == "files" and held.spec.replica_of == "chat"
    crs.source.apply("Slot", cr("chat-r2", slot_spec(18083)))  # chat has no replica 2
    assert crs.codes("Slot", "chat-r2") == []
    assert crs.slots["chat-r2"].spec.replica_of is None


def test_a_slots_replicas_cannot_take_a_files_slot_name(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [])
    _file_slots(crs, **{"code-r1": slot_spec(18081)})
    crs.source.apply("Slot", cr("code", slot_spec(18082, replicas=2)))
    assert crs.codes("Slot", "code") == ["slot.replica_name_taken"]
    assert "code" not in crs.slots
    assert crs.slots["code-r1"].stack == "files" and crs.slots["code-r1"].spec.replica_of is None


def test_between_slots_the_newcomer_is_refused(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081, replicas=3))])
    assert crs.slots["chat-r2"].spec.replica_of == "chat"
    crs.source.apply("Slot", cr("chat-r2", slot_spec(18082)))
    assert crs.codes("Slot", "chat-r2") == ["slot.replica_name_taken"]
    assert crs.slots["chat-r2"].spec.replica_of == "chat"
    # the other way: a held Slot's name is taken by a newcomer's replica
    crs.source.apply("Slot", cr("embed-r1", slot_spec(18083)))
    crs.source.apply("Slot", cr("embed", slot_spec(18084, replicas=2)))
    assert crs.codes("Slot", "embed-r1") == []
    assert crs.codes("Slot", "embed") == ["slot.replica_name_taken"]
    assert crs.slots["embed-r1"].spec.replica_of is None and "embed" not in crs.slots


def test_a_file_slot_that_gains_replicas_displaces_the_slot(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat-r1", slot_spec(18082))])
    _file_slots(crs, chat=slot_spec(18081))
    assert crs.codes("Slot", "chat-r1") == []
    _file_slots(crs, chat=slot_spec(18081, replicas=2))
    assert crs.codes("Slot", "chat-r1") == ["slot.replica_name_taken"]
    assert crs.slots["chat-r1"].spec.replica_of == "chat"
    _file_slots(crs, chat=slot_spec(18081))  # back to one: the Slot holds its name again
    assert crs.codes("Slot", "chat-r1") == []
    assert crs.slots["chat-r1"].spec.replica_of is None
