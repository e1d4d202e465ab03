"""Plain URLs (``http(s)://``): probed over aiohttp, fetched by the lean reader.

:meth:`UrlClient.probe` learns a file's size and validator before a byte is written
(``HEAD``; a server that refuses ``HEAD``, as presigned object-store URLs do, is asked
for ``Range: bytes=0-0``). :meth:`UrlClient.fetch` hands the bytes to
:mod:`controller.modelfiles.stream` (the hub files' reader too) in a worker thread: the
bytes after those on disk (``Range: bytes=N-`` with ``If-Range``: a file that changed
upstream comes back whole, ``200``, and the partial file starts again), a dropped
connection resumed from what is on disk, ``attempts`` times in a row without progress at
most. What vouches for the bytes is the model's declared ``sha256`` (required for URL
sources by the schema). Both honour the standard proxy variables (``HTTPS_PROXY``,
``HTTP_PROXY``, ``NO_PROXY``: aiohttp's ``trust_env`` for the probe, the reader's own
reading of them for the bytes). Called by :mod:`controller.modelfiles.pull`.
"""

from __future__ import annotations

import asyncio
import re
from typing import Final

import aiohttp

from controller.model.errors import ModelAccessDenied, ModelPullFailed
from controller.modelfiles.digests import Digest
from controller.modelfiles.partial import PartialFile
from controller.modelfiles.redact import redact_url
from controller.modelfiles.remote import RemoteFile
from controller.modelfiles.stream import StreamSettings, fetch

__all__ = ["UrlClient"]

_CONTENT_RANGE: Final = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_TRANSIENT: Final = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionError,
    asyncio.TimeoutError,
)


class UrlClient:
    """Probes and fetches URL sources (a :class:`~controller.modelfiles.remote.Transfer`)."""

    def __init__(
        self,
        *,
        attempts: int = 5,
        connect_timeout_s: float = 30.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        self.stream = StreamSettings(
            connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, attempts=attempts
        )
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            timeout=self._timeout,
            trust_env=True,  # HTTPS_PROXY, HTTP_PROXY, NO_PROXY: as the reader honours them
            auto_decompress=False,
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
                            source=redact_url(url),
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
                        source=redact_url(url),
                    )
        except _TRANSIENT as exc:
            raise ModelPullFailed(
                redact_url(f"{url}: {type(exc).__name__}: {exc}"),
                source=redact_url(url),
                reason="network",
            ) from None

    @staticmethod
    def _raise_for(status: int, url: str) -> None:
        if status < 400 or status == 416:
            return
        shown = redact_url(url)
        if status in (401, 403):
            raise ModelAccessDenied(
                f"{shown} answered {status}",
                source=shown,
                reason="unauthorized",
                token_sent=False,
                status=status,
            )
        if status == 404:
            raise ModelPullFailed(
                f"{shown} answered 404", source=shown, reason="file_not_found", status=status
            )
        raise ModelPullFailed(
            f"{shown} answered {status}", source=shown, reason="http", status=status
        )

    # -- fetch --------------------------------------------------------------------------

    async def fetch(self, remote: RemoteFile, partial: PartialFile) -> None:
        """The bytes after ``partial.size`` into ``partial`` (resumed, retried)."""
        await asyncio.to_thread(fetch, remote, partial, self.stream)


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
