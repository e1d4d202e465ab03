"""Replicas scaled by demand inside admission (issue 38, item 3): the pure decision's
hysteresis (a square wave faster than the windows changes nothing), and the manager's
scaler over the router's own counters — a replica added when its siblings stay
saturated, taken away after the quiet window, each decision an event with its reason,
a scale-up that would need a higher priority's memory refused (fake clock: the tests
wait on state, never on time)."""

from __future__ import annotations

from pathlib import Path

from controller.model.events import EventKind
from controller.model.lifecycle import SlotState
from controller.scheduling.scaling import ReplicaFigures, ScaleMemory, decide_scale
from controller.slots.records import Lease
from controller.spec.replicas import replica_specs
from controller.spec.schema import SlotSpec
from tests.unit.manager_fixtures import events_of, model_spec, settle, slot_spec
from tests.unit.test_multigpu import Host

S = SlotState
UP, DOWN = 5.0, 30.0


def figures(running: int, in_flight: int, total: int = 3, limit: int = 2) -> list[ReplicaFigures]:
    """``total`` replicas, the first ``running`` up, ``in_flight`` requests spread."""
    out = []
    for i in range(total):
        share = in_flight // running + (1 if i < in_flight % running else 0) if i < running else 0
        out.append(
            ReplicaFigures(
                f"r{i}",
                i,
                running=i < running,
                in_flight=min(share, limit),
                waiting=max(0, share - limit),
                concurrency=limit,
            )
        )
    return out


def drive(wave: list[tuple[float, int]], *, step: float = 1.0) -> list[tuple[float, str, int]]:
    """Run the decision every ``step`` seconds over ``wave`` ((seconds, demand) phases),
    the replicas following its decisions at once; the decisions (time, action, running)."""
    memory, running, now = ScaleMemory(), 1, 0.0
    out = []
    for seconds, demand in wave:
        end = now + seconds
        while now < end:
            d = decide_scale(
                figures(running, demand),
                memory,
                now,
                min_count=1,
                max_count=3,
                up_after_s=UP,
                down_after_s=DOWN,
            )
            memory = d.memory
            if d.action == "up":
                running += 1
            elif d.action == "down":
                running -= 1
            if d.action != "hold":
                out.append((now, d.action, running))
                assert d.reason
            now += step
    return out


def test_a_square_wave_faster_than_the_down_window_adds_once_and_never_flaps() -> None:
    # saturated (5 requests on replicas of 2) for 10 s, then nothing for 10 s, 8 times
    decisions = drive([(10.0, 5), (10.0, 0)] * 8)
    assert [a for _, a, _ in decisions] == ["up", "up"]  # to 3 (5 > 2 x 2), then held
    assert all(r <= 3 for _, _, r in decisions)


def test_a_long_quiet_takes_the_extras_away_one_window_each() -> None:
    decisions = drive([(20.0, 5), (100.0, 0)])
    assert [a for _, a, _ in decisions] == ["up", "up", "down", "down"]
    downs = [t for t, a, _ in decisions if a == "down"]
    assert downs[1] - downs[0] >= DOWN  # the window restarts after each decision


def test_a_saturation_shorter_than_the_up_window_adds_nothing() -> None:
    assert drive([(UP - 1, 9), (3.0, 0)] * 10) == []


def test_min_and_max_are_kept() -> None:
    assert drive([(200.0, 50)])[-1][2] == 3  # never above max
    assert all(r >= 1 for _, _, r in drive([(20.0, 5), (300.0, 0)]))


def test_nothing_is_decided_while_a_replica_comes_up() -> None:
    reps = [*figures(1, 9, total=1), ReplicaFigures("r1", 1, running=False, coming=True)]
    memory = ScaleMemory(saturated_since=0.0)
    d = decide_scale(reps, memory, 100.0, min_count=1, max_count=3, up_after_s=1, down_after_s=1)
    assert d.action == "hold" and d.memory == ScaleMemory()


# ----------------------------------------------------------------- the manager's scaler


def chat(**kw: object) -> list[SlotSpec]:
    base = slot_spec(
        "chat",
        "m",
        min_replicas=1,
        max_replicas=2,
        max_concurrency=1,
        scale_up_after_s=UP,
        scale_down_after_s=DOWN,
        **kw,
    )
    return [base, *replica_specs(base)]


async def tick_for(host: Host, seconds: float) -> None:
    """The scaler's look every second for ``seconds`` (fake time), work settled between."""
    for _ in range(int(seconds)):
        await host.manager.housekeeping.scaling.tick()
        await settle(host.manager)
        host.clock.advance(1.0)


async def test_the_scaler_adds_a_replica_under_load_and_takes_it_away_after(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path, [24, 24])
    m = host.manager
    await host.declare(chat(), [model_spec("m", 8)])
    await m.load("chat")
    sub = m.events.subscribe()
    held: list[Lease] = [await m.acquire("chat")]  # at its max_concurrency: saturated
    await tick_for(host, UP + 2)
    assert m.view("chat-r1").state is S.READY and host.gpus_of("chat-r1") == (1,)
    scale = events_of(sub, EventKind.SCALE)
    assert [(e.slot, e.details["action"]) for e in scale] == [("chat-r1", "up")]
    assert "saturated" in scale[0].message and scale[0].details["slot"] == "chat"
    # a square wave: both replicas busy 10 s, quiet 10 s: nothing more happens
    for _ in range(4):
        held.append(await m.acquire("chat-r1"))
        await tick_for(host, 10)
        for lease in held:
            m.release(lease)
        held = []
        await tick_for(host, 10)
    assert events_of(sub, EventKind.SCALE) == []
    assert m.view("chat-r1").state is S.READY
    # quiet past the down window: the extra replica goes, its memory given back
    await tick_for(host, DOWN + 2)
    assert m.view("chat-r1").state is S.OFFLINE and m.view("chat").state is S.READY
    down = events_of(sub, EventKind.SCALE)
    assert [(e.slot, e.details["action"]) for e in down] == [("chat-r1", "down")]
    assert m.admitted_bytes("gpu:1") == 0


async def test_a_scale_up_never_evicts_a_higher_priority(tmp_path: Path) -> None:
    host = Host(tmp_path, [16])
    m = host.manager
    slots = [*chat(priority=40), slot_spec("vip", "v", priority=90)]
    await host.declare(slots, [model_spec("m", 8), model_spec("v", 8)])
    await m.load("chat")
    await m.load("vip")
    sub = m.events.subscribe()
    lease = await m.acquire("chat")
    await tick_for(host, UP + 2)
    assert m.view("vip").state is S.READY  # not evicted for a replica
    assert m.view("chat-r1").state is not S.READY
    scale = events_of(sub, EventKind.SCALE)
    # one decision, its refusal said once: the replica waits for memory, not retried
    # by the scaler every window (the reconciler retries a waiting load)
    assert [e.details["action"] for e in scale] == ["up", "refused"]
    assert "not admitted" in scale[1].message and scale[1].error == "model.insufficient_memory"
    m.release(lease)


def test_the_minimum_follows_a_slot_loaded_on_demand() -> None:
    reps = [
        ReplicaFigures("r0", 0, running=True),
        ReplicaFigures("r1", 1, running=False),
        ReplicaFigures("r2", 2, running=False, offline=False),  # failed: the breaker's
    ]
    d = decide_scale(
        reps, ScaleMemory(), 0.0, min_count=3, max_count=3, up_after_s=1, down_after_s=1
    )
    assert (d.action, d.replica) == ("up", "r1") and "min_replicas = 3" in d.reason
    idle = [ReplicaFigures("r0", 0, running=False), ReplicaFigures("r1", 1, running=False)]
    d = decide_scale(
        idle, ScaleMemory(), 0.0, min_count=2, max_count=2, up_after_s=1, down_after_s=1
    )
    assert d.action == "hold"  # nothing serves: nothing is loaded for it


async def test_fixed_replicas_of_an_on_demand_slot_come_up_together(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24])
    m = host.manager
    base = slot_spec("chat", "m", replicas=2, autoload=False)
    await host.declare([base, *replica_specs(base)], [model_spec("m", 8)])
    await tick_for(host, 3)
    assert m.view("chat-r1").state is S.OFFLINE  # nothing asked for the slot yet
    sub = m.events.subscribe()
    await m.load("chat")  # a request's cold load
    await tick_for(host, 2)
    assert m.view("chat-r1").state is S.READY and host.gpus_of("chat-r1") == (1,)
    (event,) = events_of(sub, EventKind.SCALE)
    assert event.slot == "chat-r1" and "min_replicas = 2" in event.message


async def test_a_replica_still_serving_is_not_taken_away_until_it_is_free(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24])
    m = host.manager
    base = slot_spec(
        "chat",
        "m",
        min_replicas=1,
        max_replicas=2,
        max_concurrency=4,
        scale_up_after_s=UP,
        scale_down_after_s=DOWN,
    )
    await host.declare([base, *replica_specs(base)], [model_spec("m", 8)])
    await m.load("chat")
    await m.load("chat-r1")
    sub = m.events.subscribe()
    lease = await m.acquire("chat-r1")  # light demand, on the extra replica
    await tick_for(host, DOWN + 2)
    assert m.view("chat-r1").state is S.SERVING  # the removal waited: no event said it
    assert events_of(sub, EventKind.SCALE) == []
    m.release(lease)
    await tick_for(host, DOWN + 2)
    assert m.view("chat-r1").state is S.OFFLINE
    assert [e.details["action"] for e in events_of(sub, EventKind.SCALE)] == ["down"]
