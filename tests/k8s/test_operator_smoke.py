from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controller.operator.run import Operator, OperatorOptions
from tests.integration.helpers import free_port
from tests.k8s.conftest import Cluster, eventually


async def test_smoke(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    op = Operator(OperatorOptions(state_dir=tmp_path / "state", namespaces=["default"]))
    task = asyncio.create_task(op.run())
    await cluster.create({"apiVersion": "slotctl.io/v1alpha1", "kind": "Model",
                          "metadata": {"name": "m1"}, "spec": {"source": "demo://m1", "memory_gb": 0.05}})
    port = free_port()
    await cluster.create({"apiVersion": "slotctl.io/v1alpha1", "kind": "Slot",
                          "metadata": {"name": "chat"},
                          "spec": {"provider": "demo", "model": {"default": "m1"}, "device": "cpu",
                                   "port": port, "autoload": True,
                                   "server": {"extra_args": ["--load-seconds", "0.2"]}}})
    async def ready():
        obj = await cluster.get("slots", "chat")
        st = (obj or {}).get("status", {})
        pass
        return st.get("state") == "ready"
    try:
        await eventually(ready, "ready", timeout=20, every=0.5)
    finally:
        print(sorted(cluster.operator_requests()))
        print("VERDICTS", op.source.verdicts, op.source.slot_names, op.source._crs)
        import os
        for r, d, f in os.walk(tmp_path / "state" / "config"): print(r, f)
        print((await cluster.get("slots", "chat")))
        op.controller.stop.set()
        op.kopf_stop.set()
        await task
        await op.manager.stop_all() if op.controller.manager else None
