"""A file somewhere else, resolved: where to fetch it, how big it is, what vouches for it.

Plain data shared by the two transfers (:mod:`controller.modelfiles.hub` resolves hub files
through ``huggingface_hub``, :mod:`controller.modelfiles.urls` probes URLs over aiohttp) and
the :class:`Transfer` seam :mod:`controller.modelfiles.pull` drives. ``headers`` may hold a
hub token: it is excluded from ``repr`` and never logged; ``url`` may be a CDN's signed
location: errors name ``source`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from controller.modelfiles.digests import Digest
from controller.modelfiles.partial import PartialFile

__all__ = ["RemoteFile", "Transfer"]


@dataclass(frozen=True, slots=True)
class RemoteFile:
    name: str  # the path in the repository, or the URL's file name (what progress shows)
    url: str  # where the bytes are fetched (a hub's resolved, maybe signed, location)
    size: int | None
    digests: tuple[Digest, ...]  # every digest the bytes must match (none: unverifiable)
    commit: str | None = None  # the hub commit the file was resolved at
    validator: str | None = None  # a URL's ETag or Last-Modified (If-Range on resume)
    # what errors name: the declared source (hf://org/repo/file, a redacted URL), never
    # ``url`` (a CDN's signed location); empty: ``url`` redacted
    source: str = field(default="", compare=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def tag(self) -> str:
        """What names this version of the file (its partial file's key)."""
        if self.digests:
            return str(self.digests[0])
        return f"{self.url}|{self.size}|{self.validator}"


class Transfer(Protocol):
    """Fetches a resolved file's missing bytes into a partial file (from its size on)."""

    async def fetch(self, remote: RemoteFile, partial: PartialFile) -> None: ...
