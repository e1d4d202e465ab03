"""A real control plane with simulated GPU nodes, for the kubernetes runtime's real tier.

etcd + ``kube-apiserver`` (:mod:`tests.k8s.realapi`), ``kube-controller-manager`` (the
Deployment, ReplicaSet, node lifecycle, taint eviction, garbage collector and service
account controllers), ``kube-scheduler`` and ``kwok`` (``sigs.k8s.io/kwok``: it keeps the
nodes it manages Ready, with leases, and plays their kubelets' part for pods: Running
with an IP from the node's ``podCIDR``), all one binary built by ``tools/k8s/build.sh``
(each command a link to it), started on 127.0.0.1. Each node gets a loopback ``podCIDR``
(``127.1.N.0/24``), so its pods' IPs are addresses this host can bind.

kwok runs no containers. :class:`ContainerRuntime` does, as ``tests/k8s/kubelet.py`` does
for KMock: a thread that follows the pods of slotctl (a list, then a watch) and starts
each Running pod's container args as a real demo server bound to the pod's IP (one
process a pod), or, for the scale bench, all of them inside one process
(:class:`InProcessServers`: the demo server's own app and HTTP code on a socket per pod);
a pod deleted or terminating has its server stopped.

:func:`start` returns a :class:`Cluster` once every component is up; :meth:`Cluster.kubectl`
runs the built ``kubectl`` with the admin kubeconfig.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.k8s import realapi
from tests.k8s.images import container_argv
from tests.k8s.realapi import ApiServer

REPO = Path(__file__).resolve().parents[2]
NAMES = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kubectl", "kwok")
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "garbage-collector-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "pod-garbage-collector-controller",
)


def binaries() -> Path | None:
    """The folder holding every binary of this tier, or None when one is not built."""
    folder = Path(os.environ.get("SLOTCTL_K8S_BIN") or realapi.cache_dir())
    built = all(os.access(folder / name, os.X_OK) for name in NAMES)
    return folder if built and (folder / "kwok-stages.yaml").is_file() else None


def gpu_node(
    name: str,
    index: int,
    *,
    gpus: int = 1,
    gib_per_gpu: int | None = 16,
    replicas: int | None = None,
    pods: int = 110,
) -> dict[str, Any]:
    """A kwok-managed node with ``gpus`` allocatable ``nvidia.com/gpu`` (``replicas``:
    time-sliced), GPU feature discovery's labels when ``gib_per_gpu`` is given (None: the
    device plugin alone), room for ``pods`` pods, and the loopback podCIDR
    ``127.1.<index>.0/24``."""
    labels = {"kubernetes.io/hostname": name, "type": "kwok"}
    if gib_per_gpu is not None:
        labels["nvidia.com/gpu.count"] = str(gpus)
        labels["nvidia.com/gpu.memory"] = str(gib_per_gpu * 1024)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": f"127.1.{index}.0/24", "podCIDRs": [f"127.1.{index}.0/24"]},
        "status": {
            "allocatable": {
                "cpu": "32",
                "memory": "256Gi",
                "pods": str(pods),
                "nvidia.com/gpu": str(replicas or gpus),
            },
            "capacity": {
                "cpu": "32",
                "memory": "256Gi",
                "pods": str(pods),
                "nvidia.com/gpu": str(replicas or gpus),
            },
        },
    }


# ---------------------------------------------------------------------- the servers


class InProcessServers:
    """Many demo servers in one process (the scale bench: a process a pod does not fit
    in this machine's memory): each pod's port on its IP, the demo server's own app
    (:mod:`controller.demo.api`) and connection code (:mod:`controller.demo.httpd`),
    loaded after its ``--load-seconds``; one selector thread accepts for all of them."""

    def __init__(self) -> None:
        from controller.demo.httpd import Tracker

        self.selector = selectors.DefaultSelector()
        self.tracker = Tracker()
        self.sockets: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="demo-servers", daemon=True)
        self._thread.start()

    def start(self, name: str, args: list[str], ip: str) -> None:
        from controller.demo.api import DemoState, build_app
        from controller.demo.config import parse_args
        from controller.demo.httpd import listen

        config = parse_args([ip if a == "0.0.0.0" else a for a in args[3:]])  # after -m mod
        state = DemoState(config)
        app = build_app(state)
        listeners = listen(config.host, config.port)
        timer = threading.Timer(config.load_seconds, lambda: setattr(state, "loaded", True))
        timer.daemon = True
        timer.start()
        with self._lock:
            self.sockets[name] = listeners
            for sock in listeners:
                self.selector.register(sock, selectors.EVENT_READ, app)

    def stop(self, name: str) -> None:
        with self._lock:
            for sock in self.sockets.pop(name, []):
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(sock)
                sock.close()

    def _serve(self) -> None:
        from controller.demo.httpd import serve_connection

        while not self._stop.is_set():
            with self._lock:
                ready = self.selector.select(0) if self.selector.get_map() else []
            if not ready:
                time.sleep(0.01)
                continue
            for key, _ in ready:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with contextlib.suppress(OSError):
                    conn, _ = sock.accept()
                    conn.setblocking(True)
                    threading.Thread(
                        target=serve_connection, args=(conn, key.data, self.tracker), daemon=True
                    ).start()

    def close(self) -> None:
        self._stop.set()
        for name in list(self.sockets):
            self.stop(name)
        self._thread.join(5)


@dataclass
class ContainerRuntime:
    """The nodes' container runtime (see the module docstring): follows slotctl's pods
    through the API and runs each Running pod's server on its IP."""

    api: ApiServer
    log_dir: Path
    inproc: InProcessServers | None = None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ips: dict[str, str] = field(default_factory=dict)  # pod -> the IP its server binds
    started: list[str] = field(default_factory=list)  # every pod it ever started
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _resp: Any = None  # the open watch

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="container-runtime", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._list()
                self._watch(version)
            except (OSError, ValueError, AttributeError, urllib.error.URLError):
                # (AttributeError: http.client's read of a response stop() closed)
                time.sleep(0.2)

    def _get(self, path: str, timeout: float) -> Any:
        req = urllib.request.Request(
            self.api.url + path,
            headers={"Authorization": f"Bearer {self.api.admin_token}"},
        )
        return urllib.request.urlopen(req, context=self.api.ssl_context(), timeout=timeout)

    def _list(self) -> str:
        selector = urllib.parse.quote("slotctl.managed=true")
        with self._get(f"/api/v1/pods?labelSelector={selector}", 30) as resp:
            body = json.loads(resp.read())
        for pod in body.get("items", []):
            self._seen(pod)
        live = {p["metadata"]["name"] for p in body.get("items", [])}
        for name in [n for n in self.ips if n not in live]:
            self._kill(name)
        return str(body["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> None:
        query = urllib.parse.urlencode(
            {
                "labelSelector": "slotctl.managed=true",
                "watch": "true",
                "resourceVersion": version,
                "timeoutSeconds": "60",
            }
        )
        with self._get(f"/api/v1/pods?{query}", 90) as resp:
            self._resp = resp
            if self._stop.is_set():  # stop() may have closed the one before, not this one
                return
            for line in resp:
                if self._stop.is_set():
                    return
                event = json.loads(line)
                if event["type"] == "ERROR":
                    return  # (410 Gone among them) list again
                pod = event["object"]
                if event["type"] == "DELETED":
                    self._kill(pod["metadata"]["name"])
                else:
                    self._seen(pod)

    def _seen(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp") or status.get("phase") in (
            "Succeeded",
            "Failed",
        ):
            self._kill(name)
            return
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not ip or name in self.ips:
            return
        (container,) = pod["spec"]["containers"]
        args = container_argv(container)
        self.ips[name] = ip
        self.started.append(name)
        if self.inproc is not None:
            self.inproc.start(name, args, ip)
            return
        assert args and args[0] == "python3", args
        args[0] = sys.executable
        args = [ip if a == "0.0.0.0" else a for a in args]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        # an empty value (a cpu slot's CUDA_VISIBLE_DEVICES="") comes back without "value"
        env.update(
            {
                e["name"]: e.get("value", "")
                for e in container.get("env") or []
                if "valueFrom" not in e
            }
        )
        with (self.log_dir / f"{name}.log").open("ab") as log:
            self.processes[name] = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def _kill(self, name: str) -> None:
        self.ips.pop(name, None)
        if self.inproc is not None:
            self.inproc.stop(name)
        proc = self.processes.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def running(self, prefix: str) -> list[str]:
        """The pods whose name starts with ``prefix`` that have a server up now."""
        return [n for n in list(self.ips) if n.startswith(prefix)]

    def stop(self) -> None:
        self._stop.set()
        if self._resp is not None:  # an open watch holds the API server's shutdown
            # shut down, not closed: close() waits for the reading thread's lock, that is
            # for the watch's next event (up to its timeout)
            with (
                contextlib.suppress(OSError, ValueError),
                socket.fromfd(self._resp.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock,
            ):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(10)
        for name in list(self.ips):
            self._kill(name)
        if self.inproc is not None:
            self.inproc.close()


# ---------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    api: ApiServer
    bin_dir: Path
    kubeconfig: Path  # the admin's
    workdir: Path
    procs: list[subprocess.Popen[bytes]]
    containers: ContainerRuntime
    nodes: int = 0

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        """The built ``kubectl`` as the admin; its output."""
        done = subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}{done.stdout}")
        return done.stdout

    def add_node(self, name: str, **kw: Any) -> None:
        """A kwok node (see :func:`gpu_node`); returns once it is Ready."""
        self.nodes += 1
        body = gpu_node(name, self.nodes, **kw)
        status, answer = self.api.request("POST", "/api/v1/nodes", body)
        if status >= 300:
            raise realapi.ApiError(status, answer)
        deadline = time.monotonic() + 60
        while not self.node_ready(name):
            if time.monotonic() > deadline:
                raise AssertionError(f"node {name} not Ready: {self.api.tail()}")
            time.sleep(0.2)

    def node_ready(self, name: str) -> bool:
        status, node = self.api.request("GET", f"/api/v1/nodes/{name}")
        conditions = (node.get("status") or {}).get("conditions") or [] if status == 200 else []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def ready_seen(self, name: str, seconds: int) -> list[str]:
        """Every status of the node's Ready condition for ``seconds``, from a watch (one
        that lasts a moment is seen too)."""
        query = urllib.parse.urlencode(
            {"watch": "true", "fieldSelector": f"metadata.name={name}", "timeoutSeconds": seconds}
        )
        seen = []
        with self.containers._get(f"/api/v1/nodes?{query}", seconds + 30) as resp:
            for line in resp:
                node = json.loads(line)["object"]
                for c in (node.get("status") or {}).get("conditions") or []:
                    if c["type"] == "Ready":
                        seen.append(c["status"])
        return seen

    def lose_node(self, name: str) -> None:
        """The node's kubelet is gone: kwok stops managing it (no more heartbeats) and its
        Ready condition turns Unknown, as the node lifecycle controller would set it
        after its grace period."""
        patch = {"metadata": {"annotations": {KWOK_ANNOTATION: None}}}
        self.api.request(
            "PATCH", f"/api/v1/nodes/{name}", patch, content_type="application/merge-patch+json"
        )
        _, node = self.api.request("GET", f"/api/v1/nodes/{name}")
        conditions = [
            {**c, "status": "Unknown", "reason": "NodeStatusUnknown", "message": "kubelet gone"}
            if c["type"] == "Ready"
            else c
            for c in (node.get("status") or {}).get("conditions") or []
        ]
        self.api.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {"status": {"conditions": conditions}},
            content_type="application/strategic-merge-patch+json",
        )

    def metrics(self) -> dict[str, float]:
        """``apiserver_request_total`` by verb (every client), from the server's /metrics."""
        status, text = self.api.request("GET", "/metrics")
        assert status == 200, text
        out: dict[str, float] = {}
        for line in str(text).splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels, value = line.rsplit(" ", 1)
            verb = labels.split('verb="', 1)[1].split('"', 1)[0]
            out[verb] = out.get(verb, 0.0) + float(value)
        return out

    def tail(self, lines: int = 30) -> str:
        out = [self.api.tail(lines)]
        for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
            path = self.workdir / f"{name}.log"
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            out.append(f"--- {name} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def stop(self) -> None:
        self.containers.stop()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.api.stop()


def _spawn(bin_dir: Path, name: str, args: list[str], workdir: Path) -> subprocess.Popen[bytes]:
    with (workdir / f"{name}.log").open("wb") as out:
        return subprocess.Popen(
            [str(bin_dir / name), *args], stdout=out, stderr=subprocess.STDOUT, cwd=workdir
        )


def start(
    workdir: Path,
    bin_dir: Path,
    *,
    node_monitor_grace_s: int = 20,
    inproc: bool = False,
    audit: bool = True,
) -> Cluster:
    """Every component up (see the module docstring); ``inproc``: the servers in one
    process (the bench). The admin kubeconfig is ``workdir/admin.kubeconfig``."""
    api = realapi.start(workdir / "apiserver", bin_dir, audit=audit)
    kubeconfig = api.kubeconfig(workdir / "admin.kubeconfig")
    pki = api.workdir / "pki"
    auth = [f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--secure-port=0"]
    procs = []
    try:
        procs.append(
            _spawn(
                bin_dir,
                "kube-controller-manager",
                [
                    *auth,
                    f"--controllers={','.join(CONTROLLERS)}",
                    f"--service-account-private-key-file={pki / 'sa-key.pem'}",
                    f"--root-ca-file={pki / 'ca.pem'}",
                    f"--node-monitor-grace-period={node_monitor_grace_s}s",
                    "--node-monitor-period=2s",
                    "--concurrent-deployment-syncs=20",
                    "--concurrent-replicaset-syncs=20",
                    "--kube-api-qps=500",
                    "--kube-api-burst=1000",
                    "--v=1",
                ],
                workdir,
            )
        )
        procs.append(_spawn(bin_dir, "kube-scheduler", [*auth, "--v=1"], workdir))
        procs.append(
            _spawn(
                bin_dir,
                "kwok",
                [
                    f"--kubeconfig={kubeconfig}",
                    f"--config={bin_dir / 'kwok-stages.yaml'}",
                    f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                    "--cidr=127.2.0.0/16",
                    # leases, renewed every quarter of their duration (here half the node
                    # lifecycle controller's grace period, as a kubelet's 10 s): without
                    # them kwok's node heartbeat is every 10 minutes and the nodes turn
                    # NotReady after the grace period, over and over
                    f"--node-lease-duration-seconds={2 * node_monitor_grace_s}",
                    "--node-ip=127.0.0.1",
                ],
                workdir,
            )
        )
        containers = ContainerRuntime(api, workdir, InProcessServers() if inproc else None)
        containers.start()
    except BaseException:
        for proc in procs:
            proc.kill()
        api.stop()
        raise
    cluster = Cluster(api, bin_dir, kubeconfig, workdir, procs, containers)
    for proc in procs:
        if proc.poll() is not None:
            tail = cluster.tail()
            cluster.stop()
            raise RuntimeError(f"a control-plane component exited: {proc.args}\n{tail}")
    return cluster


@contextlib.contextmanager
def running(workdir: Path, bin_dir: Path, **kw: Any) -> Iterator[Cluster]:
    cluster = start(workdir, bin_dir, **kw)
    try:
        yield cluster
    finally:
        cluster.stop()


def wait_service_account(api: ApiServer, namespace: str, timeout: float = 60) -> None:
    """Until the namespace's ``default`` ServiceAccount exists (pods need it; the
    service account controller makes it a moment after the namespace)."""
    deadline = time.monotonic() + timeout
    while api.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")[0] != 200:
        if time.monotonic() > deadline:
            raise AssertionError(f"no default ServiceAccount in {namespace}")
        time.sleep(0.2)
