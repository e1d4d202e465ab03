"""Opt-in: the operator against a real cluster (k3s or any), driven with ``kubectl``.

Runs only with ``SLOTCTL_K8S_E2E=1`` and a ``KUBECONFIG`` whose user may create CRDs and
namespaces (the CI machines have no cluster; KMock covers the same flows in
``test_operator.py``). It applies ``crds/``, runs ``slotctl operator -n NS`` as a
subprocess on this machine, applies a demo Model and Slot, waits for ``Ready`` with
``kubectl wait``, and deletes the Slot (the finalizer stops the server first).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controller.daemon.main import stop_everything
from tests.integration.helpers import free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("SLOTCTL_K8S_E2E") != "1" or shutil.which("kubectl") is None,
        reason="opt-in: set SLOTCTL_K8S_E2E=1 with kubectl and a KUBECONFIG for a cluster",
    ),
    pytest.mark.timeout(300),
]


def kubectl(*args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def test_slot_on_a_real_cluster(tmp_path: Path) -> None:
    namespace = f"slotctl-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl("create", "namespace", namespace)
    state = tmp_path / "state"
    operator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controller",
            "--state-dir",
            str(state),
            "--config-dir",
            str(state / "config"),
            "operator",
            "--namespace",
            namespace,
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=(tmp_path / "operator.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    port = free_port()
    objects = [
        {
            "apiVersion": "slotctl.io/v1alpha1",
            "kind": "Model",
            "metadata": {"name": "m"},
            "spec": {"source": "demo://m", "memory_gb": 0.05},
        },
        {
            "apiVersion": "slotctl.io/v1alpha1",
            "kind": "Slot",
            "metadata": {"name": "chat"},
            "spec": {
                "provider": "demo",
                "model": {"default": "m"},
                "device": "cpu",
                "port": port,
                "autoload": True,
            },
        },
    ]
    try:
        kubectl(
            "apply",
            "-n",
            namespace,
            "-f",
            "-",
            stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
        )
        kubectl("wait", "-n", namespace, "slot/chat", "--for=condition=Ready", "--timeout=120s")
        status = json.loads(kubectl("get", "-n", namespace, "slot/chat", "-o", "json"))["status"]
        assert status["state"] in ("ready", "idle", "serving")
        assert status["endpoint"].endswith(f":{port}")
        kubectl("delete", "-n", namespace, "slot/chat", "--timeout=120s")
        # `kubectl delete` returned: the finalizer is gone, so the server was stopped first
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, "the server still listens"
    finally:
        operator.send_signal(signal.SIGTERM)
        operator.wait(timeout=60)
        kubectl("delete", "namespace", namespace, "--wait=false")
        asyncio.run(stop_everything(state / "config", state, "process", lambda _: None))
    assert operator.returncode == 0, (tmp_path / "operator.log").read_text()
