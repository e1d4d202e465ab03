"""Operator latency: a CR edit -> the Slot's status updated, against KMock's emulator.

An in-process :class:`~controller.operator.run.Operator` (kopf + the controller core,
process runtime, one demo server) serves one ``Slot``; the benchmark edits its
``priority`` (applied in place, nothing restarts) ``--edits`` times, each time measuring
from the PATCH until a GET shows ``status.observedGeneration`` at the new generation
(polled every 2 ms). The floor next to it: a PATCH plus a GET of the same object on the
same emulator (what any client pays), and the ratio between the two.

Prints a table; never fails on timing.

    python bench/k8s_operator.py [--edits 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kmock
import kmock._internal.parsing as kmock_parsing

from controller.daemon.main import stop_everything
from controller.operator.run import Operator, OperatorOptions
from tests.integration.helpers import free_port
from tests.k8s import conftest as k8s

kmock_parsing.parse_path = k8s._parse_path  # KMock 0.8's /api/v1/namespaces (see tests)


async def _wait(check: Any, timeout: float = 30.0) -> Any:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.002)
    raise TimeoutError("the operator did not answer in time")


async def run(edits: int) -> dict[str, list[float]]:
    import aiohttp

    out: dict[str, list[float]] = {"status": [], "floor": []}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        async with k8s.Emulator() as emulator, kmock.Server(emulator) as server:
            k8s.declare(emulator)
            url = str(server.url).rstrip("/")
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(
                '{"apiVersion": "v1", "kind": "Config", "current-context": "k",'
                f' "clusters": [{{"name": "k", "cluster": {{"server": "{url}"}}}}],'
                ' "users": [{"name": "u", "user": {"token": "t"}}],'
                ' "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}]}'
            )
            os.environ["KUBECONFIG"] = str(kubeconfig)
            session = aiohttp.ClientSession(base_url=url, headers={"User-Agent": k8s.TEST_AGENT})
            cluster = k8s.Cluster(emulator, url, kubeconfig, session)
            op = Operator(OperatorOptions(state_dir=state, namespaces=["default"], quiet=True))
            task = asyncio.create_task(op.run())
            try:
                await cluster.create(
                    {
                        "apiVersion": "slotctl.io/v1alpha1",
                        "kind": "Model",
                        "metadata": {"name": "m"},
                        "spec": {"source": "demo://m"},
                    }
                )
                await cluster.create(
                    {
                        "apiVersion": "slotctl.io/v1alpha1",
                        "kind": "Slot",
                        "metadata": {"name": "chat"},
                        "spec": {
                            "provider": "demo",
                            "model": {"default": "m"},
                            "device": "cpu",
                            "port": free_port(),
                            "server": {"extra_args": ["--load-seconds", "0.1"]},
                        },
                    }
                )

                async def observed(generation: int) -> bool:
                    obj = await cluster.get("slots", "chat") or {}
                    status = obj.get("status") or {}
                    return status.get("state") == "ready" and (
                        status.get("observedGeneration") == generation
                    )

                await _wait(lambda: observed(1))
                for i in range(edits):
                    started = time.perf_counter()
                    await cluster.edit("slots", "chat", {"priority": 10 + i % 80})
                    await _wait(lambda i=i: observed(i + 2))
                    out["status"].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await cluster.edit("models", "m", {"memory_gb": 0.0})
                    await cluster.get("models", "m")
                    out["floor"].append(time.perf_counter() - started)
                    await asyncio.sleep(0.05)
            finally:
                op.kopf_stop.set()
                op.controller.stop.set()
                await task
                await session.close()
                await stop_everything(state / "config", state, "process", lambda _: None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edits", type=int, default=20)
    args = parser.parse_args()
    results = asyncio.run(run(args.edits))
    ms = {k: sorted(v) for k, v in results.items()}
    p50 = {k: statistics.median(v) * 1000 for k, v in ms.items()}
    print(f"# bench/k8s_operator.py  {platform.python_version()}  {os.cpu_count()} cores")
    print(f"{'measurement':<58} {'p50':>9} {'max':>9}")
    print(
        f"{'Slot priority edit -> status.observedGeneration updated':<58} "
        f"{p50['status']:>7.1f}ms {ms['status'][-1] * 1000:>7.1f}ms"
    )
    print(
        f"{'floor: PATCH + GET on the same emulator':<58} "
        f"{p50['floor']:>7.1f}ms {ms['floor'][-1] * 1000:>7.1f}ms"
    )
    print(f"ratio (p50): x{p50['status'] / p50['floor']:.1f} the floor")


if __name__ == "__main__":
    main()
