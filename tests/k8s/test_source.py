"""CRs as a source of desired state, without kopf: held in memory (nothing written), judged
per key with the loader's codes, the last good spec kept, conflicts charged to the
newcomer, the config dir's files first, pruning of what no CR declares any more, and the
status mapping (lastTransitionTime moves only when a condition flips)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.model.lifecycle import SlotState
from controller.operator.source import STACK, CrSource
from controller.operator.status import (
    Observed,
    Verdict,
    Written,
    model_status,
    rollout_status,
    slot_status,
)
from controller.reconcile.apply import apply_to_config
from controller.spec.configdir import read_config_dir
from controller.spec.desired import DesiredCache
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.problems import Problem
from controller.spec.schema import ModelSpec, SlotSpec
from controller.spec.sources import DesiredChange


def cr(
    name: str, spec: dict[str, Any], namespace: str = "default", created: str = "1"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "generation": 1,
            "creationTimestamp": created,
        },
        "spec": spec,
    }


def slot_spec(port: int, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"provider": "demo", "port": port, "model": {"default": model}, "device": "cpu", **extra}


@dataclass
class Crs:
    """A CR source attached to the desired-state cache of a config dir, as the operator
    has it."""

    cache: DesiredCache
    source: CrSource
    config: Path

    def load(self, kind: str, bodies: list[dict[str, Any]]) -> DesiredChange:
        """kopf's listing of ``kind`` (what is missing is gone): judged, published."""
        return self.source.replace(kind, bodies)

    def verdict(self, kind: str, name: str, namespace: str = "default") -> Verdict:
        return self.source.verdicts[(kind, namespace, name)]

    def codes(self, kind: str, name: str, namespace: str = "default") -> list[str]:
        return [p.code for p in self.verdict(kind, name, namespace).problems]

    @property
    def slots(self) -> dict[str, DesiredSlot]:
        return self.cache.snapshot.slots


def source_with(tmp_path: Path, slots: list[dict[str, Any]]) -> Crs:
    config = tmp_path / "config"
    cache = DesiredCache(config)
    source = CrSource()
    cache.add_source(source)
    crs = Crs(cache, source, config)
    crs.load("Model", [cr("m", {"source": "demo://m"})])
    crs.load("Slot", slots)
    return crs


def test_crs_become_the_loaders_desired_state_in_memory(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [])
    change = crs.load("Slot", [cr("chat", slot_spec(18081)), cr("embed", slot_spec(18082))])
    assert change.slots == {"chat", "embed"}
    snap = crs.cache.snapshot
    assert sorted(snap.slots) == ["chat", "embed"] and list(snap.models) == ["m"]
    assert {s.stack for s in snap.slots.values()} == {STACK}
    assert snap.slots["chat"].autoload is True  # the loader's migration: a bound model
    assert all(v.accepted and not v.problems for v in crs.source.verdicts.values())
    # level-triggered: the same CRs change nothing
    assert not crs.load("Slot", [cr("chat", slot_spec(18081)), cr("embed", slot_spec(18082))])
    # nothing is written: the config dir holds no slot, no model (TOML is an export)
    assert not (crs.config / "slots").exists() or not list((crs.config / "slots").iterdir())
    assert read_config_dir(crs.config).models == {}


def test_invalid_spec_keeps_the_last_good_one(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081, priority=10))])
    bad = slot_spec(18081, priority=20, server={"extra_args": ["--n-gpu-layers=99"]})
    change = crs.load("Slot", [cr("chat", bad)])
    verdict = crs.verdict("Slot", "chat")
    assert [p.code for p in verdict.problems] == ["slot.hardware_flag"]
    assert verdict.accepted and not verdict.current
    assert not change
    assert crs.slots["chat"].spec.priority == 10
    crs.load("Slot", [cr("chat", {**slot_spec(18081), "context_length": 4096})])
    assert crs.codes("Slot", "chat") == ["slot.model_owned_key"]
    crs.load("Slot", [cr("chat", {**slot_spec(18081), "prio": 1})])
    assert crs.codes("Slot", "chat") == ["slot.unknown_key"]


def test_a_spec_judged_before_is_not_judged_again_but_every_change_is(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """An unchanged spec reuses its verdict (issue 28), a changed one — a nested value
    edited in place included — is judged anew; a change judges only what it touches."""
    import controller.operator.source as source_module

    judged: list[object] = []
    real = source_module.check_slot_payload

    def counting(payload: object) -> Any:
        judged.append(payload)
        return real(payload)

    monkeypatch.setattr(source_module, "check_slot_payload", counting)
    spec = slot_spec(18081, server={"extra_args": ["--threads", "2"]})
    crs = source_with(tmp_path, [cr("chat", spec), cr("embed", slot_spec(18082))])
    assert len(judged) == 2
    crs.load("Slot", [cr("chat", spec), cr("embed", slot_spec(18082))])
    crs.source.apply("Slot", cr("embed", slot_spec(18082)))
    assert len(judged) == 2  # nothing changed: nothing judged again
    spec["server"]["extra_args"].append("--n-gpu-layers=99")  # the body's dict, in place
    crs.load("Slot", [cr("chat", spec), cr("embed", slot_spec(18082))])
    assert len(judged) == 3  # only chat
    assert crs.codes("Slot", "chat") == ["slot.hardware_flag"]
    crs.load("Slot", [cr("chat", spec), cr("embed", slot_spec(18082))])
    assert crs.codes("Slot", "chat") == ["slot.hardware_flag"]
    # Equal in Python, not to the check: 50 and 50.0 (a priority must be an integer).
    crs.load("Slot", [cr("chat", slot_spec(18081, priority=50))])
    assert not crs.verdict("Slot", "chat").problems
    crs.load("Slot", [cr("chat", slot_spec(18081, priority=50.0))])
    assert crs.codes("Slot", "chat") == ["slot.invalid_value"]


def test_a_change_judges_only_the_resources_it_touches(tmp_path: Path) -> None:
    """Per key (issue 41): a Slot's edit judges that Slot (and the refused ones a change
    may settle), not the other 200; a Model's judges the Slots naming it."""
    slots = [cr(f"s{i}", slot_spec(19000 + i)) for i in range(200)]
    crs = source_with(tmp_path, slots)
    crs.source.apply("Model", cr("other", {"source": "demo://other"}))
    before = crs.source.judged
    change = crs.source.apply("Slot", cr("s7", slot_spec(19007, priority=90)))
    assert change.slots == {"s7"} and crs.source.judged - before == 1
    before = crs.source.judged
    crs.source.apply("Slot", cr("late", slot_spec(19007)))  # s7's port: refused
    assert crs.codes("Slot", "late") == ["slot.duplicate_port"]
    assert crs.source.judged - before == 1
    before = crs.source.judged
    crs.source.apply("Slot", cr("s8", slot_spec(19008, priority=1)))
    assert crs.source.judged - before == 2  # s8, and the refused one
    before = crs.source.judged
    crs.source.apply("Model", cr("other", {"source": "demo://other", "memory_gb": 2}))
    assert crs.source.judged - before == 1  # the Model (no Slot names it)
    before = crs.source.judged
    change = crs.source.remove(("Slot", "default", "s7"))
    assert change.slots == {"s7", "late"}  # s7 gone, the port free: late is accepted
    assert crs.verdict("Slot", "late").current and crs.slots["late"].spec.port == 19007
    assert crs.source.judged - before == 2


def test_a_new_slot_that_takes_a_port_in_use_is_the_one_refused(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081), created="1")])
    crs.load(
        "Slot",
        [cr("chat", slot_spec(18081), created="1"), cr("aaa", slot_spec(18081), created="2")],
    )
    assert crs.codes("Slot", "aaa") == ["slot.duplicate_port"]
    assert not crs.verdict("Slot", "aaa").accepted
    assert crs.verdict("Slot", "chat").current
    assert list(crs.slots) == ["chat"]


def test_same_slot_name_in_two_namespaces(tmp_path: Path) -> None:
    crs = source_with(
        tmp_path,
        [
            cr("chat", slot_spec(18081), namespace="team-a", created="1"),
            cr("chat", slot_spec(18082), namespace="team-b", created="2"),
        ],
    )
    assert crs.verdict("Slot", "chat", "team-a").current
    assert crs.codes("Slot", "chat", "team-b") == ["slot.duplicate_name"]
    assert crs.slots["chat"].spec.port == 18081


def test_unknown_model_and_invalid_model(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081, model="nope"))])
    assert crs.codes("Slot", "chat") == ["slot.unknown_model"]
    crs.load("Model", [cr("m", {"source": "s3://bucket/m"})])
    assert crs.verdict("Model", "m").problems[0].code == "model.invalid_value"
    # a Model that comes later settles the Slot that named it
    crs.load("Model", [cr("m", {"source": "demo://m"}), cr("nope", {"source": "demo://n"})])
    assert crs.verdict("Slot", "chat").current and "chat" in crs.slots


def test_a_deleted_cr_is_pruned_but_other_stacks_are_not(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081)), cr("embed", slot_spec(18082))])
    files = DesiredState(
        stacks=("files",),
        models={"fm": ModelSpec(id="fm", source="demo://fm")},
        slots={
            "filed": DesiredSlot(
                spec=SlotSpec.model_validate({"name": "filed", **slot_spec(18090, "fm")}),
                stack="files",
            )
        },
    )
    apply_to_config(files, crs.config, prune=True)
    crs.cache.refresh()
    assert crs.load("Slot", [cr("embed", slot_spec(18082))]).slots == {"chat"}
    assert sorted(crs.slots) == ["embed", "filed"]


def test_a_stack_files_slot_holds_its_name_and_port(tmp_path: Path) -> None:
    """The config dir's files come first: a Slot never takes a name or a port a stack
    file holds, and one that held it before the file came is refused then."""
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081))])
    files = DesiredState(
        stacks=("files",),
        models=crs.cache.snapshot.models,
        slots={
            "filed": DesiredSlot(
                spec=SlotSpec.model_validate({"name": "filed", **slot_spec(18081)}),
                stack="files",
            )
        },
    )
    apply_to_config(files, crs.config, prune=True)
    crs.cache.refresh()
    assert crs.codes("Slot", "chat") == ["slot.duplicate_port"]
    assert sorted(crs.slots) == ["filed"] and crs.slots["filed"].stack == "files"
    crs.source.apply("Slot", cr("filed", slot_spec(18082)))
    assert crs.codes("Slot", "filed") == ["slot.duplicate_name"]


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_conditions_move_only_when_they_flip() -> None:
    verdict = Verdict(generation=3, accepted=True, current=True)
    warming = Observed(state=SlotState.WARMING, model="m", device="cpu", memory_bytes=2**30)
    first = slot_status(warming, verdict, None, now="T1")
    conds = _conditions(first)
    assert conds["Ready"]["status"] == "False" and conds["Progressing"]["status"] == "True"
    assert conds["Progressing"]["reason"] == "Warming"
    assert first["memory"] == {"device": "cpu", "gb": 1.0, "admitted": True}
    ready = Observed(state=SlotState.READY, model="m", dispatchable=True, endpoint="http://x")
    second = slot_status(ready, verdict, first, now="T2")
    conds = _conditions(second)
    assert conds["Ready"]["lastTransitionTime"] == "T2"  # flipped
    assert conds["Degraded"]["lastTransitionTime"] == "T1"  # did not
    assert all(c["observedGeneration"] == 3 for c in second["conditions"])
    bad = Verdict(
        generation=4,
        accepted=True,
        problems=(Problem(code="slot.hardware_flag", message="nope", key="server.extra_args[0]"),),
    )
    third = slot_status(ready, bad, second, now="T3")
    conds = _conditions(third)
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "InvalidSpec"
    assert conds["Ready"]["lastTransitionTime"] == "T2"
    assert third["lastError"]["code"] == "slot.hardware_flag"
    crashed = Observed(state=SlotState.ERROR, message="server exited", last_error=("x", "y"))
    fourth = slot_status(crashed, verdict, third, now="T4")
    assert _conditions(fourth)["Degraded"]["reason"] == "ServerError"
    assert fourth["lastError"] == {"code": "x", "message": "y"}


def test_written_status_is_believed_until_the_body_shows_it_or_for_a_while() -> None:
    written = Written(trust_s=30.0)
    old = {"state": "starting", "node": "n1"}
    written.wrote("s", {"state": "warming"}, now=0.0)
    written.wrote("s", {"state": "ready", "endpoint": "http://e"}, now=1.0)
    # kopf's body lags: the writes over it (an older one than the last, too)
    assert written.believed("s", old, now=2.0) == {**old, "state": "ready", "endpoint": "http://e"}
    assert written.believed("s", {**old, "state": "warming"}, now=2.0)["state"] == "ready"
    assert written.believed("t", old, now=2.0) == old  # another CR
    # the body shows them all: it is the truth again, whatever it says next
    caught_up = {**old, "state": "ready", "endpoint": "http://e"}
    assert written.believed("s", caught_up, now=3.0) == caught_up
    assert written.believed("s", old, now=3.0) == old
    # a write the body never shows (a lost patch, someone else's status): only for trust_s
    written.wrote("s", {"state": "ready"}, now=10.0)
    assert written.believed("s", old, now=40.0)["state"] == "ready"
    assert written.believed("s", old, now=40.1) == old
    written.wrote("s", {"state": "ready"}, now=50.0)
    written.forget("s")  # the CR deleted
    assert written.believed("s", old, now=50.0) == old


def test_model_status() -> None:
    verdict = Verdict(generation=1, accepted=True, current=True)
    status = model_status("m", verdict, {"chat": SlotState.READY, "b": SlotState.OFFLINE}, None)
    assert status["state"] == "loaded" and status["slots"] == ["b", "chat"]
    assert _conditions(status)["Ready"]["status"] == "True"


def test_an_edit_that_takes_a_port_in_use_is_refused_not_the_slot_holding_it(
    tmp_path: Path,
) -> None:
    older = cr("aaa", slot_spec(18081), created="1")
    newer = cr("zzz", slot_spec(18082), created="2")
    crs = source_with(tmp_path, [older, newer])
    # the older object is edited onto the newer one's port: the edit is what is refused
    change = crs.load("Slot", [cr("aaa", slot_spec(18082), created="1"), newer])
    assert crs.codes("Slot", "aaa") == ["slot.duplicate_port"]
    assert crs.verdict("Slot", "aaa").accepted  # its last good spec stays
    assert crs.verdict("Slot", "zzz").current
    assert (crs.slots["aaa"].spec.port, crs.slots["zzz"].spec.port) == (18081, 18082)
    assert not change


def test_a_port_swap_in_one_listing_is_legal(tmp_path: Path) -> None:
    """Two Slots trading ports, seen in one listing, are judged as the set they are."""
    crs = source_with(
        tmp_path,
        [cr("aaa", slot_spec(18081), created="1"), cr("zzz", slot_spec(18082), created="2")],
    )
    crs.load(
        "Slot",
        [cr("aaa", slot_spec(18082), created="1"), cr("zzz", slot_spec(18081), created="2")],
    )
    assert crs.verdict("Slot", "aaa").current and crs.verdict("Slot", "zzz").current
    assert (crs.slots["aaa"].spec.port, crs.slots["zzz"].spec.port) == (18082, 18081)


def test_what_an_older_operator_wrote_is_removed_at_the_start(tmp_path: Path) -> None:
    """An older operator wrote its CRs into its config dir as the ``kubernetes`` stack;
    they would now come first (the files' slots hold their names and ports), so its start
    removes them, through the guard, and leaves a stack file's slots and the catalogue."""
    from controller.operator.run import forget_written_files
    from controller.spec.aliases import AliasEntry
    from controller.spec.schema import AliasSpec

    config = tmp_path / "config"
    assert forget_written_files(config) == []  # no config dir yet: nothing to do
    model = ModelSpec(id="m", source="demo://m")

    def declared(name: str, port: int) -> DesiredSlot:
        spec = SlotSpec.model_validate({"name": name, **slot_spec(port)})
        return DesiredSlot(spec=spec, stack=STACK if name != "filed" else "files")

    old = DesiredState(
        stacks=(STACK,),
        models={"m": model},
        slots={"chat": declared("chat", 18081), "embed": declared("embed", 18082)},
        aliases={"a": AliasEntry(spec=AliasSpec(id="a", models=["m"]), stack=STACK)},
    )
    apply_to_config(old, config, prune=True)
    files = DesiredState(stacks=("files",), models={}, slots={"filed": declared("filed", 18090)})
    apply_to_config(files, config, prune=True)
    assert sorted(forget_written_files(config)) == ["aliases", "chat", "embed"]
    snap = read_config_dir(config)
    assert list(snap.slots) == ["filed"] and snap.aliases == {} and list(snap.models) == ["m"]
    assert forget_written_files(config) == []  # once


def test_status_rollout_in_flight_and_done() -> None:
    """``status.rollout``: a surge in flight keeps ``Progressing`` True (reason
    ``RolloutSurge``) while the slot stays ready; once done it stays as the last one."""
    verdict = Verdict(generation=2, accepted=True, current=True)
    live = rollout_status("surge", "starting", "2.00 GiB fits on gpu-a/gpu:0", "warming")
    surging = Observed(state=SlotState.READY, dispatchable=True, rollout=live)
    status = slot_status(surging, verdict, None, now="T1")
    assert status["rollout"] == {
        "strategy": "surge",
        "phase": "starting",
        "reason": "2.00 GiB fits on gpu-a/gpu:0",
        "message": "warming",
    }
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "True" and progressing["reason"] == "RolloutSurge"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"  # the old server serves meanwhile
    last = rollout_status("recreate", "done", "no room to surge, needs 8.00 GiB, 2.00 GiB free")
    done = slot_status(Observed(SlotState.READY, dispatchable=True, rollout=last), verdict, status)
    assert done["rollout"]["phase"] == "done" and done["rollout"]["strategy"] == "recreate"
    progressing = next(c for c in done["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "False"
