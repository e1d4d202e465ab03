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

from controller.access.keys import KeyHold, KeyRing, Principal
from controller.router.refusals import Refusal
from controller.slots.interfaces import RouterPort
from controller.slots.records import Requester
from controller.spec.schema import ControllerSettings

__all__ = [
    "PRIORITY_HEADER",
    "bearer",
    "hold",
    "identify",
    "model_refused",
    "permitted",
    "requester",
    "served_model",
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


def hold(
    ring: KeyRing, authorization: str | None, api_key: str | None, now: float, wall: float
) -> KeyHold | Principal | None:
    """:func:`identify`'s answer, a key's as its :class:`KeyHold` (``KeyRing.again``)."""
    secret = bearer(authorization) or (api_key.strip() if api_key else None)
    return ring.hold(secret, now, wall) if secret else None


def model_refused(principal: Principal, model: str, asked: str = "") -> Refusal:
    """The 403 of a key that may not use ``model`` (its ``--models`` patterns); ``asked``:
    the name the request gave, when it resolved to ``model``."""
    via = f" (which {asked!r} resolves to)" if asked and asked != model else ""
    return Refusal(
        403,
        f"the key {principal.name!r} may not use the model {model!r}{via}",
        code="model_not_allowed",
        param="model",
    )


def served_model(manager: RouterPort, slot: str) -> str:
    """The model ``slot`` serves: its catalogue model, or its own name for a model-less
    (self-managed) slot. What a key's ``--models`` patterns are checked on."""
    spec = manager.known(slot)
    return spec.model_id if spec is not None and spec.model_id else slot


def permitted(
    principal: Principal | None, manager: RouterPort, asked: str, names: list[str]
) -> list[str]:
    """``names`` (the slots a request for ``asked`` resolved to, best first) whose served
    model the key may use; the 403 when it may use none of them.

    Authorization is decided on what would serve, never on the name asked for alone
    (OWASP API1): a slot's name, a provider's or an alias' member can resolve to a model
    the key's patterns do not allow, and nothing of it may load. The API token and keys
    without patterns may use every model."""
    if principal is None or not principal.models or not names:
        return names
    kept = [n for n in names if principal.may_use(served_model(manager, n))]
    if not kept:
        raise model_refused(principal, served_model(manager, names[0]), asked)
    return kept


def requester(settings: ControllerSettings, principal: Principal, asked: str | None) -> Requester:
    """Who waits, and in which class: the key's class (the default one for the API token
    and keys without one), or a lower one the request asks for. A class that is higher
    than the key's is not granted (the key's own is used: a header cannot raise it); a
    class that is not declared is a 400."""
    own = settings.priority_class(principal.priority)
    if not asked:
        return Requester(principal.name, own.name, principal.id)
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
    return Requester(principal.name, chosen.name, principal.id)
