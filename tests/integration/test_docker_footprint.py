"""What ran on Docker is learnt (issue 36): the docker runtime measures a server's
container (its memory cgroup's figure as ``docker stats`` computes it, its processes'
host pids from ``docker top``) and the slot manager keeps it as the slot's footprint.

The server is the demo server in the tiny test image with ``--memory-mb 200`` (it
allocates and touches 200 MiB before it reports ready): the figure is checked within a
sane band (the ballast plus a Python interpreter), never to a percent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from controller.model.sizes import MIB
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.runtime.base import LaunchSpec, MeasuresContainers
from controller.runtime.docker.runtime import DockerRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.integration import test_docker_runtime as base
from tests.integration.test_docker_runtime import wait_listed

pytestmark = pytest.mark.docker

# The docker runtime tests' fixtures (a runtime on the test engine, a demo launch).
make_runtime = base.make_runtime
runtime = base.runtime
launch_for = base.launch_for

BALLAST_MB = 200
# The ballast, and at most this much more (the interpreter, the demo server's modules).
SLACK = 150 * MIB


def in_band(figure: int) -> bool:
    return BALLAST_MB * MIB <= figure <= BALLAST_MB * MIB + SLACK


async def test_the_runtime_measures_a_containers_memory_and_pids(
    runtime: DockerRuntime, launch_for: Callable[..., LaunchSpec]
) -> None:
    assert isinstance(runtime, MeasuresContainers)
    launch = launch_for("use", "--memory-mb", str(BALLAST_MB))
    assert await runtime.container_usage(launch.slot) is None  # no container yet
    await runtime.start(launch)
    try:
        await wait_listed(launch.endpoint)  # ready: the ballast is held
        usage = await runtime.container_usage(launch.slot)
        assert usage is not None
        assert in_band(usage.memory_bytes), usage.memory_bytes / MIB
        assert usage.pids  # docker-init and the server, as the host numbers them
        commands = []
        for pid in usage.pids:
            try:
                commands.append(" ".join(psutil.Process(pid).cmdline()))
            except psutil.Error:
                continue
        assert any("controller.demo" in c for c in commands), commands
    finally:
        await runtime.stop(launch.slot, timeout=5)
    assert await runtime.container_usage(launch.slot) is None  # gone: nothing to measure


async def test_the_manager_learns_what_a_container_held(
    runtime: DockerRuntime, docker_stack: str, docker_test_image: str, tmp_path: Path
) -> None:
    settings = ControllerSettings(memory_budget_gb={"cpu": 10.0})
    data = {
        "name": f"fp-{docker_stack}",
        "provider": "demo",
        "model": {"default": base.MODEL},
        "device": "cpu",
        "autoload": False,
        "server": {"image": docker_test_image, "extra_args": ["--memory-mb", str(BALLAST_MB)]},
    }
    spec = normalise(SlotSpec.model_validate(data), settings)
    models = {base.MODEL: ModelSpec(id=base.MODEL, source="demo://m")}
    slot = DesiredSlot(spec=spec, stack=docker_stack)
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp_path / "state",
        config_dir=tmp_path / "config",
        settings=settings,
        prober=HttpProber(timeout_s=5.0),
        memory=FakeMemoryProbe({}),
        config=ManagerConfig(stop_timeout_s=5.0),
    )
    name = slot.name
    try:
        await manager.set_desired(DesiredState((docker_stack,), models, {name: slot}))
        await manager.load(name, resident=False)
        record = manager.core.table.get(name)
        seen = record.seen  # measured at ready
        assert seen is not None and seen.source == "cgroup"
        assert seen.model == base.MODEL
        assert in_band(seen.device_bytes), seen.device_bytes / MIB
        assert seen.host_bytes == seen.device_bytes  # a CPU slot: the device is the host
        await manager.loading.sizing.observe(record)  # what the liveness cadence does
        assert record.seen is not None and record.seen.device_bytes >= seen.device_bytes
        [fp] = await manager.footprints(base.MODEL)
        assert fp.observed_source == "cgroup"
        assert fp.observed_bytes == record.seen.device_bytes
    finally:
        await manager.stop_all(reason="test teardown")
        await manager.close()
    saved = manager.store.read(name)
    assert saved is not None and saved.extra.seen is not None  # kept across restarts
    assert saved.extra.seen.source == "cgroup"
