"""The bytes of a resolved file over HTTP: a lean, resumable reader shared by both sources.

Resolution stays where it is (the hub's own client library for hub files, a ``HEAD`` for
URLs); this module only moves bytes, as ``curl -L`` does and no slower by much:

* a blocking :mod:`http.client` connection in a worker thread reads the body straight into
  reusable blocks (``readinto`` into a ``bytearray`` — no per-chunk Python object, no
  re-chunking), and ``os.write`` appends each block to the partial file from that thread;
* a second thread hashes the blocks as they are filled (``hashlib`` releases the GIL for
  big buffers), so hashing overlaps reading and writing: the sha256 costs no wall time on
  a machine with a core to spare;
* ``Range: bytes=N-`` from the bytes on disk (with ``If-Range`` when the source gave a
  validator): a dropped connection is resumed from what was written, ``attempts`` times in
  a row without progress at most; a server that answers ``200`` to a range (it ignores
  ranges, or the file changed under ``If-Range``) restarts the partial file from zero;
* redirects are followed (the hub answers ``302`` to its CDN), and ``Authorization`` is
  dropped on a redirect to another origin (``httpx``'s rule, which ``huggingface_hub``
  relies on: a CDN's signed URL is its own credential; an ``http`` → ``https`` upgrade of
  the same host keeps it);
* a block is written once full, or once :data:`FLUSH_S` passed since the last write (a
  slow link shows progress and loses little): what a kill costs is the bytes read and not
  yet written, less than one block (:data:`CHUNK_BYTES`).

A cancelled pull (:meth:`PartialFile.cancel`) shuts the socket down, so a reader waiting on a
slow server wakes at once. No header value (a token), no URL query (a signature), no
``user:password@`` and no signed location is ever put in an error: errors name the declared
source (:attr:`RemoteFile.source`, ``hf://org/repo/file`` or the URL redacted). The standard
proxy variables are honoured as ``httpx`` and :mod:`urllib` read them (``HTTPS_PROXY``,
``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``; an ``http://`` proxy, with ``user:password@``
sent as ``Proxy-Authorization``): ``https`` through ``CONNECT`` (the proxy sees the host and
port, no header of the request), ``http`` as an absolute URL to the proxy. Called by
:mod:`controller.modelfiles.hub` and :mod:`controller.modelfiles.urls`, from a worker thread.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import queue
import re
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import SplitResult, quote, unquote, urljoin, urlsplit

from controller.model.errors import ModelAccessDenied, ModelPullFailed
from controller.modelfiles.partial import PartialFile, PullCancelled
from controller.modelfiles.redact import redact_url
from controller.modelfiles.remote import RemoteFile

__all__ = ["CHUNK_BYTES", "FLUSH_S", "StreamSettings", "fetch"]

CHUNK_BYTES: Final = 4 * 1024 * 1024  # one block: written and hashed as a unit
BLOCKS: Final = 4  # blocks in flight (one filling, the others waiting for the hasher)
READ_BYTES: Final = 1024 * 1024  # one readinto (what a connection reset can lose)
FLUSH_S: Final = 0.2  # a partly filled block is written after this long
MAX_REDIRECTS: Final = 10
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_CONTENT_RANGE: Final = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_PATH_SAFE: Final = "/%:@!$&'()*+,;=-._~"  # a path as it is, but for what must be escaped
_QUERY_SAFE: Final = _PATH_SAFE + "?"
_TRANSIENT: Final = (OSError, http.client.HTTPException)


@dataclass(frozen=True, slots=True)
class StreamSettings:
    connect_timeout_s: float = 30.0
    read_timeout_s: float = 60.0  # one read with no byte at all for this long fails it
    attempts: int = 5  # failures in a row without progress before giving up
    block_bytes: int = CHUNK_BYTES


class _Restart(Exception):
    """The answer does not continue the bytes on disk: start the file from zero."""


class _WriteFailed(Exception):
    """The partial file refused bytes (an I/O error, not the network's)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    return (
        parts.scheme,
        (parts.hostname or "").lower(),
        parts.port or _DEFAULT_PORTS.get(parts.scheme, 0),
    )


def redirect_headers(headers: Mapping[str, str], source: str, target: str) -> dict[str, str]:
    """The headers for following ``source``'s redirect to ``target``: ``Authorization``
    stays only on the same origin, or on an ``http`` → ``https`` upgrade of it."""
    kept = dict(headers)
    before, after = _origin(source), _origin(target)
    upgrade = (
        before[0] == "http"
        and after[0] == "https"
        and before[1] == after[1]
        and before[2] in (80, 0)
        and after[2] == 443
    )
    if before != after and not upgrade:
        for name in [k for k in kept if k.lower() == "authorization"]:
            del kept[name]
    return kept


_TLS: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    global _TLS
    if _TLS is None:
        context = ssl.create_default_context()
        with contextlib.suppress(ImportError, OSError):
            import certifi  # what httpx verifies with, where the system has no CA bundle

            context.load_verify_locations(certifi.where())
        _TLS = context
    return _TLS


class _Hasher:
    """Hashes the blocks handed to it, in order, on a thread of its own; gives each block
    back to the reader once hashed (the last slice of it)."""

    def __init__(self, partial: PartialFile, blocks: int, block_bytes: int) -> None:
        self.partial = partial
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(blocks):
            self.free.put(bytearray(block_bytes))
        self._work: queue.Queue[tuple[bytearray, int, int, bool] | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="slotctl-pull-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            block, start, end, last = item
            if self._failure is None and end > start:
                try:
                    self.partial.absorb(memoryview(block)[start:end])
                except BaseException as exc:  # noqa: BLE001  (handed to the reader)
                    self._failure = exc
            if last:
                self.free.put(block)

    def submit(self, block: bytearray, start: int, end: int, *, last: bool) -> None:
        self._work.put((block, start, end, last))

    def take(self) -> bytearray:
        return self.free.get()

    def drain(self) -> None:
        """Wait until every block handed over is hashed (the partial file's hash is whole)."""
        self._work.put(None)
        self._thread.join()
        if self._failure is not None:
            raise self._failure

    def restart(self) -> None:
        """Drain and go on with a fresh thread (after the partial file was cut)."""
        self.drain()
        self._thread = threading.Thread(target=self._run, name="slotctl-pull-hash", daemon=True)
        self._thread.start()


class _Reader:
    """One file's transfer (see the module text)."""

    def __init__(self, remote: RemoteFile, partial: PartialFile, settings: StreamSettings) -> None:
        self.remote = remote
        self.partial = partial
        self.settings = settings
        # what errors name: the declared source, never the signed location fetched
        self.source = remote.source or redact_url(remote.url)
        self.shown = self.source
        self._sock_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._written = 0  # bytes written by this reader (what progress is)
        self._hasher = _Hasher(partial, BLOCKS, settings.block_bytes)
        partial.on_cancel(self._wake)

    # -- cancellation --------------------------------------------------------------------

    def _wake(self) -> None:
        with self._sock_lock:
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _check(self) -> None:
        if self.partial.cancelled:
            raise PullCancelled(str(self.partial.path))

    # -- the loop of attempts ------------------------------------------------------------

    def run(self) -> None:
        failures = 0
        try:
            while True:
                self._check()
                before = self._written
                try:
                    if self._once():
                        return
                    failure = f"the body ended at {self.partial.size} of {self.remote.size} bytes"
                except _Restart:
                    self._hasher.restart()
                    self.partial.restart()
                    failure = "its answers do not continue the bytes on disk"
                except _WriteFailed as exc:
                    raise ModelPullFailed(
                        f"cannot write {self.partial.path}: "
                        f"{exc.error.strerror or type(exc.error).__name__}",
                        source=self.source,
                        reason="write",
                    ) from None
                except ssl.SSLCertVerificationError as exc:
                    raise ModelPullFailed(
                        f"{self.shown}: the server's certificate was refused "
                        f"({exc.verify_message or exc.reason})",
                        source=self.source,
                        reason="tls",
                    ) from None
                except _TRANSIENT as exc:
                    self._check()
                    failure = f"{type(exc).__name__}"
                if self._written > before:  # bytes came (a restart from zero brought none)
                    failures = 0
                else:
                    failures += 1
                if failures >= self.settings.attempts:
                    raise ModelPullFailed(
                        f"{self.shown}: {failure}, {self.settings.attempts} times in a row "
                        f"without progress ({self.partial.size} bytes kept to resume)",
                        source=self.source,
                        reason="network",
                    )
                if self.partial.wait_cancelled(min(0.2 * 2**failures, 5.0)):
                    self._check()
        finally:
            self._hasher.drain()

    # -- one request ---------------------------------------------------------------------

    def _connect(self, url: str) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
        """A connection for ``url`` (through its proxy, if the environment names one), the
        request target to send on it, and the headers for the proxy (its credentials)."""
        parts = urlsplit(url)
        if parts.scheme not in _DEFAULT_PORTS:
            raise ModelPullFailed(
                f"{self.shown}: redirected to a {parts.scheme or 'relative'} URL",
                source=self.source,
                reason="http",
            )
        # host and port apart: http.client would read an IPv6 literal's last group as a port
        host = parts.hostname or ""
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
        target = quote(parts.path or "/", safe=_PATH_SAFE)
        if parts.query:
            target += "?" + quote(parts.query, safe=_QUERY_SAFE)
        timeout = self.settings.connect_timeout_s
        proxy = self._proxy(parts)
        to_proxy: dict[str, str] = {}
        conn: http.client.HTTPConnection
        if proxy is None:
            if parts.scheme == "https":
                conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=_tls())
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
        else:
            if proxy.username is not None:
                to_proxy["Proxy-Authorization"] = _basic(proxy.username, proxy.password)
            proxy_host, proxy_port = proxy.hostname or "", proxy.port or 80
            if parts.scheme == "https":
                # CONNECT: the proxy sees the host and port, never a header of the request
                conn = http.client.HTTPSConnection(
                    proxy_host, proxy_port, timeout=timeout, context=_tls()
                )
                conn.set_tunnel(host, port, headers=to_proxy)
                to_proxy = {}
            else:
                # plain http: the absolute URL to the proxy (no user:password in it)
                conn = http.client.HTTPConnection(proxy_host, proxy_port, timeout=timeout)
                shown_host = f"[{host}]" if ":" in host else host
                if port != _DEFAULT_PORTS["http"]:
                    shown_host += f":{port}"
                target = f"http://{shown_host}{target}"
        try:
            conn.connect()
        except OSError as exc:
            tunnel = re.match(r"Tunnel connection failed: (\d+)", str(exc))
            if proxy is None or tunnel is None:
                raise
            conn.close()
            code = int(tunnel.group(1))  # the proxy refused the CONNECT: no retry mends it
            raise ModelPullFailed(
                f"{self.shown}: the proxy refused the tunnel ({code})",
                source=self.source,
                reason="proxy",
                status=code,
            ) from None
        assert conn.sock is not None
        conn.sock.settimeout(self.settings.read_timeout_s)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._sock_lock:
            self._sock = conn.sock
        if self.partial.cancelled:
            self._wake()
        return conn, target, to_proxy

    def _proxy(self, parts: SplitResult) -> SplitResult | None:
        """The proxy for a URL, as ``httpx`` and ``urllib`` find it: ``HTTPS_PROXY`` /
        ``HTTP_PROXY`` (then ``ALL_PROXY``) unless ``NO_PROXY`` names the host."""
        proxies = urllib.request.getproxies()
        value = proxies.get(parts.scheme) or proxies.get("all")
        if not value:
            return None
        hostport = parts.netloc.rpartition("@")[2]
        if urllib.request.proxy_bypass(hostport):
            return None
        proxy = urlsplit(value if "://" in value else "http://" + value)
        if proxy.scheme != "http" or not proxy.hostname:
            where = proxy.netloc.rpartition("@")[2]  # never the proxy's password
            raise ModelPullFailed(
                f"{self.shown}: the proxy {proxy.scheme}://{where} is not an http:// proxy "
                "(the only kind supported)",
                source=self.source,
                reason="proxy",
            )
        return proxy

    def _once(self) -> bool:
        """One request (following redirects) from the bytes on disk; True once the file
        is whole (as far as its size is known), False when the body ended short."""
        offset = self.partial.size
        size = self.remote.size
        if size is not None and offset >= size:
            return True
        url = self.remote.url
        headers = {**self.remote.headers, "Accept-Encoding": "identity"}
        parts = urlsplit(url)
        if parts.username is not None and not any(k.lower() == "authorization" for k in headers):
            # credentials in the URL (user:password@host), as curl and aiohttp send them
            headers["Authorization"] = _basic(parts.username, parts.password)
        if offset:
            headers["Range"] = f"bytes={offset}-"
            if self.remote.validator:
                headers["If-Range"] = self.remote.validator
        for _ in range(MAX_REDIRECTS + 1):
            conn, target, to_proxy = self._connect(url)
            try:
                conn.request("GET", target, headers={**headers, **to_proxy})
                resp = conn.getresponse()
                location = resp.getheader("Location")
                if resp.status in _REDIRECTS and location:
                    follow = urljoin(url, location)
                    headers = redirect_headers(headers, url, follow)
                    url = follow
                    continue
                return self._answer(resp, offset)
            finally:
                with self._sock_lock:
                    self._sock = None
                conn.close()
        raise ModelPullFailed(
            f"{self.shown}: more than {MAX_REDIRECTS} redirects",
            source=self.source,
            reason="http",
        )

    def _answer(self, resp: http.client.HTTPResponse, offset: int) -> bool:
        status = resp.status
        size = self.remote.size
        if status == 416 and size is not None and offset >= size:
            return True
        _raise_for(status, self.source, self.shown)
        if status == 206:
            match = _CONTENT_RANGE.match(resp.getheader("Content-Range") or "")
            if not match or int(match.group(1)) != offset:
                raise _Restart
        elif status == 200:
            if offset:
                # The range was ignored, or the file changed (If-Range): from zero, with
                # this very answer.
                self._hasher.restart()
                self.partial.restart()
        else:
            raise ModelPullFailed(
                f"{self.shown} answered {status}",
                source=self.source,
                reason="http",
                status=status,
            )
        complete = self._body(resp)
        return complete and (size is None or self.partial.size >= size)

    def _body(self, resp: http.client.HTTPResponse) -> bool:
        """Read the body into blocks; write each (here) and hash it (the hasher's thread).
        True when the body came whole (its ``Content-Length``, or the end of a chunked or
        close-delimited body)."""
        hasher = self._hasher
        block_bytes = self.settings.block_bytes
        block = hasher.take()
        owned = True  # the block is ours until handed back to the pool
        view = memoryview(block)
        start = filled = 0
        flushed_at = time.monotonic()

        def flush() -> None:
            """Write ``view[start:filled]``, then hand it to the hasher."""
            nonlocal start, flushed_at
            if filled > start:
                try:
                    self.partial.append(view[start:filled])
                except OSError as exc:
                    raise _WriteFailed(exc) from exc
                self._written += filled - start
                hasher.submit(block, start, filled, last=False)
                start = filled
            flushed_at = time.monotonic()

        try:
            while True:
                try:
                    n = resp.readinto(view[filled : min(filled + READ_BYTES, block_bytes)])
                except _TRANSIENT:
                    # Bytes read before a drop are good bytes (TCP kept their order):
                    # written, so a resume asks for the rest only.
                    flush()
                    raise
                if not n:
                    # a cancel shuts the socket down: an end of a body without a length
                    # that is no end (what was read and not written stays unwritten)
                    self._check()
                    flush()
                    return not resp.length
                filled += n
                if filled == block_bytes:
                    flush()
                    owned = False
                    hasher.submit(block, 0, 0, last=True)
                    block = hasher.take()
                    owned = True
                    view = memoryview(block)
                    start = filled = 0
                elif time.monotonic() - flushed_at >= FLUSH_S:
                    flush()
        finally:
            if owned:  # back to the pool once the hasher is done with it
                hasher.submit(block, 0, 0, last=True)


def _basic(user: str, password: str | None) -> str:
    """``Authorization``'s (or ``Proxy-Authorization``'s) value for a URL's credentials."""
    pair = f"{unquote(user)}:{unquote(password or '')}"
    return "Basic " + base64.b64encode(pair.encode()).decode("ascii")


def _raise_for(status: int, url: str, shown: str) -> None:
    if status < 400 or status == 416:
        return
    if status in (401, 403):
        raise ModelAccessDenied(
            f"{shown} answered {status}",
            source=url,
            reason="unauthorized",
            token_sent=False,
            status=status,
        )
    if status == 407:
        raise ModelPullFailed(
            f"{shown}: the proxy answered 407 (its credentials: user:password@ in the "
            "proxy variable)",
            source=url,
            reason="proxy",
            status=407,
        )
    if status == 404:
        raise ModelPullFailed(
            f"{shown} answered 404", source=url, reason="file_not_found", status=404
        )
    raise ModelPullFailed(f"{shown} answered {status}", source=url, reason="http", status=status)


def fetch(remote: RemoteFile, partial: PartialFile, settings: StreamSettings) -> None:
    """The bytes of ``remote`` after ``partial.size`` into ``partial`` (blocking: run it
    in a worker thread). Raises :class:`PullCancelled` once the pull is cancelled, typed
    errors for refusals and for a connection that makes no progress."""
    _Reader(remote, partial, settings).run()
