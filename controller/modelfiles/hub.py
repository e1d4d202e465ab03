"""The Hugging Face hub, through its own client library (``huggingface_hub``).

What the library does here, and why not its ``hf_hub_download``/``snapshot_download``:

* **resolution and listing are the library's**: :func:`huggingface_hub.hf_hub_url` and
  :func:`huggingface_hub.get_hf_file_metadata` (``HEAD /{repo}/resolve/{revision}/{file}``:
  ``X-Repo-Commit``, ``X-Linked-Etag`` — an LFS file's sha256 —, ``X-Linked-Size``,
  ``ETag``, the redirect ``Location``), :meth:`HfApi.repo_info` (the commit a branch or
  tag names) and :meth:`HfApi.list_repo_tree` (every file with its size and LFS sha256 or
  git blob id), :func:`huggingface_hub.utils.filter_repo_objects` (include/exclude, with
  ``snapshot_download``'s own semantics). So ``HF_ENDPOINT``, ``HF_TOKEN`` (and the token
  file), ``HF_HUB_OFFLINE``, ``HF_HUB_ETAG_TIMEOUT``, revisions and the hub's error codes
  (gated, not found, revision not found) behave as everywhere else.
* **the bytes go through** :mod:`controller.modelfiles.stream` (the reader URL sources use
  too): the resolved location (the CDN's signed URL the library's ``HEAD`` found, or the
  ``resolve`` URL, whose redirect it follows), ``Range`` from the bytes on disk, into our
  own :class:`~controller.modelfiles.partial.PartialFile`, hashed on a thread of its own
  as the bytes arrive. ``hf_hub_download`` (2.x) writes each attempt to a fresh
  ``<etag>.<uuid>.incomplete`` file and deletes it on failure (huggingface_hub#4306,
  #4196): a controller restarted mid-pull would start from zero, and nothing it downloads
  is verified beyond its size. The library's ``file_download.http_get`` (used here before)
  reads through httpx and re-chunks into 10 MiB blocks (0.70x curl's throughput with the
  hash); the lean reader is at 0.78-0.93x curl with the hash and the ``fsync``
  (docs/performance.md, "Model pulls"). Its read timeout is the library's
  ``HF_HUB_DOWNLOAD_TIMEOUT``.

Resolution is synchronous (httpx), so each call runs in a worker thread. The token is read
from ``token_file`` when configured, else as the library reads it (``HF_TOKEN``, then
``$HF_HOME/token``); it is sent to the hub only (the library's own rule: dropped on a
redirect off the hub), never logged, never in an error. Called by
:mod:`controller.modelfiles.pull`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, RepoFile, get_hf_file_metadata, get_token, hf_hub_url
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# Both are documented as huggingface_hub.utils.*; its __init__ re-exports them lazily,
# which mypy does not count as an explicit export: imported from their home modules.
from huggingface_hub.utils._headers import build_hf_headers
from huggingface_hub.utils._paths import filter_repo_objects

from controller.model.errors import ModelAccessDenied, ModelPullFailed, SlotctlError
from controller.modelfiles.digests import Digest, digest_from_etag
from controller.modelfiles.partial import PartialFile, PullCancelled
from controller.modelfiles.redact import redact_url
from controller.modelfiles.remote import RemoteFile
from controller.modelfiles.sources import HubFile, HubSnapshot
from controller.modelfiles.stream import StreamSettings, fetch

__all__ = ["LIBRARY_NAME", "HubClient", "HubSettings", "redact_url"]

log = logging.getLogger(__name__)
LIBRARY_NAME: Final = "slotctl"
_HUB_ORIGINS: Final = frozenset(
    {("https", "huggingface.co", 443), ("https", "hub-ci.huggingface.co", 443)}
)
T = TypeVar("T")


# The library's loggers that may print a download URL (a retry's warning names it), and
# its HTTP client's (every request's URL at INFO, response headers at DEBUG).
_LIBRARY_LOGGERS: Final = (
    "huggingface_hub.file_download",
    "huggingface_hub.utils._http",
    "huggingface_hub._snapshot_download",
    "huggingface_hub.hf_api",
    "httpx2",
    "httpcore2.http11",
    "httpcore2.http2",
    "httpcore2.connection",
    "httpcore2.proxy",
)


class _RedactQueries(logging.Filter):
    """Cuts URL queries out of the library's log records before any handler sees them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_url(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACT: Final = _RedactQueries()


def _quiet_signed_urls() -> None:
    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme, 0)
    return (parts.scheme, (parts.hostname or "").lower(), parts.port or default)


@dataclass(frozen=True, slots=True)
class HubSettings:
    """Where the hub is and how to authenticate (never from a stack file)."""

    endpoint: str | None = None  # None: HF_ENDPOINT as huggingface_hub read it
    token_file: Path | None = None  # None: HF_TOKEN, then the hub's token file
    etag_timeout_s: float = 10.0


class HubClient:
    """Resolves hub files and snapshots and fetches their bytes (a :class:`Transfer`)."""

    def __init__(self, settings: HubSettings | None = None, *, version: str = "") -> None:
        self.settings = settings or HubSettings()
        self._version = version
        _quiet_signed_urls()

    # -- the token ----------------------------------------------------------------------

    def _token(self) -> str | None:
        path = self.settings.token_file
        if path is not None:
            try:
                return path.read_text(encoding="utf-8").strip() or None
            except OSError as exc:
                raise ModelPullFailed(
                    f"cannot read the hub token file {path}: {exc.strerror or exc}",
                    source=str(path),
                    reason="token_file",
                ) from None
        return get_token()

    def _headers(self, token: str | None) -> dict[str, str]:
        return build_hf_headers(
            token=token or False, library_name=LIBRARY_NAME, library_version=self._version
        )

    # -- resolution ---------------------------------------------------------------------

    async def resolve(self, file: HubFile, source: str) -> RemoteFile:
        """The file's commit, size, digest and download location (``HEAD .../resolve``)."""
        return await self._call(lambda: self._resolve(file), source, file.repo)

    def _resolve(self, file: HubFile) -> RemoteFile:
        token = self._token()
        endpoint = self.settings.endpoint
        revision = file.revision or "main"
        url = hf_hub_url(file.repo, file.filename, revision=revision, endpoint=endpoint)
        meta = get_hf_file_metadata(
            url,
            token=token or False,
            timeout=self.settings.etag_timeout_s,
            library_name=LIBRARY_NAME,
            library_version=self._version,
            endpoint=endpoint,
            retry_on_errors=True,
        )
        if meta.commit_hash is None:
            raise ModelPullFailed(
                f"{redact_url(url)} answered without X-Repo-Commit: is HF_ENDPOINT a hub?",
                source=f"hf://{file.repo}/{file.filename}",
                reason="not_a_hub",
            )
        location = meta.location
        if location == url and revision != meta.commit_hash:
            # Fetch the very commit the HEAD resolved, even if the branch moves meanwhile.
            location = hf_hub_url(
                file.repo, file.filename, revision=meta.commit_hash, endpoint=endpoint
            )
        digest = digest_from_etag(meta.etag)
        return RemoteFile(
            name=file.filename,
            url=location,
            size=meta.size,
            digests=(digest,) if digest else (),
            commit=meta.commit_hash,
            source=f"hf://{file.repo}/{file.filename}",
            headers=self._download_headers(token, url, location),
        )

    def _download_headers(self, token: str | None, url: str, location: str) -> dict[str, str]:
        headers = self._headers(token)
        if _origin(location) not in {_origin(url), *_HUB_ORIGINS}:
            headers.pop("authorization", None)  # a CDN's signed URL: the token stays home
        return headers

    async def snapshot(self, snap: HubSnapshot, source: str) -> tuple[str, list[RemoteFile]]:
        """The commit ``snap.revision`` names and its files, filtered by the patterns."""
        return await self._call(lambda: self._snapshot(snap), source, snap.repo)

    def _snapshot(self, snap: HubSnapshot) -> tuple[str, list[RemoteFile]]:
        token = self._token()
        endpoint = self.settings.endpoint
        api = HfApi(
            endpoint=endpoint,
            token=token or False,
            library_name=LIBRARY_NAME,
            library_version=self._version,
        )
        info = api.repo_info(snap.repo, revision=snap.revision)
        commit = info.sha
        if not commit:
            raise ModelPullFailed(
                f"the hub gave no commit for {snap.repo}@{snap.revision or 'main'}",
                source=f"hf://{snap.repo}",
                reason="not_a_hub",
            )
        entries = [
            f
            for f in api.list_repo_tree(snap.repo, recursive=True, revision=commit)
            if isinstance(f, RepoFile)
        ]
        chosen = filter_repo_objects(
            entries,
            allow_patterns=list(snap.include) or None,
            ignore_patterns=list(snap.exclude) or None,
            key=lambda f: f.path,
        )
        headers = self._headers(token)
        files = []
        for entry in sorted(chosen, key=lambda f: f.path):
            if entry.lfs is not None:
                digest = Digest("sha256", str(entry.lfs.sha256).lower())
                size = int(entry.lfs.size)
            else:
                digest = Digest("git-sha1", str(entry.blob_id).lower())
                size = int(entry.size)
            url = hf_hub_url(snap.repo, entry.path, revision=commit, endpoint=endpoint)
            # GET .../resolve/<commit>/<path>: the reader follows the hub's redirect and
            # drops the Authorization header when it leaves the hub's origin.
            files.append(
                RemoteFile(
                    name=entry.path,
                    url=url,
                    size=size,
                    digests=(digest,),
                    commit=commit,
                    source=f"hf://{snap.repo}/{entry.path}",
                    headers=headers,
                )
            )
        return commit, files

    # -- the bytes ----------------------------------------------------------------------

    async def fetch(self, remote: RemoteFile, partial: PartialFile) -> None:
        """The bytes after ``partial.size`` (``Range``), through the lean reader."""
        settings = StreamSettings(read_timeout_s=float(hf_constants.HF_HUB_DOWNLOAD_TIMEOUT))
        source = remote.source or remote.name
        await self._call(lambda: fetch(remote, partial, settings), source, remote.name)

    # -- errors -------------------------------------------------------------------------

    async def _call(self, work: Callable[[], T], source: str, repo: str) -> T:
        try:
            return await asyncio.to_thread(work)
        except (SlotctlError, PullCancelled):
            raise
        except Exception as exc:  # noqa: BLE001  (typed below: the library raises many kinds)
            raise self._typed(exc, source, repo) from None

    def _typed(self, exc: Exception, source: str, repo: str) -> SlotctlError:
        """The library's failure as a typed error (no token, no signed URL, no traceback)."""
        sent = self._token_quietly() is not None
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, GatedRepoError):
            return ModelAccessDenied(
                f"hub repository {repo} is gated: "
                + (
                    "the token sent has no access to it"
                    if sent
                    else "set HF_TOKEN (or the token file) to a token that was granted access"
                ),
                source=source,
                reason="gated",
                token_sent=sent,
                status=status,
            )
        if isinstance(exc, RepositoryNotFoundError):
            if status == 401:
                return ModelAccessDenied(
                    f"hub repository {repo} does not exist or is private "
                    + (
                        "(the token sent has no access)"
                        if sent
                        else "(no token was sent: set HF_TOKEN or the token file)"
                    ),
                    source=source,
                    reason="unauthorized",
                    token_sent=sent,
                    status=status,
                )
            return ModelPullFailed(
                f"hub repository {repo} not found",
                source=source,
                reason="not_found",
                status=status,
            )
        if isinstance(exc, RevisionNotFoundError):
            return ModelPullFailed(
                f"hub repository {repo} has no such revision",
                source=source,
                reason="revision_not_found",
                status=status,
            )
        if isinstance(exc, RemoteEntryNotFoundError):
            return ModelPullFailed(
                f"{source}: no such file in hub repository {repo}",
                source=source,
                reason="file_not_found",
                status=status,
            )
        if isinstance(exc, OfflineModeIsEnabled):
            return ModelPullFailed(
                f"{source} is not on disk and HF_HUB_OFFLINE is set",
                source=source,
                reason="offline",
            )
        if isinstance(exc, HfHubHTTPError) and status == 401:
            return ModelAccessDenied(
                f"the hub refused the token for {repo} (401)",
                source=source,
                reason="unauthorized",
                token_sent=sent,
                status=status,
            )
        if isinstance(exc, HfHubHTTPError):
            return ModelPullFailed(
                f"the hub answered {status} for {source}",
                source=source,
                reason="http",
                status=status,
            )
        if isinstance(exc, (httpx2.TransportError, OSError)):
            return ModelPullFailed(
                f"{source}: {type(exc).__name__}: {_first_line(exc)}",
                source=source,
                reason="network",
            )
        if isinstance(exc, ValueError):
            return ModelPullFailed(
                f"{source}: {_first_line(exc)}", source=source, reason="refused_by_client"
            )
        log.error("unexpected failure pulling %s", source, exc_info=exc)
        return ModelPullFailed(f"{source}: {type(exc).__name__}", source=source, reason="internal")

    def _token_quietly(self) -> str | None:
        try:
            return self._token()
        except SlotctlError:
            return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return redact_url(lines[0]) if lines else ""
