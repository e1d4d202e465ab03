"""Alias requests that prefer what is warm, against fixed models (issue 25, item 3).

The real SlotManager over the process runtime, two demo servers (``big`` loading in
``--load-seconds``, default 2, and ``small``), the API server with its data plane in front;
requests go over TCP, one at a time, each a tiny chat completion. The alias ``chat`` names
``big`` then ``small`` with ``prefer = "warm"``; ``small`` is loaded, ``big`` is not. Side
by side, the time a request takes through the router:

* **alias, warm**: a request for ``chat``: the router resolves it to ``small`` (resident)
  and rewrites the body's ``model``;
* **fixed, warm**: a request for ``small`` itself (the baseline of a warm request);
* **fixed, cold**: a request for ``big``, which waits for its cold load (``big`` unloaded
  again after each request): what ``chat`` would cost if it always meant its first member.

Prints p50/p95 and the ratios; never fails on timing.

    python bench/aliases.py [--requests 200] [--cold 3] [--load-seconds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.api.app import ApiContext
from controller.api.server import ApiServer
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import AliasSpec, ControllerSettings, ModelSpec, SlotSpec
from tests.integration.helpers import free_ports

TOKEN = "bench-aliases"


def _state(load_s: float, settings: ControllerSettings) -> DesiredState:
    slots, models = {}, {}
    for (name, gb, args), port in zip(
        [("big", 3.0, ["--load-seconds", f"{load_s:g}"]), ("small", 1.0, [])],
        free_ports(2),
        strict=True,
    ):
        models[name] = ModelSpec(id=name, source=f"demo://{name}", memory_gb=gb)
        spec = SlotSpec.model_validate(
            {
                "name": f"s-{name}",
                "provider": "demo",
                "port": port,
                "device": "gpu",
                "model": {"default": name},
                "autoload": False,
                "pinned": False,
                "server": {"extra_args": ["--tokens-per-second", "0", *args]},
            }
        )
        slots[spec.name] = DesiredSlot(spec=normalise(spec, settings), stack="bench")
    return DesiredState(stacks=("bench",), models=models, slots=slots)


async def _one(session: aiohttp.ClientSession, url: str, model: str) -> tuple[float, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    began = time.perf_counter()
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as answer:
        data = await answer.json()
        assert answer.status == 200, data
    return (time.perf_counter() - began) * 1000, str(data["model"])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(args: argparse.Namespace) -> None:
    settings = ControllerSettings(memory_budget_gb={"gpu": 8.0}, safety_margin_gb=0)
    with tempfile.TemporaryDirectory(prefix="slotctl-bench-aliases-") as tmp:
        state_dir, config_dir = Path(tmp) / "state", Path(tmp) / "config"
        manager = SlotManager(
            runtime=ProcessRuntime(state_dir, kill_grace_s=5.0),
            state_dir=state_dir,
            config_dir=config_dir,
            settings=settings,
            prober=HttpProber(timeout_s=5.0),
            memory=FakeMemoryProbe({}),
            config=ManagerConfig(stop_timeout_s=5.0),
        )
        await manager.set_desired(_state(args.load_seconds, settings))
        manager.set_aliases({"chat": AliasSpec(id="chat", models=["big", "small"], prefer="warm")})
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
        figures: dict[str, list[float]] = {"alias": [], "warm": [], "cold": []}
        try:
            await manager.load("s-small")
            async with aiohttp.ClientSession() as session:
                for _ in range(20):  # warm-up: connections, caches
                    await _one(session, url, "chat")
                    await _one(session, url, "small")
                for _ in range(args.requests):  # interleaved: like against like
                    ms, served = await _one(session, url, "chat")
                    assert served == "small", served
                    figures["alias"].append(ms)
                    figures["warm"].append((await _one(session, url, "small"))[0])
                for _ in range(args.cold):
                    figures["cold"].append((await _one(session, url, "big"))[0])
                    await manager.unload("s-big")
        finally:
            await server.stop()
            stop.set()
            await runner
            await manager.stop_all(reason="bench done")
            await manager.close()
    _report(figures, args)


def _report(figures: dict[str, list[float]], args: argparse.Namespace) -> None:
    p50 = {k: statistics.median(v) for k, v in figures.items()}
    print(
        f"alias requests through the router (data plane), {args.requests} warm requests "
        f"each, {args.cold} cold; big loads in {args.load_seconds:g} s"
    )
    print(f"{'request':<34}{'p50 ms':>10}{'p95 ms':>10}{'vs alias':>10}")
    rows = [
        ("alias chat (warm: small resident)", "alias"),
        ("fixed small (warm)", "warm"),
        ("fixed big (cold load)", "cold"),
    ]
    for label, key in rows:
        ratio = p50[key] / p50["alias"]
        print(f"{label:<34}{p50[key]:>10.2f}{_pct(figures[key], 0.95):>10.2f}{ratio:>9.2f}x")
    print(
        f"alias/warm fixed: {p50['alias'] / p50['warm']:.2f}x; "
        f"cold fixed/alias: {p50['cold'] / p50['alias']:,.0f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--load-seconds", type=float, default=2.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
