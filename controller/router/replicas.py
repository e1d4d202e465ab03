"""Routing among a slot's replicas: the candidates of a request reordered by the slot's
``routing`` (:mod:`controller.router.prefix`, the pure function) over the manager's
figures (each replica's requests in flight and waiting, whether it serves now).

Called by the routed call (:mod:`controller.router.call`) after the selection ranking
(:func:`controller.router.selection.serving`): when the best candidate is a replica of a
slot with siblings among the candidates, the siblings take its place, in the routing's
order; anything else is left as ranked. A request the routing sends nowhere else waits
in its replica's fair queue (the demand scaler, :mod:`controller.slots.scaling`, sees
the queue and adds a replica).
"""

from __future__ import annotations

import json
from typing import Any, Final

from controller.router.prefix import ReplicaLoad, prefix_key, rank_replicas
from controller.slots.interfaces import RouterPort

__all__ = ["route_replicas"]

_TURNS: Final[dict[str, int]] = {}  # round-robin: a counter per slot


def _body(content_type: str, body: bytes) -> dict[str, Any]:
    """The JSON object of the body (already judged valid by the ``model`` read); {} for
    a form (a transcription's upload: no prompt to hash)."""
    if content_type.partition(";")[0].strip().lower() == "multipart/form-data":
        return {}
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def route_replicas(
    manager: RouterPort, candidates: list[str], model: str, content_type: str, body: bytes
) -> list[str]:
    """``candidates`` (best first) with the best one's replica siblings in the order its
    slot's ``routing`` gives them (unchanged when it has none among the candidates)."""
    if len(candidates) < 2:
        return candidates
    first = manager.known(candidates[0])
    group = first.replica_group if first is not None else ""
    if not group or first is None:
        return candidates
    members: list[str] = []
    for name in candidates:
        spec = manager.known(name)
        if spec is not None and spec.replica_group == group:
            members.append(name)
    if len(members) < 2:
        return candidates
    loads = []
    for name in members:
        in_flight, waiting, warm = manager.load_of(name)
        loads.append(ReplicaLoad(name, in_flight + waiting, warm))
    routing = first.routing
    turn = 0
    key = ""
    if routing == "round-robin":
        turn = _TURNS.get(group, 0)
        _TURNS[group] = turn + 1
    elif routing == "prefix":
        key = prefix_key(_body(content_type, body), model)
        if key == model:  # no prompt to hash (an upload, an odd body): the least loaded
            routing = "least-loaded"
    order = rank_replicas(loads, key, routing=routing, load_factor=first.load_factor, turn=turn)
    taken = set(members)
    at = candidates.index(members[0])
    rest = [n for n in candidates if n not in taken]
    return rest[:at] + order + rest[at:]
