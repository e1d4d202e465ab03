"""Who a routed request is and what it may do: the key it presents (``Authorization:
Bearer`` or ``x-api-key``, as clients of other OpenAI-compatible servers send it), the
models it may reach, the priority class it waits in (``X-Slotctl-Priority`` may lower it,
never raise it), and its key's own limits (requests in flight, requests a minute: 429s).

Used by the routed call (:mod:`controller.router.call`), the data plane and the API's
auth middleware (:mod:`controller.api.app`); the keys themselves are
:mod:`controller.access.keys`'s.
"""

from __future__ import annotations

from typing import Final

from controller.access.keys import KeyRing, Principal
from controller.router.refusals import Refusal
from controller.slots.records import Requester
from controller.spec.schema import ControllerSettings

__all__ = [
    "PRIORITY_HEADER",
    "bearer",
    "identify",
    "model_refused",
    "requester",
]

PRIORITY_HEADER: Final = "x-slotctl-priority"


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer`` value (None: none)."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


def identify(
    ring: KeyRing, authorization: str | None, api_key: str | None, now: float, wall: float
) -> Principal | None:
    """The principal of the secret a request presents (the bearer token first, else
    ``x-api-key``); None: none, or one nobody holds (a 401)."""
    secret = bearer(authorization) or (api_key.strip() if api_key else None)
    return ring.identify(secret, now, wall) if secret else None


def model_refused(principal: Principal, model: str) -> Refusal:
    """The 403 of a key that may not use ``model`` (its ``--models`` patterns)."""
    return Refusal(
        403,
        f"the key {principal.name!r} may not use the model {model!r}",
        code="model_not_allowed",
        param="model",
    )


def requester(settings: ControllerSettings, principal: Principal, asked: str | None) -> Requester:
    """Who waits, and in which class: the key's class (the default one for the API token
    and keys without one), or a lower one the request asks for. A class that is higher
    than the key's is not granted (the key's own is used: a header cannot raise it); a
    class that is not declared is a 400."""
    own = settings.priority_class(principal.priority)
    if not asked:
        return Requester(principal.name, own.name)
    name = asked.strip().lower()
    wanted = next((c for c in settings.priority_classes if c.name == name), None)
    if wanted is None:
        names = ", ".join(c.name for c in settings.priority_classes)
        raise Refusal(
            400,
            f"unknown priority class {asked!r} in {PRIORITY_HEADER} (declared: {names})",
            code="invalid_priority",
            param=PRIORITY_HEADER,
        )
    chosen = wanted if wanted.weight <= own.weight else own
    return Requester(principal.name, chosen.name)
