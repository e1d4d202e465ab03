"""The slot manager on a multi-GPU host (FakeRuntime, fake clock, a fake per-GPU probe).

Each GPU its own device: loads are placed per GPU and the placement is recorded in
state.json and kept across a restart; slots spanning GPUs need their share on each;
evictions happen only on the GPUs a load uses; pins are honoured or refused with a typed
error that changes nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.api.dryrun import plan_json
from controller.kit.clock import FakeClock
from controller.model.devices import GpuRef
from controller.model.errors import DeviceUnavailable, InsufficientMemory, SlotConfigError
from controller.model.events import EventKind
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.runtime.fake import FakeProber, FakeRuntime
from controller.scheduling.fit import DeviceMemory
from controller.slots.manager import SlotManager
from controller.slots.records import ADMITTED_STATES, ManagerConfig
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.unit.manager_fixtures import desired, events_of, model_spec, settle, slot_spec

S = SlotState


class GpuProbe(FakeMemoryProbe):
    """A fake probe whose GPUs can be lost (as NVML reports a card that fell off the bus)."""

    def __init__(self, sizes_gb: list[float]) -> None:
        super().__init__({f"gpu:{i}": int(gb * GIB) for i, gb in enumerate(sizes_gb)})
        self.lost: set[int] = set()

    def gpus(self) -> tuple[DeviceMemory, ...]:
        out = []
        for g in super().gpus():
            uuid = f"GPU-{g.index:08d}-0000-0000-0000-000000000000"
            if g.index in self.lost:
                out.append(DeviceMemory(g.device, 0, 0, "fake", g.index, uuid, error="lost"))
            else:
                out.append(
                    DeviceMemory(
                        g.device,
                        g.total_bytes,
                        g.free_bytes,
                        "fake",
                        g.index,
                        uuid,
                        "Fake GPU",
                        "nvidia",
                    )
                )
        return tuple(out)


class Host:
    """A manager over ``sizes_gb`` GPUs, its state dir kept for a restart."""

    def __init__(self, tmp: Path, sizes_gb: list[float], **settings: Any) -> None:
        self.tmp = tmp
        self.clock = FakeClock(start=100.0)
        self.runtime = FakeRuntime(self.clock)
        self.prober = FakeProber(self.runtime)
        self.memory = GpuProbe(sizes_gb)
        self.settings = ControllerSettings(safety_margin_gb=0.0, **settings)
        self.manager = self.new_manager()

    def new_manager(self) -> SlotManager:
        manager = SlotManager(
            runtime=self.runtime,
            state_dir=self.tmp / "state",
            config_dir=self.tmp / "config",
            settings=self.settings,
            prober=self.prober,
            memory=self.memory,
            clock=self.clock,
            config=ManagerConfig(stop_timeout_s=1.0),
        )
        self.memory.used_by = manager.resident_bytes
        return manager

    async def declare(self, slots: list[SlotSpec], models: list[ModelSpec]) -> None:
        await self.manager.set_desired(desired(slots, models))

    def gpus_of(self, name: str) -> tuple[int, ...]:
        return self.manager.view(name).gpus

    def visible(self, name: str) -> tuple[GpuRef, ...]:
        return self.runtime.objects[name].launch.visible


def _models(**sizes: float) -> list[ModelSpec]:
    return [model_spec(name, gb) for name, gb in sizes.items()]


async def test_two_big_models_go_to_two_gpus_and_each_server_sees_only_its_own(
    tmp_path: Path,
) -> None:
    """The issue's case: 2 x 24 GB and two 16 GB models: one per GPU, not both on GPU 0."""
    host = Host(tmp_path, [24, 24])
    await host.declare([slot_spec("a", "ma"), slot_spec("b", "mb")], _models(ma=16, mb=16))
    await host.manager.load("a")
    await host.manager.load("b")
    assert (host.gpus_of("a"), host.gpus_of("b")) == ((0,), (1,))
    assert [g.index for g in host.visible("a")] == [0] and [g.index for g in host.visible("b")] == [
        1
    ]
    assert host.visible("b")[0].uuid == "GPU-00000001-0000-0000-0000-000000000000"
    m = host.manager
    assert m.admitted_bytes("gpu:0") == m.admitted_bytes("gpu:1") == 16 * GIB
    assert m.admitted_bytes("gpu") == 32 * GIB  # the kind: every GPU
    record = m.store.read("b")
    assert record is not None and [g.index for g in record.extra.gpus] == [1]
    figures = {d.device: d for d in m.devices()}
    assert figures["gpu:1"].slots == ("b",) and figures["gpu:1"].resident_bytes == 16 * GIB
    assert figures["gpu:1"].free_bytes == 8 * GIB and figures["gpu:1"].name == "Fake GPU"


async def test_an_eviction_happens_only_on_the_gpu_the_load_uses(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24])
    slots = [
        slot_spec("low", "ml", priority=10),
        slot_spec("mid", "mm", priority=40),
        slot_spec("new", "mn", priority=50),
    ]
    await host.declare(slots, _models(ml=20, mm=20, mn=16))
    m = host.manager
    await m.load("low")
    await m.load("mid")
    assert (host.gpus_of("low"), host.gpus_of("mid")) == ((0,), (1,))
    plan = plan_json(m.explain_load("new"))
    assert plan["action"] == "evict-then-load" and plan["devices"] == ["gpu:0"]
    assert [v["slot"] for v in plan["evict"]] == ["low"] and plan["evict"][0]["devices"] == [
        "gpu:0"
    ]
    assert plan["placement"][0]["evict"] == ["low"]
    sub = m.events.subscribe()
    await m.load("new")
    assert host.gpus_of("new") == (0,)
    assert m.view("low").state is S.OFFLINE and m.view("mid").state is S.READY
    evictions = [e for e in events_of(sub) if e.kind == EventKind.EVICTION]
    assert [e.slot for e in evictions] == ["low"] and "gpu:0" in evictions[0].message


async def test_a_restart_never_replaces_a_running_slot(tmp_path: Path) -> None:
    """``a`` landed on GPU 1 because GPU 0 was full then; GPU 0 empties; a restarted
    controller keeps ``a`` where its server runs (a fresh placement would pick GPU 0)."""
    host = Host(tmp_path, [24, 24])
    await host.declare([slot_spec("x", "mx"), slot_spec("a", "ma")], _models(mx=20, ma=10))
    await host.manager.load("x")
    await host.manager.load("a")
    assert host.gpus_of("a") == (1,)
    await host.manager.unload("x")
    await host.manager.close()
    host.manager = host.new_manager()
    await host.declare([slot_spec("x", "mx"), slot_spec("a", "ma")], _models(mx=20, ma=10))
    await host.manager.recover()
    assert host.manager.view("a").state is S.READY and host.gpus_of("a") == (1,)
    assert host.runtime.starts["a"] == 1  # adopted, not started again
    assert host.manager.admitted_bytes("gpu:1") == 10 * GIB
    assert host.manager.admitted_bytes("gpu:0") == 0
    await host.manager.load("x")  # the next load sees GPU 1 as taken
    assert host.gpus_of("x") == (0,)


async def test_an_adopted_server_without_a_recorded_placement_is_counted_on_a_gpu(
    tmp_path: Path,
) -> None:
    """A server started by a controller before per-GPU placement has no GPUs recorded: it
    is counted where the placement would put it, and that is recorded."""
    host = Host(tmp_path, [24, 24])
    await host.declare([slot_spec("a", "ma")], _models(ma=10))
    await host.manager.load("a")
    record = host.manager.store.read("a")
    assert record is not None
    old = record.model_copy(update={"extra": record.extra.model_copy(update={"gpus": ()})})
    host.manager.store.write(old)
    await host.manager.close()
    host.manager = host.new_manager()
    await host.declare([slot_spec("a", "ma")], _models(ma=10))
    await host.manager.recover()
    assert host.gpus_of("a") == (0,) and host.manager.admitted_bytes("gpu:0") == 10 * GIB
    again = host.manager.store.read("a")
    assert again is not None and [g.index for g in again.extra.gpus] == [0]


async def test_a_slot_spanning_two_gpus_holds_its_share_on_each(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24, 24])
    slots = [slot_spec("small", "ms"), slot_spec("tp", "mt", gpus=2)]
    await host.declare(slots, _models(ms=16, mt=20))
    await host.manager.load("small")
    await host.manager.load("tp")
    assert host.gpus_of("small") == (0,) and host.gpus_of("tp") == (1, 2)
    assert [g.index for g in host.visible("tp")] == [1, 2]
    m = host.manager
    assert m.admitted_bytes("gpu:1") == m.admitted_bytes("gpu:2") == 10 * GIB
    # The one pass housekeeping's pressure check reads agrees with the per-device sums.
    table = m.core.table
    every = table.usage.all_resident_bytes()
    assert every == {"gpu:0": 16 * GIB, "gpu:1": 10 * GIB, "gpu:2": 10 * GIB, "gpu": 36 * GIB}
    assert all(every[key] == table.usage.resident_bytes(key) for key in every)


async def test_pins_are_honoured(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24])
    uuid1 = "GPU-00000001-0000-0000-0000-000000000000"
    slots = [slot_spec("one", "m1", device="gpu:1"), slot_spec("u", "m2", device=f"gpu:{uuid1}")]
    await host.declare(slots, _models(m1=4, m2=4))
    await host.manager.load("one")
    await host.manager.load("u")
    assert host.gpus_of("one") == (1,) and host.gpus_of("u") == (1,)


@pytest.mark.parametrize(
    ("device", "gpus", "reason"),
    [("gpu:5", None, "not_found"), ("gpu", 3, "too_few"), ("gpu:1", None, "lost")],
)
async def test_an_impossible_placement_is_a_typed_refusal_that_changes_nothing(
    tmp_path: Path, device: str, gpus: int | None, reason: str
) -> None:
    host = Host(tmp_path, [24, 24])
    if reason == "lost":
        host.memory.lost.add(1)
    extra = {"gpus": gpus} if gpus else {}
    await host.declare([slot_spec("s", "m", device=device, **extra)], _models(m=4))
    m = host.manager
    sub = m.events.subscribe()
    before = m.store.read("s")
    with pytest.raises(DeviceUnavailable) as info:
        await m.load("s")
    assert info.value.details["reason"] == reason
    assert [g["device"] for g in info.value.details["gpus"]] == ["gpu:0", "gpu:1"]
    refusals = [e for e in events_of(sub) if e.kind == EventKind.REFUSAL]
    assert len(refusals) == 1 and refusals[0].error == "device.unavailable"
    assert m.view("s").state is S.OFFLINE and not m.view("s").resident
    assert m.store.read("s") == before and host.runtime.starts["s"] == 0
    assert plan_json(m.explain_load("s"))["action"] == "refuse"


async def test_a_lost_gpu_is_skipped_for_unpinned_slots(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24])
    host.memory.lost.add(0)
    await host.declare([slot_spec("s", "m")], _models(m=4))
    await host.manager.load("s")
    assert host.gpus_of("s") == (1,)
    lost = next(d for d in host.manager.devices() if d.device == "gpu:0")
    assert lost.error == "lost" and lost.total_bytes is None


async def test_gpus_all_taken_by_pinned_slots_is_refused_with_figures_per_gpu(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path, [24, 24], default_pinned=[])
    slots = [
        slot_spec("p0", "m0", pinned=True),
        slot_spec("p1", "m1", pinned=True),
        slot_spec("new", "mn"),
    ]
    await host.declare(slots, _models(m0=20, m1=20, mn=8))
    await host.manager.load("p0")
    await host.manager.load("p1")
    with pytest.raises(InsufficientMemory) as info:
        await host.manager.load("new")
    figures = info.value.details["gpus"]
    assert [(f["device"], f["free_bytes"], f["evictable_bytes"]) for f in figures] == [
        ("gpu:0", 4 * GIB, 0),
        ("gpu:1", 4 * GIB, 0),
    ]
    assert host.manager.view("new").state is S.OFFLINE


async def test_a_budget_per_gpu(tmp_path: Path) -> None:
    """``gpu = 20`` is each GPU's budget, ``"gpu:1" = 8`` GPU 1's own."""
    host = Host(tmp_path, [24, 24], memory_budget_gb={"gpu": 20, "gpu:1": 8})
    slots = [slot_spec("a", "ma", pinned=True), slot_spec("b", "mb")]
    await host.declare(slots, _models(ma=12, mb=10))
    await host.manager.load("a")
    assert host.gpus_of("a") == (0,)
    with pytest.raises(InsufficientMemory):
        await host.manager.load("b")  # 8 left on gpu:0, budget 8 on gpu:1
    budgets = {d.device: d.budget_bytes for d in host.manager.devices()}
    assert budgets == {"gpu:0": 20 * GIB, "gpu:1": 8 * GIB}


async def test_budget_only_gpus_are_placed_and_made_visible_by_index(tmp_path: Path) -> None:
    """No GPU probe answers, the budgets name two GPUs: placed there, shown by index."""
    host = Host(tmp_path, [], memory_budget_gb={"gpu:0": 8, "gpu:1": 16})
    await host.declare([slot_spec("a", "ma")], _models(ma=12))
    await host.manager.load("a")
    assert host.gpus_of("a") == (1,)
    (gpu,) = host.visible("a")
    assert (gpu.index, gpu.uuid, gpu.vendor) == (1, None, None)


# ----------------------------------------------------------------- property

_SIZES = [8, 12, 16, 24]
_ops = st.lists(
    st.tuples(st.sampled_from(["load", "unload", "restart"]), st.integers(0, 5)),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.sampled_from(_SIZES), min_size=2, max_size=4),
    plan=st.lists(
        st.tuples(
            st.integers(1, 12), st.integers(0, 100), st.sampled_from([1, 1, 1, 2]), st.booleans()
        ),
        min_size=6,
        max_size=6,
    ),
    ops=_ops,
)
def test_no_gpu_over_budget_placement_stable_victims_on_the_loads_gpus(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    plan: list[tuple[int, int, int, bool]],
    ops: list[tuple[str, int]],
) -> None:
    asyncio.run(_run_property(tmp_path_factory.mktemp("gpus"), sizes, plan, ops))


async def _run_property(
    tmp: Path, sizes: list[int], plan: list[tuple[int, int, int, bool]], ops: list[tuple[str, int]]
) -> None:
    host = Host(tmp, [float(s) for s in sizes], default_pinned=[])
    slots, models = [], []
    for i, (gb, priority, span, pin) in enumerate(plan):
        span = min(span, len(sizes))
        device = f"gpu:{i % len(sizes)}" if pin and span == 1 else "gpu"
        extra = {"gpus": span} if span > 1 else {}
        slots.append(slot_spec(f"s{i}", f"m{i}", priority=priority, device=device, **extra))
        models.append(model_spec(f"m{i}", gb))
    await host.declare(slots, models)
    sub = host.manager.events.subscribe()
    for op, index in ops:
        name = f"s{index}"
        if op == "restart":
            before = {s: host.gpus_of(s) for s in host.manager.names() if host.gpus_of(s)}
            await host.manager.close()
            host.manager = host.new_manager()
            await host.declare(slots, models)
            await host.manager.recover()
            sub = host.manager.events.subscribe()
            after = {s: host.gpus_of(s) for s in before}
            assert after == before  # a restart never re-places a running slot
        elif op == "load":
            with_gpus = {s: set(host.gpus_of(s)) for s in host.manager.names()}
            dry = plan_json(host.manager.explain_load(name))
            refused = False
            try:
                await host.manager.load(name)
            except (InsufficientMemory, DeviceUnavailable):
                refused = True
            await settle(host.manager)
            mine = set(host.gpus_of(name))
            evicted = [e.slot for e in events_of(sub) if e.kind == EventKind.EVICTION]
            # the dry run is the action: refused, or on its GPUs evicting its victims
            assert refused == (dry["action"] == "refuse"), (dry, refused)
            if dry["action"] in ("load", "evict-then-load"):
                assert sorted(f"gpu:{i}" for i in mine) == sorted(dry["devices"]), dry
                assert evicted == [v["slot"] for v in dry["evict"]], (dry, evicted)
            for victim in evicted:
                assert with_gpus[victim] & mine, (victim, with_gpus, mine)
        else:
            await host.manager.unload(name, force=True)
        _check_budgets(host, sizes)
    await host.manager.close()


def _check_budgets(host: Host, sizes: list[int]) -> None:
    m = host.manager
    for i, size in enumerate(sizes):
        assert m.admitted_bytes(f"gpu:{i}") <= size * GIB, (i, m.views())
    for view in m.views():
        assert bool(view.gpus) == (view.state in ADMITTED_STATES), view
        spec = m.known(view.name)
        if view.gpus and spec is not None:
            assert len(view.gpus) == spec.gpu_count
            if spec.device_ref.pins:
                assert [str(i) for i in view.gpus] == list(spec.device_ref.pins)


async def test_an_autoload_slot_pinned_to_a_lost_gpu_waits_said_once_and_loads_when_it_is_back(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path, [24, 24])
    host.memory.lost.add(1)
    await host.declare([slot_spec("p", "m", device="gpu:1", autoload=True)], _models(m=4))
    m = host.manager
    sub = m.events.subscribe()
    outcomes = await m.restore()
    assert outcomes == {"p": "device.unavailable"}
    for _ in range(3):  # the reconciler's retries: quiet
        with pytest.raises(DeviceUnavailable):
            await m.load("p", resident=False, background=True)
    refusals = [e for e in events_of(sub) if e.kind == EventKind.REFUSAL]
    assert len(refusals) == 1 and refusals[0].error == "device.unavailable"
    view = m.view("p")
    assert view.waiting == "waiting_for_device" and view.state is S.OFFLINE
    assert view.message.startswith("waiting for its GPU: ") and "cannot be read" in view.message
    assert m.waiting_with_room() == []
    host.memory.lost.clear()  # the card is back (a driver reset)
    assert m.waiting_with_room() == ["p"]
    await m.load("p", resident=False, background=True)
    assert m.view("p").state is S.READY and host.gpus_of("p") == (1,)
    assert m.view("p").waiting is None


async def test_two_small_vllm_slots_on_one_gpu_are_each_told_their_share(tmp_path: Path) -> None:
    """Best fit puts both on GPU 0; vLLM would claim 90 % of it each without being told."""
    host = Host(tmp_path, [24, 24])
    slots = [slot_spec(n, f"m-{n}", provider="vllm") for n in ("a", "b")]
    await host.declare(slots, _models(**{"m-a": 8, "m-b": 8}))
    await host.manager.load("a")
    await host.manager.load("b")
    assert host.gpus_of("a") == host.gpus_of("b") == (0,)
    for name in ("a", "b"):
        launch = host.runtime.objects[name].launch
        assert launch.placed_args == ("--gpu-memory-utilization", "0.333")
        assert launch.run_argv[-2:] == launch.placed_args
        assert "--gpu-memory-utilization" not in launch.argv  # not part of the config hash


async def test_an_adopted_server_without_a_record_is_counted_on_the_first_gpu_that_holds_it(
    tmp_path: Path,
) -> None:
    """Best fit would say GPU 1 (the tighter one); a server of an older controller saw
    every GPU and sits on GPU 0, where it is counted."""
    host = Host(tmp_path, [24, 12])
    await host.declare([slot_spec("a", "ma", device="gpu:0")], _models(ma=10))
    await host.manager.load("a")
    record = host.manager.store.read("a")
    assert record is not None
    host.manager.store.write(
        record.model_copy(update={"extra": record.extra.model_copy(update={"gpus": ()})})
    )
    await host.manager.close()
    host.manager = host.new_manager()
    await host.declare([slot_spec("a", "ma")], _models(ma=10))  # unpinned now
    await host.manager.recover()
    assert host.gpus_of("a") == (0,)


async def test_pins_on_the_kubernetes_runtime_are_refused_before_a_peer_is_unloaded(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path, [24, 24])
    host.runtime.kind = "kubernetes"
    image = {"server": {"image": "slotctl:test"}}
    slots = [slot_spec("peer", "mp", **image), slot_spec("pinned", "mq", device="gpu:1", **image)]
    models = [model_spec("mp", 4, group="x"), model_spec("mq", 4, group="x")]
    await host.manager.set_desired(desired(slots, models))
    m = host.manager
    await m.load("peer")
    assert plan_json(m.explain_load("pinned"))["action"] == "refuse"
    sub = m.events.subscribe()
    with pytest.raises(SlotConfigError, match="device plugin"):
        await m.load("pinned")
    assert m.view("peer").state is S.READY  # the exclusive peer was not swapped out
    refusals = [e for e in events_of(sub) if e.kind == EventKind.REFUSAL]
    assert [e.error for e in refusals] == ["slot.config_error"]


async def test_a_clusters_nodes_have_a_metric_family_of_their_own(tmp_path: Path) -> None:
    """On the kubernetes runtime the admission keys are NODE/gpu:N: each node's series carry
    its name (one `device="gpu"` series per node would repeat the same labels)."""
    from lightkube.models.core_v1 import NodeCondition, NodeStatus
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Node
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from controller.api.app import ApiContext
    from controller.api.metrics import Metrics
    from controller.runtime.kubernetes.nodes import NodeMemory

    gfd = {"nvidia.com/gpu.memory": "24576", "nvidia.com/gpu.count": "1"}
    nodes = NodeMemory(
        {
            name: Node(
                metadata=ObjectMeta(name=name, labels=gfd),
                status=NodeStatus(
                    allocatable={"nvidia.com/gpu": "1"},
                    conditions=[NodeCondition(type="Ready", status="True")],
                ),
            )
            for name in ("node-a", "node-b")
        }
    )
    host = Host(tmp_path, [])
    host.runtime.kind = "kubernetes"
    host.memory = nodes  # type: ignore[assignment]
    host.manager = host.new_manager()
    image = {"server": {"image": "slotctl:test"}}
    slots = [slot_spec(n, f"m-{n}", node=f"node-{n}", **image) for n in ("a", "b")]
    await host.declare(slots, _models(**{"m-a": 4, "m-b": 6}))
    await host.manager.load("a")
    await host.manager.load("b")
    ctx = ApiContext(
        manager=host.manager,
        reconciler=None,
        config_dir=tmp_path,
        state_dir=tmp_path,
        token="t",
        events=host.manager.events,
    )
    text = generate_latest(Metrics(ctx).registry).decode()
    seen: list[tuple[str, frozenset[tuple[str, str]]]] = []
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset(sample.labels.items())
            seen.append((sample.name, labels))
            values[(sample.name, labels)] = sample.value
    assert len(seen) == len(set(seen))  # no series twice
    key = (
        "slotctl_node_memory_bytes",
        frozenset({("node", "node-b"), ("device", "gpu:0"), ("kind", "admitted")}),  # per GPU
    )
    assert values[key] == 6 * GIB
