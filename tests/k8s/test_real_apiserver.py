"""The CRDs and the operator against a real ``kube-apiserver`` (etcd storage), the
envtest tier (``tests/k8s/realapi.py``): what KMock cannot show.

The real server enforces the CRDs' structural schema, prunes unknown fields, runs the CEL
rules, splits ``status`` into its subresource, bumps ``metadata.generation`` on spec
changes only, refuses writes with a stale ``resourceVersion``, and authorizes with RBAC:
the operator runs as ``slotctl operator`` with a service-account token bound to the
chart's rendered roles, so an end-to-end run is the least-privilege proof, and a request
outside those roles is refused.

Skipped when the binaries are not built (``tools/k8s/build.sh``) unless
``SLOTCTL_K8S_APISERVER=1`` asks for this tier, as ``make test`` does when they are.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller.daemon.main import stop_everything
from tests.integration.helpers import free_ports
from tests.k8s import chart, realapi
from tests.k8s.conftest import eventually
from tests.k8s.realapi import ApiError, ApiServer, Kube
from tests.k8s.test_operator import (
    adapter,
    alias,
    answers,
    condition,
    model,
    server_pid,
    slot,
)

REPO = Path(__file__).resolve().parents[2]
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    bin_dir = realapi.binaries()
    if bin_dir is None:
        message = f"kube-apiserver and etcd are not built in {realapi.cache_dir()}"
        if realapi.requested():
            pytest.fail(f"SLOTCTL_K8S_APISERVER=1 but {message} (run tools/k8s/build.sh)")
        pytest.skip(f"{message}: run tools/k8s/build.sh or set SLOTCTL_K8S_APISERVER=1")
    with realapi.running(tmp_path_factory.mktemp("apiserver"), bin_dir) as server:
        realapi.install_crds(server, REPO / "crds")
        yield server


@pytest.fixture
def namespace(api_server: ApiServer) -> Iterator[str]:
    """A fresh namespace; its custom resources go at the end (no controller-manager here
    deletes a namespace's contents, and a cluster-wide operator would see leftovers)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    realapi.create_namespace(api_server, name)
    yield name
    realapi.delete_all_crs(api_server, name)


@pytest_asyncio.fixture
async def admin(api_server: ApiServer, namespace: str) -> AsyncIterator[Kube]:
    kube = Kube(api_server, api_server.admin_token, namespace)
    try:
        yield kube
    finally:
        await kube.close()


def operator_token(
    server: ApiServer, namespace: str, drop: str = "", cluster_wide: bool = False
) -> str:
    """The chart's ServiceAccount and RBAC (rendered to serve this namespace, or every
    namespace), and a token; ``drop`` leaves out the Role's rules naming that resource."""
    watch = [] if cluster_wide else [namespace]
    docs = chart.render({"watchNamespaces": watch}, namespace=namespace)
    rbac = [d for d in docs if d["kind"] in RBAC_KINDS]
    expected = RBAC_KINDS - {"Role", "RoleBinding"} if cluster_wide else RBAC_KINDS
    assert {d["kind"] for d in rbac} == expected
    for doc in rbac:
        if doc["kind"] == "Role" and drop:
            doc["rules"] = [r for r in doc["rules"] if drop not in r["resources"]]
    realapi.apply(server, rbac)
    return realapi.service_account_token(server, namespace, "slotctl")


async def refused(call: Any, status: int) -> ApiError:
    with pytest.raises(ApiError) as info:
        await call
    assert info.value.status == status, info.value
    return info.value


# ---------------------------------------------------------------------- the CRDs


async def test_structural_schema_refuses_wrong_types(admin: Kube) -> None:
    bad = slot("chat", "m", 8080)
    bad["spec"]["port"] = "eighty"
    err = await refused(admin.create(bad), 422)
    assert "spec.port" in err.body["message"] and "integer" in err.body["message"]
    out_of_range = slot("chat", "m", 70000)
    err = await refused(admin.create(out_of_range), 422)
    assert "spec.port" in err.body["message"]
    no_spec = {"apiVersion": "slotctl.io/v1alpha1", "kind": "Slot", "metadata": {"name": "x"}}
    err = await refused(admin.create(no_spec), 422)
    assert "spec" in err.body["message"]
    assert await admin.get("slots", "chat") is None


async def test_unknown_fields_are_pruned_with_a_warning(admin: Kube) -> None:
    obj = slot("chat", "m", 8080)
    obj["spec"]["colour"] = "blue"
    obj["spec"]["server"]["nice"] = 5
    resp = await admin.call("POST", realapi.path_of("slots", admin.namespace), obj)
    assert resp.status == 201, resp.body
    assert any("unknown field" in w and "spec.colour" in w for w in resp.warnings), resp.warnings
    stored = await admin.get("slots", "chat")
    assert stored is not None
    assert "colour" not in stored["spec"] and "nice" not in stored["spec"]["server"]
    assert stored["spec"]["server"]["extra_args"] == ["--load-seconds", "0.2"]
    # what `kubectl apply --validate=strict` sends: refused instead of pruned
    obj["metadata"]["name"] = "strict"
    resp = await admin.call(
        "POST",
        realapi.path_of("slots", admin.namespace),
        obj,
        params={"fieldValidation": "Strict"},
    )
    assert resp.status == 400 and "colour" in resp.body["message"], resp.body
    # status is pruned to its schema too (kopf's own state could not live there)
    await admin.patch(
        "slots", "chat", {"status": {"state": "ready", "kopf": {"x": 1}}}, sub="status"
    )
    stored = await admin.get("slots", "chat")
    assert stored is not None and stored["status"] == {"state": "ready"}


async def test_cel_rules_run_in_the_server(admin: Kube) -> None:
    flags = slot("chat", "m", 8080, server={"extra_args": ["-ngl", "99"]})
    err = await refused(admin.create(flags), 422)
    assert "server.extra_args sets a flag" in err.body["message"]
    env = slot("chat", "m", 8080, server={"env": {"CUDA_VISIBLE_DEVICES": "1"}})
    err = await refused(admin.create(env), 422)
    assert "device visibility" in err.body["message"]
    dotted = slot("chat.v2", "m", 8080)  # a DNS subdomain (a valid object name), not a label
    err = await refused(admin.create(dotted), 422)
    assert "DNS-1123 label" in err.body["message"]
    # the replica cross-field rules (the loader's SlotSpec._check_replicas)
    for bad, words in [
        ({"replicas": 2, "max_replicas": 3, "max_concurrency": 2}, "sets both bounds"),
        ({"min_replicas": 3, "max_replicas": 2, "max_concurrency": 2}, "above max_replicas"),
        ({"min_replicas": 1, "max_replicas": 3}, "set it"),
        ({"replicas": 2, "device": "npu"}, "npu slot"),
    ]:
        err = await refused(admin.create(slot("chat", "m", 8080, **bad)), 422)
        assert words in err.body["message"], (bad, err.body["message"])
    err = await refused(admin.create(slot("a" * 61, "m", 8080, replicas=10)), 422)
    assert "too long for its replicas" in err.body["message"]
    await admin.create(slot("scaled", "m", 8081, min_replicas=1, max_replicas=3, max_concurrency=2))
    # a valid object, then an edit the rules refuse: the stored spec is unchanged
    await admin.create(slot("chat", "m", 8080))
    await refused(
        admin.edit("slots", "chat", {"server": {"extra_args": ["--n-gpu-layers=9"]}}), 422
    )
    stored = await admin.get("slots", "chat")
    assert stored is not None and stored["spec"]["server"]["extra_args"] == [
        "--load-seconds",
        "0.2",
    ]


async def test_status_subresource_and_generation(admin: Kube) -> None:
    created = await admin.create(slot("chat", "m", 8080))
    assert created["metadata"]["generation"] == 1
    # the main resource ignores status; the status subresource ignores everything else
    after = await admin.patch("slots", "chat", {"status": {"state": "ready"}})
    assert "status" not in after and after["metadata"]["generation"] == 1
    after = await admin.patch(
        "slots", "chat", {"spec": {"priority": 99}, "status": {"state": "ready"}}, sub="status"
    )
    assert after["status"] == {"state": "ready"}
    assert "priority" not in after["spec"] and after["metadata"]["generation"] == 1
    # metadata changes leave the generation alone; a spec change bumps it
    after = await admin.patch("slots", "chat", {"metadata": {"annotations": {"a": "b"}}})
    assert after["metadata"]["generation"] == 1
    after = await admin.edit("slots", "chat", {"priority": 60})
    assert after["metadata"]["generation"] == 2 and after["status"] == {"state": "ready"}


async def test_stale_resource_version_is_a_conflict(admin: Kube) -> None:
    created = await admin.create(slot("chat", "m", 8080))
    stale = created["metadata"]["resourceVersion"]
    await admin.edit("slots", "chat", {"priority": 60})
    created["spec"]["priority"] = 70
    put = admin.checked("PUT", realapi.path_of("slots", admin.namespace, "chat"), created)
    err = await refused(put, 409)
    assert err.body["reason"] == "Conflict"
    patch = admin.patch(
        "slots", "chat", {"metadata": {"resourceVersion": stale}, "spec": {"priority": 80}}
    )
    await refused(patch, 409)
    stored = await admin.get("slots", "chat")
    assert stored is not None and stored["spec"]["priority"] == 60


# ---------------------------------------------------------------------- RBAC


async def test_the_chart_role_refuses_what_it_does_not_grant(
    api_server: ApiServer, namespace: str, admin: Kube
) -> None:
    other = f"{namespace}-other"
    realapi.create_namespace(api_server, other)
    await admin.create(slot("chat", "m", 8080))
    await admin.create(slot("chat", "m", 8080), namespace=other)
    token = operator_token(api_server, namespace)
    op = Kube(api_server, token, namespace)
    try:
        # granted: list, watch and patch of Slots, patch of their status, Events
        listed = await op.checked("GET", realapi.path_of("slots", namespace))
        assert [i["metadata"]["name"] for i in listed["items"]] == ["chat"]
        await op.patch("slots", "chat", {"metadata": {"annotations": {"x": "y"}}})
        await op.patch("slots", "chat", {"status": {"state": "pending"}}, sub="status")
        # not granted: get, create, delete, other namespaces, other resources
        await refused(op.get("slots", "chat"), 403)
        await refused(op.create(slot("new", "m", 8081)), 403)
        await refused(op.delete("slots", "chat"), 403)
        await refused(op.checked("GET", realapi.path_of("slots", other)), 403)
        await refused(op.patch("slots", "chat", {"spec": {"priority": 1}}, namespace=other), 403)
        await refused(op.checked("GET", realapi.path_of("secrets", namespace)), 403)
        await refused(op.checked("GET", realapi.path_of("configmaps", namespace)), 403)
        await refused(
            op.checked(
                "GET", realapi.path_of("customresourcedefinitions", None, "slots.slotctl.io")
            ),
            403,
        )
        stored = await admin.get("slots", "chat", namespace=other)
        assert stored is not None and "priority" not in stored["spec"]
    finally:
        await op.close()
        # a leftover "chat" would clash with the next cluster-wide operator's own
        realapi.delete_all_crs(api_server, other)


# ---------------------------------------------------------------------- the operator


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    yield path
    asyncio.run(stop_everything(path / "config", path, "process", lambda _: None))


def start_operator(
    kubeconfig: Path, namespace: str | None, state: Path, log: Path
) -> subprocess.Popen[bytes]:
    """``slotctl operator -n NAMESPACE`` (None: ``--all-namespaces``) as a subprocess."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(REPO)}
    env.pop("SLOTCTL_CONFIG_DIR", None)
    env.pop("SLOTCTL_STATE_DIR", None)
    command = [
        sys.executable,
        "-m",
        "controller",
        "operator",
        *(["--namespace", namespace] if namespace else ["--all-namespaces"]),
        "--runtime",
        "process",
        "--state-dir",
        str(state),
        "--config-dir",
        str(state / "config"),
    ]
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


async def stop_operator(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    for _ in range(300):
        if proc.poll() is not None:
            return proc.returncode
        await asyncio.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError("the operator did not stop on SIGTERM")


async def ready(kube: Kube, name: str, generation: int) -> dict[str, Any] | None:
    obj = await kube.get("slots", name)
    cond = condition(obj, "Ready")
    if cond.get("status") == "True" and cond.get("observedGeneration") == generation:
        return obj
    return None


@pytest.mark.parametrize("cluster_wide", [False, True], ids=["namespaced", "cluster-wide"])
async def test_operator_with_the_chart_service_account(
    api_server: ApiServer,
    namespace: str,
    admin: Kube,
    state: Path,
    tmp_path: Path,
    cluster_wide: bool,
) -> None:
    """``slotctl operator -n NS`` (a Role) or ``-A`` (the chart's default, a ClusterRole)
    with only the chart's RBAC: create, edit, a port conflict, a refused edit, a quiet
    steady state, delete through the finalizer."""
    (port,) = free_ports(1)
    token = operator_token(api_server, namespace, cluster_wide=cluster_wide)
    kubeconfig = api_server.kubeconfig(tmp_path / "operator.kubeconfig", token=token)
    log = tmp_path / "operator.log"
    proc = start_operator(kubeconfig, None if cluster_wide else namespace, state, log)
    try:
        await admin.create(model("m-chat"))
        await admin.create(slot("chat", "m-chat", port))
        obj = await eventually(lambda: ready(admin, "chat", 1), "Ready", timeout=90)
        assert obj["status"]["state"] == "ready" and obj["status"]["model"] == "m-chat"
        assert obj["status"]["observedGeneration"] == 1
        assert "slotctl.io/finalizer" in obj["metadata"]["finalizers"]
        assert await answers(obj["status"]["endpoint"])
        pid = server_pid(port)
        assert pid is not None

        async def model_ready_with_chat() -> dict[str, Any] | None:
            obj = await _model_ready(admin, "m-chat")
            return obj if obj is not None and obj["status"].get("slots") == ["chat"] else None

        # (the Model's status names its slots at its next write after the Slot's)
        await eventually(model_ready_with_chat, "the Model Ready, serving chat", timeout=60)

        # an Alias: the CRD's CEL rule refuses a member named twice; a good one is Ready
        # and its status passes the real server's schema
        await refused(admin.create(alias("twice", "m-chat", "m-chat", namespace=namespace)), 422)
        await admin.create(alias("assistant", "m-chat", namespace=namespace))

        async def alias_ready() -> dict[str, Any] | None:
            obj = await admin.get("aliases", "assistant")
            return obj if condition(obj, "Ready").get("status") == "True" else None

        found = await eventually(alias_ready, "the Alias Ready", timeout=60)
        assert found["status"]["id"] == "assistant"
        assert found["status"]["observedGeneration"] == 1
        # an Adapter: its status passes the real server's schema too
        await admin.create(adapter("sql", "m-chat", "/adapters/sql.gguf", namespace=namespace))

        async def adapter_ready() -> dict[str, Any] | None:
            obj = await admin.get("adapters", "sql")
            return obj if condition(obj, "Ready").get("status") == "True" else None

        declared = await eventually(adapter_ready, "the Adapter Ready", timeout=60)
        assert declared["status"]["id"] == "sql"

        # the status the operator writes survives the schema whole: once it is
        # written, the steady state makes no more writes (no patch loop on pruned keys)
        await asyncio.sleep(3)
        before = (await admin.get("slots", "chat")) or {}
        await asyncio.sleep(6)
        after = (await admin.get("slots", "chat")) or {}
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], (
            _status_diff(before, after)
        )

        # a spec edit: the server bumps the generation, the operator observes it
        await admin.edit("slots", "chat", {"priority": 80})
        await eventually(lambda: ready(admin, "chat", 2), "generation 2 observed", timeout=60)
        assert server_pid(port) == pid

        # a conflict only the operator can judge (a port taken by another Slot): its
        # Degraded status, reason and lastError pass the status schema of the real server
        await admin.create(slot("dup", "m-chat", port))

        async def degraded() -> dict[str, Any] | None:
            obj = await admin.get("slots", "dup")
            return obj if condition(obj, "Degraded").get("status") == "True" else None

        dup = await eventually(degraded, "the duplicate port Degraded", timeout=60)
        assert condition(dup, "Degraded")["reason"] == "InvalidSpec"
        assert dup["status"]["lastError"]["code"] == "slot.duplicate_port"
        assert condition(dup, "Ready")["status"] == "False"
        assert await ready(admin, "chat", 2) is not None and server_pid(port) == pid
        await admin.delete("slots", "dup")
        await eventually(lambda: _gone(admin, "dup"), "dup removed", timeout=60)

        # an edit the CEL rules refuse never reaches the operator
        await refused(admin.edit("slots", "chat", {"server": {"extra_args": ["-ngl", "9"]}}), 422)
        obj = await admin.get("slots", "chat")
        assert obj is not None and obj["metadata"]["generation"] == 2

        # delete: the finalizer holds the object until the server is stopped
        await admin.delete("slots", "chat")
        await eventually(lambda: _gone(admin, "chat"), "Slot removed", timeout=60)
        # (its server no longer listens; the freed port may be anyone's now: a process of
        # another test on this machine took it once)
        assert server_pid(port) != pid
        events = await admin.events()
        reasons = {e["reason"] for e in events if e["involvedObject"]["name"] == "chat"}
        assert "Stopped" in reasons, reasons
        assert await stop_operator(proc) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Forbidden" not in text and " 403" not in text, text[-4000:]
    # least privilege, from the real server's audit log: the chart grants exactly what the
    # operator sent (the KMock tier checks the same against its request record)
    used = api_server.requests_of(f"system:serviceaccount:{namespace}:slotctl")
    chart.assert_rbac_allows_exactly(used, namespaces=[] if cluster_wide else [namespace])


async def test_a_refused_request_shows_in_the_operator_log(
    api_server: ApiServer, namespace: str, admin: Kube, state: Path, tmp_path: Path
) -> None:
    """A Role without ``slots/status``: the server refuses the status patch, and the
    operator says so on stderr (kopf's per-object errors otherwise only become Events,
    which is how the check for ``Forbidden`` above could not fail)."""
    (port,) = free_ports(1)
    token = operator_token(api_server, namespace, drop="slots/status")
    kubeconfig = api_server.kubeconfig(tmp_path / "operator.kubeconfig", token=token)
    log = tmp_path / "operator.log"
    proc = start_operator(kubeconfig, namespace, state, log)
    try:
        await admin.create(model("m-chat"))
        await admin.create(slot("chat", "m-chat", port))
        refusal = 'cannot patch resource "slots/status"'

        async def logged() -> bool:
            return refusal in log.read_text()

        await eventually(logged, "the refusal in the operator log", timeout=60)
        assert "Forbidden" in log.read_text()
        obj = await admin.get("slots", "chat")
        assert obj is not None and "status" not in obj
        assert await stop_operator(proc) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _model_ready(kube: Kube, name: str) -> dict[str, Any] | None:
    obj = await kube.get("models", name)
    return obj if condition(obj, "Ready").get("status") == "True" else None


async def _gone(kube: Kube, name: str) -> bool:
    return await kube.get("slots", name) is None


def _status_diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    old, new = before.get("status") or {}, after.get("status") or {}
    return str(
        {k: (old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k)}
    )


def test_binaries_are_found_in_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The lookup the fixture uses: SLOTCTL_K8S_BIN first, else the versioned cache."""
    monkeypatch.delenv("SLOTCTL_K8S_BIN", raising=False)
    monkeypatch.setenv("SLOTCTL_K8S_CACHE", str(tmp_path))
    assert realapi.binaries() is None
    folder = realapi.cache_dir()
    key = f"{realapi.K8S_VERSION}-etcd-{realapi.ETCD_VERSION}-kwok-{realapi.KWOK_VERSION}"
    assert folder == tmp_path / key
    folder.mkdir(parents=True)
    for name in ("kube-apiserver", "etcd"):
        (folder / name).write_text("#!/bin/sh\n")
        (folder / name).chmod(0o755)
    assert realapi.binaries() == folder
    monkeypatch.setenv("SLOTCTL_K8S_BIN", str(tmp_path / "elsewhere"))
    assert realapi.binaries() is None


def test_build_script_pins_the_versions_the_fixture_expects() -> None:
    text = realapi.BUILD.read_text()
    assert f"K8S_VERSION={realapi.K8S_VERSION}" in text
    assert f"ETCD_VERSION={realapi.ETCD_VERSION}" in text
    assert f"KWOK_VERSION={realapi.KWOK_VERSION}" in text
    gomod = (REPO / "tools/k8s/cluster/go.mod").read_text()
    assert f"go.etcd.io/etcd/server/v3 {realapi.ETCD_VERSION}" in gomod
    assert f"sigs.k8s.io/kwok {realapi.KWOK_VERSION}" in gomod
    assert f"k8s.io/kubernetes {realapi.K8S_VERSION}" in gomod
    staging = realapi.K8S_VERSION.replace("v1.", "v0.")
    replaced = [line for line in gomod.splitlines() if "=>" in line]
    assert replaced and all(line.rstrip().endswith(staging) for line in replaced)
