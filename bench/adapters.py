"""LoRA adapters inside a slot (issue 37): what switching between loaded adapters costs,
and a randomized soak that checks no request is answered by the wrong weights.

The real SlotManager over the process runtime, one demo server (vLLM's adapter API: the
demo's documented-contract double, ``--max-loras``), the API server with its data plane
in front; requests over TCP.

1. **switching**: two adapters resident; requests alternate base, ``a1``, ``a2`` (one at a
   time). Side by side, p50/p95 of a base request and of an adapter request, and the
   adapter loads made meanwhile (0: switching between resident adapters reloads nothing).
2. **soak**: ``--soak`` requests over 4 adapters in a slot holding 2 (so loads and
   evictions happen), ``--concurrency`` at once, by id or ``base:id`` at random, while a
   side task unloads and loads adapters at random. Each answer names the adapter whose
   weights made it (the demo server's ``[id]`` mark): a wrong one is counted (must be 0);
   a 503 ``adapter.unavailable`` (every place in use) is counted as refused, never wrong.

Prints figures; never fails on timing.

    python bench/adapters.py [--requests 200] [--soak 1000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.api.app import ApiContext
from controller.api.server import ApiServer
from controller.model.errors import SlotctlError
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import AdapterSpec, ControllerSettings, ModelSpec, SlotSpec
from tests.integration.helpers import free_ports

TOKEN = "bench-adapters"
ADAPTERS = ("a1", "a2", "a3", "a4")


@dataclass
class Figures:
    base: list[float] = field(default_factory=list)
    adapter: list[float] = field(default_factory=list)
    switch_loads: int = 0
    soak: int = 0
    answered: int = 0
    wrong: int = 0
    refused: int = 0
    other: int = 0
    others: dict[str, int] = field(default_factory=dict)  # "status code: message" -> count
    soak_loads: int = 0
    soak_evictions: int = 0
    side_ops: int = 0
    soak_s: float = 0.0


def _state(tmp: Path, settings: ControllerSettings, capacity: int) -> DesiredState:
    (port,) = free_ports(1)
    spec = SlotSpec.model_validate(
        {
            "name": "lora",
            "provider": "demo",
            "port": port,
            "device": "gpu",
            "model": {"default": "base"},
            "autoload": False,
            "max_loras": capacity,
            "server": {"extra_args": ["--tokens-per-second", "0", "--lora-load-seconds", "0.02"]},
        }
    )
    slots = {"lora": DesiredSlot(spec=normalise(spec, settings), stack="bench")}
    models = {"base": ModelSpec(id="base", source="demo://base", memory_gb=1.0)}
    return DesiredState(stacks=("bench",), models=models, slots=slots)


def _adapters(tmp: Path) -> dict[str, AdapterSpec]:
    out = {}
    for name in ADAPTERS:
        path = tmp / f"{name}.safetensors"
        path.write_bytes(b"lora")
        out[name] = AdapterSpec(id=name, base="base", source=str(path), rank=8)
    return out


async def _ask(session: aiohttp.ClientSession, url: str, model: str) -> tuple[float, int, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    began = time.perf_counter()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with session.post(url, json=body, headers=headers) as answer:
        data = await answer.json()
        return (time.perf_counter() - began) * 1000, answer.status, data


def _mark(data: dict) -> str:
    text = str(data["choices"][0]["message"]["content"])
    return text[1 : text.index("]")] if text.startswith("[") and "]" in text else ""


async def _switching(
    manager: SlotManager, url: str, args: argparse.Namespace, fig: Figures
) -> None:
    async with aiohttp.ClientSession() as session:
        for name in ("a1", "a2"):
            await manager.lora.load("lora", name)
        for _ in range(20):  # warm-up: connections, caches
            for model in ("base", "a1", "a2"):
                await _ask(session, url, model)
        loads = manager.lora.loads
        for i in range(args.requests):
            ms, status, data = await _ask(session, url, "base")
            assert status == 200 and not _mark(data), data
            fig.base.append(ms)
            name = ("a1", "a2")[i % 2]
            ms, status, data = await _ask(session, url, name)
            assert status == 200 and _mark(data) == name, data
            fig.adapter.append(ms)
        fig.switch_loads = manager.lora.loads - loads


async def _soak(manager: SlotManager, url: str, args: argparse.Namespace, fig: Figures) -> None:
    rng = random.Random(args.seed)
    loads, evictions = manager.lora.loads, manager.lora.evictions
    queue: asyncio.Queue[str] = asyncio.Queue()
    for _ in range(args.soak):
        name = rng.choice(ADAPTERS)
        queue.put_nowait(name if rng.random() < 0.5 else f"base:{name}")
    done = asyncio.Event()

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            asked = queue.get_nowait()
            _, status, data = await _ask(session, url, asked)
            fig.soak += 1
            want = asked.rpartition(":")[2]
            if status == 200:
                fig.answered += 1
                # the server's own answer: the weights' mark and the model it says it ran
                fig.wrong += _mark(data) != want or data.get("model") != want
            elif status == 503 and data["error"]["code"] == "adapter.unavailable":
                fig.refused += 1
            else:
                fig.other += 1
                error = data.get("error") or {}
                said = f"{status} {error.get('code')}: {str(error.get('message'))[:120]}"
                fig.others[said] = fig.others.get(said, 0) + 1

    async def side() -> None:  # concurrent explicit unloads and loads
        while not done.is_set():
            name = rng.choice(ADAPTERS)
            with contextlib.suppress(SlotctlError):
                if rng.random() < 0.5:
                    await manager.lora.unload("lora", name, timeout_s=5)
                else:
                    await manager.lora.load("lora", name)
                fig.side_ops += 1
            await asyncio.sleep(0.01)

    began = time.perf_counter()
    side_task = asyncio.create_task(side())
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    done.set()
    await side_task
    fig.soak_s = time.perf_counter() - began
    fig.soak_loads = manager.lora.loads - loads
    fig.soak_evictions = manager.lora.evictions - evictions


async def run(args: argparse.Namespace) -> Figures:
    settings = ControllerSettings(memory_budget_gb={"gpu": 8.0}, safety_margin_gb=0)
    fig = Figures()
    with tempfile.TemporaryDirectory(prefix="slotctl-bench-adapters-") as tmp_name:
        tmp = Path(tmp_name)
        state_dir, config_dir = tmp / "state", tmp / "config"
        manager = SlotManager(
            runtime=ProcessRuntime(state_dir, kill_grace_s=5.0),
            state_dir=state_dir,
            config_dir=config_dir,
            settings=settings,
            prober=HttpProber(timeout_s=5.0),
            memory=FakeMemoryProbe({}),
            config=ManagerConfig(stop_timeout_s=5.0),
        )
        await manager.set_desired(_state(tmp, settings, capacity=2))
        manager.set_adapters(_adapters(tmp))
        stop = asyncio.Event()
        runner = asyncio.create_task(manager.run(stop))
        ctx = ApiContext(
            manager=manager,
            reconciler=None,
            config_dir=config_dir,
            state_dir=state_dir,
            token=TOKEN,
            events=manager.events,
        )
        ctx.ready.set()
        server = ApiServer(ctx, "127.0.0.1", 0)
        url = f"http://{await server.start()}/v1/chat/completions"
        try:
            await manager.load("lora")
            await _switching(manager, url, args, fig)
            await _soak(manager, url, args, fig)
        finally:
            await server.stop()
            stop.set()
            await runner
            await manager.stop_all(reason="bench done")
            await manager.close()
    return fig


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(fig: Figures, args: argparse.Namespace) -> None:
    base, adapter = statistics.median(fig.base), statistics.median(fig.adapter)
    print(f"switching between two resident adapters, {args.requests} requests each (one at a time)")
    print(f"{'request':<30}{'p50 ms':>10}{'p95 ms':>10}{'vs base':>10}")
    print(f"{'base model':<30}{base:>10.2f}{_pct(fig.base, 0.95):>10.2f}{1:>9.2f}x")
    print(
        f"{'adapter (a1, a2 alternating)':<30}{adapter:>10.2f}"
        f"{_pct(fig.adapter, 0.95):>10.2f}{adapter / base:>9.2f}x"
    )
    print(f"adapter loads while switching: {fig.switch_loads}")
    print(
        f"soak: {fig.soak} requests over {len(ADAPTERS)} adapters (2 places), "
        f"{args.concurrency} at once, {fig.side_ops} concurrent loads/unloads, "
        f"{fig.soak_s:.1f} s: {fig.answered} answered, {fig.wrong} by the wrong adapter, "
        f"{fig.refused} refused (503 adapter.unavailable), {fig.other} other; "
        f"{fig.soak_loads} loads, {fig.soak_evictions} evictions"
    )
    for said, count in sorted(fig.others.items()):
        print(f"  other: {count} x {said}")


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    out.add_argument("--requests", type=int, default=200)
    out.add_argument("--soak", type=int, default=1000)
    out.add_argument("--concurrency", type=int, default=8)
    out.add_argument("--seed", type=int, default=37)
    return out


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=logging.WARNING)
    report(asyncio.run(run(args)), args)


if __name__ == "__main__":
    main()
