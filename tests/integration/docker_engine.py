"""A Docker engine and a tiny image for the integration tests (no registry needed).

Used by the session fixtures in ``tests/integration/conftest.py``:

* :func:`reachable_engine` finds an engine that already answers (``DOCKER_HOST``, then
  ``/var/run/docker.sock``);
* otherwise :class:`PrivateDockerd` starts a throw-away ``dockerd`` in a temp dir (its own
  data root, exec root, pid file and unix socket; no iptables, no bridge: containers use
  the host network), tries the ``overlay2`` storage driver first and falls back to
  ``vfs``, waits for ``/_ping`` and stops it again (SIGTERM, wait, SIGKILL as a last
  resort) so nothing is left running;
* :func:`import_base_image` ``docker import``\\ s an almost empty root filesystem built in
  memory with :mod:`tarfile` (``proc sys dev tmp etc sbin`` as real directories so the
  engine can mount over them, ``bin``/``lib``/``lib64`` as symlinks into ``usr``). A
  container of it runs the *host's* binaries: the tests bind-mount ``/usr``, ``/etc``
  and the Python install read-only (the ``demo`` provider adds the interpreter and the
  package itself). ``init=True`` gives it a real PID 1 (``docker-init``) so SIGTERM
  reaches the server.

Nothing here imports pytest: the fixtures decide whether a missing engine skips or fails
(``SLOTCTL_REQUIRE_DOCKER=1``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests

__all__ = [
    "BASE_IMAGE",
    "TEST_LABEL",
    "Engine",
    "EngineUnavailable",
    "PrivateDockerd",
    "client_for",
    "import_base_image",
    "ping",
    "reachable_engine",
    "remove_test_containers",
    "rootfs_tarball",
]

BASE_IMAGE = "slotctl-test/base:1"
DEFAULT_SOCKET = "unix:///var/run/docker.sock"
STORAGE_DRIVERS = ("overlay2", "vfs")
MNT_DETACH = 2
# Containers a test makes by hand (not through the runtime) carry this label with the
# test's stack name, so the per-test cleanup finds them without a slotctl label.
TEST_LABEL = "slotctl-test.stack"


class EngineUnavailable(RuntimeError):
    """No engine answers and none could be started (the message says why)."""


@dataclass(frozen=True)
class Engine:
    """The engine the tests use: where it listens and whether we started it."""

    base_url: str
    private: bool
    storage_driver: str | None = None


def client_for(base_url: str, *, timeout: int = 30) -> Any:
    """A ``docker.DockerClient`` for ``base_url`` (connects: negotiates the API version)."""
    return docker.DockerClient(base_url=base_url, version="auto", timeout=timeout)


def ping(base_url: str, *, timeout: float = 2.0) -> bool:
    """True when an engine answers ``/_ping`` at ``base_url``.

    Unix sockets are pinged with a plain socket: the SDK's unix connection leaks its
    socket when the connect fails (a ResourceWarning, i.e. an error under
    ``filterwarnings = error``).
    """
    if base_url.startswith("unix://"):
        return _unix_ping(base_url.removeprefix("unix://"), timeout)
    try:
        client = docker.APIClient(base_url=base_url, version="1.41", timeout=int(timeout) or 1)
    except docker.errors.DockerException:
        return False
    try:
        return bool(client.ping())
    except (docker.errors.DockerException, requests.RequestException, OSError):
        return False
    finally:
        client.close()


def _unix_ping(path: str, timeout: float) -> bool:
    if not Path(path).exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
    except OSError:
        return False
    status, _, _ = reply.partition(b"\r\n")
    return status.split(b" ")[1:2] == [b"200"] and reply.endswith(b"OK")


def reachable_engine() -> str | None:
    """``DOCKER_HOST`` when set and answering, else the default socket if it answers."""
    host = os.environ.get("DOCKER_HOST")
    if host:
        return host if ping(host) else None
    return DEFAULT_SOCKET if ping(DEFAULT_SOCKET) else None


@dataclass
class PrivateDockerd:
    """A ``dockerd`` of our own, under a temp dir, stopped by :meth:`stop`."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="slotctl-dockerd-")))
    startup_timeout_s: float = 30.0
    proc: subprocess.Popen[bytes] | None = None
    storage_driver: str | None = None
    attempts: list[str] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.root / "dockerd.log"

    def start(self) -> str:
        """Start the engine; the base URL, or :class:`EngineUnavailable` with the reasons."""
        binary = shutil.which("dockerd")
        if binary is None:
            self.cleanup()
            raise EngineUnavailable(
                "no Docker engine answers (DOCKER_HOST / /var/run/docker.sock) and the "
                "dockerd binary is not installed (apt-get install docker.io)"
            )
        for driver in STORAGE_DRIVERS:
            if self._try_start(binary, driver):
                self.storage_driver = driver
                return self.base_url
        self.cleanup()
        reasons = "; ".join(self.attempts) or "unknown reason"
        raise EngineUnavailable(f"could not start a private dockerd: {reasons}")

    def _argv(self, binary: str, driver: str) -> list[str]:
        data, exec_root = self.root / f"data-{driver}", self.root / "exec"
        return [
            binary,
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            f"--storage-driver={driver}",
            f"--data-root={data}",
            f"--exec-root={exec_root}",
            f"--pidfile={self.root / 'docker.pid'}",
            "--log-level=warn",
            "-H",
            self.base_url,
        ]

    def _try_start(self, binary: str, driver: str) -> bool:
        with self.log_path.open("ab") as log:
            log.write(f"--- starting dockerd with storage driver {driver}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self._argv(binary, driver),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of pytest is not forwarded to the engine
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.attempts.append(
                    f"{driver}: dockerd exited with code {self.proc.returncode}: {self._log_tail()}"
                )
                self.proc = None
                return False
            if self.socket.exists() and ping(self.base_url, timeout=1):
                return True
            time.sleep(0.1)
        self.attempts.append(
            f"{driver}: no answer within {self.startup_timeout_s:.0f}s: {self._log_tail()}"
        )
        self._terminate()
        return False

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])

    def _terminate(self, timeout: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # dockerd ignored SIGTERM for too long: kill its whole session (containerd too).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop(self) -> None:
        """Stop the engine (its containerd goes with it) and delete its directory."""
        self._terminate()
        self.cleanup()

    def cleanup(self) -> None:
        """Unmount what the engine left mounted under its root, then delete the root.

        Even a clean dockerd shutdown leaves its ``exec/netns/default`` nsfs bind mount
        behind (and a killed one its container mounts): detach them (deepest first)
        so the directory can go and no mount outlives the session.
        """
        for mount_point in sorted(_mounts_under(self.root), key=len, reverse=True):
            _detach(mount_point)
        shutil.rmtree(self.root, ignore_errors=True)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve())
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 2:
                continue
            point = fields[1].encode().decode("unicode_escape")  # \040 = space, ...
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return found


def _detach(mount_point: str) -> None:
    """``umount2(path, MNT_DETACH)`` through libc (no child process, no shell)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(os.fsencode(mount_point), MNT_DETACH)


def rootfs_tarball() -> bytes:
    """An almost empty root filesystem: mount points and symlinks into ``/usr``."""
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("proc", "sys", "dev", "tmp", "etc", "sbin", "usr", "root", "run"):
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if name == "tmp" else 0o755
            info.mtime = now
            tar.addfile(info)
        links = {"bin": "usr/bin", "lib": "usr/lib"}
        if Path("/lib64").exists():
            links["lib64"] = "usr/lib64"
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            info.mtime = now
            tar.addfile(info)
    return buffer.getvalue()


def import_base_image(client: Any, reference: str = BASE_IMAGE) -> str:
    """``docker import`` the rootfs as ``reference`` (once: reused when present); its id."""
    try:
        return str(client.images.get(reference).id)
    except docker.errors.ImageNotFound:
        pass
    repository, _, tag = reference.rpartition(":")
    client.api.import_image_from_data(rootfs_tarball(), repository=repository, tag=tag)
    return str(client.images.get(reference).id)


def remove_test_containers(client: Any, stack: str) -> list[str]:
    """Force-remove every container of a test's ``stack`` (runtime-made or hand-made).

    Runtime-made containers carry ``slotctl.stack=<stack>``; hand-made ones (the
    "unmanaged container" cases) carry :data:`TEST_LABEL`. Returns the removed names.
    """
    removed = []
    for label in (f"slotctl.stack={stack}", f"{TEST_LABEL}={stack}"):
        for container in client.containers.list(
            all=True, filters={"label": label}, ignore_removed=True
        ):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
                removed.append(str(container.name))
    return removed
