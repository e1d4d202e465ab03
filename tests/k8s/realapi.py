"""A real Kubernetes API server for the operator tests, as controller-runtime's envtest
does it: the upstream ``kube-apiserver`` (built from the ``k8s.io/kubernetes`` module by
``tools/k8s/build.sh``) on 127.0.0.1, backed by etcd (its own storage, built into the same
binary), with no kubelet, scheduler or controller-manager.

:func:`start` generates a CA, a serving certificate for 127.0.0.1, a service-account
signing key and an admin token in ``system:masters``, starts etcd and the API server with
``--authorization-mode=RBAC`` and waits for ``/readyz``. :class:`Kube` is a small async
client (the tests' ``kubectl``), :func:`kubeconfig` writes what the operator reads.

The binaries come from ``$SLOTCTL_K8S_BIN`` or the build cache
(``~/.cache/slotctl/k8s/<version key>/``: each command a link to the one binary the build
makes, ``slotctl-k8s``); :func:`binaries` returns ``None`` when neither has them, and the
tests skip, unless ``SLOTCTL_K8S_APISERVER=1`` asked for this tier (then a missing build is
a failure: ``make test`` builds first with that variable set).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import secrets
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from tests.integration.helpers import free_ports

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.0"
KWOK_VERSION = "v0.8.0"
BUILD = REPO / "tools" / "k8s" / "build.sh"
TEST_AGENT = "slotctl-tests/kubectl"


def cache_dir() -> Path:
    root = os.environ.get("SLOTCTL_K8S_CACHE") or str(Path.home() / ".cache/slotctl/k8s")
    return Path(root) / f"{K8S_VERSION}-etcd-{ETCD_VERSION}-kwok-{KWOK_VERSION}"


def requested() -> bool:
    """``SLOTCTL_K8S_APISERVER=1``: this tier must run (a missing build fails)."""
    return os.environ.get("SLOTCTL_K8S_APISERVER") == "1"


def binaries() -> Path | None:
    """The folder holding ``kube-apiserver`` and ``etcd``, or None when not built."""
    folder = Path(os.environ.get("SLOTCTL_K8S_BIN") or cache_dir())
    if all(os.access(folder / name, os.X_OK) for name in ("kube-apiserver", "etcd")):
        return folder
    return None


# ---------------------------------------------------------------------- certificates


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
    else:
        usage = x509.KeyUsage(True, False, True, False, False, False, False, False, False)
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        ).add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    builder = builder.add_extension(usage, critical=True)
    signer = issuer[1] if issuer else key
    return builder.sign(signer, hashes.SHA256())


def write_pki(folder: Path) -> dict[str, Path]:
    """CA, serving cert/key for 127.0.0.1, service-account key pair (PEM files)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("slotctl-test-ca", ca_key, None, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("kube-apiserver", key, (ca, ca_key), ca=False)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = {
        "ca": ca.public_bytes(serialization.Encoding.PEM),
        "cert": cert.public_bytes(serialization.Encoding.PEM),
        "key": _pem_key(key),
        "sa-key": _pem_key(sa_key),
        "sa-pub": sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    paths = {}
    for name, data in files.items():
        path = folder / f"{name}.pem"
        path.write_bytes(data)
        path.chmod(0o600)
        paths[name] = path
    return paths


# ---------------------------------------------------------------------- the servers


@dataclass
class ApiServer:
    """A running etcd + kube-apiserver pair and how to reach it as the admin."""

    url: str
    ca: Path
    admin_token: str
    workdir: Path
    logs: dict[str, Path]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def kubeconfig(self, path: Path, token: str | None = None, namespace: str = "") -> Path:
        return kubeconfig(path, self.url, self.ca, token or self.admin_token, namespace)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        """A blocking request as the admin (set-up only; tests use :class:`Kube`)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.admin_token}",
                "Content-Type": content_type,
                "User-Agent": TEST_AGENT,
            },
        )
        try:
            with urllib.request.urlopen(req, context=self.ssl_context(), timeout=30) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()
        except urllib.error.HTTPError as err:
            raw = err.read()
            return err.code, json.loads(raw) if raw[:1] == b"{" else raw.decode()

    def requests_of(self, user: str) -> set[tuple[str, str, str]]:
        """Every (verb, apiGroup, resource[/subresource]) ``user`` sent, as RBAC names
        them, from the server's audit log (discovery and other non-resource URLs left out)."""
        out = set()
        path = self.workdir / "audit.log"
        text = path.read_text()
        deadline = time.monotonic() + 30
        while text and not text.endswith("\n") and time.monotonic() < deadline:
            time.sleep(0.05)  # the server is writing its last event: wait for its end
            text = path.read_text()
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                continue  # (still torn after the wait: the test's own assertions tell)
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if event["user"].get("username") != user or not ref.get("resource"):
                continue
            resource = ref["resource"] + (
                f"/{ref['subresource']}" if ref.get("subresource") else ""
            )
            out.add((event["verb"], ref.get("apiGroup", ""), resource))
        return out

    def tail(self, lines: int = 40) -> str:
        out = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            out.append(f"--- {name} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def stop(self) -> None:
        """The API server first (its graceful shutdown still talks to etcd), then etcd."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:g}s")


def start(workdir: Path, bin_dir: Path, timeout: float = 120.0, *, audit: bool = True) -> ApiServer:
    """Start etcd and kube-apiserver under ``workdir``; returns once ``/readyz`` is ok.
    ``audit``: write the audit log (every request: the least-privilege checks read it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    pki = write_pki(workdir / "pki")
    admin_token = secrets.token_hex(16)
    tokens = workdir / "tokens.csv"
    tokens.write_text(f'{admin_token},admin,admin-uid,"system:masters"\n')
    tokens.chmod(0o600)
    audit_policy = workdir / "audit-policy.yaml"
    audit_policy.write_text(
        json.dumps(
            {
                "apiVersion": "audit.k8s.io/v1",
                "kind": "Policy",
                "omitStages": ["RequestReceived"],
                "rules": [
                    # the bodies of the patches to slotctl's CRs (bench/k8s_scale.py
                    # tells which fields a steady state's writes change)
                    {
                        "level": "Request",
                        "verbs": ["patch"],
                        "resources": [{"group": "slotctl.io"}],
                    },
                    {"level": "Metadata"},
                ],
            }
        )
    )
    etcd_port, peer_port, api_port = free_ports(3)
    logs = {"etcd": workdir / "etcd.log", "kube-apiserver": workdir / "kube-apiserver.log"}
    server = ApiServer(
        url=f"https://127.0.0.1:{api_port}",
        ca=pki["ca"],
        admin_token=admin_token,
        workdir=workdir,
        logs=logs,
    )
    try:
        with logs["etcd"].open("wb") as out:
            etcd = subprocess.Popen(
                [
                    str(bin_dir / "etcd"),
                    f"--data-dir={workdir / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                    # one member, its peer port on loopback (the default, 2380, would be
                    # shared by every server of a parallel run)
                    f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                    # a throwaway store: no fsync per commit (a loaded CI disk would
                    # otherwise pace every write)
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        server.procs.append(etcd)
        _wait_port(etcd_port, etcd, "etcd", 30)
        with logs["kube-apiserver"].open("wb") as out:
            api = subprocess.Popen(
                [
                    str(bin_dir / "kube-apiserver"),
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    "--endpoint-reconciler-type=none",  # loopback: no kubernetes Endpoints
                    f"--secure-port={api_port}",
                    f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                    f"--cert-dir={workdir / 'certs'}",
                    f"--tls-cert-file={pki['cert']}",
                    f"--tls-private-key-file={pki['key']}",
                    f"--token-auth-file={tokens}",
                    "--authorization-mode=RBAC",
                    *(
                        [
                            f"--audit-policy-file={audit_policy}",
                            f"--audit-log-path={workdir / 'audit.log'}",
                            "--audit-log-mode=blocking",
                        ]
                        if audit
                        else []
                    ),
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                    f"--service-account-key-file={pki['sa-pub']}",
                    f"--service-account-signing-key-file={pki['sa-key']}",
                    "--service-cluster-ip-range=10.0.0.0/16",  # a Service per slot: room for 1000s
                    "--profiling=false",
                    "--enable-priority-and-fairness=false",
                    "--v=1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        server.procs.append(api)
        deadline = time.monotonic() + timeout
        while True:
            if api.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited with {api.returncode}")
            with contextlib.suppress(OSError):
                status, _body = server.request("GET", "/readyz")
                if status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready within {timeout:g}s")
            time.sleep(0.2)
    except BaseException as err:
        tail = server.tail()
        server.stop()
        raise RuntimeError(f"the API server did not start: {err}\n{tail}") from err
    return server


@contextlib.contextmanager
def running(workdir: Path, bin_dir: Path) -> Iterator[ApiServer]:
    server = start(workdir, bin_dir)
    try:
        yield server
    finally:
        server.stop()


def kubeconfig(path: Path, url: str, ca: Path, token: str, namespace: str = "") -> Path:
    context: dict[str, str] = {"cluster": "real", "user": "user"}
    if namespace:
        context["namespace"] = namespace
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "real", "cluster": {"server": url, "certificate-authority": str(ca)}}
                ],
                "users": [{"name": "user", "user": {"token": token}}],
                "contexts": [{"name": "real", "context": context}],
                "current-context": "real",
            }
        )
    )
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------------- paths


_CORE = {"namespaces", "events", "serviceaccounts", "configmaps", "secrets", "pods"}
_RBAC = {"roles", "rolebindings", "clusterroles", "clusterrolebindings"}
_CLUSTER_SCOPED = {"namespaces", "clusterroles", "clusterrolebindings", "customresourcedefinitions"}


def path_of(plural: str, namespace: str | None, name: str | None = None, sub: str = "") -> str:
    """The REST path of a resource (the few kinds these tests touch)."""
    if plural in _CORE:
        base = "/api/v1"
    elif plural in _RBAC:
        base = "/apis/rbac.authorization.k8s.io/v1"
    elif plural == "customresourcedefinitions":
        base = "/apis/apiextensions.k8s.io/v1"
    else:
        base = "/apis/slotctl.io/v1alpha1"
    path = base + ("" if plural in _CLUSTER_SCOPED else f"/namespaces/{namespace}")
    path += f"/{plural}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def plural_of(kind: str) -> str:
    return {"ServiceAccount": "serviceaccounts", "Alias": "aliases"}.get(kind, kind.lower() + "s")


# ---------------------------------------------------------------------- the client


class ApiError(AssertionError):
    """A refused request: ``status`` and the server's ``Status`` body."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body if isinstance(body, dict) else {"message": str(body)}
        super().__init__(f"HTTP {status}: {self.body.get('message', body)}")


@dataclass
class Response:
    status: int
    body: Any
    warnings: list[str]


class Kube:
    """An async ``kubectl`` for one namespace, with the token it was given."""

    def __init__(self, server: ApiServer, token: str, namespace: str) -> None:
        self.server = server
        self.namespace = namespace
        self.session = aiohttp.ClientSession(
            base_url=server.url,
            headers={"Authorization": f"Bearer {token}", "User-Agent": TEST_AGENT},
            connector=aiohttp.TCPConnector(ssl=server.ssl_context()),
        )

    async def close(self) -> None:
        await self.session.close()

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Response:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self.session.request(
            method, path, data=data, headers=headers, params=params
        ) as resp:
            text = await resp.text()
            parsed: Any = json.loads(text) if text[:1] == "{" else text
            warnings = resp.headers.getall("Warning", [])
            return Response(resp.status, parsed, list(warnings))

    async def checked(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        resp = await self.call(method, path, body, **kw)
        if resp.status >= 300:
            raise ApiError(resp.status, resp.body)
        return resp.body

    def _ns(self, namespace: str | None) -> str:
        return namespace or self.namespace

    async def create(self, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        ns = self._ns(namespace or obj.get("metadata", {}).get("namespace"))
        result: dict[str, Any] = await self.checked(
            "POST", path_of(plural_of(obj["kind"]), ns), obj
        )
        return result

    async def get(
        self, plural: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        resp = await self.call("GET", path_of(plural, self._ns(namespace), name))
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise ApiError(resp.status, resp.body)
        result: dict[str, Any] = resp.body
        return result

    async def patch(
        self,
        plural: str,
        name: str,
        body: Any,
        namespace: str | None = None,
        sub: str = "",
        content_type: str = "application/merge-patch+json",
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self.checked(
            "PATCH",
            path_of(plural, self._ns(namespace), name, sub),
            body,
            content_type=content_type,
        )
        return result

    async def edit(
        self, plural: str, name: str, spec: dict[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        """``kubectl edit`` of the spec (the server bumps ``metadata.generation``)."""
        return await self.patch(plural, name, {"spec": spec}, namespace)

    async def delete(self, plural: str, name: str, namespace: str | None = None) -> None:
        await self.checked("DELETE", path_of(plural, self._ns(namespace), name))

    async def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        data = await self.checked("GET", path_of("events", self._ns(namespace)))
        return list(data.get("items", []))


# ---------------------------------------------------------------------- set-up helpers


def apply(server: ApiServer, docs: list[dict[str, Any]], field_manager: str = "tests") -> None:
    """Server-side apply as the admin (create or update)."""
    for doc in docs:
        meta = doc["metadata"]
        path = path_of(plural_of(doc["kind"]), meta.get("namespace"), meta["name"])
        status, body = server.request(
            "PATCH",
            f"{path}?fieldManager={field_manager}&force=true",
            doc,
            content_type="application/apply-patch+yaml",
        )
        if status >= 300:
            raise ApiError(status, body)


def install_crds(server: ApiServer, folder: Path, timeout: float = 60.0) -> list[str]:
    """Apply every CRD in ``folder`` and wait until each is Established."""
    docs = [
        d
        for p in sorted(folder.glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d and d.get("kind") == "CustomResourceDefinition"
    ]
    apply(server, docs)
    names = [d["metadata"]["name"] for d in docs]
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            status, body = server.request("GET", path_of("customresourcedefinitions", None, name))
            conds = (body.get("status") or {}).get("conditions") or [] if status == 200 else []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"CRD {name} not Established: {body}")
            time.sleep(0.1)
    # Established is not yet servable: a list answers 429 "storage is (re)initializing"
    # until the resource's watch cache has started.
    for doc in docs:
        spec = doc["spec"]
        path = f"/apis/{spec['group']}/{spec['versions'][0]['name']}/{spec['names']['plural']}"
        while (status := server.request("GET", path)[0]) != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} answers {status}")
            time.sleep(0.1)
    return names


def create_namespace(server: ApiServer, name: str) -> None:
    status, body = server.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    if status >= 300:
        raise ApiError(status, body)


def service_account_token(server: ApiServer, namespace: str, name: str) -> str:
    """A TokenRequest for the ServiceAccount (what the kubelet mounts into a pod)."""
    status, body = server.request(
        "POST",
        path_of("serviceaccounts", namespace, name, "token"),
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600},
        },
    )
    if status >= 300:
        raise ApiError(status, body)
    return str(body["status"]["token"])


def delete_all_crs(server: ApiServer, namespace: str) -> None:
    """Every resource of every slotctl.io kind in ``namespace`` (the kinds read from the
    server's CRDs, so that a new kind is not forgotten), finalizers released first (a
    test's operator may be gone). A leftover is seen by a later cluster-wide operator on
    the same server: an Adapter left behind kept its id, unique across namespaces, and
    the next test's Adapter of that id was refused (``adapter.duplicate_id``)."""
    for plural in slotctl_plurals(server):
        status, body = server.request("GET", path_of(plural, namespace))
        if status != 200:
            raise ApiError(status, body)
        for item in body.get("items", []):
            name = item["metadata"]["name"]
            if item["metadata"].get("finalizers"):
                server.request(
                    "PATCH",
                    path_of(plural, namespace, name),
                    {"metadata": {"finalizers": None}},
                    content_type="application/merge-patch+json",
                )
            server.request("DELETE", path_of(plural, namespace, name))


def slotctl_plurals(server: ApiServer) -> list[str]:
    """The plural of every slotctl.io kind the server has a CRD of."""
    status, body = server.request("GET", path_of("customresourcedefinitions", None))
    if status != 200:
        raise ApiError(status, body)
    return sorted(
        item["spec"]["names"]["plural"]
        for item in body.get("items", [])
        if item["spec"]["group"] == "slotctl.io"
    )
