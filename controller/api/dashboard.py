"""The dashboard: one static page at ``/``, its assets under ``/static/``, and the device
memory figures it draws (``GET /api/devices``).

The page and its assets hold no data, so they are public; everything they show comes
from the authenticated API (``/api/slots``, ``/api/devices``, ``/api/events``) with the
bearer token the page asks for once and keeps in the browser's ``localStorage``. No build
step: plain HTML, CSS and JavaScript in ``controller/api/static/`` (package data).

:func:`setup` is the hook ``build_app`` calls for the live parts: the app's metrics object
(``ctx.extra["metrics"]``) and the shutdown signal that ends open event streams.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Final

from aiohttp import web
from pydantic import BaseModel

from controller.api import metrics, sse
from controller.api.app import API_CTX, ApiContext, json_response, route

__all__ = ["STATIC_DIR", "DeviceList", "DeviceOut", "setup"]

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
    """One device's memory, in bytes; null where unknown (no probe, no budget)."""

    device: str
    total_bytes: int | None
    free_bytes: int | None
    admitted_bytes: int
    budget_bytes: int | None
    safety_margin_bytes: int
    source: str | None
    slots: list[str]


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
    summary="device memory: probed total and free, admitted by slotctl, configured budget",
    tag="dashboard",
    responses={200: ("devices", DeviceList)},
)
async def list_devices(request: web.Request) -> web.Response:
    ctx = request.app[API_CTX]
    figures = metrics.device_figures(ctx.manager)
    return json_response({"devices": [dataclasses.asdict(f) for f in figures]})
