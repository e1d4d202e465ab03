"""The bytes of a resolved file over HTTP: a lean, resumable reader shared by both sources.

Resolution stays where it is (the hub's own client library for hub files, a ``HEAD`` for
URLs); this module only moves bytes, as ``curl -L`` does and no slower by much:

* a blocking :mod:`http.client` connection in a worker thread reads the body straight into
  reusable 1 MiB blocks (``readinto`` into a ``bytearray`` — no per-chunk Python object,
  no re-chunking) and only reads, so the socket is drained all the time;
* two threads behind it take each block: one appends it to the partial file
  (``os.write``), one hashes it (``hashlib`` releases the GIL for big buffers); the block
  goes back to the pool of four once both are done, so the hash and the write overlap the
  reads and each other: the sha256 costs no wall time on a machine with a core to spare;
* ``Range: bytes=N-`` from the bytes on disk (with ``If-Range`` when the source gave a
  validator): a dropped connection is resumed from what was written, ``attempts`` times in
  a row without progress at most; a server that answers ``200`` to a range (it ignores
  ranges, or the file changed under ``If-Range``) restarts the partial file from zero;
* redirects are followed (the hub answers ``302`` to its CDN), and ``Authorization`` is
  dropped on a redirect to another origin (``httpx``'s rule, which ``huggingface_hub``
  relies on: a CDN's signed URL is its own credential; an ``http`` → ``https`` upgrade of
  the same host keeps it);
* a block is handed over once full, or once :data:`FLUSH_S` passed since the last hand-over
  (a slow link shows progress and loses little): what a kill costs is the bytes read and
  not yet written, the four blocks at most (:data:`CHUNK_BYTES`, 4 MiB).

A cancelled pull (:meth:`PartialFile.cancel`) shuts the socket down, so a reader waiting on a
slow server wakes at once. No header value (a token) and no URL query (a signature) is
ever put in an error. Proxies are not used. Called by :mod:`controller.modelfiles.hub` and
:mod:`controller.modelfiles.urls`, from a worker thread.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, unquote, urljoin, urlsplit

from controller.model.errors import ModelAccessDenied, ModelPullFailed
from controller.modelfiles.partial import PartialFile, PullCancelled
from controller.modelfiles.redact import redact_url
from controller.modelfiles.remote import RemoteFile

__all__ = ["CHUNK_BYTES", "FLUSH_S", "StreamSettings", "fetch"]

CHUNK_BYTES: Final = 4 * 1024 * 1024  # read and not yet written at most (a kill's loss)
BLOCKS: Final = 4  # blocks in flight (one filling, the others being written and hashed)
READ_BYTES: Final = 1024 * 1024  # one readinto (what a connection reset can lose)
BLOCK_BYTES: Final = CHUNK_BYTES // BLOCKS
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
    block_bytes: int = BLOCK_BYTES


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


class _Sinks:
    """Two threads behind the reader: one writes the blocks handed to it (``os.write``),
    one hashes them, each in order; a block goes back to the pool once both are done
    with it. The reader only reads, so the socket is drained while the disk and the hash
    work; a failure of a write (a cancel, a full disk) is :attr:`failure`, which the
    reader raises at its next read."""

    def __init__(self, partial: PartialFile, blocks: int, block_bytes: int) -> None:
        self.partial = partial
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(blocks):
            self.free.put(bytearray(block_bytes))
        self.failure: BaseException | None = None
        self._users: dict[int, int] = {}  # id(block) -> sinks still holding it
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[bytearray, int, int, bool] | None] = queue.Queue()
        self._hashes: queue.Queue[tuple[bytearray, int, int, bool] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, args=(q, f), name=name, daemon=True)
            for q, f, name in (
                (self._writes, self._write, "slotctl-pull-write"),
                (self._hashes, partial.absorb, "slotctl-pull-hash"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def _write(self, view: memoryview) -> None:
        try:
            self.partial.append(view)
        except OSError as exc:
            raise _WriteFailed(exc) from exc

    def _run(
        self,
        work: queue.Queue[tuple[bytearray, int, int, bool] | None],
        sink: Callable[[memoryview], object],
    ) -> None:
        while (item := work.get()) is not None:
            block, start, end, last = item
            try:
                if self.failure is None and end > start:
                    sink(memoryview(block)[start:end])
            except BaseException as exc:  # noqa: BLE001  (raised by the reader)
                self.failure = exc
            finally:
                if last:
                    self._release(block)
                work.task_done()
        work.task_done()

    def _release(self, block: bytearray) -> None:
        with self._lock:
            left = self._users[id(block)] - 1
            if left:
                self._users[id(block)] = left
                return
            del self._users[id(block)]
        self.free.put(block)

    def take(self) -> bytearray:
        return self.free.get()

    def submit(self, block: bytearray, start: int, end: int, *, last: bool) -> None:
        """``block[start:end]``: the next bytes; ``last``: the block goes back afterwards."""
        if last:
            with self._lock:
                self._users[id(block)] = 2
        item = (block, start, end, last)
        self._writes.put(item)
        self._hashes.put(item)

    def sync(self) -> None:
        """Wait until every block handed over is written and hashed; raise a failure."""
        self._writes.join()
        self._hashes.join()
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        for work in (self._writes, self._hashes):
            work.put(None)
        for thread in self._threads:
            thread.join()


class _Reader:
    """One file's transfer (see the module text)."""

    def __init__(self, remote: RemoteFile, partial: PartialFile, settings: StreamSettings) -> None:
        self.remote = remote
        self.partial = partial
        self.settings = settings
        self.shown = redact_url(remote.url)
        self._sock_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._sinks = _Sinks(partial, BLOCKS, settings.block_bytes)
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
                before = self.partial.size
                try:
                    whole = self._once()
                    self._sinks.sync()
                    if whole:
                        return
                    failure = f"the body ended at {self.partial.size} of {self.remote.size} bytes"
                except _Restart:
                    self._sinks.sync()
                    self.partial.restart()
                    failures += 1
                    failure = "its answers do not continue the bytes on disk"
                except _WriteFailed as exc:
                    raise ModelPullFailed(
                        f"cannot write {self.partial.path}: "
                        f"{exc.error.strerror or type(exc.error).__name__}",
                        source=self.remote.url,
                        reason="write",
                    ) from None
                except ssl.SSLCertVerificationError as exc:
                    raise ModelPullFailed(
                        f"{self.shown}: the server's certificate was refused "
                        f"({exc.verify_message or exc.reason})",
                        source=self.remote.url,
                        reason="tls",
                    ) from None
                except _TRANSIENT as exc:
                    self._sinks.sync()  # the bytes read before the failure, written
                    self._check()
                    failure = f"{type(exc).__name__}"
                if self.partial.size > before:
                    failures = 0
                else:
                    failures += 1
                if failures >= self.settings.attempts:
                    raise ModelPullFailed(
                        f"{self.shown}: {failure}, {self.settings.attempts} times in a row "
                        f"without progress ({self.partial.size} bytes kept to resume)",
                        source=self.remote.url,
                        reason="network",
                    )
                if self.partial.wait_cancelled(min(0.2 * 2**failures, 5.0)):
                    self._check()
        finally:
            self._sinks.close()

    # -- one request ---------------------------------------------------------------------

    def _connect(self, url: str) -> http.client.HTTPConnection:
        parts = urlsplit(url)
        host = parts.hostname or ""
        timeout = self.settings.connect_timeout_s
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(host, parts.port, timeout=timeout, context=_tls())
        elif parts.scheme == "http":
            conn = http.client.HTTPConnection(host, parts.port, timeout=timeout)
        else:
            raise ModelPullFailed(
                f"{self.shown}: redirected to a {parts.scheme or 'relative'} URL",
                source=self.remote.url,
                reason="http",
            )
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.settings.read_timeout_s)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._sock_lock:
            self._sock = conn.sock
        if self.partial.cancelled:
            self._wake()
        return conn

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
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        if offset:
            headers["Range"] = f"bytes={offset}-"
            if self.remote.validator:
                headers["If-Range"] = self.remote.validator
        for _ in range(MAX_REDIRECTS + 1):
            conn = self._connect(url)
            try:
                parts = urlsplit(url)
                target = quote(parts.path or "/", safe=_PATH_SAFE)
                if parts.query:
                    target += "?" + quote(parts.query, safe=_QUERY_SAFE)
                conn.request("GET", target, headers=headers)
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
            source=self.remote.url,
            reason="http",
        )

    def _answer(self, resp: http.client.HTTPResponse, offset: int) -> bool:
        status = resp.status
        size = self.remote.size
        if status == 416 and size is not None and offset >= size:
            return True
        _raise_for(status, self.remote.url, self.shown)
        if status == 206:
            match = _CONTENT_RANGE.match(resp.getheader("Content-Range") or "")
            if not match or int(match.group(1)) != offset:
                raise _Restart
        elif status == 200:
            if offset:
                # The range was ignored, or the file changed (If-Range): from zero, with
                # this very answer.
                self._sinks.sync()
                self.partial.restart()
        else:
            raise ModelPullFailed(
                f"{self.shown} answered {status}",
                source=self.remote.url,
                reason="http",
                status=status,
            )
        complete = self._body(resp)
        return complete and (size is None or self.partial.size >= size)

    def _body(self, resp: http.client.HTTPResponse) -> bool:
        """Read the body into blocks, each handed to the sinks (written and hashed on
        their threads) when full or :data:`FLUSH_S` after the last hand-over. True when
        the body came whole (its ``Content-Length``, or the end of a chunked or
        close-delimited body)."""
        sinks = self._sinks
        block_bytes = self.settings.block_bytes
        block = sinks.take()
        owned = True  # the block is ours until handed back with ``last``
        view = memoryview(block)
        start = filled = 0
        handed_at = time.monotonic()
        try:
            while True:
                if sinks.failure is not None:
                    raise sinks.failure
                n = resp.readinto(view[filled : min(filled + READ_BYTES, block_bytes)])
                if not n:
                    return not resp.length
                filled += n
                if filled == block_bytes:
                    owned = False
                    sinks.submit(block, start, filled, last=True)
                    block = sinks.take()
                    owned = True
                    view = memoryview(block)
                    start = filled = 0
                    handed_at = time.monotonic()
                elif time.monotonic() - handed_at >= FLUSH_S:
                    sinks.submit(block, start, filled, last=False)
                    start = filled
                    handed_at = time.monotonic()
        finally:
            # What was read (before a drop too: TCP kept the bytes' order, so a resume
            # asks for the rest only), then the block back to the pool.
            if owned:
                sinks.submit(block, start, filled, last=True)


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
