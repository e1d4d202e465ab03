"""The kubernetes runtime at scale, on the real control plane (``tests/k8s/realcluster.py``):
kube-apiserver + etcd, kube-controller-manager, kube-scheduler and kwok nodes.

``--nodes`` kwok nodes with ``--gpus`` GPUs each (``--gib`` per GPU, GPU feature
discovery's labels, time-sliced to ``--replicas`` allocatable each), one Model and
``--slots`` Slots of ``--slot-gib`` (unpinned, autoload) in one namespace;
``slotctl operator --runtime kubernetes`` as a subprocess with the chart's RBAC; the
pods' demo servers all in this process (one socket per pod on its 127.x IP: a process a
pod does not fit here). Measured, from ``kubectl apply`` of every Slot:

* the time until every Slot is placed (``status.node``) and until every one is Ready;
* the operator's CPU seconds (user + system, ``/proc``) and its RSS (now and peak);
* the API server's requests by verb, from its ``/metrics`` (every client: the
  controller-manager, the scheduler, kwok and this bench included) and the operator's
  own, from the audit log (its ServiceAccount), during the run and during ``--steady``
  seconds of steady state afterwards.

**The floor.** In the same run, on the same control plane, before the operator starts,
the bench applies exactly the objects the operator writes for those Slots — each one's
Deployment and Service, made by the runtime's own ``deployment_body``/``service_body``
from the launch the operator builds — straight with ``kubectl apply --server-side`` (the
operator's server-side apply), no operator, in a namespace of its own, and times them to
Ready the same way: every pod Running and its demo server answering (``/health``, loaded)
at its pod's IP, polled once a second. What the floor leaves out: the operator's placement
(its pods carry no node affinity: the scheduler alone places them) and its status writes.
Its objects are then deleted and their pods waited for before the operator's run. Printed:
the operator's converge over the floor's, its CPU and API requests per Slot, and the
floor's own figures (``--no-floor`` skips it).

**Restart at scale** (``--restarts K``, issue 39 item 4). With every Slot Ready (after the
steady state), ``K`` times: the operator is killed (SIGKILL), a new Slot is created while
it is down, and the operator is started again on the same state directory. Measured for
each try: the time from its start until its first API request (*back*), from then until
its first decision (its server-side apply of the new Slot's Deployment, from the audit
log) and until the new Slot is Ready (polled every 0.1 s); the p50/p99/max over the tries
and how many were Ready within 5 s of the operator being back. Over all the tries: the
pods of the Slots that were Ready before, by UID and restart count (recreated or
restarted: must be 0), and Slots with more than one pod (duplicates: must be 0).

``--baseline DIR`` runs the same against another checkout (``git archive main | tar -x
-C DIR``: today's polling runtime) first, ``--baseline-slots`` of them (the polling
operator at the full size can keep the API server from ever converging on a small
machine; ``--timeout`` bounds each run), and prints both side by side.

Prints a table; never fails on timing.

    python bench/k8s_scale.py [--nodes 100 --gpus 4 --slots 1000] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from tests.integration.helpers import free_ports
from tests.k8s import chart, realapi, realcluster
from tests.k8s.realcluster import Cluster

REPO = Path(__file__).resolve().parent.parent
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
NAMESPACE = "scale"
FLOOR_NAMESPACE = "floor"


@dataclass
class Floor:
    """The control plane's own floor: the operator's objects applied straight."""

    slots: int
    ready_s: float | None = None
    ready: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # every client, by verb
    cpu: dict[str, float] = field(default_factory=dict)  # every process of the run


@dataclass
class Restart:
    """The restart phase (``--restarts``): per try, seconds from the operator's start to its
    first request (back), from then to its first decision and to the new Slot Ready."""

    tries: int
    back_s: list[float] = field(default_factory=list)
    decision_s: list[float | None] = field(default_factory=list)
    ready_s: list[float | None] = field(default_factory=list)
    pods: int = 0  # the Ready Slots' pods before the first kill
    recreated: int = 0  # of them, gone or replaced (another UID) after the last try
    restarted: int = 0  # of them, a container restart counted after the last try
    duplicates: int = 0  # Slots with more than one pod after the last try


@dataclass
class Run:
    label: str
    slots: int
    placed_s: float | None = None
    ready_s: float | None = None
    ready: int = 0
    cpu_s: float = 0.0
    rss_mb: float = 0.0
    peak_mb: float = 0.0
    run_all: Counter[str] = field(default_factory=Counter)
    run_operator: Counter[str] = field(default_factory=Counter)
    steady_all: Counter[str] = field(default_factory=Counter)
    steady_operator: Counter[str] = field(default_factory=Counter)
    steady_s: float = 0.0
    steady_fields: Counter[str] = field(default_factory=Counter)
    quiet_after_s: float | None = None  # the operator's last write, after all Ready
    watch_stats: str = ""
    # CPU seconds over the run of every process on the machine that takes part in it
    others_cpu: dict[str, float] = field(default_factory=dict)
    floor: Floor | None = None
    restart: Restart | None = None


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def component_cpu(cluster: Cluster, operator: int | None) -> dict[str, float]:
    """CPU seconds so far of each process of the run: the control plane's, kwok's, the
    operator's (when one runs) and this process's (the pods' demo servers and their
    "container runtime" run here)."""
    out = {"operator": proc_cpu(operator)} if operator is not None else {}
    for proc in [*cluster.api.procs, *cluster.procs]:
        out[Path(str(proc.args[0])).name] = proc_cpu(proc.pid)
    times = os.times()
    out["bench (pod servers, kubelet)"] = times.user + times.system
    return out


def proc_rss(pid: int) -> tuple[float, float]:
    """(RSS, peak RSS) in MB."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def audit_counts(cluster: Cluster, user: str, since: float, until: float) -> Counter[str]:
    """The operator's requests by verb and resource in [since, until) (wall clock), from
    the audit log."""
    out: Counter[str] = Counter()
    for line in (cluster.api.workdir / "audit.log").read_text().splitlines():
        event = json.loads(line)
        if event["user"].get("username") != user:
            continue
        stamp = event.get("requestReceivedTimestamp", "")
        when = datetime.datetime.fromisoformat(stamp).timestamp()
        if since <= when < until:
            ref = event.get("objectRef") or {}
            what = "/".join(x for x in (ref.get("resource"), ref.get("subresource")) if x)
            out[f"{event['verb']} {what}".strip()] += 1
    return out


def last_write(cluster: Cluster, user: str, since: float) -> float | None:
    """The wall-clock time of the operator's last write (not a read) from ``since`` on."""
    last = None
    for line in (cluster.api.workdir / "audit.log").read_text().splitlines():
        event = json.loads(line)
        if event["user"].get("username") != user or event["verb"] in ("get", "list", "watch"):
            continue
        when = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        if when >= since:
            last = when if last is None else max(last, when)
    return last


def patched_fields(cluster: Cluster, user: str, since: float, until: float) -> Counter[str]:
    """What the operator's patches of slotctl's CRs in [since, until) wrote: each
    top-level key of the body, its ``status`` and ``metadata`` ones one level down
    (``status.conditions``, ``metadata.annotations``), counted once a patch."""
    out: Counter[str] = Counter()
    for line in (cluster.api.workdir / "audit.log").read_text().splitlines():
        event = json.loads(line)
        body = event.get("requestObject")
        if event["user"].get("username") != user or not isinstance(body, dict):
            continue
        when = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        if since <= when < until:
            for key, value in body.items():
                inner = value if key in ("status", "metadata") and isinstance(value, dict) else {}
                for name in inner or [""]:
                    out[f"{key}.{name}" if name else key] += 1
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> Counter[str]:
    return Counter({k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)})


def slot_spec(port: int) -> dict[str, Any]:
    """Each Slot's spec (the floor builds its objects from the same)."""
    return {
        "provider": "demo",
        "model": {"default": "m"},
        "port": port,
        "autoload": True,
        # no ready -> idle inside the run: a converge slower than the 300 s
        # default would mix a second status write per Slot into its figures
        "idle_timeout_s": 0,
        "server": {"image": "slotctl:bench", "extra_args": ["--load-seconds", "0.5"]},
    }


def floor_objects(slots: int, slot_gib: float, ports: list[int]) -> str:
    """The Deployment and Service of each Slot as the operator writes them (its launch,
    built as the operator builds it, through the runtime's own bodies), unplaced."""
    from controller.operator.source import STACK
    from controller.providers.launch import build_launch, launch_context
    from controller.runtime.kubernetes.spec import deployment_body, service_body, without_nulls
    from controller.spec.schema import ModelSpec, SlotSpec

    model = ModelSpec.model_validate({"id": "m", "source": "demo://m", "memory_gb": slot_gib})
    ctx = launch_context("kubernetes", STACK)
    docs: list[dict[str, Any]] = []
    for i in range(slots):
        spec = SlotSpec.model_validate({"name": f"s{i:04d}", **slot_spec(ports[i])})
        launch = build_launch(spec, model, ctx)
        docs.append(without_nulls(deployment_body(launch, FLOOR_NAMESPACE)))
        docs.append(without_nulls(service_body(launch, FLOOR_NAMESPACE)))
    # JSON, not YAML: a config hash such as 12e45678 is a string to PyYAML, a number to kubectl
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})


def floor_ready(cluster: Cluster, answered: set[str]) -> int:
    """How many of the floor's pods run with their server answering (``/health`` 200 at
    the pod's IP: loaded); ``answered`` keeps those seen so, each probed until it is."""
    status, body = cluster.api.request("GET", f"/api/v1/namespaces/{FLOOR_NAMESPACE}/pods")
    assert status == 200, body
    for pod in body.get("items", []):
        name, st = pod["metadata"]["name"], pod.get("status") or {}
        if name in answered or st.get("phase") != "Running" or not st.get("podIP"):
            continue
        port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
        try:
            with urllib.request.urlopen(f"http://{st['podIP']}:{port}/health", timeout=1):
                answered.add(name)
        except (OSError, urllib.error.URLError):
            pass  # loading (503), or not listening yet
    return len(answered)


def floor_run(args: argparse.Namespace, cluster: Cluster, workdir: Path, slots: int) -> Floor:
    """The floor (see the module docstring), then its objects deleted and its pods gone."""
    floor = Floor(slots)
    realapi.create_namespace(cluster.api, FLOOR_NAMESPACE)
    realcluster.wait_service_account(cluster.api, FLOOR_NAMESPACE)
    files = workdir / "floor.json"
    files.write_text(floor_objects(slots, args.slot_gib, free_ports(slots)))
    cpu0, metrics0 = component_cpu(cluster, None), cluster.metrics()
    began, answered = time.monotonic(), set[str]()
    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=slotctl",
        "-f",
        str(files),
        timeout=max(60.0, args.timeout),  # 2,000 objects: as the Slots' own apply below
    )
    while time.monotonic() - began < args.timeout:
        floor.ready = floor_ready(cluster, answered)
        if floor.ready >= slots:
            floor.ready_s = time.monotonic() - began
            break
        time.sleep(1.0)
    floor.requests = delta(cluster.metrics(), metrics0)
    cpu1 = component_cpu(cluster, None)
    floor.cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
    # 2,000 objects at 1,000 Slots: kubectl's own 60 s was not enough (its pods waited below)
    cluster.kubectl(
        "delete",
        "deployments,services",
        "--all",
        "--wait=false",
        "-n",
        FLOOR_NAMESPACE,
        timeout=max(60.0, args.timeout),
    )
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        status, body = cluster.api.request("GET", f"/api/v1/namespaces/{FLOOR_NAMESPACE}/pods")
        if status == 200 and not body.get("items"):
            break
        time.sleep(1.0)
    return floor


def manifests(slots: int, slot_gib: float, ports: list[int]) -> str:
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "slotctl.io/v1alpha1",
            "kind": "Model",
            "metadata": {"name": "m", "namespace": NAMESPACE},
            "spec": {"source": "demo://m", "memory_gb": slot_gib},
        }
    ]
    for i in range(slots):
        docs.append(
            {
                "apiVersion": "slotctl.io/v1alpha1",
                "kind": "Slot",
                "metadata": {"name": f"s{i:04d}", "namespace": NAMESPACE},
                "spec": slot_spec(ports[i]),
            }
        )
    return yaml.safe_dump_all(docs)


def slot_status(cluster: Cluster) -> tuple[int, int]:
    """(placed, Ready) Slots, from one list."""
    status, body = cluster.api.request(
        "GET", f"/apis/slotctl.io/v1alpha1/namespaces/{NAMESPACE}/slots"
    )
    assert status == 200, body
    placed = ready = 0
    for item in body.get("items", []):
        st = item.get("status") or {}
        placed += 1 if st.get("node") else 0
        conditions = st.get("conditions") or []
        ready += any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return placed, ready


def start_operator(cluster: Cluster, tree: Path, workdir: Path) -> subprocess.Popen[bytes]:
    docs = chart.render({"watchNamespaces": [NAMESPACE], "runtime": "kubernetes"}, NAMESPACE)
    realapi.apply(cluster.api, [d for d in docs if d["kind"] in RBAC_KINDS])
    token = realapi.service_account_token(cluster.api, NAMESPACE, "slotctl")
    kubeconfig = cluster.api.kubeconfig(workdir / "operator.kubeconfig", token=token)
    state = workdir / "state"
    (state / "config").mkdir(parents=True, exist_ok=True)  # a restart: the same state
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PYTHONPATH": str(tree),
        "SLOTCTL_K8S_NAMESPACE": NAMESPACE,
    }
    for name in ("SLOTCTL_CONFIG_DIR", "SLOTCTL_STATE_DIR", "KUBERNETES_SERVICE_HOST"):
        env.pop(name, None)
    command = [sys.executable, "-m", "controller", "operator", "-n", NAMESPACE]
    command += ["--runtime", "kubernetes", "--state-dir", str(state)]
    command += ["--config-dir", str(state / "config")]
    log = (workdir / "operator.log").open("ab")
    return subprocess.Popen(command, env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT)


def pods_of(cluster: Cluster) -> dict[str, tuple[str, str, int]]:
    """Every pod of the operator's namespace: name -> (its slot, UID, container restarts)."""
    status, body = cluster.api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")
    assert status == 200, body
    out = {}
    for pod in body.get("items", []):
        meta, st = pod["metadata"], pod.get("status") or {}
        restarts = sum(c.get("restartCount", 0) for c in st.get("containerStatuses") or [])
        out[meta["name"]] = (
            (meta.get("labels") or {}).get("slotctl.slot", ""),
            meta["uid"],
            restarts,
        )
    return out


def slot_ready(cluster: Cluster, name: str) -> bool:
    status, body = cluster.api.request(
        "GET", f"/apis/slotctl.io/v1alpha1/namespaces/{NAMESPACE}/slots/{name}"
    )
    conditions = ((body or {}).get("status") or {}).get("conditions") or [] if status == 200 else []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def first_request(
    cluster: Cluster, user: str, since: float
) -> tuple[float | None, dict[str, float]]:
    """From the audit log: the wall-clock time of ``user``'s first request from ``since``
    on, and of its first apply of each Deployment from then on (name -> time)."""
    first: float | None = None
    applied: dict[str, float] = {}
    for line in (cluster.api.workdir / "audit.log").read_text().splitlines():
        event = json.loads(line)
        if event["user"].get("username") != user:
            continue
        when = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        if when < since:
            continue
        first = when if first is None else min(first, when)
        ref = event.get("objectRef") or {}
        if event["verb"] == "patch" and ref.get("resource") == "deployments":
            name = str(ref.get("name"))
            applied[name] = min(applied.get(name, when), when)
    return first, applied


def restart_phase(
    args: argparse.Namespace,
    cluster: Cluster,
    workdir: Path,
    tree: Path,
    held: list[subprocess.Popen[bytes]],
) -> Restart:
    """The restart phase (see the module docstring); ``held[0]``: the running operator,
    replaced by each restart's."""
    user = f"system:serviceaccount:{NAMESPACE}:slotctl"
    restart = Restart(args.restarts)
    before = pods_of(cluster)
    restart.pods = len(before)
    ports = free_ports(args.restarts)
    starts: list[tuple[float, float | None]] = []  # (start wall, Ready wall)
    for i in range(args.restarts):
        held[0].kill()  # SIGKILL: no goodbye
        held[0].wait()
        name = f"r{i:03d}"
        slot = {
            "apiVersion": "slotctl.io/v1alpha1",
            "kind": "Slot",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": slot_spec(ports[i]),
        }
        status, body = cluster.api.request(
            "POST", f"/apis/slotctl.io/v1alpha1/namespaces/{NAMESPACE}/slots", slot
        )
        assert status == 201, body
        started = time.time()
        held[0] = start_operator(cluster, tree, workdir)
        ready_at: float | None = None
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            if slot_ready(cluster, name):
                ready_at = time.time()
                break
            time.sleep(0.1)
        starts.append((started, ready_at))
    for i, (started, ready_at) in enumerate(starts):
        back, applied = first_request(cluster, user, started)
        back = back if back is not None else started
        restart.back_s.append(back - started)
        decided = applied.get(f"slotctl-r{i:03d}")
        restart.decision_s.append(None if decided is None else decided - back)
        restart.ready_s.append(None if ready_at is None else ready_at - back)
    after = pods_of(cluster)
    for pod, (_slot, uid, restarts) in before.items():
        now = after.get(pod)
        if now is None or now[1] != uid:
            restart.recreated += 1
        elif now[2] > restarts:
            restart.restarted += 1
    per_slot = Counter(slot for slot, _uid, _r in after.values())
    restart.duplicates = sum(1 for n in per_slot.values() if n > 1)
    return restart


def one_run(args: argparse.Namespace, label: str, tree: Path, slots: int) -> Run:
    bin_dir = realcluster.binaries()
    assert bin_dir is not None, "build the tier first: tools/k8s/build.sh"
    run = Run(label, slots)
    with tempfile.TemporaryDirectory(prefix="slotctl-k8s-scale-") as tmp:
        workdir = Path(tmp)
        with realcluster.running(workdir / "cluster", bin_dir, inproc=True) as cluster:
            realapi.install_crds(cluster.api, REPO / "crds")
            for i in range(args.nodes):
                cluster.add_node(
                    f"n{i:03d}", gpus=args.gpus, gib_per_gpu=args.gib, replicas=args.replicas
                )
            if args.floor:
                run.floor = floor_run(args, cluster, workdir, slots)
            realapi.create_namespace(cluster.api, NAMESPACE)
            realcluster.wait_service_account(cluster.api, NAMESPACE)
            held = [start_operator(cluster, tree, workdir)]  # a restart replaces it
            proc = held[0]
            try:
                time.sleep(args.settle)  # its start: kopf's discovery, the caches' first lists
                user = f"system:serviceaccount:{NAMESPACE}:slotctl"
                files = workdir / "slots.yaml"
                files.write_text(manifests(slots, args.slot_gib, free_ports(slots)))
                cpu0 = component_cpu(cluster, proc.pid)
                metrics0, wall0 = cluster.metrics(), time.time()
                began = time.monotonic()
                cluster.kubectl("apply", "-f", str(files), timeout=600)
                while time.monotonic() - began < args.timeout:
                    placed, ready = slot_status(cluster)
                    now = time.monotonic() - began
                    if run.placed_s is None and placed >= slots:
                        run.placed_s = now
                    run.ready = ready
                    if ready >= slots:
                        run.ready_s = now
                        break
                    time.sleep(1.0)
                wall1 = time.time()
                metrics1 = cluster.metrics()
                cpu1 = component_cpu(cluster, proc.pid)
                run.others_cpu = {k: cpu1[k] - cpu0[k] for k in cpu1 if k != "operator"}
                run.cpu_s = cpu1["operator"] - cpu0["operator"]
                run.rss_mb, run.peak_mb = proc_rss(proc.pid)
                run.run_all = delta(metrics1, metrics0)
                time.sleep(2.0)  # the last status writes
                metrics2, wall2 = cluster.metrics(), time.time()
                time.sleep(args.steady)
                metrics3, wall3 = cluster.metrics(), time.time()
                run.steady_s = wall3 - wall2
                run.steady_all = delta(metrics3, metrics2)
                run.run_operator = audit_counts(cluster, user, wall0, wall1)
                run.steady_operator = audit_counts(cluster, user, wall2, wall3)
                run.steady_fields = patched_fields(cluster, user, wall2, wall3)
                last = last_write(cluster, user, wall1)
                run.quiet_after_s = None if last is None else max(0.0, last - wall1)
                if args.restarts:
                    run.restart = restart_phase(args, cluster, workdir, tree, held)
                if args.keep:
                    keep = Path(args.keep) / label.split(":")[0]
                    keep.mkdir(parents=True, exist_ok=True)
                    for path in (cluster.api.workdir / "audit.log", workdir / "operator.log"):
                        keep.joinpath(path.name).write_bytes(path.read_bytes())
            finally:
                proc = held[0]
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return run


def _verbs(counts: Counter[str]) -> str:
    return ", ".join(f"{v} {n}" for v, n in counts.most_common()) or "none"


def report(runs: list[Run], args: argparse.Namespace) -> list[str]:
    lines = [
        f"{args.nodes} kwok nodes x {args.gpus} GPUs ({args.gib} GiB, {args.replicas} "
        f"allocatable each: time-sliced), Slots of {args.slot_gib:g} GiB, unpinned",
    ]
    for run in runs:
        placed = f"{run.placed_s:.1f} s" if run.placed_s is not None else "not all"
        ready = (
            f"{run.ready_s:.1f} s"
            if run.ready_s is not None
            else f"not within {args.timeout:g} s ({run.ready} of {run.slots} Ready)"
        )
        steady_all = sum(run.steady_all.values()) / run.steady_s if run.steady_s else 0.0
        total = run.cpu_s + sum(run.others_cpu.values())
        steady_op = sum(run.steady_operator.values()) / run.steady_s if run.steady_s else 0.0
        lines += [
            "",
            f"[{run.label}] {run.slots} Slots",
            f"  kubectl apply -> all placed: {placed}; all Ready: {ready}",
            f"  operator: {run.cpu_s:.1f} CPU s over the run, RSS {run.rss_mb:.0f} MB "
            f"(peak {run.peak_mb:.0f} MB)",
            "  CPU s over the run of the others: "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(run.others_cpu.items()))
            + f"; all together with the operator's {total:.0f} CPU s: at least "
            f"{total / (os.cpu_count() or 1):.0f} s on {os.cpu_count()} cores",
            f"  API requests during the run, every client: {sum(run.run_all.values())} "
            f"({_verbs(run.run_all)})",
            f"  ... of them the operator's: {sum(run.run_operator.values())} "
            f"({_verbs(run.run_operator)})",
            f"  steady state, {run.steady_s:.0f} s: every client {steady_all:.2f} req/s "
            f"({_verbs(run.steady_all)}); the operator {steady_op:.2f} req/s "
            f"({_verbs(run.steady_operator)})",
            f"  ... the fields its steady-state patches of Slots and Models wrote: "
            f"{_verbs(run.steady_fields)}",
            "  the operator's last write: "
            + (
                "none after all Ready"
                if run.quiet_after_s is None
                else f"{run.quiet_after_s:.1f} s after all Ready"
            ),
            f"  per Slot: operator CPU {1000 * run.cpu_s / run.slots:.1f} ms, operator API "
            f"requests {sum(run.run_operator.values()) / run.slots:.1f}",
        ]
        lines += floor_lines(run)
        lines += restart_lines(run)
    lines += [
        "",
        "goals: steady state < 1 request/s for 1,000 slots (the operator's), converge < 60 s, "
        "operator RSS < 300 MB",
    ]
    return lines


def floor_lines(run: Run) -> list[str]:
    floor = run.floor
    if floor is None:
        return []
    if floor.ready_s is None:
        return [f"  floor: not all Ready ({floor.ready} of {floor.slots})"]
    ratio = f"{run.ready_s / floor.ready_s:.2f}x" if run.ready_s is not None else "n/a"
    total = sum(floor.cpu.values())
    return [
        f"  floor (the same Deployments and Services by kubectl, no operator): all Ready "
        f"in {floor.ready_s:.1f} s; slotctl's converge over the floor's: {ratio} "
        "(goal 1.25x)",
        f"  floor: API requests, every client: {sum(floor.requests.values())} "
        f"({sum(floor.requests.values()) / floor.slots:.1f} per Slot: "
        f"{_verbs(floor.requests)}); CPU s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(floor.cpu.items()))
        + f" ({total:.0f} together)",
    ]


def _quantiles(values: list[float | None]) -> str:
    known = sorted(v for v in values if v is not None)
    if not known:
        return "none"

    def at(q: float) -> float:
        return known[min(len(known) - 1, max(0, math.ceil(q * len(known)) - 1))]  # nearest rank

    missing = len(values) - len(known)
    return f"p50 {at(0.5):.2f} s, p99 {at(0.99):.2f} s, max {known[-1]:.2f} s" + (
        f" ({missing} never)" if missing else ""
    )


def restart_lines(run: Run) -> list[str]:
    r = run.restart
    if r is None:
        return []
    within = sum(1 for v in r.ready_s if v is not None and v <= 5.0)
    return [
        f"  restart (SIGKILL, a new Slot created while down, started again), {r.tries} tries "
        f"with {run.slots} Slots Ready:",
        f"    start -> first request (back): {_quantiles([*r.back_s])}",
        f"    back -> first decision (the new Slot's Deployment applied): "
        f"{_quantiles(r.decision_s)}",
        f"    back -> the new Slot Ready: {_quantiles(r.ready_s)}; within 5 s: {within} of "
        f"{r.tries} (goal: p99 within 5 s)",
        f"    the {r.pods} pods Ready before: {r.recreated} recreated, {r.restarted} "
        f"restarted; Slots with more than one pod: {r.duplicates} (goal: 0, 0, 0)",
    ]


def main(argv: list[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--gib", type=int, default=24)
    parser.add_argument("--replicas", type=int, default=12)
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--slot-gib", type=float, default=6.0)
    parser.add_argument("--steady", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--baseline", default=None, help="also measure this checkout first")
    parser.add_argument("--baseline-slots", type=int, default=None)
    parser.add_argument(
        "--baseline-only", action="store_true", help="measure only --baseline (a run of its own)"
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="then kill -9 and restart the operator this many times, a Slot created each time",
    )
    parser.add_argument("--keep", default=None, help="copy the audit and operator logs here")
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the floor (the operator's objects applied straight, no operator)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cluster is stopped on the way out
    print(
        f"slotctl bench/k8s_scale.py — {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    runs = []
    if args.baseline:
        slots = args.baseline_slots or args.slots
        runs.append(one_run(args, f"before: {args.baseline}", Path(args.baseline), slots))
    if not (args.baseline and args.baseline_only):
        runs.append(one_run(args, f"after: {REPO}", REPO, args.slots))
    for line in report(runs, args):
        print(line)
    return runs


if __name__ == "__main__":
    main()
