"""The API assembled: every route module's table, the app built from them, the document.

The top of ``controller.api``: it imports the route modules (REST routes of slots,
models, their files and stacks, the OpenAI routes the data plane serves, the event stream, metrics,
the dashboard); they
import only the kernel (:mod:`controller.api.app`) and what they share, which import none
of them. ``/api/openapi.json`` lives here, since the document covers every module.
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web

from controller.api import (
    adapter_routes,
    dashboard,
    file_routes,
    key_routes,
    metrics,
    model_routes,
    openai,
    routes,
    sse,
    stack_routes,
    traffic,
)
from controller.api.app import (
    ApiContext,
    RouteSpec,
    RouteTable,
    json_response,
)
from controller.api.app import build_app as build_kernel_app
from controller.api.app import build_probe_app as build_kernel_probe_app
from controller.api.openapi import openapi_document as kernel_openapi_document

__all__ = ["ROUTES", "build_app", "build_probe_app", "openapi_document"]

_own = RouteTable()


@_own.route(
    "GET",
    "/api/openapi.json",
    summary="this document",
    tag="health",
    responses={200: ("OpenAPI 3.1 document", None)},
)
async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())


# In the order aiohttp resolves them (none of these paths overlap another anyway).
ROUTES: Final[tuple[RouteSpec, ...]] = (
    *metrics.routes,
    *sse.routes,
    *dashboard.routes,
    *traffic.routes,
    *openai.routes,
    *routes.routes,
    *model_routes.routes,
    *adapter_routes.routes,
    *file_routes.routes,
    *stack_routes.routes,
    *key_routes.routes,
    *_own,
)


def build_app(ctx: ApiContext) -> web.Application:
    """The whole API: REST, events, metrics, dashboard (bearer auth but public), and the
    OpenAI routes' documents (the data plane serves them)."""
    setups = (dashboard.setup, openai.setup, traffic.setup, key_routes.setup)
    return build_kernel_app(ctx, ROUTES, setups)


def build_probe_app(ctx: ApiContext) -> web.Application:
    """``--metrics-listen``: ``/metrics``, ``/healthz``, ``/readyz`` without a token."""
    return build_kernel_probe_app(ctx, ROUTES)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route."""
    return kernel_openapi_document(ROUTES)
