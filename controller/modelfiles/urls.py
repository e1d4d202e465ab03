"""Plain URLs (``http(s)://``) over aiohttp, resumed with HTTP ranges.

:meth:`UrlClient.probe` learns a file's size and validator before a byte is written
(``HEAD``; a server that refuses ``HEAD``, as presigned object-store URLs do, is asked
for ``Range: bytes=0-0``). :meth:`UrlClient.fetch` asks for the bytes after those on
disk (``Range: bytes=N-`` with ``If-Range``: a file that changed upstream comes back
whole, ``200``, and the partial file starts again), reads them on the event loop and
hands them, one ``chunk_bytes`` block at a time, to a writer thread (the write and the
hash never block the loop; the next block is read while the last one is written). A
connection dropped mid-file is resumed from what is on disk, ``attempts`` times in a
row without progress at most; a drop costs at most one chunk (what aiohttp had read and
not yet handed over is lost with the connection). What vouches for the bytes is the model's declared
``sha256`` (required for URL sources by the schema). Called by
:mod:`controller.modelfiles.pull`.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import aiohttp

from controller.kit.clock import SYSTEM_CLOCK, Clock
from controller.model.errors import ModelAccessDenied, ModelPullFailed
from controller.modelfiles.digests import Digest
from controller.modelfiles.partial import PartialFile
from controller.modelfiles.redact import redact_url
from controller.modelfiles.remote import RemoteFile

__all__ = ["CHUNK_BYTES", "UrlClient"]

CHUNK_BYTES: Final = 1024 * 1024
_CONTENT_RANGE: Final = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_TRANSIENT: Final = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionError,
    asyncio.TimeoutError,
)


class _Restart(Exception):
    """The server's answer does not continue the bytes on disk: start from zero."""


class UrlClient:
    """Probes and fetches URL sources (a :class:`~controller.modelfiles.remote.Transfer`)."""

    def __init__(
        self,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        attempts: int = 5,
        connect_timeout_s: float = 30.0,
        read_timeout_s: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.attempts = attempts
        self.clock = clock
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            timeout=self._timeout,
            auto_decompress=False,
            # aiohttp drops what it buffered, unread, when a connection breaks (a read
            # raises at once): a small read buffer bounds what a drop costs to one
            # chunk (it pauses reading at twice this).
            read_bufsize=max(64 * 1024, self.chunk_bytes // 2),
            headers={"Accept-Encoding": "identity"},
        )

    # -- probe --------------------------------------------------------------------------

    async def probe(self, url: str, sha256: str | None) -> RemoteFile:
        """Size and validator of ``url`` (nothing is written)."""
        digests = (Digest("sha256", sha256),) if sha256 else ()
        name = url.rsplit("/", 1)[-1].split("?", 1)[0]
        try:
            async with self._session() as session:
                async with session.head(url, allow_redirects=True) as resp:
                    if resp.status in (403, 405, 501):
                        pass  # no HEAD here (presigned URLs): ask for one byte instead
                    else:
                        self._raise_for(resp.status, url)
                        return RemoteFile(
                            name=name,
                            url=url,
                            size=_length(resp.headers),
                            digests=digests,
                            validator=_validator(resp.headers),
                        )
                async with session.get(
                    url, headers={"Range": "bytes=0-0"}, allow_redirects=True
                ) as resp:
                    self._raise_for(resp.status, url)
                    size = _length(resp.headers)
                    match = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
                    if resp.status == 206 and match and match.group(3) != "*":
                        size = int(match.group(3))
                    return RemoteFile(
                        name=name,
                        url=url,
                        size=size,
                        digests=digests,
                        validator=_validator(resp.headers),
                    )
        except _TRANSIENT as exc:
            raise ModelPullFailed(
                f"{redact_url(url)}: {type(exc).__name__}: {exc}", source=url, reason="network"
            ) from None

    @staticmethod
    def _raise_for(status: int, url: str) -> None:
        if status < 400 or status == 416:
            return
        shown = redact_url(url)
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
                f"{shown} answered 404", source=url, reason="file_not_found", status=status
            )
        raise ModelPullFailed(
            f"{shown} answered {status}", source=url, reason="http", status=status
        )

    # -- fetch --------------------------------------------------------------------------

    async def fetch(self, remote: RemoteFile, partial: PartialFile) -> None:
        """The bytes after ``partial.size`` into ``partial`` (resumed, retried)."""
        loop = asyncio.get_running_loop()
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slotctl-pull-write")
        failures = 0
        try:
            async with self._session() as session:
                while True:
                    before = partial.size
                    try:
                        await self._once(session, remote, partial, loop, writer)
                        return
                    except _Restart:
                        await loop.run_in_executor(writer, partial.restart)
                        failures += 1
                    except _TRANSIENT as exc:
                        failures = 0 if partial.size > before else failures + 1
                        if failures >= self.attempts:
                            raise ModelPullFailed(
                                f"{redact_url(remote.url)}: {type(exc).__name__} "
                                f"{self.attempts} times in a row without progress "
                                f"({partial.size} bytes kept to resume)",
                                source=remote.url,
                                reason="network",
                            ) from None
                    if failures >= self.attempts:
                        raise ModelPullFailed(
                            f"{redact_url(remote.url)} does not answer the ranges asked",
                            source=remote.url,
                            reason="http",
                        )
                    await self.clock.sleep(min(0.2 * 2**failures, 5.0))
        finally:
            writer.shutdown(wait=True)

    async def _once(
        self,
        session: aiohttp.ClientSession,
        remote: RemoteFile,
        partial: PartialFile,
        loop: asyncio.AbstractEventLoop,
        writer: ThreadPoolExecutor,
    ) -> None:
        offset = partial.size
        if remote.size is not None and offset >= remote.size:
            return
        headers = {}
        if offset:
            headers["Range"] = f"bytes={offset}-"
            if remote.validator:
                headers["If-Range"] = remote.validator
        async with session.get(remote.url, headers=headers, allow_redirects=True) as resp:
            if resp.status == 416 and remote.size is not None and offset >= remote.size:
                return
            self._raise_for(resp.status, remote.url)
            if offset and resp.status == 200:
                raise _Restart  # the range was ignored, or the file changed (If-Range)
            if resp.status == 206:
                match = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
                if not match or int(match.group(1)) != offset:
                    raise _Restart
            elif resp.status != 200:
                raise ModelPullFailed(
                    f"{redact_url(remote.url)} answered {resp.status}",
                    source=remote.url,
                    reason="http",
                    status=resp.status,
                )
            pending: asyncio.Future[int] | None = None
            buffer = bytearray()
            try:
                async for data in resp.content.iter_chunked(self.chunk_bytes):
                    buffer += data
                    if len(buffer) >= self.chunk_bytes:
                        if pending is not None:
                            await pending
                        pending = loop.run_in_executor(writer, partial.write, bytes(buffer))
                        buffer.clear()
            finally:
                # Bytes that arrived before a drop are good bytes (TCP kept their order):
                # they are written, so a resume asks only for the rest.
                if pending is not None:
                    await pending
                if buffer:
                    await loop.run_in_executor(writer, partial.write, bytes(buffer))


def _length(headers: aiohttp.typedefs.LooseHeaders) -> int | None:
    get = getattr(headers, "get", None)
    if get is None:
        return None
    encoding = (get("Content-Encoding") or "identity").lower()
    value = get("Content-Length")
    if encoding != "identity" or value is None or not str(value).isdigit():
        return None
    return int(value)


def _validator(headers: aiohttp.typedefs.LooseHeaders) -> str | None:
    """A strong ETag, else Last-Modified (what If-Range may carry)."""
    get = getattr(headers, "get", None)
    if get is None:
        return None
    etag = get("ETag")
    if etag and not str(etag).startswith("W/"):
        return str(etag)
    modified = get("Last-Modified")
    return str(modified) if modified else None
