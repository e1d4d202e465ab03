"""Which headers the router passes on, in each direction (the data plane's request and
answer heads).

Never forwarded: hop-by-hop headers (RFC 9110 §7.6.1) and every header a ``Connection``
header names, the controller's own credentials, the lengths and codings each connection
sets itself; nor a name that is one of those with ``_`` for ``-`` (``Transfer_Encoding``:
a server that folds ``_`` into ``-``, as CGI-style stacks do, would read it as the framing
header the router did not check; nginx drops such names too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = [
    "REQUEST_DROP",
    "REQUEST_DROP_BYTES",
    "RESPONSE_DROP",
    "RESPONSE_DROP_BYTES",
    "connection_names",
    "passes",
]

_HOP_BY_HOP: Final = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    )
)
# A key (as a bearer token or x-api-key) and the class header are the router's, never
# the server's.
REQUEST_DROP: Final = _HOP_BY_HOP | {
    "authorization",
    "cookie",
    "expect",
    "x-api-key",
    "x-slotctl-priority",
}
RESPONSE_DROP: Final = _HOP_BY_HOP | {"set-cookie", "server", "date"}
REQUEST_DROP_BYTES: Final = frozenset(h.encode() for h in REQUEST_DROP)
# The data plane passes the upstream's Date (aiohttp, which adds its own, drops it).
RESPONSE_DROP_BYTES: Final = frozenset(h.encode() for h in RESPONSE_DROP) - {b"date"}


def connection_names(values: Iterable[str]) -> frozenset[str]:
    """The header names that ``Connection`` header values name (lower case)."""
    return frozenset(
        token.strip().lower() for value in values for token in value.split(",") if token.strip()
    )


def passes(name: str, drop: frozenset[str], named: frozenset[str] = frozenset()) -> bool:
    """Whether a header (its name lower case) is passed on: not in ``drop``, not named by
    ``Connection`` (``named``), not a dropped name spelt with ``_``."""
    if name in drop or name in named:
        return False
    return "_" not in name or name.replace("_", "-") not in drop
