"""URLs made fit for a log line, an error or an event: their query and their
``user:password@`` cut.

A hub's CDN answers with signed URLs whose query is a credential, and a URL source may
carry one too (in its query, or as ``user:password@host``); every message of the engine
that names a URL passes it through :func:`redact_url` (the hub's and the HTTP client's
log records too: a filter in :mod:`controller.modelfiles.hub`). Pure, and cheap to import:
the pull's messages, the dry run's and the CLI's use it without loading the hub's client
library.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["redact_url"]

_URL_QUERY: Final = re.compile(r"(https?://[^\s?#'\"]+)[?#][^\s'\"]*")
_URL_USERINFO: Final = re.compile(r"(https?://)[^\s/?#'\"]*@")


def redact_url(text: str) -> str:
    """``text`` with every URL's query and credentials cut (a CDN's signed URL carries a
    credential in its query, ``https://user:password@host/...`` one before its host)."""
    return _URL_QUERY.sub(r"\1?…", _URL_USERINFO.sub(r"\1", text))
