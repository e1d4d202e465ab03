"""The dashboard: one static page at ``/``, its assets under ``/static/``, and the device
memory figures it draws (``GET /api/devices``).

The page and its assets hold no data, so they are public; everything they show comes
from the authenticated API (``/api/slots``, ``/api/devices``, ``/api/events``) with the
bearer token the page asks for once and keeps in the browser's ``localStorage``. No build
step: plain HTML, CSS and JavaScript in ``controller/api/static/`` (package data).

One-time login links (like Jupyter's, without putting the token in a URL): ``slotctl
up`` (and ``slotctl dashboard``, through ``POST /api/login-codes``) prints
``http://HOST:PORT/#login=CODE``. The code sits in the URL *fragment*, which browsers
never send to a server, so it reaches no access log or Referer; the page posts it to the
public ``POST /api/login``, which answers the token once: a code works a single time
and for :data:`LOGIN_CODE_TTL_S` only. The page then drops the fragment from the
address bar and its history entry. ``POST /api/login`` takes ``application/json`` only
(a cross-site page cannot send that without a CORS preflight, never granted); ``slotctl
up`` prints a link only on a terminal (a log file or the journal must not hold one).

:func:`setup` is the hook ``build_app`` calls for the live parts: the app's metrics object
(:data:`~controller.api.metrics.METRICS` in ``ctx.store``) and the shutdown signal that
ends open event streams.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import secrets
import time
from pathlib import Path
from typing import Final

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from controller.api import metrics, sse
from controller.api.app import API_CTX, ApiContext, CtxKey, RouteTable, json_response, read_body
from controller.model.errors import InvalidRequest, Unauthorized

__all__ = [
    "LOGIN_CODE_TTL_S",
    "STATIC_DIR",
    "DeviceList",
    "DeviceOut",
    "login_path",
    "mint_login_code",
    "setup",
]

routes = RouteTable()  # this module's routes (collected by controller.api.assembly)
route = routes.route

LOGIN_CODE_TTL_S: Final = 15 * 60.0


class LoginCodes(dict[str, float]):
    """The one-time login codes minted and not yet used: code -> monotonic expiry."""


_LOGIN_CODES: Final = CtxKey("login_codes", LoginCodes)

STATIC_DIR: Final = Path(__file__).resolve().parent / "static"

_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_ASSET_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# The page loads nothing from elsewhere and runs no inline script.
_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def setup(app: web.Application, ctx: ApiContext) -> None:
    """Called once by ``build_app``."""
    metrics.setup(app, ctx)
    sse.setup(app)


class DeviceOut(BaseModel):
    """One device's memory, in bytes; null where unknown (no probe, no budget). Each GPU
    is a device of its own (``gpu:0``, ``gpu:1``…, with its index, UUID and name)."""

    device: str
    kind: str
    total_bytes: int | None
    free_bytes: int | None
    admitted_bytes: int
    reserved_bytes: int
    resident_bytes: int
    budget_bytes: int | None
    safety_margin_bytes: int
    source: str | None
    slots: list[str]
    index: int | None
    uuid: str | None
    name: str | None
    error: str | None


class DeviceList(BaseModel):
    devices: list[DeviceOut]


def _asset(name: str) -> web.Response:
    path = STATIC_DIR / name
    content_type = _TYPES.get(path.suffix)
    if not _ASSET_NAME.match(name) or content_type is None or not path.is_file():
        raise web.HTTPNotFound()  # the typed 404 body (``http.not_found``)
    return web.Response(body=path.read_bytes(), headers={**_HEADERS, "Content-Type": content_type})


@route(
    "GET",
    "/",
    summary="the dashboard (a static page; it asks for the API token)",
    tag="dashboard",
    public=True,
    responses={200: ("HTML page", str)},
    content_type="text/html",
)
async def dashboard_page(request: web.Request) -> web.Response:
    return _asset("index.html")


@route(
    "GET",
    "/static/{name}",
    summary="the dashboard's static assets (CSS, JavaScript, icon)",
    tag="dashboard",
    public=True,
    responses={200: ("the asset", str), 404: ("no such asset", None)},
    content_type="application/octet-stream",
)
async def dashboard_asset(request: web.Request) -> web.Response:
    return _asset(request.match_info["name"])


@route(
    "GET",
    "/api/devices",
    summary="device memory, each GPU its own: probed total and free, admitted (resident, "
    "reserved) by slotctl, configured budget",
    tag="dashboard",
    responses={200: ("devices", DeviceList)},
)
async def list_devices(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    figures = metrics.device_figures(ctx.manager)
    return json_response({"devices": [dataclasses.asdict(f) for f in figures]})


# ----------------------------------------------------------------------------- login links


def mint_login_code(ctx: ApiContext) -> str:
    """A fresh one-time login code (valid :data:`LOGIN_CODE_TTL_S`); expired ones go."""
    codes = ctx.store.setdefault(_LOGIN_CODES, LoginCodes)
    now = time.monotonic()
    for old in [c for c, expiry in codes.items() if expiry <= now]:
        del codes[old]
    code = secrets.token_urlsafe(18)
    codes[code] = now + LOGIN_CODE_TTL_S
    return code


def login_path(code: str) -> str:
    """The dashboard path that logs in with ``code`` (in the fragment: never sent)."""
    return f"/#login={code}"


class LoginBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(min_length=1, max_length=200)


class LoginAnswer(BaseModel):
    token: str


class LoginCode(BaseModel):
    code: str
    path: str
    expires_in_s: float


@route(
    "POST",
    "/api/login",
    summary="exchange a one-time login code (from `slotctl up`/`slotctl dashboard`) for the "
    "API token",
    tag="dashboard",
    public=True,
    body=LoginBody,
    responses={
        200: ("the API token", LoginAnswer),
        400: ("not an application/json body, or not the schema's", None),
        401: ("wrong, used or expired code", None),
    },
)
async def login(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    if request.content_type != "application/json":
        # Any web page may send a text/plain (or form) POST cross-site without asking;
        # application/json needs a CORS preflight, which this API never grants.
        raise InvalidRequest(
            "POST /api/login takes an application/json body only "
            f"(got {request.content_type or 'none'!r})"
        )
    body: LoginBody = await read_body(request, LoginBody)
    codes = ctx.store.setdefault(_LOGIN_CODES, LoginCodes)
    now = time.monotonic()
    for code, expiry in list(codes.items()):
        if hmac.compare_digest(code.encode(), body.code.encode()):
            del codes[code]  # one use, whatever the outcome
            if expiry > now:
                return json_response({"token": ctx.token})
    raise Unauthorized(
        "this login link is wrong, used or expired: run `slotctl dashboard` for a new one"
    )


@route(
    "POST",
    "/api/login-codes",
    summary="a new one-time dashboard login code (what `slotctl dashboard` prints)",
    tag="dashboard",
    responses={201: ("a code and the dashboard path that uses it", LoginCode)},
)
async def new_login_code(request: web.Request) -> web.Response:
    code = mint_login_code(request.app[API_CTX])
    return json_response(
        {"code": code, "path": login_path(code), "expires_in_s": LOGIN_CODE_TTL_S}, status=201
    )
