"""Co-loaded units (docs/design/0013): the stack syntax and its problems, the pure joint
placement and unit-aware candidates, and the manager loading, rolling back and evicting a
unit whole (FakeRuntime + FakeClock)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from controller.api.dryrun import plan_json
from controller.cli.output import Style
from controller.cli.remote import _unit_lines
from controller.model.errors import InsufficientMemory, SlotSpawnFailed
from controller.model.lifecycle import SlotState
from controller.reconcile.plan import plan_slot
from controller.scheduling.eviction import EvictionCandidate, unified, without_unit
from controller.scheduling.fit import DeviceMemory
from controller.scheduling.placement import DeviceFacts, Need, place_joint
from controller.spec.loader import LoadReport, load_stack_texts
from controller.spec.schema import ControllerSettings, SlotSpec
from tests.unit.manager_fixtures import Harness, desired, model_spec, settle, slot_spec

S = SlotState
G = 1024**3
NOW = 10_000.0

HEAD = """
[stack]
name = "t"
[[model]]
id = "chat-m"
source = "demo://chat"
memory_gb = 4
[[model]]
id = "embed-m"
source = "demo://embed"
memory_gb = 1
"""


def _slot(name: str, port: int, extra: str = "") -> str:
    return (
        f'[[slot]]\nname = "{name}"\nprovider = "demo"\nport = {port}\n'
        f'model.default = "{"embed" if "embed" in name else "chat"}-m"\n{extra}\n'
    )


def load(text: str) -> LoadReport:
    return load_stack_texts([("s.toml", HEAD + text)])


def units_of(report: LoadReport) -> dict[str, str | None]:
    assert report.ok, [p.message for p in report.errors]
    assert report.state is not None
    return {n: s.spec.unit for n, s in report.state.slots.items()}


# ================================================================= stack syntax


def test_unit_table_sets_each_members_unit() -> None:
    text = _slot("chat", 9001) + _slot("embed", 9002) + _slot("other", 9003)
    text += '[[unit]]\nname = "rag"\nslots = ["chat", "embed"]\n'
    assert units_of(load(text)) == {"chat": "rag", "embed": "rag", "other": None}


def test_with_names_the_unit_after_its_slot_and_chains_join() -> None:
    text = _slot("chat", 9001, 'with = ["embed"]') + _slot("embed", 9002, 'with = ["rerank"]')
    text += _slot("rerank", 9003)
    assert units_of(load(text)) == {"chat": "chat", "embed": "chat", "rerank": "chat"}


def test_a_slots_own_unit_key_is_kept() -> None:
    text = _slot("chat", 9001, 'unit = "rag"') + _slot("embed", 9002, 'unit = "rag"')
    assert units_of(load(text)) == {"chat": "rag", "embed": "rag"}


@pytest.mark.parametrize(
    ("text", "code"),
    [
        (_slot("chat", 9001, 'with = ["nope"]'), "unit.unknown_member"),
        (_slot("chat", 9001, 'with = ["chat"]'), "unit.with_self"),
        (_slot("chat", 9001, 'with = "embed"') + _slot("embed", 9002), "unit.invalid_with"),
        (
            _slot("chat", 9001, 'with = ["embed"]') + _slot("embed", 9002, 'with = ["chat"]'),
            "unit.with_cycle",
        ),
        (
            _slot("chat", 9001, 'with = ["embed"]')
            + _slot("embed", 9002)
            + '[[unit]]\nname = "rag"\nslots = ["embed", "other"]\n'
            + _slot("other", 9003),
            "unit.slot_in_two_units",
        ),
        (
            _slot("chat", 9001)
            + _slot("embed", 9002)
            + '[[unit]]\nname = "rag"\nslots = ["chat"]\n'
            + '[[unit]]\nname = "rag"\nslots = ["embed"]\n',
            "unit.duplicate",
        ),
        (
            _slot("chat", 9001, 'node = "a"\nwith = ["embed"]')
            + _slot("embed", 9002, 'node = "b"'),
            "unit.split_nodes",
        ),
        (_slot("chat", 9001) + '[[unit]]\nname = "rag"\nslots = ["chat"]\nx = 1\n', "unit.invalid"),
        (_slot("chat", 9001) + '[[unit]]\nname = "Bad Name"\nslots = ["chat"]\n', "unit.invalid"),
        (
            _slot("chat", 9001, 'unit = "a"') + '[[unit]]\nname = "b"\nslots = ["chat"]\n',
            "unit.slot_in_two_units",
        ),
    ],
)
def test_unit_problems_are_typed_and_located(text: str, code: str) -> None:
    report = load(text)
    assert report.state is None
    codes = [p.code for p in report.errors]
    assert code in codes, codes
    problem = next(p for p in report.errors if p.code == code)
    assert problem.file == "s.toml" and problem.line is not None


def test_a_unit_may_name_slots_of_other_stack_files() -> None:
    first = HEAD + _slot("chat", 9001) + '[[unit]]\nname = "rag"\nslots = ["chat", "embed"]\n'
    second = '[stack]\nname = "u"\n' + _slot("embed", 9002)
    report = load_stack_texts([("a.toml", first), ("b.toml", second)])
    assert units_of(report) == {"chat": "rag", "embed": "rag"}
    assert report.state is not None and report.state.slots["embed"].stack == "u"
    again = '[stack]\nname = "v"\n[[unit]]\nname = "rag"\nslots = ["embed"]\n'
    report = load_stack_texts([("a.toml", first), ("b.toml", second), ("c.toml", again)])
    (problem,) = report.errors
    assert problem.code == "unit.duplicate" and problem.file == "c.toml" and problem.line == 4


def test_a_unit_of_one_is_a_warning() -> None:
    report = load(_slot("chat", 9001) + '[[unit]]\nname = "rag"\nslots = ["chat"]\n')
    assert report.ok
    assert [p.code for p in report.warnings] == ["unit.single_member"]


def test_a_unit_change_is_applied_in_place() -> None:
    report = load(_slot("chat", 9001, 'with = ["embed"]') + _slot("embed", 9002))
    assert report.state is not None
    want = report.state.slots["chat"]
    have = want.spec.model_copy(update={"unit": None})
    action = plan_slot("chat", want, have, None, want_hash="h")
    assert action.kind == "update" and "unit" in action.details["keys"]


# ================================================================= pure: candidates, joint


def cand(name: str, gb: float, *, unit: str | None = None, **kw: Any) -> EvictionCandidate:
    data: dict[str, Any] = {
        "name": name,
        "devices": ("gpu:0",),
        "bytes": int(gb * G),
        "priority": 50,
        "last_used": NOW - 600,
        "state": S.READY,
        "unit": unit,
    }
    data.update(kw)
    return EvictionCandidate(**data)


def test_unified_judges_a_member_as_its_unit() -> None:
    chat = cand("chat", 4, unit="rag", priority=80, leases=1)
    embed = cand("embed", 1, unit="rag", priority=10, last_used=NOW)
    out = {c.name: c for c in unified([chat, embed, cand("x", 1)])}
    assert out["embed"].priority == 80 and out["embed"].leases == 1
    assert out["chat"].last_used == NOW
    assert out["x"] == cand("x", 1)
    assert [c.name for c in without_unit("rag", out.values())] == ["x"]


def gpu(index: int, total_gb: float, admitted_gb: float = 0.0) -> DeviceFacts:
    total, admitted = int(total_gb * G), int(admitted_gb * G)
    sample = DeviceMemory(f"gpu:{index}", total, total - admitted, "fake", index, f"GPU-{index}")
    return DeviceFacts(f"gpu:{index}", admitted, sample, None, 0)


def test_place_joint_biggest_first_and_all_or_nothing() -> None:
    devices = [gpu(0, 6), gpu(1, 3)]
    needs = [(Need("embed", 2 * G), devices), (Need("chat", 5 * G), devices)]
    joint = place_joint(needs, lambda: [], NOW)
    assert joint.ok
    where = {n: p.devices for n, p in joint.members}
    assert [n for n, _ in joint.members] == ["chat", "embed"]
    assert where == {"chat": ("gpu:0",), "embed": ("gpu:1",)}
    # each alone fits GPU 0 (6 GiB), together they do not: refused whole
    alone = [gpu(0, 6)]
    joint = place_joint([(Need("a", 4 * G), alone), (Need("b", 3 * G), alone)], lambda: [], NOW)
    assert not joint.ok and joint.failed == "b"


def test_place_joint_evicts_outsiders_once() -> None:
    devices = [gpu(0, 8, admitted_gb=6)]
    outsider = cand("old", 6)
    needs = [(Need("a", 4 * G), devices), (Need("b", 3 * G), devices)]
    joint = place_joint(needs, lambda: [outsider], NOW)
    assert joint.ok and [v.name for v in joint.victims] == ["old"]


# ================================================================= the manager


async def unit_setup(tmp: Path, gpu_gb: float = 12.0, **embed: Any) -> Harness:
    h = Harness(tmp, gpu_gb=gpu_gb)
    slots = [
        slot_spec("chat", unit="rag", priority=60),
        slot_spec("embed", unit="rag", priority=40, **embed),
        slot_spec("big", priority=90),
        slot_spec("low", priority=10),
    ]
    models = [
        model_spec("chat-m", 4),
        model_spec("embed-m", 2),
        model_spec("big-m", 8),
        model_spec("low-m", 9),
    ]
    await h.manager.set_desired(desired(slots, models))
    return h


async def test_a_request_for_one_member_loads_the_unit(tmp_path: Path) -> None:
    h = await unit_setup(tmp_path)
    m = h.manager
    lease = await m.acquire("embed")
    assert m.view("embed").state is S.SERVING
    assert m.view("chat").state is S.READY  # loaded with it, biggest first
    m.release(lease)
    order = [s for s, _b, a in m.transitions if a == "starting"]
    assert order == ["chat", "embed"]
    await settle(m)


async def test_a_member_failure_rolls_the_unit_back(tmp_path: Path) -> None:
    h = await unit_setup(tmp_path)
    m = h.manager
    h.runtime.script("embed", outcome="exit")
    with pytest.raises(SlotSpawnFailed):
        await m.load("chat")
    assert m.view("embed").state is S.ERROR
    assert m.view("chat").state is S.OFFLINE
    record = m.store.read("chat")
    assert record is not None and "rolled back" in record.message
    await settle(m)


async def test_a_unit_that_does_not_fit_together_changes_nothing(tmp_path: Path) -> None:
    h = await unit_setup(tmp_path, gpu_gb=5)  # chat 4 + embed 2: each fits, not both
    m = h.manager
    before = list(m.transitions)
    with pytest.raises(InsufficientMemory) as err:
        await m.load("embed")
    assert err.value.details["unit"] == {
        "name": "rag",
        "members": ["chat", "embed"],
        "failed": "embed",
    }
    assert "unit 'rag'" in err.value.message
    assert list(m.transitions) == before
    plan = plan_json(m.explain_load("chat"))
    assert plan["action"] == "refuse" and plan["unit"]["failed"] == "embed"
    assert [p["slot"] for p in plan["unit"]["members"]] == ["chat", "embed"]
    lines = _unit_lines(plan, Style(io.StringIO()))  # what `slot load --dry-run` prints
    assert lines[0] == "  unit rag: chat, embed load together"
    assert lines[1] == "    embed does not fit beside the other members"


async def test_eviction_takes_the_unit_whole_and_never_a_member_for_a_member(
    tmp_path: Path,
) -> None:
    h = await unit_setup(tmp_path)
    m = h.manager
    await m.load("chat")
    assert m.view("embed").state is S.READY
    h.clock.advance(600)
    plan = plan_json(
        m.explain_load("big")
    )  # 8 GiB: 6 free; embed (2) alone would do, the unit goes
    assert plan["action"] == "evict-then-load"
    await m.load("big")
    assert m.view("chat").state is S.OFFLINE and m.view("embed").state is S.OFFLINE
    record = m.store.read("chat")
    assert record is not None and "goes with" in record.message
    # a member is never a victim of its own unit's load: "low" (9) is evicted instead
    await m.unload("big")
    await m.load("low")
    h.clock.advance(600)
    await m.load("embed")
    assert m.view("low").state is S.OFFLINE
    assert m.view("chat").state is S.READY and m.view("embed").state is S.READY
    await settle(m)


async def test_a_lease_on_one_member_protects_the_unit(tmp_path: Path) -> None:
    h = await unit_setup(tmp_path)
    m = h.manager
    lease = await m.acquire("chat")
    h.clock.advance(600)
    with pytest.raises(InsufficientMemory):
        await m.load("big")  # embed alone would free enough: it is not evicted alone
    assert m.view("embed").state is S.READY
    m.release(lease)
    await settle(m)


def test_unit_is_a_slot_spec_field() -> None:
    assert SlotSpec.model_validate({"name": "a", "provider": "demo", "unit": "rag"}).unit == "rag"


async def test_the_restore_brings_the_unit_back_together(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=12)
    slots = [
        slot_spec("chat", unit="rag", autoload=False, priority=60),
        slot_spec("embed", unit="rag", autoload=False, priority=40),
    ]
    models = [model_spec("chat-m", 4), model_spec("embed-m", 2)]
    h.manager.residency.set("embed", "embed-m")  # only one member was wished resident
    m = h.new_manager()
    await m.set_desired(desired(slots, models))
    outcome = await m.restore()
    assert outcome == {"embed": "ready"}
    assert m.view("chat").state is S.READY  # restored with its unit
    assert h.runtime.starts == {"chat": 1, "embed": 1}
    await settle(m)


async def test_a_unit_sleeps_together_and_wakes_together(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=10)
    h.memory.totals["cpu"] = 64 * G
    h.manager.settings = ControllerSettings(safety_margin_gb=0.0, host_margin_gb=0.0)
    slots = [
        slot_spec("chat", unit="rag", sleep=True, priority=60),
        slot_spec("embed", unit="rag", sleep=True, priority=40),
        slot_spec("big", priority=90),
    ]
    models = [model_spec("chat-m", 4), model_spec("embed-m", 2), model_spec("big-m", 8)]
    m = h.manager
    await m.set_desired(desired(slots, models))
    await m.load("embed")
    h.clock.advance(600)
    await m.load("big")
    assert h.runtime.sleeping == {"chat": 1, "embed": 1}
    await m.unload("big")
    lease = await m.acquire("chat")  # a request for one member wakes both
    assert h.runtime.sleeping == {}
    assert m.view("embed").state is S.READY and m.view("embed").residency == "awake"
    m.release(lease)
    await settle(m)


async def test_a_member_is_never_evicted_for_its_own_mate(tmp_path: Path) -> None:
    h = await unit_setup(tmp_path)
    m = h.manager
    await m.load("chat")
    await m.unload("embed")  # a person unloads one member: that one only
    assert m.view("chat").state is S.READY and m.view("embed").state is S.OFFLINE
    h.memory.totals["gpu"] = 5 * G  # chat (4) leaves 1: embed (2) needs chat's room
    h.clock.advance(600)
    plan = plan_json(m.explain_load("embed"))
    assert plan["action"] == "refuse"
    with pytest.raises(InsufficientMemory):
        await m.load("embed")
    assert m.view("chat").state is S.READY
    await settle(m)


async def test_ttl_counts_the_units_quiet_time_and_unloads_it_whole(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=12)
    slots = [
        slot_spec("chat", unit="rag", autoload=False, ttl_s=100),
        slot_spec("embed", unit="rag", autoload=False, ttl_s=0),
    ]
    m = h.manager
    await m.set_desired(desired(slots, [model_spec("chat-m", 4), model_spec("embed-m", 2)]))
    await m.load("chat")
    h.clock.advance(80)
    m.release(await m.acquire("embed"))  # the unit is in use: chat's ttl waits
    h.clock.advance(80)
    await m.tick()
    assert m.view("chat").state is not S.OFFLINE
    h.clock.advance(30)
    await m.tick()
    assert m.view("chat").state is S.OFFLINE and m.view("embed").state is S.OFFLINE
    assert not m.view("chat").resident and not m.view("embed").resident
    assert "goes with chat" in m.view("embed").message
    await settle(m)


async def test_a_waiting_member_is_woken_only_when_its_unit_fits(tmp_path: Path) -> None:
    h = await unit_setup(tmp_path, gpu_gb=5)  # chat 4 + embed 2: each fits, not both
    m = h.manager
    with pytest.raises(InsufficientMemory) as err:
        await m.load("chat", resident=False, background=True)
    assert err.value.details.get("waiting") is True
    assert m.view("chat").waiting == "waiting_for_memory"
    assert m.admission.waiting_with_room() == ["chat"]  # chat alone would fit
    assert m.waiting_with_room() == []  # its unit does not
    h.memory.totals["gpu"] = 6 * G
    assert m.waiting_with_room() == ["chat"]
