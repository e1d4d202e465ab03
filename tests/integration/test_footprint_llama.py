"""Footprints against real servers (issue 36): the estimate of a generated GGUF against
what the real llama-cpp-python server holds on CPU, learnt by the manager; NVML's
per-process figures (a fake pynvml module) learnt for a GPU slot, a declared figure below
them warned about once.

The estimate's accuracy over the whole panel is ``bench/footprint_estimate.py``'s; here a
generous band (±25 %) catches a broken part (a missing KV cache, weights counted twice),
never a percent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import psutil
import pytest

from controller.model.sizes import GIB
from controller.model.weights import GgufModel
from controller.modelfiles.headers import read_model
from controller.probes.memory import FakeMemoryProbe, NvmlProbe, SystemMemoryProbe
from controller.probes.usage import ProcessUsage
from controller.runtime.process.runtime import ProcessRuntime
from controller.scheduling.footprint import estimate_gguf, launch_facts
from controller.slots.manager import SlotManager
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.integration.helpers import free_port
from tests.integration.llama_fixtures import require_llama_server
from tests.integration.panel_gguf import PANEL, write_llama

DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_llama_server()
    return write_llama(tmp_path_factory.mktemp("panel") / "s.gguf", PANEL[0])


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[ProcessRuntime]:
    rt = ProcessRuntime(tmp_path / "state", kill_grace_s=5.0)
    yield rt
    for observed in await rt.list_managed():
        await rt.stop(observed.slot, timeout=5.0)


def _manager(rt: ProcessRuntime, tmp: Path, **kw: Any) -> SlotManager:
    kw.setdefault("memory", FakeMemoryProbe({"cpu": 64 * GIB, "gpu": 80 * GIB}))
    return SlotManager(runtime=rt, state_dir=tmp / "state", config_dir=tmp / "config", **kw)


def _desired(slot: dict[str, Any], model: ModelSpec) -> DesiredState:
    spec = normalise(SlotSpec.model_validate(slot), ControllerSettings())
    return DesiredState(
        stacks=("t",),
        models={model.id: model},
        slots={spec.name: DesiredSlot(spec=spec, stack="t")},
    )


async def _prompt(endpoint: str, tokens: int) -> None:
    """One completion whose prompt fills ``tokens`` (a byte-level vocabulary: one per
    character), so the compute buffer is used as a long prompt uses it."""
    body = {"prompt": "a" * tokens, "max_tokens": 1, "temperature": 0}
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(endpoint + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_a_cpu_slot_is_estimated_then_learnt_from_what_ran(
    runtime: ProcessRuntime, small: Path, tmp_path: Path
) -> None:
    context = 1024
    manager = _manager(runtime, tmp_path)
    model = ModelSpec(id="tiny", source=str(small), context_length=context)
    slot = {
        "name": "lcp",
        "provider": "llama-cpp-python",
        "device": "cpu",
        "port": free_port(),
        "model": {"default": "tiny"},
    }
    await manager.set_desired(_desired(slot, model))
    try:
        plan = await manager.explain("lcp")
        assert plan.footprint is not None and plan.footprint.basis == "estimated"
        estimated = plan.footprint.estimated_bytes
        assert estimated is not None
        await manager.load("lcp", resident=False)
        record = manager.core.table.get("lcp")
        assert record.seen is not None and record.seen.source == "rss"  # at ready
        launch = record.launch
        assert launch is not None
        await _prompt(launch.endpoint, context - 24)
        await manager.loading.sizing.observe(record)  # what the liveness cadence does
        seen = record.seen.device_bytes
        assert 0.75 <= seen / estimated <= 1.25, (seen, estimated)
        [fp] = await manager.footprints("tiny")
        assert fp.observed_bytes == seen and fp.admitted_bytes == max(seen, estimated)
        assert fp.basis == ("observed" if seen > estimated else "estimated")
    finally:
        await manager.unload("lcp")
        await manager.close()
    saved = manager.store.read("lcp")
    assert saved is not None and saved.extra.seen is not None  # kept across restarts


@pytest.mark.parametrize("context", [512, 2048])
async def test_the_estimate_meets_the_real_servers_peak(
    runtime: ProcessRuntime, small: Path, context: int
) -> None:
    from controller.providers.base import BuildContext
    from controller.providers.launch import build_launch

    spec = SlotSpec.model_validate(
        {
            "name": f"lcp-{context}",
            "provider": "llama-cpp-python",
            "device": "cpu",
            "port": free_port(),
            "model": {"default": "tiny"},
        }
    )
    model = ModelSpec(id="tiny", source=str(small), context_length=context)
    launch = build_launch(spec, model, BuildContext(runtime="process"))
    read = read_model(small)
    assert isinstance(read, GgufModel)
    estimate = estimate_gguf(read, launch_facts("llama-cpp-python", "cpu", launch.argv))
    observed = await runtime.start(launch)
    deadline = time.monotonic() + DEADLINE_S
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(launch.endpoint + "/v1/models") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, await runtime.logs(launch.slot)
            await asyncio.sleep(0.2)
    await _prompt(launch.endpoint, context - 24)
    assert observed.ident is not None
    usage = ProcessUsage().measure(int(observed.ident), "cpu")
    assert usage is not None
    assert 0.75 <= usage.host_bytes / estimate.device <= 1.25, (usage, estimate)


class NvmlOfChildren:
    """A fake pynvml: one 80 GiB GPU whose compute processes are this test's children,
    each using ``used`` bytes (what NVML's per-process figure says of a real server)."""

    def __init__(self, used: int) -> None:
        self.used = used

    def nvmlInit(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=80 * GIB, free=70 * GIB, used=10 * GIB)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return "GPU-fake-0"

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA Fake"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        children = psutil.Process().children(recursive=True)
        return [SimpleNamespace(pid=c.pid, usedGpuMemory=self.used) for c in children]


async def test_a_gpu_slot_learns_nvmls_per_process_figure_and_warns_once(
    runtime: ProcessRuntime, tmp_path: Path
) -> None:
    nvml = NvmlProbe(NvmlOfChildren(3 * GIB))
    memory = SystemMemoryProbe(nvml=nvml)
    manager = _manager(runtime, tmp_path, memory=memory)
    model = ModelSpec(id="demo-m", source="demo://demo-m", memory_gb=1.0)
    slot = {
        "name": "gpu-demo",
        "provider": "demo",
        "device": "gpu",
        "port": free_port(),
        "model": {"default": "demo-m"},
    }
    await manager.set_desired(_desired(slot, model))
    sub = manager.events.subscribe()
    try:
        await manager.load("gpu-demo", resident=False)
        record = manager.core.table.get("gpu-demo")
        assert record.seen is not None and record.seen.source == "nvml"
        assert record.seen.device_bytes == 3 * GIB
        fp = record.footprint
        assert fp.basis == "declared" and fp.bytes == GIB and fp.warning is not None
        await manager.loading.sizing.observe(record)  # seen again: said once
        events = []
        while (event := sub.get_nowait()) is not None:
            events.append(event)
        warnings = [e for e in events if e.kind == "admission" and "seen using" in e.message]
        assert len(warnings) == 1 and "1.00 GiB" in warnings[0].message
        assert "3.00 GiB" in warnings[0].message
    finally:
        sub.close()
        await manager.unload("gpu-demo")
        await manager.close()
