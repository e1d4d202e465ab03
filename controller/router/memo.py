"""A connection's last route: what a routed call decided, kept for the next request on the
same kept-alive connection, and the inputs it was decided from.

Where it sits: beside :mod:`controller.router.call` (its one reader and writer); the data
plane's :class:`~controller.dataplane.connection.Connection` holds one per client
connection and hands it to each :class:`~controller.router.call.RoutedCall` it makes.

A kept-alive client sends the same requester, the same priority header and a body naming
the same model, request after request. :meth:`RoutedCall.begin
<controller.router.call.RoutedCall.begin>` decides, for each, who asks (the key's class),
which slots serve the model and which of them serve the endpoint: a few hundred bytecodes
(docs/performance.md, the router) whose answer is the last one's. The memo keeps that
answer with what it was decided from, and a request whose inputs are the same objects (or
equal) takes it whole:

- ``routing``: :meth:`SlotManager.routing <controller.slots.manager.SlotManager.routing>`'s
  tuple: the settings, the catalogue, the aliases and the adapters (each replaced whole on
  a change) and the slot table's routing generation (bumped when a slot is added, removed,
  or its spec or model replaced: what a model names and which endpoints its slot serves);
- ``principal`` (by identity: the key ring makes a new one when ``keys.json`` changes) and
  ``asked``, the priority class the request asks for: they decide ``who``;
- ``model`` (the body's, read for every request) and ``kind`` (the endpoint's): with the
  above they decide ``candidates``.

Only a plain route is kept: a catalogue model (or a slot's, a provider's name) served by
one slot, neither an alias (its member is chosen by the members' states) nor an adapter
(its slots by what they hold), nor replicas (ranked by their load). What follows the
decision — the key's limits, the lease or the wait, the release, the metrics — runs for
every request as ever. A refusal is never kept: a refused request decides again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controller.access.keys import Principal
from controller.slots.records import Requester

__all__ = ["RouteMemo"]


class RouteMemo:
    """The last plain route of one connection (see the module docstring); empty until its
    first routed request is decided."""

    __slots__ = ("asked", "candidates", "kind", "model", "principal", "routing", "who")

    def __init__(self) -> None:
        self.routing: (
            tuple[Any, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any], int] | None
        ) = None
        self.principal: Principal | None = None
        self.asked: str | None = None
        self.who: Requester | None = None  # the requester decided (None: no principal)
        self.model = ""  # the model asked for and served (a plain route: the same)
        self.kind = ""
        self.candidates: tuple[str, ...] = ()  # the one slot, of a type serving ``kind``

    def keep(
        self,
        routing: tuple[Any, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any], int],
        principal: Principal | None,
        asked: str | None,
        who: Requester | None,
        model: str,
        kind: str,
        candidates: tuple[str, ...],
    ) -> None:
        """Remember a plain route decided from these inputs."""
        self.routing, self.principal, self.asked, self.who = routing, principal, asked, who
        self.model, self.kind, self.candidates = model, kind, candidates

    def forget(self) -> None:
        """Keep nothing (the next request decides again)."""
        self.routing = None
