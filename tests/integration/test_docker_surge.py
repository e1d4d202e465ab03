"""The docker runtime's surge capability against a real engine (the demo server in the
test image): a second container beside the slot's, promoted by renames, the old one
stopped; every step idempotent; only our containers touched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.runtime.base import LaunchSpec, RunStatus
from controller.runtime.docker.runtime import DockerRuntime, container_name
from controller.runtime.docker.surge import RETIRING_SUFFIX, SURGE_SUFFIX
from controller.runtime.surging import cannot_surge, surge_of
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.integration import test_docker_runtime as base
from tests.integration.test_docker_runtime import complete, models_listed, wait_listed

pytestmark = pytest.mark.docker

# The docker runtime tests' fixtures (a runtime on the test engine, a demo launch).
make_runtime = base.make_runtime
runtime = base.runtime
launch_for = base.launch_for


async def test_a_second_container_is_promoted_and_the_old_one_stopped(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    assert cannot_surge(runtime) is None
    surge = surge_of(runtime)
    assert surge is not None
    old = launch_for("sg")
    slot = old.slot
    await runtime.start(old)
    await wait_listed(old.endpoint)
    new = launch_for("sg", "--load-seconds", "0.3")  # the same slot, another port
    assert new.slot == slot and new.port != old.port
    started = await surge.start_instance(new)
    assert started.running and started.config_hash == new.config_hash()
    assert (await surge.start_instance(new)).ident == started.ident  # adopted, not twice
    await wait_listed(new.endpoint)
    assert (await runtime.inspect(slot)).config_hash == old.config_hash()  # still the old
    await surge.promote(slot)
    await surge.promote(slot)  # idempotent: nothing left to promote
    names = {c.name for c in runtime.docker.client().containers.list(all=True)}
    assert container_name(slot) + RETIRING_SUFFIX in names
    assert container_name(slot) + SURGE_SUFFIX not in names
    main = await runtime.inspect(slot)
    assert main.running and main.config_hash == new.config_hash()
    assert await complete(old.endpoint) == 200  # the old one serves until it is stopped
    await surge.stop_retiring(slot, timeout=5)
    assert await models_listed(old.endpoint) is None
    assert await complete(new.endpoint) == 200
    managed = [o for o in await runtime.list_managed() if o.slot == slot]
    assert [o.config_hash for o in managed] == [new.config_hash()]
    await runtime.stop(slot, timeout=5)


async def test_a_failed_second_container_is_removed_and_the_slot_kept(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    surge = surge_of(runtime)
    assert surge is not None
    old = launch_for("sf")
    await runtime.start(old)
    await wait_listed(old.endpoint)
    bad = launch_for("sf", "--fail-on-load")
    await surge.start_instance(bad)
    await surge.stop_instance(bad.slot, timeout=5)
    assert (await surge.inspect_instance(bad.slot)).status is RunStatus.MISSING
    assert (await runtime.inspect(old.slot)).config_hash == old.config_hash()
    assert await complete(old.endpoint) == 200
    await runtime.stop(old.slot, timeout=5)


async def test_the_manager_surges_a_docker_slot(
    runtime: DockerRuntime, docker_stack: str, docker_test_image: str, tmp_path: Path
) -> None:
    """A SlotManager on the docker runtime rolls a changed slot out by surge: one
    container of the new config under the slot's name afterwards, on a new port."""
    settings = ControllerSettings(memory_budget_gb={"cpu": 10.0})

    def spec(*args: str) -> SlotSpec:
        data = {
            "name": f"ms-{docker_stack}",
            "provider": "demo",
            "model": {"default": base.MODEL},
            "device": "cpu",
            "autoload": False,
            "server": {"image": docker_test_image, "extra_args": list(args)},
        }
        return normalise(SlotSpec.model_validate(data), settings)

    models = {base.MODEL: ModelSpec(id=base.MODEL, source="demo://m", memory_gb=1)}
    first = DesiredSlot(spec=spec(), stack=docker_stack)
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp_path / "state",
        config_dir=tmp_path / "config",
        settings=settings,
        prober=HttpProber(timeout_s=5.0),
        memory=FakeMemoryProbe({}),
        config=ManagerConfig(stop_timeout_s=5.0),
    )
    name = first.name
    try:
        await manager.set_desired(DesiredState((docker_stack,), models, {name: first}))
        await manager.load(name, resident=False)
        old_endpoint = manager.endpoint(name)
        want = DesiredSlot(spec=spec("--load-seconds", "0.3"), stack=docker_stack)
        assert manager.rollout_for(want).surge, manager.rollout_for(want)
        manager.upsert(want)
        assert (await manager.roll_out(name, want)).surge
        assert manager.endpoint(name) != old_endpoint
        assert await models_listed(old_endpoint or "") is None  # the old one is gone
        assert await complete(manager.endpoint(name) or "") == 200
        observed = await runtime.inspect(name)
        assert observed.config_hash == manager.launch_hash(want)
        names = {c.name for c in runtime.docker.client().containers.list(all=True)}
        assert {n for n in names if n.startswith(container_name(name))} == {container_name(name)}
    finally:
        await manager.stop_all(reason="test teardown")
        await manager.close()


async def test_a_surge_container_of_a_slot_nobody_declares_is_listed_and_reaped(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec], tmp_path: Path
) -> None:
    """A rollout a restart interrupted, its slot removed meanwhile: the slot's second
    container alone (``-surge``, no ``slotctl-<slot>``) is listed as managed (its own
    server missing), so the reconciler's orphan sweep reaps it; and a ``-retiring`` one."""
    surge = surge_of(runtime)
    assert surge is not None
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp_path / "state",
        config_dir=tmp_path / "config",
        settings=ControllerSettings(memory_budget_gb={"cpu": 10.0}),
        prober=HttpProber(timeout_s=5.0),
        memory=FakeMemoryProbe({}),
        config=ManagerConfig(stop_timeout_s=5.0),
    )
    try:
        lone = launch_for("orph")
        await surge.start_instance(lone)
        listed = {o.slot: o for o in await runtime.list_managed()}
        assert listed[lone.slot].status is RunStatus.MISSING  # not the slot's own server
        assert await manager.reap_orphan(lone.slot)
        assert (await surge.inspect_instance(lone.slot)).status is RunStatus.MISSING
        assert lone.slot not in {o.slot for o in await runtime.list_managed()}

        old = launch_for("orph2")
        await runtime.start(old)
        await surge.start_instance(launch_for("orph2", "--load-seconds", "0.1"))
        await surge.promote(old.slot)  # the old one is -retiring now; then the new one goes
        await runtime.stop(old.slot, timeout=5)
        names = {c.name for c in runtime.docker.client().containers.list(all=True)}
        assert container_name(old.slot) + RETIRING_SUFFIX in names
        assert old.slot in {o.slot for o in await runtime.list_managed()}
        assert await manager.reap_orphan(old.slot)
        names = {c.name for c in runtime.docker.client().containers.list(all=True)}
        assert not {n for n in names if n.startswith(container_name(old.slot))}
    finally:
        await manager.close()
