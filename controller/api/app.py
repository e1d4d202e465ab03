"""The HTTP application: route registry, bearer-token auth, typed errors.

Every route is declared once with :func:`route` (method, path, summary, request and
response types, whether it is public, the scope it needs). The same registry builds the
aiohttp router, the auth rule (everything but the routes marked public needs a key:
``Authorization: Bearer`` or ``x-api-key``, the API token or one of ``keys.json``, whose
scope reaches the route's: :func:`route_scope`) and the OpenAPI 3 document
(:mod:`controller.api.openapi`) — so a route cannot exist without its documentation or
its auth decision, and ``tests`` enumerate the registry to prove it.

Errors leave as the typed JSON body of :mod:`controller.model.errors` (``Retry-After`` when the
error carries ``retry_after_s``); anything unexpected is ``500 internal`` with a log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel, TypeAdapter, ValidationError

from controller.access.keys import KeyLimits, KeyRing, Principal, Scope
from controller.api.ctxstore import REQUEST_RECORDER, CtxKey, CtxStore
from controller.api.hostcheck import hosts_middleware
from controller.kit.eventbus import EventBus
from controller.kit.tasks import TaskSet
from controller.model.errors import Forbidden, InvalidRequest, SlotctlError, Unauthorized
from controller.model.events import EventKind, Op
from controller.reconcile.reconciler import Reconciler
from controller.router.access import bearer, identify
from controller.router.context import RequestRecorder
from controller.router.refusals import (
    BAD_BEARER_MESSAGE,
    NO_BEARER_MESSAGE,
    openai_error_body,
)
from controller.slots.manager import SlotManager

__all__ = [
    "API_CTX",
    "BAD_BEARER_MESSAGE",
    "NO_BEARER_MESSAGE",
    "PRINCIPAL",
    "PROBE_PATHS",
    "REQUEST_RECORDER",
    "ApiContext",
    "CtxKey",
    "CtxStore",
    "ErrorBody",
    "Query",
    "RequestRecorder",
    "RouteSpec",
    "RouteTable",
    "build_app",
    "build_probe_app",
    "json_response",
    "openai_error_body",
    "principal_of",
    "read_body",
    "route_scope",
]

log = logging.getLogger("slotctl.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class ApiContext:
    """What handlers share: the manager and the reconciler (None where a test or the
    metrics listener serves without one), the dirs, the token, background operations."""

    manager: SlotManager
    reconciler: Reconciler | None
    config_dir: Path
    state_dir: Path
    token: str
    events: EventBus
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: TaskSet = field(default_factory=lambda: TaskSet(log))  # loads/unloads answered 202
    apply_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one stack apply at a time
    # The route modules' own objects, by typed key (see CtxStore).
    store: CtxStore = field(default_factory=CtxStore)
    # GitOps mode: the stack dir and the stacks it declares (the daemon's live set).
    stack_dir: Path | None = None
    gitops_stacks: set[str] = field(default_factory=set)
    # ``--allowed-host``: names the API answers besides its address and localhost.
    allowed_hosts: tuple[str, ...] = ()
    # Who a request is (the token, the keys of <state_dir>/keys.json) and the keys'
    # requests in flight and a minute.
    keys: KeyRing = field(init=False)
    limits: KeyLimits = field(default_factory=KeyLimits)
    # The app is cleaning up (set by the router's cleanup, controller.api.openai): a routed
    # request still running opens nothing new. A field, read by every routed request.
    closed: bool = False

    def __post_init__(self) -> None:
        self.keys = KeyRing(Path(self.state_dir), self.token)

    @property
    def recorder(self) -> RequestRecorder | None:
        """Where routed requests are reported (the metrics, when they run)."""
        # store.get(REQUEST_RECORDER), in line (once a routed request: its code runs from
        # cold caches, where each function more it touches costs; docs/performance.md)
        return self.store._values.get(REQUEST_RECORDER)  # type: ignore[return-value]


API_CTX: Final = web.AppKey("slotctl_api", ApiContext)


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error: ``{"error": {"code", "message", ...details}}``."""

    error: ErrorDetail


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    type: str = "string"  # boolean | number | integer | string
    description: str = ""


@dataclass(frozen=True, slots=True)
class RouteSpec:
    method: str
    path: str
    handler: Handler | None  # None: the data plane serves it (a /v1 route: not aiohttp's)
    summary: str
    tag: str
    public: bool = False
    body: Any = None  # pydantic model / dataclass / TypeAdapter-able type
    responses: Mapping[int, tuple[str, Any]] = field(default_factory=dict)
    query: Sequence[Query] = ()
    content_type: str = "application/json"
    scope: Scope | None = None  # None: route_scope's rule
    operation: str = ""  # the OpenAPI operation's name ("": the handler's)

    @property
    def operation_id(self) -> str:
        name = self.operation or (self.handler.__name__ if self.handler is not None else "")
        return f"{self.method.lower()}_{name}"


def route_scope(spec: RouteSpec) -> Scope | None:
    """The scope a key needs for a route (None: public): ``inference`` the ``/v1``
    routes, ``read`` every other ``GET`` (the event stream and metrics too), ``admin``
    everything else — unless the route declares its own."""
    if spec.public:
        return None
    if spec.scope is not None:
        return spec.scope
    if spec.path == "/v1" or spec.path.startswith("/v1/"):
        return Scope.INFERENCE
    return Scope.READ if spec.method in ("GET", "HEAD") else Scope.ADMIN


class RouteTable:
    """One route module's routes, declared with :meth:`route` next to their handlers.

    The kernel imports no route module: :mod:`controller.api.assembly` collects every
    module's table and builds the app and the OpenAPI document from them.
    """

    def __init__(self) -> None:
        self._routes: list[RouteSpec] = []

    def __iter__(self) -> Iterator[RouteSpec]:
        return iter(self._routes)

    def route(
        self,
        method: str,
        path: str,
        *,
        summary: str,
        tag: str,
        public: bool = False,
        body: Any = None,
        responses: Mapping[int, tuple[str, Any]] | None = None,
        query: Sequence[Query] = (),
        content_type: str = "application/json",
        scope: Scope | None = None,
    ) -> Callable[[Handler], Handler]:
        """Declare a route (see the module docstring)."""

        def register(handler: Handler) -> Handler:
            self._routes.append(
                RouteSpec(
                    method=method,
                    path=path,
                    handler=handler,
                    summary=summary,
                    tag=tag,
                    public=public,
                    body=body,
                    responses=responses or {200: ("OK", None)},
                    query=query,
                    content_type=content_type,
                    scope=scope,
                )
            )
            return handler

        return register

    def served_elsewhere(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        summary: str,
        tag: str,
        body: Any = None,
        responses: Mapping[int, tuple[str, Any]] | None = None,
    ) -> None:
        """Declare a route the data plane serves (``/v1``): documented and given its auth
        rule here, never added to aiohttp's router."""
        self._routes.append(
            RouteSpec(
                method=method,
                path=path,
                handler=None,
                summary=summary,
                tag=tag,
                body=body,
                responses=responses or {200: ("OK", None)},
                operation=operation,
            )
        )


def _jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become null (never ``Infinity``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    body = json.dumps(_jsonable(data), default=str)
    return web.Response(text=body, status=status, content_type="application/json", headers=headers)


# OpenAI's error ``type`` by HTTP status (``/v1/*`` answers in OpenAI's shape).
def _is_openai(request: web.Request) -> bool:
    return request.path == "/v1" or request.path.startswith("/v1/")


def error_response(error: SlotctlError) -> web.Response:
    headers: dict[str, str] = {}
    retry = error.details.get("retry_after_s")
    if isinstance(retry, int | float) and retry > 0:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    if error.http_status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="slotctl"'
    return json_response(error.to_dict(), status=error.http_status, headers=headers)


async def read_body(request: web.Request, model: Any) -> Any:
    """The request body validated as ``model``; a typed 400 otherwise."""
    try:
        raw = await request.json() if request.can_read_body else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is not valid JSON: nested too deeply") from None
    try:
        return TypeAdapter(model).validate_python(raw)
    except ValidationError as exc:
        problems = [
            {"loc": ".".join(str(p) for p in e["loc"]), "message": e["msg"]}
            for e in exc.errors(include_url=False)
        ]
        raise InvalidRequest("request body does not match the schema", problems=problems) from None


def query_flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no", ""):
        return False
    raise InvalidRequest(f"query parameter {name!r} must be true or false, got {value!r}")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SlotctlError as exc:
        _report(request, exc)
        response = error_response(exc)
        if _is_openai(request):  # the same status and headers, OpenAI's body
            code = "invalid_api_key" if exc.http_status == 401 else exc.code
            body = openai_error_body(exc.http_status, exc.message, code)
            response.text = json.dumps(body)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = f"http.{exc.reason.lower().replace(' ', '_')}"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        if _is_openai(request):
            what = "Invalid URL" if exc.status == 404 else exc.reason
            message = f"{what} ({request.method} {request.path})"
            body = openai_error_body(exc.status, message, code.removeprefix("http."))
            return json_response(body, status=exc.status, headers=headers)
        body = {"error": {"code": code, "message": exc.reason}}
        return json_response(body, status=exc.status, headers=headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except RecursionError:  # hostile input (absurd nesting) that reached deeper code
        log.warning("%s %s: input nested too deeply", request.method, request.path)
        return error_response(InvalidRequest("request input is nested too deeply"))
    except Exception:  # every unexpected failure: a typed 500 and a log line
        log.exception("unhandled error in %s %s", request.method, request.path)
        body = {"error": {"code": "internal", "message": "internal error (see the log)"}}
        return json_response(body, status=500)


def _report(request: web.Request, error: SlotctlError) -> None:
    """A refused change nobody reported yet (a pinned delete, a disabled model...) gets
    its one event and log line here; a malformed or unauthenticated request does not."""
    if error.reported or request.method == "GET":
        return
    if isinstance(error, InvalidRequest | Unauthorized | Forbidden):
        return
    error.reported = True
    request.app[API_CTX].events.emit(
        EventKind.REFUSAL,
        Op.API,
        slot=request.match_info.get("name"),
        model=request.match_info.get("model_id"),
        message=error.message,
        error=error.code,
        details={"method": request.method, "path": request.path},
    )


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who the request is, and whether its key's scope reaches the route (an unknown
    path needs a key, any scope, before its 404)."""
    info = request.match_info
    resource = info.route.resource
    canonical = resource.canonical if resource is not None else request.path
    scopes = request.app[_SCOPES]
    needed = scopes.get((request.method, canonical), Scope.INFERENCE)
    if needed is None:
        return await handler(request)
    headers = request.headers
    authorization, api_key = headers.get("Authorization"), headers.get("x-api-key")
    ctx = request.app[API_CTX]
    principal = identify(ctx.keys, authorization, api_key, _now(), _wall())
    if principal is None:
        given = bearer(authorization) or api_key
        raise Unauthorized(BAD_BEARER_MESSAGE if given else NO_BEARER_MESSAGE)
    if principal.scope < needed:
        raise Forbidden(
            f"the key {principal.name!r} has the {principal.scope.label} scope: "
            f"{request.method} {canonical} needs {needed.label}",
            key=principal.name,
            scope=principal.scope.label,
            needs=needed.label,
        )
    request[PRINCIPAL] = principal
    return await handler(request)


PRINCIPAL: Final = web.RequestKey("slotctl_principal", Principal)
_SCOPES: Final = web.AppKey("slotctl_scopes", dict)


def principal_of(request: web.Request) -> Principal | None:
    """Who an authenticated request is (None on a public route)."""
    return request.get(PRINCIPAL)


def _now() -> float:
    return time.monotonic()


def _wall() -> float:
    return time.time()


def build_app(
    ctx: ApiContext,
    routes: Sequence[RouteSpec],
    setups: Sequence[Callable[[web.Application, ApiContext], None]] = (),
) -> web.Application:
    """The aiohttp app serving ``routes`` (auth and typed errors), then each ``setup``."""
    app = web.Application(
        middlewares=[_errors, hosts_middleware, _auth], client_max_size=8 * 1024 * 1024
    )
    app[API_CTX] = ctx
    scopes: dict[tuple[str, str], Scope | None] = {}
    for spec in routes:
        if spec.handler is None:
            continue  # the data plane's
        added = app.router.add_route(spec.method, spec.path, spec.handler)
        resource = added.resource
        canonical = resource.canonical if resource is not None else spec.path
        scopes[(spec.method, canonical)] = route_scope(spec)  # as _auth finds it
    app[_SCOPES] = scopes
    for setup in setups:
        setup(app, ctx)
    return app


# Served without a token by ``--metrics-listen`` (Kubernetes probes, Prometheus).
PROBE_PATHS: Final = ("/metrics", "/healthz", "/readyz")


def build_probe_app(ctx: ApiContext, routes: Sequence[RouteSpec]) -> web.Application:
    """Only ``GET`` of :data:`PROBE_PATHS`, no authentication (``--metrics-listen``).

    They expose no slot config and change nothing; every other path is a 404.
    """
    app = web.Application(middlewares=[_errors])
    app[API_CTX] = ctx
    for spec in routes:
        if spec.method == "GET" and spec.path in PROBE_PATHS and spec.handler is not None:
            app.router.add_route(spec.method, spec.path, spec.handler)
    return app
