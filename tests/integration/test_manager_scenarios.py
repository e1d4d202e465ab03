"""SlotManager scenarios with the real process runtime and the demo server (SPEC §1, §6, §7).

Each test runs real ``python -m controller.demo`` children through a SlotManager built
on :class:`ProcessRuntime` and :class:`HttpProber` with the real clock. Memory figures
are deterministic: the ``gpu`` device has no probe (``FakeMemoryProbe({})``) and a
configured ``memory_budget_gb``, so free = budget - admitted, to the byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from controller.api.dryrun import plan_json
from controller.kit.eventbus import Subscription
from controller.model.errors import (
    InsufficientMemory,
    SlotCrashLooping,
    SlotctlError,
    SlotSpawnFailed,
)
from controller.model.events import Event
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.runtime.base import RunStatus
from controller.runtime.process.runtime import ProcessRuntime
from controller.runtime.process.servers import LOG
from controller.slots.manager import SlotManager
from controller.slots.records import ADMITTED_STATES, Lease, ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.integration.helpers import free_port

S = SlotState


# ============================================================================ builders


def model(model_id: str, gb: float, group: str | None = None) -> ModelSpec:
    return ModelSpec(id=model_id, source=f"demo://{model_id}", memory_gb=gb, exclusive_group=group)


@dataclass
class Env:
    """Builds managers over one state/config dir; the fixture stops and closes them all."""

    tmp: Path
    budget_gb: float = 10.0
    margin_gb: float = 0.0
    managers: list[SlotManager] = field(default_factory=list)
    _ports: set[int] = field(default_factory=set)

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    @property
    def config_dir(self) -> Path:
        return self.tmp / "config"

    def port(self) -> int:
        while True:
            port = free_port()
            if port not in self._ports:
                self._ports.add(port)
                return port

    def slot(self, name: str, model_id: str, *args: str, **kw: Any) -> SlotSpec:
        data: dict[str, Any] = {
            "name": name,
            "provider": "demo",
            "port": self.port(),
            "model": {"default": model_id},
            "device": "gpu",
            "autoload": False,
            "pinned": False,
            "server": {"extra_args": list(args)},
        }
        data.update(kw)
        return normalise(SlotSpec.model_validate(data), self.settings())

    def settings(self) -> ControllerSettings:
        return ControllerSettings(
            memory_budget_gb={"gpu": self.budget_gb}, safety_margin_gb=self.margin_gb
        )

    @staticmethod
    def desired(slots: Sequence[SlotSpec], models: Sequence[ModelSpec]) -> DesiredState:
        return DesiredState(
            stacks=("scenarios",),
            models={m.id: m for m in models},
            slots={s.name: DesiredSlot(spec=s, stack="scenarios") for s in slots},
        )

    async def manager(self, desired: DesiredState) -> SlotManager:
        runtime = ProcessRuntime(self.state_dir, kill_grace_s=5.0)
        manager = SlotManager(
            runtime=runtime,
            state_dir=self.state_dir,
            config_dir=self.config_dir,
            settings=self.settings(),
            prober=HttpProber(timeout_s=5.0, logs=runtime),  # woken by the ready line
            memory=FakeMemoryProbe({}),  # no probe for gpu: the configured budget rules
            config=ManagerConfig(stop_timeout_s=5.0),
        )
        self.managers.append(manager)
        await manager.set_desired(desired)
        return manager


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    environment = Env(tmp_path)
    try:
        yield environment
    finally:
        # Newest first: a restarted manager owns the servers it adopted.
        for manager in reversed(environment.managers):
            with contextlib.suppress(SlotctlError):
                await manager.stop_all(reason="test teardown")
            await manager.close()


# ============================================================================ observers


def runtime_of(manager: SlotManager) -> ProcessRuntime:
    runtime = manager.runtime
    assert isinstance(runtime, ProcessRuntime)
    return runtime


def server_starts(manager: SlotManager, slot: str) -> int:
    """``--- slotctl: starting`` lines in the slot's log and its rotated predecessors."""
    log_path = runtime_of(manager).log_path(slot)
    count = 0
    for path in log_path.parent.glob(f"{LOG}*"):
        count += path.read_text(errors="replace").count("--- slotctl: starting ")
    return count


def labelled(manager: SlotManager, slot: str) -> list[int]:
    """Live (non-zombie) processes carrying this runtime's labels for ``slot``."""
    owner = runtime_of(manager).servers.owner
    pids = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            ours = env.get("SLOTCTL_OWNER") == owner and env.get("SLOTCTL_SLOT") == slot
            if ours and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return sorted(pids)


async def pid_of(manager: SlotManager, slot: str) -> int:
    observed = await manager.runtime.inspect(slot)
    assert observed.status is RunStatus.RUNNING, observed
    return int(observed.ident or 0)


def drain(sub: Subscription) -> list[Event]:
    events = []
    while (event := sub.get_nowait()) is not None:
        events.append(event)
    return events


def transitions(events: Sequence[Event]) -> list[tuple[str, str, str]]:
    return [
        (e.slot or "", e.from_state or "", e.to_state or "")
        for e in events
        if e.kind == "transition"
    ]


def state_files(manager: SlotManager, names: Sequence[str]) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for name in names:
        path = manager.store.path_for(name)
        out[name] = path.read_bytes() if path.exists() else None
    return out


async def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def wait_dead(pid: int, timeout: float = 5.0) -> None:
    def dead() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    await wait_for(dead, timeout)


# ============================================================================ scenarios


async def test_exclusive_group_swap_unloads_the_peer_first(env: Env) -> None:
    models = [model("ma", 2, group="g"), model("mb", 2, group="g")]
    m = await env.manager(env.desired([env.slot("a", "ma"), env.slot("b", "mb")], models))
    assert (await m.load("a")).state is S.READY
    pid_a = await pid_of(m, "a")
    assert m.view("a").resident

    sub = m.events.subscribe()
    view_b = await m.load("b")
    events = drain(sub)
    sub.close()

    assert view_b.state is S.READY
    assert m.view("a").state is S.OFFLINE
    assert not m.view("a").resident and "a" not in m.residency.read()
    assert "b" in m.residency.read()
    assert (await m.runtime.inspect("a")).status is RunStatus.MISSING
    assert labelled(m, "a") == [] and pid_a not in labelled(m, "b")
    record = m.store.read("a")
    assert record is not None and record.state is S.OFFLINE
    assert "exclusive group g" in record.message and "b" in record.message

    # Replay the transitions: each starts where the previous left the slot, and at no
    # point are both members admitted (pulling/starting .. unloading).
    seen = {"a": S.READY.value, "b": S.OFFLINE.value}
    steps = transitions(events)
    for slot, src, dst in steps:
        assert seen[slot] == src, (slot, src, dst, steps)
        seen[slot] = dst
        active = [n for n, st in seen.items() if SlotState(st) in ADMITTED_STATES]
        assert len(active) <= 1, f"both members active after {slot} {src}->{dst}: {steps}"
    a_steps = [(src, dst) for slot, src, dst in steps if slot == "a"]
    b_steps = [(src, dst) for slot, src, dst in steps if slot == "b"]
    assert a_steps == [("ready", "unloading"), ("unloading", "offline")]
    assert b_steps == [("offline", "starting"), ("starting", "warming"), ("warming", "ready")]
    assert steps.index(("a", "unloading", "offline")) < steps.index(("b", "offline", "starting"))


async def test_refused_load_reports_exact_bytes_and_changes_nothing(env: Env) -> None:
    env.margin_gb = 0.5
    slots = [
        env.slot("anchor", "m-anchor", pinned=True),
        env.slot("small", "m-small"),
        env.slot("big", "m-big"),
    ]
    models = [model("m-anchor", 3.25), model("m-small", 1.5), model("m-big", 6.75)]
    m = await env.manager(env.desired(slots, models))
    await asyncio.gather(m.load("anchor"), m.load("small"))
    pids = {n: await pid_of(m, n) for n in ("anchor", "small")}
    names = ["anchor", "small", "big"]
    before_files = state_files(m, names)
    before_views = {n: (m.view(n).state, m.view(n).message) for n in names}
    before_residency = dict(m.residency.read())

    # budget 10 GiB, admitted 3.25 + 1.5 = 4.75 GiB, margin 0.5 GiB: 6.75 GiB needs 2 GiB
    # more than the 4.75 GiB of room; only "small" (1.5 GiB) is evictable (anchor is pinned).
    needed, free, evictable = 7_247_757_312, 5_637_144_576, 1_610_612_736
    assert (needed, free, evictable) == (int(6.75 * GIB), int(5.25 * GIB), int(1.5 * GIB))

    sub = m.events.subscribe()
    plan = plan_json(m.explain_load("big"))
    assert plan["action"] == "refuse"
    assert plan["error"]["needed_bytes"] == needed
    assert plan["error"]["free_bytes"] == free
    assert plan["error"]["evictable_bytes"] == evictable
    with pytest.raises(InsufficientMemory) as err:
        await m.load("big")
    events = drain(sub)
    sub.close()

    details = err.value.details
    assert details["needed_bytes"] == needed
    assert details["free_bytes"] == free
    assert details["evictable_bytes"] == evictable
    assert details["budget_bytes"] == 10 * GIB and details["admitted_bytes"] == int(4.75 * GIB)
    assert err.value.code == "model.insufficient_memory" and err.value.http_status == 409

    # Nothing changed: no transition, no eviction, no process, same files and states.
    assert transitions(events) == []
    assert [e.kind for e in events] == ["refusal"], events
    assert events[0].error == "model.insufficient_memory"
    assert events[0].details["needed_bytes"] == needed
    assert state_files(m, names) == before_files
    assert before_files["big"] is None
    assert {n: (m.view(n).state, m.view(n).message) for n in names} == before_views
    assert dict(m.residency.read()) == before_residency
    assert (await m.runtime.inspect("big")).status is RunStatus.MISSING
    assert not runtime_of(m).log_path("big").exists()
    assert labelled(m, "big") == []
    assert {n: await pid_of(m, n) for n in ("anchor", "small")} == pids
    assert m.admitted_bytes("gpu") == int(4.75 * GIB)


async def test_preload_eviction_picks_lowest_priority_lru_and_explains_first(env: Env) -> None:
    slots = [
        env.slot("low-a", "m-low-a", priority=10),
        env.slot("low-b", "m-low-b", priority=10),
        env.slot("high", "m-high", priority=90),
        env.slot("new", "m-new", priority=50),
    ]
    models = [model(f"m-{s.name}", 3) for s in slots]
    m = await env.manager(env.desired(slots, models))
    await asyncio.gather(m.load("low-a"), m.load("low-b"), m.load("high"))
    pids = {n: await pid_of(m, n) for n in ("low-a", "high")}
    # low-a was used a moment ago: inside the priority-10 tier low-b is least recently used.
    await asyncio.sleep(0.3)
    m.release(await m.acquire("low-a"))

    plan = plan_json(m.explain_load("new"))
    assert plan["action"] == "evict-then-load"
    assert [v["slot"] for v in plan["evict"]] == ["low-b"]
    victim = plan["evict"][0]
    assert victim["priority"] == 10 and victim["bytes"] == 3 * GIB
    assert victim["idle_s"] >= 0.3
    assert "make room for new" in victim["reason"]
    assert "priority 10" in victim["reason"] and "idle" in victim["reason"]
    # The dry run changed nothing.
    assert [m.view(n).state for n in ("low-a", "low-b", "high", "new")] == [
        S.READY,
        S.READY,
        S.READY,
        S.OFFLINE,
    ]

    sub = m.events.subscribe()
    assert (await m.load("new")).state is S.READY
    events = drain(sub)
    sub.close()

    evictions = [e for e in events if e.kind == "eviction"]
    assert [e.slot for e in evictions] == ["low-b"]
    assert evictions[0].details["bytes"] == 3 * GIB
    assert m.view("low-b").state is S.OFFLINE
    assert labelled(m, "low-b") == []
    assert {n: m.view(n).state for n in ("low-a", "high", "new")} == dict.fromkeys(
        ("low-a", "high", "new"), S.READY
    )
    assert {n: await pid_of(m, n) for n in ("low-a", "high")} == pids
    record = m.store.read("low-b")
    assert record is not None and record.state is S.OFFLINE
    assert record.message.startswith("evicted to make room for new: priority 10, idle ")
    assert [s for s, _, _ in transitions(events) if s != "new"] == ["low-b", "low-b"]


async def test_crash_loop_backs_off_and_reset_clears_it(env: Env) -> None:
    m = await env.manager(
        env.desired([env.slot("crash", "m-crash", "--fail-on-load")], [model("m-crash", 1)])
    )

    with pytest.raises(SlotSpawnFailed):
        await m.load("crash")
    assert m.view("crash").state is S.ERROR
    message = m.view("crash").message
    assert "exited with code 1" in message and "injected failure" in message
    # A load that started and failed keeps the wish (it shows error and is retried, as a
    # resident model failing at start does); only a refused load leaves nothing behind.
    assert "crash" in m.residency.read()
    with pytest.raises(SlotCrashLooping) as first:
        await m.load("crash")
    assert 0.7 < first.value.retry_after_s <= 1.0
    assert first.value.details["failures"] == 1
    assert server_starts(m, "crash") == 1  # the refused attempt started nothing

    await asyncio.sleep(first.value.retry_after_s + 0.05)
    with pytest.raises(SlotSpawnFailed):
        await m.load("crash")
    assert server_starts(m, "crash") == 2
    with pytest.raises(SlotCrashLooping) as second:
        await m.load("crash")
    assert 1.7 < second.value.retry_after_s <= 2.0
    assert m.view("crash").failures == 2

    view = await m.reset("crash")
    assert view.state is S.OFFLINE and view.failures == 0 and view.retry_after_s == 0.0
    assert plan_json(m.explain_load("crash"))["action"] == "load"
    with pytest.raises(SlotSpawnFailed):  # retried at once: fails for real, not refused
        await m.load("crash")
    assert server_starts(m, "crash") == 3
    assert labelled(m, "crash") == []


async def test_fifty_cold_acquirers_share_one_start(env: Env) -> None:
    m = await env.manager(
        env.desired([env.slot("cold", "m-cold", "--load-seconds", "1")], [model("m-cold", 2)])
    )
    leases = await asyncio.gather(*(m.acquire("cold") for _ in range(50)))

    assert all(isinstance(lease, Lease) and lease.error is None for lease in leases)
    assert len({lease.id for lease in leases}) == 50
    view = m.view("cold")
    assert view.state is S.SERVING and view.leases == 50 and view.waiters == 0
    assert server_starts(m, "cold") == 1
    assert labelled(m, "cold") == [await pid_of(m, "cold")]

    for lease in leases:
        m.release(lease)
    view = m.view("cold")
    assert view.state is S.READY and view.leases == 0


async def test_cancelled_cold_acquirers_do_not_cancel_the_load(env: Env) -> None:
    m = await env.manager(
        env.desired([env.slot("cold", "m-cold", "--load-seconds", "1")], [model("m-cold", 2)])
    )
    tasks = [asyncio.create_task(m.acquire("cold")) for _ in range(50)]
    await wait_for(lambda: m.view("cold").waiters == 50 and m.view("cold").state is S.WARMING)
    for task in tasks[:49]:
        task.cancel()
    results = await asyncio.gather(*tasks[:49], return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert m.view("cold").waiters == 1

    lease = await tasks[49]
    view = m.view("cold")
    assert view.state is S.SERVING and view.leases == 1 and view.waiters == 0
    assert server_starts(m, "cold") == 1
    m.release(lease)
    await asyncio.sleep(0.1)  # no cleanup may unload it behind the remaining waiter's back
    assert m.view("cold").state is S.READY
    assert labelled(m, "cold") == [await pid_of(m, "cold")]


async def test_every_cold_acquirer_cancelled_unloads_after_the_load_settles(env: Env) -> None:
    m = await env.manager(
        env.desired([env.slot("cold", "m-cold", "--load-seconds", "0.5")], [model("m-cold", 2)])
    )
    tasks = [asyncio.create_task(m.acquire("cold")) for _ in range(10)]
    await wait_for(lambda: m.view("cold").state is S.WARMING)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # The load itself goes on (one start), then the cleanup unloads it: nobody wants it.
    await wait_for(lambda: m.view("cold").state is S.OFFLINE)
    assert server_starts(m, "cold") == 1
    assert labelled(m, "cold") == []
    record = m.store.read("cold")
    assert record is not None and "every waiter cancelled" in record.message


async def test_killed_server_revokes_every_lease_with_a_typed_error(env: Env) -> None:
    m = await env.manager(env.desired([env.slot("victim", "m-victim")], [model("m-victim", 2)]))
    leases = [await m.acquire("victim") for _ in range(3)]
    assert m.view("victim").state is S.SERVING
    pid = await pid_of(m, "victim")

    os.kill(pid, signal.SIGKILL)
    await wait_dead(pid)
    # As housekeeping does every tick: a check that finds the slot busy (its load's last
    # steps on a loaded machine) passes it over and the next one sees the exit.
    for _ in range(50):
        await m.check_exits()
        if m.view("victim").state is S.ERROR:
            break
        await asyncio.sleep(0.1)

    view = m.view("victim")
    assert view.state is S.ERROR, view
    assert "killed by SIGKILL" in view.message
    assert view.leases == 0
    for lease in leases:
        assert lease.lost.is_set()
        with pytest.raises(SlotctlError) as err:
            lease.check()
        assert err.value.code == "slot.health_failed"
        m.release(lease)  # releasing a revoked lease is a harmless no-op
    assert m.view("victim").state is S.ERROR
    record = m.store.read("victim")
    assert record is not None and record.state is S.ERROR and "SIGKILL" in record.message


async def test_restarted_manager_adopts_live_servers_and_flags_vanished_ones(env: Env) -> None:
    desired = env.desired(
        [env.slot("keep", "m-keep"), env.slot("lost", "m-lost")],
        [model("m-keep", 2), model("m-lost", 2)],
    )
    first = await env.manager(desired)
    await asyncio.gather(first.load("keep"), first.load("lost"))
    pid_keep, pid_lost = await pid_of(first, "keep"), await pid_of(first, "lost")
    await first.close()  # the controller goes down; its servers keep running

    os.kill(pid_lost, signal.SIGKILL)  # ... and one of them dies meanwhile
    await wait_dead(pid_lost)

    second = await env.manager(desired)
    assert second.view("keep").state is S.READY  # from state.json
    await second.recover()

    keep = second.view("keep")
    assert keep.state is S.READY, keep
    assert await pid_of(second, "keep") == pid_keep
    assert labelled(second, "keep") == [pid_keep]
    assert server_starts(second, "keep") == 1  # adopted, never restarted
    assert keep.resident and keep.endpoint is not None
    lease = await second.acquire("keep")  # dispatchable through the adopted server
    second.release(lease)
    assert server_starts(second, "keep") == 1

    lost = second.view("lost")
    assert lost.state is S.ERROR, lost
    assert "server vanished while the controller was down" in lost.message
    record = second.store.read("lost")
    assert record is not None and record.state is S.ERROR and record.message == lost.message
    assert labelled(second, "lost") == []


async def test_refused_swap_in_an_exclusive_group_keeps_the_loaded_peer(env: Env) -> None:
    models = [model("ma", 2, group="g"), model("mhuge", 12, group="g")]
    m = await env.manager(env.desired([env.slot("a", "ma"), env.slot("huge", "mhuge")], models))
    await m.load("a")
    pid_a = await pid_of(m, "a")
    sub = m.events.subscribe()
    with pytest.raises(InsufficientMemory) as err:
        await m.load("huge")
    events = drain(sub)
    sub.close()
    # Even with the peer gone, 12 GiB can not fit in 10 GiB: refused before touching "a".
    assert err.value.details["needed_bytes"] == 12 * GIB
    assert transitions(events) == []
    assert [e.kind for e in events] == ["refusal"]
    assert m.view("a").state is S.READY and m.view("a").resident
    assert set(m.residency.read()) == {"a"}
    assert await pid_of(m, "a") == pid_a
    assert labelled(m, "huge") == []


async def test_stop_all_does_not_wait_for_a_hung_load(tmp_path: Path) -> None:
    """Shutdown cancels a load that would otherwise hold its slot for warmup_timeout_s."""
    spec = normalise(
        SlotSpec.model_validate(
            {
                "name": "hung",
                "provider": "demo",
                "port": free_port(),
                "device": "cpu",
                "model": {"default": "m-hung"},
                "warmup_timeout_s": 600,
                "server": {"extra_args": ["--hang-on-load"]},
            }
        ),
        ControllerSettings(),
    )
    manager = SlotManager(
        runtime=ProcessRuntime(tmp_path / "state"),
        state_dir=tmp_path / "state",
        config_dir=tmp_path / "config",
        prober=HttpProber(),
        memory=FakeMemoryProbe({"cpu": 64 * 1024**3}),
    )
    await manager.set_desired(
        DesiredState(
            stacks=("t",),
            models={"m-hung": ModelSpec(id="m-hung", source="demo://x")},
            slots={"hung": DesiredSlot(spec=spec, stack="t")},
        )
    )
    load = asyncio.create_task(manager.load("hung"))
    for _ in range(200):
        if manager.view("hung").state.value == "warming":
            break
        await asyncio.sleep(0.02)
    assert manager.view("hung").state.value == "warming"
    started = time.monotonic()
    await asyncio.wait_for(manager.stop_all(), timeout=20)
    assert time.monotonic() - started < 15
    assert manager.view("hung").state.value == "offline"
    assert (await manager.runtime.inspect("hung")).status.value == "missing"
    with contextlib.suppress(asyncio.CancelledError, SlotctlError):
        await load
    await manager.close()
