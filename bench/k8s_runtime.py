"""The kubernetes runtime: a Slot edit -> its Deployment updated, against KMock's emulator.

An in-process :class:`~controller.operator.run.Operator` with ``runtime="kubernetes"``
serves one ``Slot`` (a demo server); the test suite's fake kubelet
(``tests/k8s/kubelet.py``) runs its pods as real processes on 127.0.0.N. The benchmark
edits the slot's server arguments (a runtime change) ``--edits`` times, each time
measuring from the PATCH of the ``Slot`` until a GET of ``slotctl-chat`` shows the new
config hash on its pod template (polled every 2 ms), and on until the Slot is ``Ready``
at the new generation (the old pod gone, the new one probed). The floor next to it: a
PATCH plus a GET on the same emulator.

Prints a table; never fails on timing.

    python bench/k8s_runtime.py [--edits 10]
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

import aiohttp
import kmock
import kmock._internal.parsing as kmock_parsing

from controller.operator.run import Operator, OperatorOptions
from tests.integration.helpers import free_port
from tests.k8s import conftest as k8s
from tests.k8s.kubelet import Kubelet, declare_workloads, gpu_node

kmock_parsing.parse_path = k8s._parse_path  # KMock 0.8's /api/v1/namespaces (see tests)
HASH = "slotctl.config-hash"


async def _wait(check: Any, timeout: float = 60.0) -> Any:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.002)
    raise TimeoutError("the operator did not answer in time")


def _slot(port: int, load_s: str) -> dict[str, Any]:
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": "chat"},
        "spec": {
            "provider": "demo",
            "model": {"default": "m"},
            "device": "gpu",
            "port": port,
            "server": {"image": "slotctl:bench", "extra_args": ["--load-seconds", load_s]},
        },
    }


async def run(edits: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"deployment": [], "ready": [], "floor": []}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        async with k8s.Emulator() as emulator, kmock.Server(emulator) as server:
            k8s.declare(emulator)
            declare_workloads(emulator)
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
            logs = Path(tmp) / "pods"
            logs.mkdir()
            kubelet = Kubelet(cluster, logs)
            kubelet.start()
            await kubelet.create(gpu_node("gpu-a", gpus=1, gib_per_gpu=16, replicas=4))
            options = OperatorOptions(
                state_dir=state, runtime="kubernetes", namespaces=["default"], quiet=True
            )
            op = Operator(options)
            task = asyncio.create_task(op.run())
            try:
                await cluster.create(
                    {
                        "apiVersion": "slotctl.io/v1alpha1",
                        "kind": "Model",
                        "metadata": {"name": "m"},
                        "spec": {"source": "demo://m", "memory_gb": 1},
                    }
                )
                port = free_port()
                await cluster.create(_slot(port, "0.05"))

                async def ready(generation: int) -> bool:
                    obj = await cluster.get("slots", "chat") or {}
                    status = obj.get("status") or {}
                    return status.get("state") == "ready" and (
                        status.get("observedGeneration") == generation
                    )

                async def template_hash() -> str | None:
                    dep = await kubelet.get("deployments", "slotctl-chat") or {}
                    meta = ((dep.get("spec") or {}).get("template") or {}).get("metadata") or {}
                    return (meta.get("annotations") or {}).get(HASH)

                await _wait(lambda: ready(1))
                for i in range(edits):
                    before = await template_hash()
                    started = time.perf_counter()
                    spec = _slot(port, f"0.0{6 + i % 2}")["spec"]  # never the current value
                    await cluster.edit("slots", "chat", {"server": spec["server"]})

                    async def changed(before: str | None = before) -> bool:
                        return await template_hash() not in (None, before)

                    await _wait(changed)
                    out["deployment"].append(time.perf_counter() - started)
                    await _wait(lambda i=i: ready(i + 2))
                    out["ready"].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await cluster.edit("models", "m", {"memory_gb": 1})
                    await cluster.get("models", "m")
                    out["floor"].append(time.perf_counter() - started)
            finally:
                op.kopf_stop.set()
                op.controller.stop.set()
                await task
                await kubelet.stop()
                await session.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edits", type=int, default=10)
    args = parser.parse_args()
    results = asyncio.run(run(args.edits))
    ms = {k: sorted(v) for k, v in results.items()}
    p50 = {k: statistics.median(v) * 1000 for k, v in ms.items()}
    print(f"# bench/k8s_runtime.py  {platform.python_version()}  {os.cpu_count()} cores")
    print(f"{'measurement':<58} {'p50':>9} {'max':>9}")
    rows = (
        ("deployment", "Slot server edit -> Deployment template updated"),
        ("ready", "Slot server edit -> Ready again (new pod probed)"),
        ("floor", "floor: PATCH + GET on the same emulator"),
    )
    for key, label in rows:
        print(f"{label:<58} {p50[key]:>7.1f}ms {ms[key][-1] * 1000:>7.1f}ms")
    print(f"ratio (p50): x{p50['deployment'] / p50['floor']:.1f} the floor")


if __name__ == "__main__":
    main()
