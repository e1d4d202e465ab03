"""Informers: one resource kind followed with list + watch into a local cache.

Sits under :mod:`controller.runtime.kubernetes.runtime` (its reads come from these caches; its
writes go to the API). What client-go's reflector does, for one kind:

* **list** (in pages of 500) and keep the list's ``resourceVersion``;
* **watch** from it with ``allowWatchBookmarks`` (the server's bookmarks move the version
  on while nothing changes, so a reconnect rarely falls behind) and a server-side
  timeout; a closed watch is opened again from the last version seen;
* **410 Gone** (the version is too old for the server's watch cache): list again, and
  tell apart what changed meanwhile (a relist fires the events a watch would have);
* **errors** (a refused request, a dropped connection): logged, and tried again with an
  exponential backoff (0.2 s doubling to 30 s).

Objects are cached without ``metadata.managedFields`` (client-go's informers drop them
with a transform too): the server-side apply bookkeeping of every field manager is the
bulk of a pod's metadata, and nothing here reads it (drift is judged on the fields the
runtime sets). At 1,000 slots that is three thousand objects' worth.

Each change calls ``on_event(kind, old, new)`` once (ADDED: ``old`` None; DELETED:
``new`` None), from the event loop, so a change reaches the runtime's waiters, the
manager and the reconciler in one event. :class:`Informer.stats` counts the requests.

lightkube 1.0 has no bookmark option on its watch, so the watch request is built with
its client's request helpers (``prepare_request``, ``send``) and decoded with its
msgspec decoders; the list is lightkube's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import httpx2
from lightkube import AsyncClient
from lightkube.core import decoders

__all__ = ["Informer", "InformerStats", "key_of"]

log = logging.getLogger("slotctl.runtime")

R = TypeVar("R")
EventHandler = Callable[[str, Any, Any], None]

PAGE: Final = 500
WATCH_TIMEOUT_S: Final = 300  # the server ends each watch after this (jittered by it)
BACKOFF_S: Final = (0.2, 30.0)


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


@dataclass(slots=True)
class InformerStats:
    lists: int = 0
    watches: int = 0
    relists: int = 0  # lists after a 410 Gone
    events: int = 0
    bookmarks: int = 0
    errors: int = 0


def key_of(obj: Any) -> str:
    """``namespace/name`` (``name`` for a cluster-scoped object)."""
    meta = obj.metadata
    return f"{meta.namespace}/{meta.name}" if meta.namespace else str(meta.name)


def _version(obj: Any) -> str | None:
    meta = getattr(obj, "metadata", None)
    return getattr(meta, "resourceVersion", None) if meta is not None else None


def _trimmed(obj: Any) -> Any:
    """``obj`` without its ``managedFields`` (see the module docstring)."""
    meta = getattr(obj, "metadata", None)
    if meta is not None:
        meta.managedFields = None
    return obj


def _bookmark_version(raw: Any) -> str | None:
    """A bookmark's ``metadata.resourceVersion`` (a Deployment or Pod bookmark has no
    ``spec``: decoding it as one fails)."""
    meta = json.loads(bytes(raw)).get("metadata") or {}
    version = meta.get("resourceVersion")
    return str(version) if version else None


class Informer(Generic[R]):
    """The cache of one kind (see the module docstring). ``items`` by :func:`key_of`."""

    def __init__(
        self,
        client: Callable[[], AsyncClient],
        res: type[R],
        *,
        namespace: str | None = None,
        labels: dict[str, str] | None = None,
        on_event: EventHandler | None = None,
        name: str = "",
    ) -> None:
        self._client = client
        self.res = res
        self.namespace = namespace
        self.labels = labels
        self.on_event = on_event
        self.name = name or res.__name__
        self.items: dict[str, R] = {}
        self.version: str | None = None
        self.synced = asyncio.Event()
        self.stats = InformerStats()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ running

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self.run(), name=f"slotctl-informer-{self.name}"
            )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        backoff = BACKOFF_S[0]
        while True:
            try:
                if self.version is None:
                    await self._list()
                await self._watch()
                backoff = BACKOFF_S[0]
            except Gone:
                self.stats.relists += 1
                self.version = None  # list again, at once
            except (httpx2.HTTPError, OSError, ValueError) as exc:
                self.stats.errors += 1
                log.warning("watching %s: %s (again in %.1fs)", self.name, _why(exc), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
            except Exception:  # a bug, a malformed object: logged, listed again later
                self.stats.errors += 1
                log.exception("watching %s failed (listed again in %.1fs)", self.name, backoff)
                self.version = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])

    # ------------------------------------------------------------------ list

    async def _list(self) -> None:
        listing = self._client().list(
            self.res,  # type: ignore[call-overload]
            chunk_size=PAGE,
            labels=self.labels,
            **({"namespace": self.namespace} if self.namespace else {}),
        )
        fresh: dict[str, R] = {}
        async for obj in listing:
            fresh[key_of(obj)] = _trimmed(obj)
        self.stats.lists += 1
        version = listing.resourceVersion
        old = dict(self.items)
        self.items.clear()  # in place: readers hold this dict
        self.items.update(fresh)
        self.version = version
        for key, obj in fresh.items():
            before = old.get(key)
            if before is None:
                self._fire("ADDED", None, obj)
            elif _version(before) != _version(obj):
                self._fire("MODIFIED", before, obj)
        for key, obj in old.items():
            if key not in fresh:
                self._fire("DELETED", obj, None)
        self.synced.set()

    # ------------------------------------------------------------------ watch

    async def _watch(self) -> None:
        api = self._client()
        generic: Any = api._client  # lightkube's request helpers (see the module docstring)
        params: dict[str, Any] = {
            "resourceVersion": self.version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": WATCH_TIMEOUT_S,
        }
        if self.labels:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in self.labels.items())
        request = generic.prepare_request(
            "list", res=self.res, namespace=self.namespace, watch=True, params=params
        )
        request.timeout = generic._watch_timeout  # no read timeout: events come when they do
        response = await generic.send(generic.build_adapter_request(request), stream=True)
        self.stats.watches += 1
        try:
            if response.status_code == 410:
                raise Gone
            if response.status_code >= 300:
                await response.aread()
                response.raise_for_status()
            async for line in response.aiter_lines():
                if line:
                    self._on_line(line)
        finally:
            await response.aclose()

    def _on_line(self, line: str) -> None:
        event = decoders.decode_watch_event(line.encode())
        kind = event.type
        if kind == "ERROR":
            status = decoders.decode_status(event.object)
            if status.code == 410:
                raise Gone
            raise ValueError(f"watch error {status.code}: {status.message}")
        if kind == "BOOKMARK":  # only metadata: not a valid object of the kind
            self.stats.bookmarks += 1
            self.version = _bookmark_version(event.object) or self.version
            return
        obj: Any = _trimmed(decoders.decode_object(event.object, self.res))
        version = _version(obj)
        key = key_of(obj)
        before = self.items.get(key)
        if kind == "DELETED":
            self.items.pop(key, None)
            self._fire(kind, before, None)
        else:
            self.items[key] = obj
            self._fire("ADDED" if before is None else "MODIFIED", before, obj)
        self.version = version or self.version

    def _fire(self, kind: str, old: Any, new: Any) -> None:
        self.stats.events += 1
        if self.on_event is not None:
            try:
                self.on_event(kind, old, new)
            except Exception:  # a handler's bug must not end the watch
                log.exception("handling a %s event of %s", kind, self.name)


def _why(exc: BaseException) -> str:
    if isinstance(exc, httpx2.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}"
