"""Adapter CRs through the operator against KMock (issue 37): ``kubectl apply`` of an
``Adapter`` reaches the manager's desired state, its status is written like an Alias's
(Ready ``Declared``, or ``Degraded`` with the loader's code), a request for it through the
router is answered by the adapter (the demo server's vLLM adapter API, a real process),
and deleting it removes it. The chart's RBAC is checked against every request sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.operator.run import Operator
from controller.reconcile.apply import apply_to_config
from controller.spec.loader import DesiredState, load_stack_texts
from tests.integration.helpers import free_ports
from tests.k8s.chart import assert_rbac_allows
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.test_operator import (
    adapter,
    condition,
    model,
    ready,
    running_operator,
    slot,
    state,
)

__all__ = ["state"]  # the fixture: every server the operator leaves running is stopped

pytestmark = pytest.mark.timeout(180)
HEADERS = {"Authorization": "Bearer operator-test-token"}


async def _with(cluster: Cluster, name: str, cond: str) -> dict[str, Any] | None:
    obj = await cluster.get("adapters", name)
    return obj if condition(obj, cond).get("status") == "True" else None


async def _true(value: bool) -> bool:
    return value


async def _ask(api: str, name: str) -> tuple[int, dict[str, Any]]:
    request = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{api}/v1/chat/completions", json=request, headers=HEADERS) as r,
    ):
        return r.status, await r.json()


async def test_an_adapter_cr_is_declared_served_and_removed(
    cluster: Cluster, state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, api_port = free_ports(2)
    api = f"127.0.0.1:{api_port}"
    files = tmp_path / "adapters"
    files.mkdir()
    (files / "sql.safetensors").write_bytes(b"lora sql")
    op: Operator
    async with running_operator(cluster, state, monkeypatch, listen=api) as op:
        await cluster.create(model("base"))
        await cluster.create(slot("lora", "base", port, max_loras=2, max_lora_rank=16))
        await eventually(lambda: ready(cluster, "lora"), "the slot Ready")

        # refused with the loader's code: a rank above the slot's max_lora_rank
        await cluster.create(adapter("sql", "base", str(files / "sql.safetensors"), rank=64))
        bad = await eventually(lambda: _with(cluster, "sql", "Degraded"), "Degraded")
        assert bad["status"]["lastError"]["code"] == "adapter.rank_over_limit"
        assert condition(bad, "Ready")["status"] == "False"
        assert "sql" not in op.controller.desired.snapshot.adapters

        # fixed: declared, in the manager's desired state, served through the router
        await cluster.edit("adapters", "sql", {"rank": 8})
        found = await eventually(lambda: _with(cluster, "sql", "Ready"), "the Adapter Ready")
        assert found["status"]["id"] == "sql"
        assert condition(found, "Ready")["reason"] == "Declared"
        assert condition(found, "Degraded")["status"] == "False"
        entry = op.controller.desired.snapshot.adapters["sql"]
        assert entry.stack == "kubernetes" and entry.spec.base == "base" and entry.spec.rank == 8
        status, body = await _ask(api, "sql")  # loaded on demand into the slot
        assert status == 200, body
        assert body["model"] == "sql"
        assert body["choices"][0]["message"]["content"].startswith("[sql]"), body
        status, body = await _ask(api, "base")
        assert status == 200 and "[" not in body["choices"][0]["message"]["content"], body

        # deleted: gone from the desired state, and no longer served
        await cluster.delete("adapters", "sql")
        await eventually(
            lambda: _true("sql" not in op.controller.desired.snapshot.adapters),
            "the adapter gone from the desired state",
        )

        async def refused() -> bool:
            status, _ = await _ask(api, "sql")
            return status == 404

        await eventually(refused, "a request for the deleted adapter refused")
    # the chart grants what the operator sent for Adapters (test_operator.py checks the
    # whole grant against its scenarios exactly)
    used = cluster.operator_requests()
    assert {p for p in used if p[2].startswith("adapters")} == {
        ("list", "slotctl.io", "adapters"),
        ("watch", "slotctl.io", "adapters"),
        ("patch", "slotctl.io", "adapters"),
        ("patch", "slotctl.io", "adapters/status"),
    }, sorted(used)
    assert_rbac_allows(used, namespaces=["default"])


async def test_a_stack_file_taking_an_adapters_id_shows_in_its_status_at_once(
    cluster: Cluster, state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Adapter's verdict moved by the config dir's files, not by any event of its own
    or of a slot: its status follows at once (the timers' resync is out of reach here), as
    it does when the file goes again. Its status used to wait for the resync period."""
    (port,) = free_ports(1)
    files = tmp_path / "adapters"
    files.mkdir()
    (files / "sql.safetensors").write_bytes(b"lora sql")
    source = str(files / "sql.safetensors")
    config = state / "config"
    async with running_operator(cluster, state, monkeypatch, status_resync_s=3600.0) as op:
        await cluster.create(model("base"))
        await cluster.create(slot("lora", "base", port, max_loras=2, max_lora_rank=16))
        await cluster.create(adapter("sql", "base", source))
        await eventually(lambda: _with(cluster, "sql", "Ready"), "the Adapter Ready")

        # (the file's own catalogue entry of the base: the Model resource takes it over)
        text = '[stack]\nname = "files"\n[[model]]\nid = "base"\nsource = "demo://base"\n'
        text += f'[[adapter]]\nid = "sql"\nbase = "base"\nsource = "{source}"\n'
        report = load_stack_texts([("files.toml", text)])
        assert report.state is not None, report.errors
        apply_to_config(report.state, config, prune=True)
        bad = await eventually(lambda: _with(cluster, "sql", "Degraded"), "Degraded", 20)
        assert bad["status"]["lastError"]["code"] == "adapter.duplicate_id"
        assert "stack file" in bad["status"]["lastError"]["message"]
        assert condition(bad, "Ready")["status"] == "False"
        assert op.controller.desired.snapshot.adapters["sql"].stack == "files"

        empty = DesiredState(stacks=("files",), models={}, slots={}, aliases={})
        apply_to_config(empty, config, prune=True)
        again = await eventually(lambda: _with(cluster, "sql", "Ready"), "Ready again", 20)
        assert condition(again, "Degraded")["status"] == "False"
        assert op.controller.desired.snapshot.adapters["sql"].stack == "kubernetes"
