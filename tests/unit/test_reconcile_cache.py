"""The reconciler's caches (issue 12, item 3): a no-op pass rebuilds nothing, yet every
change the plan distinguishes is still seen after cached passes.

The manager memoises each slot's launch hash on its record, keyed by the very (immutable)
spec, model and stack objects it was built from; a read of the config dir brings a new
generation of objects, so a changed slot, a changed catalogue model or a new binding is
built again, and an unchanged one is recognised by value and re-keyed. These tests run a
:class:`Reconciler` over a SlotManager on FakeRuntime + FakeClock, with the config dir
written by :func:`controller.reconcile.apply.apply_to_config` (what ``stack apply`` uses).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import controller.slots.core as core_module
from controller.model.lifecycle import SlotState
from controller.providers import launch as providers
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import Reconciler
from controller.runtime.base import LaunchSpec
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.schema import ModelSpec, SlotSpec
from tests.unit.manager_fixtures import Harness, model_spec, settle, slot_spec

S = SlotState
FAST = ManagerConfig(stop_timeout_s=1.0, monitor_interval_s=0.01, tick_interval_s=0.05)


def with_changes(spec: SlotSpec, **changes: Any) -> SlotSpec:
    return SlotSpec.model_validate({**spec.model_dump(mode="json"), **changes})


def state_of(slots: list[SlotSpec], models: list[ModelSpec]) -> DesiredState:
    return DesiredState(
        stacks=("t",),
        models={m.id: m for m in models},
        slots={s.name: DesiredSlot(spec=s, stack="t") for s in slots},
    )


def base() -> tuple[list[SlotSpec], list[ModelSpec]]:
    slots = [
        slot_spec("auto-a", autoload=True),
        slot_spec("auto-b", autoload=True),
        slot_spec("lazy-a", autoload=False),
    ]
    return slots, [model_spec(s.model_id) for s in slots]


class Builds:
    """Counts launch builds by the manager (the real function runs: a spy, not a mock)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = core_module.build_launch

        def counting(slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
            self.count += 1
            return real(slot, model, ctx)

        monkeypatch.setattr(core_module, "build_launch", counting)  # a start's build
        monkeypatch.setattr(providers, "build_launch", counting)  # launch_hash's build


async def converged(tmp: Path) -> tuple[Harness, Reconciler]:
    h = Harness(tmp, config=FAST)
    apply_to_config(state_of(*base()), tmp / "config", prune=True)
    r = Reconciler(h.manager, tmp / "config", resync_s=3600.0)
    assert await r.converge(timeout=10, poll_s=0.01)
    await warm(r)
    return h, r


async def warm(r: Reconciler, passes: int = 3) -> None:
    """Cached no-op passes over every slot: each plans ``noop``, "in sync"."""
    for _ in range(passes):
        for name in r.all_names():
            assert r.plan(name).reason == "in sync", (name, r.plan(name))
            await r.reconcile(name)


def plans(r: Reconciler) -> dict[str, str]:
    return {name: r.plan(name).kind for name in r.all_names()}


# ===================================================================== every kind of change


def _config(slots: list[SlotSpec], models: list[ModelSpec]) -> None:
    slots[0] = with_changes(slots[0], server={"extra_args": ["--load-seconds", "7"]})


def _binding(slots: list[SlotSpec], models: list[ModelSpec]) -> None:
    models.append(model_spec("other-m"))
    slots[0] = with_changes(slots[0], model={"default": "other-m"})


def _catalogue(slots: list[SlotSpec], models: list[ModelSpec]) -> None:
    # The slot's own file stays as it is; only the model it serves changes.
    models[0] = ModelSpec(id=models[0].id, source="demo://elsewhere", memory_gb=1.0)


def _scheduling(slots: list[SlotSpec], models: list[ModelSpec]) -> None:
    slots[0] = with_changes(slots[0], priority=93)


def _removed(slots: list[SlotSpec], models: list[ModelSpec]) -> None:
    del slots[0]


def _added(slots: list[SlotSpec], models: list[ModelSpec]) -> None:
    slots.append(slot_spec("new-c", autoload=True))
    models.append(model_spec(slots[-1].model_id))


CHANGES: dict[str, tuple[Callable[[list[SlotSpec], list[ModelSpec]], None], str, str]] = {
    # change -> (edit, slot, the plan for it)
    "config hash": (_config, "auto-a", "recreate"),
    "model binding": (_binding, "auto-a", "recreate"),
    "catalogue model": (_catalogue, "auto-a", "recreate"),
    "scheduling key": (_scheduling, "auto-a", "update"),
    "removed": (_removed, "auto-a", "delete"),
    "added": (_added, "new-c", "create"),
}


@pytest.mark.parametrize("change", list(CHANGES))
async def test_a_desired_change_is_seen_after_cached_passes(tmp_path: Path, change: str) -> None:
    h, r = await converged(tmp_path)
    edit, slot, kind = CHANGES[change]
    slots, models = base()
    slots = [h.manager.known(s.name) or s for s in slots]  # the ports as applied
    edit(slots, models)
    apply_to_config(state_of(slots, models), tmp_path / "config", prune=True)
    r.refresh()  # a new desired-state generation
    assert plans(r) == {**dict.fromkeys(plans(r), "noop"), slot: kind}
    assert await r.converge(timeout=10, poll_s=0.01)
    await h.manager.close()
    assert set(plans(r).values()) == {"noop"}
    if kind == "recreate":
        view = h.manager.view(slot)
        assert view.state is S.READY
        assert view.config_hash == h.manager.launch_hash(r.snapshot.slots[slot])
        assert h.runtime.starts[slot] == 2
    if kind == "update":
        assert h.manager.view(slot).priority == 93
    if kind == "delete":
        assert slot not in h.manager.names() and slot not in h.runtime.objects
    if kind == "create":
        assert h.manager.view(slot).state is S.READY


async def test_a_crash_is_seen_after_cached_passes(tmp_path: Path) -> None:
    """Runtime state, not desired state: a crashed autoload server plans a reload once its
    backoff ends; the cached hash plays no part in that."""
    h, r = await converged(tmp_path)
    h.runtime.crash("auto-a")
    await h.manager.check_exits()
    assert h.manager.view("auto-a").state is S.ERROR
    assert r.plan("auto-a").reason.startswith("crash-looping: next attempt in")
    h.clock.advance(FAST.breaker_base_s)
    assert r.plan("auto-a").kind == "load"
    await r.reconcile("auto-a")
    await settle(h.manager)
    await h.manager.close()
    assert h.manager.view("auto-a").state is S.READY
    assert plans(r) == dict.fromkeys(plans(r), "noop")


async def test_a_running_server_with_an_older_config_is_recreated(tmp_path: Path) -> None:
    """Observed drift: the server that runs was started with another config (adopted
    after a restart) while the desired spec, and so the memo, stayed the same."""
    h, _ = await converged(tmp_path)
    await h.manager.close()
    slots, models = base()
    old = [h.manager.known(s.name) or s for s in slots]
    edited = [with_changes(old[0], server={"extra_args": ["--load-seconds", "5"]}), *old[1:]]
    apply_to_config(state_of(edited, models), tmp_path / "config", prune=True)
    manager = h.new_manager()  # a restarted controller adopts the old server
    fresh = Reconciler(manager, tmp_path / "config", resync_s=3600.0)
    await manager.set_desired(fresh.snapshot.desired())
    await manager.recover()
    assert fresh.plan("auto-a").kind == "recreate"
    assert await fresh.converge(timeout=10, poll_s=0.01)
    await manager.close()
    assert h.runtime.starts["auto-a"] == 2
    assert manager.view("auto-a").config_hash == manager.launch_hash(fresh.snapshot.slots["auto-a"])


# ===================================================================== the cache itself


async def test_a_no_op_pass_builds_nothing_and_a_new_generation_builds_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h, r = await converged(tmp_path)
    builds = Builds(monkeypatch)
    await warm(r)
    assert builds.count == 0

    # The same files read again: new objects, equal values. Recognised, nothing rebuilt.
    r.refresh()
    await warm(r)
    assert builds.count == 0

    # A new generation in which one catalogue model changed: exactly the slot bound to
    # it is built again (by the plan and the recreate), and planned as a recreate.
    slots, models = base()
    slots = [h.manager.known(s.name) or s for s in slots]
    _catalogue(slots, models)
    apply_to_config(state_of(slots, models), tmp_path / "config", prune=True)
    r.refresh()
    assert plans(r) == {"auto-a": "recreate", "auto-b": "noop", "lazy-a": "noop"}
    assert builds.count == 1
    assert await r.converge(timeout=10, poll_s=0.01)
    await h.manager.close()
    built = builds.count
    await warm(r)
    assert builds.count == built  # cached again


async def test_the_memoised_hash_always_equals_a_fresh_build(tmp_path: Path) -> None:
    """A random walk over spec edits, catalogue edits, re-reads (equal new objects), stack
    moves and swaps: after every step the manager's hashes equal freshly built ones."""
    h = Harness(tmp_path, config=FAST)
    manager = h.manager
    rng = random.Random(12)
    spec = slot_spec("walk", autoload=False)
    catalogue = {m.id: m for m in (model_spec("walk-m"), model_spec("alt-m"))}
    manager.set_models(catalogue)
    stack = "t"

    def fresh(spec: SlotSpec, stack: str, model: ModelSpec | None) -> str:
        ctx = BuildContext(runtime="process", stack=stack, models_dir=manager.core.models_dir)
        return build_launch(spec, model, ctx).config_hash()

    for step in range(300):
        move = rng.choice(["args", "port", "bind", "catalogue", "reread", "stack", "swap", "sched"])
        if move == "args":
            spec = with_changes(spec, server={"extra_args": ["--load-seconds", str(step % 4)]})
        elif move == "port":
            spec = with_changes(spec, port=30000 + step % 3)
        elif move == "bind":
            spec = with_changes(spec, model={"default": rng.choice(["walk-m", "alt-m"])})
        elif move == "catalogue":
            mid = rng.choice(list(catalogue))
            catalogue = {**catalogue, mid: ModelSpec(id=mid, source=f"demo://{mid}/{step % 3}")}
            manager.set_models(catalogue)
        elif move == "reread":
            spec = SlotSpec.model_validate(spec.model_dump())
            catalogue = {k: ModelSpec.model_validate(m.model_dump()) for k, m in catalogue.items()}
            manager.set_models(catalogue)
        elif move == "stack":
            stack = rng.choice(["t", "u"])
        elif move == "swap" and "walk" in manager.names():
            # The API's swap: the new binding as the config dir now declares it.
            spec = with_changes(spec, model={"default": rng.choice(list(catalogue))})
            await manager.swap(DesiredSlot(spec=spec, stack=stack))
            await settle(manager)
        elif move == "sched":
            spec = with_changes(spec, priority=step % 100)
        desired = DesiredSlot(spec=spec, stack=stack)
        want = fresh(spec, stack, catalogue.get(spec.model_id))
        assert manager.launch_hash(desired) == want, (step, move)
        if rng.random() < 0.6:
            manager.upsert(desired)
        record = manager.core.table.records.get("walk")
        if record is not None:
            have = fresh(record.spec, record.stack, record.model)
            assert manager.core.launch_hash(record) == have, (step, move)
    await manager.stop_all()
    await manager.close()


async def test_observe_says_what_the_view_says(tmp_path: Path) -> None:
    """The reconciler's lean observation and the full view agree, whatever the state."""
    h, _ = await converged(tmp_path)
    h.runtime.crash("auto-b")
    await h.manager.check_exits()
    await h.manager.unload("auto-a", pause=True)
    for name in h.manager.names():
        view, status = h.manager.view(name), h.manager.observe(name)
        assert status is not None
        assert (
            status.state,
            status.idle_reason,
            status.config_hash,
            status.message,
            status.retry_after_s,
            status.waiting,
            status.paused,
        ) == (
            view.state,
            view.idle_reason,
            view.config_hash,
            view.message,
            view.retry_after_s,
            view.waiting,
            view.paused,
        ), name
    assert h.manager.observe("nobody") is None
    assert {n: h.manager.view(n).state for n in h.manager.names()} == {
        "auto-a": S.OFFLINE,
        "auto-b": S.ERROR,
        "lazy-a": S.OFFLINE,
    }
    await h.manager.close()


async def test_more_independent_loads_than_sixteen_run_at_once(tmp_path: Path) -> None:
    """A pass that loads holds its worker until the server is ready: the worker pool must
    not be what serialises independent loads (it was 16: fifty loads took four rounds)."""
    h = Harness(tmp_path, config=FAST, gpu_gb=64.0)
    slots = [slot_spec(f"many-{i:02d}", autoload=True) for i in range(40)]
    for spec in slots:
        h.runtime.script(spec.name, load_s=5.0)
    apply_to_config(
        state_of(slots, [model_spec(s.model_id, gb=0.5) for s in slots]),
        tmp_path / "config",
        prune=True,
    )
    r = Reconciler(h.manager, tmp_path / "config", resync_s=3600.0)
    stop = asyncio.Event()
    runner = asyncio.create_task(r.run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while sum(v.state is S.WARMING for v in h.manager.views()) < len(slots):
            assert asyncio.get_running_loop().time() < deadline, {
                v.name: v.state.value for v in h.manager.views()
            }
            await asyncio.sleep(0.005)
        h.clock.advance(5.0)
        while not all(v.state is S.READY for v in h.manager.views()):
            assert asyncio.get_running_loop().time() < deadline + 10
            await asyncio.sleep(0.005)
    finally:
        stop.set()
        await runner
        await h.manager.close()
    assert all(h.runtime.starts[s.name] == 1 for s in slots)


async def test_the_models_dir_is_fixed_when_the_manager_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build context is part of the hash; the memo may keep a hash because the
    context cannot change under it: ``$SLOTCTL_MODELS_DIR`` is read once, at start."""
    monkeypatch.setenv("SLOTCTL_MODELS_DIR", str(tmp_path / "models"))
    h = Harness(tmp_path, config=FAST)
    spec = slot_spec("hf", model="hf-m", provider="llamacpp")
    model = ModelSpec(id="hf-m", source="hf://org/repo/file.gguf")
    h.manager.set_models({"hf-m": model})
    desired = DesiredSlot(spec=spec, stack="t")
    h.manager.upsert(desired)
    ctx = BuildContext(runtime="process", stack="t", models_dir=tmp_path / "models")
    at_start = build_launch(spec, model, ctx)
    assert at_start.model_path == str(tmp_path / "models" / "org/repo/file.gguf")
    assert h.manager.launch_hash(desired) == at_start.config_hash()
    monkeypatch.setenv("SLOTCTL_MODELS_DIR", str(tmp_path / "elsewhere"))
    assert h.manager.core.build_launch(h.manager.core.table.get("hf")) == at_start
    assert h.manager.launch_hash(desired) == at_start.config_hash()
    await h.manager.close()
