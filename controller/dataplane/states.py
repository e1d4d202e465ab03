"""The data plane's states, written down (after h11's ``_state.py``: one state a side, not
a flag per step): a client connection's (:class:`State`, :mod:`.connection`) and an
upstream connection's exchange (:class:`Phase`, :mod:`.upstream`).

Pure; at the bottom of :mod:`controller.dataplane`.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["READING", "Phase", "State"]


class State(enum.Enum):
    """Where a client connection is. ``call`` is set from LEASING to the request's end;
    a request for aiohttp goes PASSING (its bytes) then AIOHTTP until aiohttp answered."""

    IDLE = "idle"  # no request: the next head is read as it comes
    BODY = "body"  # a /v1 head taken, its body coming
    PASSING = "passing"  # a request for aiohttp: its bytes passed on as they come
    AIOHTTP = "aiohttp"  # aiohttp answers the request passed to it; the next one waits
    LEASING = "leasing"  # a task waits for a cold slot's lease
    CONNECTING = "connecting"  # a task waits for a new upstream connection
    SENT = "sent"  # the request went upstream; no answer head yet
    RELAYING = "relaying"  # the answer's head came; its body is relayed as it comes
    LINGERING = "lingering"  # answered before its body: the body dropped, then closed
    HANDED_OVER = "handed_over"  # aiohttp's for good (a head refused, an upgrade)
    CLOSED = "closed"


READING: Final = frozenset((State.IDLE, State.BODY, State.PASSING))


class Phase(enum.Enum):
    """Where an upstream connection is in its exchange (:class:`~.upstream.Upstream`)."""

    IDLE = "idle"  # in the pool (or not yet sent on)
    WAITING = "waiting"  # the request went out, no byte of the answer yet
    HEAD = "head"  # the answer's head is coming
    BODY = "body"  # the head was handed over; the body relayed as it comes
    DONE = "done"  # the answer is whole (or the exchange failed)
