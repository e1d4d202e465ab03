"""The API context's typed store: each route module's own objects under typed keys.

At the bottom of :mod:`controller.api` (the kernel :mod:`.app` puts a :class:`CtxStore`
on every ``ApiContext``). Like aiohttp's ``web.AppKey`` for an app: the module that owns a
value declares its :class:`CtxKey`, and every reader gets the value's type — the router's
upstream session, the metrics, the dashboard's login codes, the SSE keepalive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Generic, TypeVar, cast, final

from controller.router.context import RequestRecorder

__all__ = ["REQUEST_RECORDER", "CtxKey", "CtxStore", "RequestRecorder"]

T = TypeVar("T")


@final
class CtxKey(Generic[T]):
    """A typed key of :class:`CtxStore` (as aiohttp's ``web.AppKey`` is for an app): the
    route module that owns a value declares its key, and every reader gets its type."""

    __slots__ = ("name", "type")

    def __init__(self, name: str, tp: type[T] | None = None) -> None:
        self.name = name
        self.type = tp  # checked on set() when given (a Protocol's key goes without)

    def __repr__(self) -> str:
        return f"<CtxKey {self.name}: {getattr(self.type, '__name__', '?')}>"


class CtxStore:
    """The route modules' own objects on the shared context, by typed key (the router's
    upstream session, the metrics, the dashboard's login codes, the SSE keepalive)."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[object, object] = {}

    def get(self, key: CtxKey[T]) -> T | None:
        # (no cast(): a call the router pays twice a request)
        return self._values.get(key)  # type: ignore[return-value]  # set() checked it

    def set(self, key: CtxKey[T], value: T) -> None:
        if key.type is not None and not isinstance(value, key.type):
            raise TypeError(f"{key!r} takes a {key.type.__name__}, not {type(value).__name__}")
        self._values[key] = value

    def pop(self, key: CtxKey[T]) -> T | None:
        return cast("T | None", self._values.pop(key, None))

    def setdefault(self, key: CtxKey[T], factory: Callable[[], T]) -> T:
        """The value under ``key``, made by ``factory`` (and kept) the first time."""
        found = self.get(key)
        if found is None:
            found = factory()
            self.set(key, found)
        return found


# The kernel declares the keys two route modules share (the router writes, metrics reads);
# a key only one module uses lives in that module.
REQUEST_RECORDER: Final = CtxKey[RequestRecorder]("request_recorder")
