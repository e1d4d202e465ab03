"""A model pulled for its load is estimated once its file is on disk (issue 36): the
load was admitted before the pull with nothing to read, and is admitted again for the
estimate — or fails, its memory short — before its server starts. The real model-files
engine pulls from ``tests/integration/hubserver.py``; the servers are the fake runtime's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from controller.model.errors import InsufficientMemory
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.spec.schema import ModelSpec
from tests.integration.hubserver import HubServer
from tests.integration.panel_gguf import PANEL, write_llama
from tests.integration.test_pull_lifecycle import World, slot

S = SlotState


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


@pytest.fixture(autouse=True)
def long_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 300)


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_llama(tmp_path_factory.mktemp("panel") / "s.gguf", PANEL[0]).read_bytes()


async def test_a_pulled_model_is_estimated_then_admitted_for_it(
    tmp_path: Path, hub: HubServer, gguf_bytes: bytes
) -> None:
    hub.add_repo("org/tiny", {"s.gguf": gguf_bytes})
    world = World(tmp_path, hub)
    try:
        model = ModelSpec(id="tiny", source="hf://org/tiny/s.gguf", context_length=1024)
        await world.declare([model], [slot("chat", "tiny", provider="llamacpp")])
        sub = world.events.subscribe()
        plan = await world.manager.explain("chat")
        assert plan.footprint is not None and plan.footprint.basis == "none"
        assert plan.footprint.why_not is not None and "not on disk" in plan.footprint.why_not
        view = await world.manager.load("chat")
        assert view.state is S.READY and view.memory_basis == "estimated"
        [fp] = await world.manager.footprints("tiny")
        assert fp.source == "gguf" and view.memory_bytes == fp.estimated_bytes > 0
        messages = []
        while (event := sub.get_nowait()) is not None:
            messages.append(event.message)
        assert any("estimated from its pulled files" in m for m in messages), messages
    finally:
        hub.release()
        await world.close()


async def test_a_pulled_model_too_big_for_what_is_left_fails_before_its_server(
    tmp_path: Path, hub: HubServer, gguf_bytes: bytes
) -> None:
    hub.add_repo("org/tiny", {"s.gguf": gguf_bytes})
    world = World(tmp_path, hub)
    # llama-server's host prompt cache alone (--cache-ram, 8 GiB by default) does not fit
    world.manager.core.memory = world.manager.admission.memory = FakeMemoryProbe({"cpu": 4 * GIB})
    try:
        model = ModelSpec(id="tiny", source="hf://org/tiny/s.gguf", context_length=1024)
        await world.declare([model], [slot("chat", "tiny", provider="llamacpp")])
        with pytest.raises(InsufficientMemory):
            await world.manager.load("chat")
        view = world.manager.view("chat")
        assert view.state is S.ERROR and world.runtime.starts.get("chat", 0) == 0
        assert world.states("chat")[:2] == ["pulling", "starting"]
    finally:
        hub.release()
        await world.close()
