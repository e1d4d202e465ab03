"""The README's quickstart on a cluster: ``slotctl stack export --format crd`` of
``examples/quickstart`` applied as it is to the operator with ``--runtime kubernetes``
(KMock, the test as the kubelet: :mod:`tests.k8s.kubelet`). Its slots are ``demo`` slots
without ``server.image``: each runs the operator's own image (``SLOTCTL_K8S_IMAGE``, the
chart's ``image``), whose entrypoint is ``slotctl`` (the test kubelet knows it, as
:mod:`tests.k8s.images` says), so the pod names the image's interpreter as its command.
Before, the load stopped at "the kubernetes runtime needs server.image".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.runtime.base import OWN_IMAGE_ENV
from tests.k8s.conftest import Cluster, eventually
from tests.k8s.kubelet import Kubelet, answers, gpu_node
from tests.k8s.test_kubernetes_runtime import operator, ready

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]
OWN_IMAGE = "registry.local/team/slotctl:0.1.0"  # a slotctl image: entrypoint `slotctl`


def exported_quickstart() -> list[dict[str, Any]]:
    """``slotctl stack export --format crd --from examples/quickstart``, as a user runs it."""
    quickstart = str(REPO / "examples" / "quickstart")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller",
            "stack",
            "export",
            "--format",
            "crd",
            "--from",
            quickstart,
            "--namespace",
            "default",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


async def test_the_quickstart_stack_runs_on_the_kubernetes_runtime_with_no_image(
    cluster: Cluster, kubelet: Kubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OWN_IMAGE_ENV, OWN_IMAGE)
    objects = exported_quickstart()
    slots = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Slot"}
    assert set(slots) == {"chat", "coder", "embed"}
    assert not any(s["spec"].get("server", {}).get("image") for s in slots.values())
    await kubelet.create(gpu_node("node-a", gpus=1, gib_per_gpu=16))
    async with operator(cluster, tmp_path / "state", monkeypatch):
        for obj in objects:
            await cluster.create(obj)
        # the autoload slots come up on the operator's image and answer at their pods
        for name in ("chat", "embed"):
            obj = await eventually(lambda n=name: ready(cluster, n), f"{name} Ready", 90)
            assert obj is not None
            assert await answers(obj["status"]["endpoint"])
            dep = await kubelet.get("deployments", f"slotctl-{name}")
            assert dep is not None
            (container,) = dep["spec"]["template"]["spec"]["containers"]
            assert container["image"] == OWN_IMAGE
            # the image's entrypoint is `slotctl`: the interpreter is the command
            assert container["command"] == ["python3"]
            assert container["args"][:2] == ["-m", "controller.demo"]
        coder = await cluster.get("slots", "coder")  # autoload = false: not loaded, no error
        assert coder is not None
        assert not (coder.get("status") or {}).get("lastError"), coder.get("status")
