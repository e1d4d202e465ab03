"""API keys: named, scoped, hashed at rest, loaded without a restart.

``<state_dir>/keys.json`` (mode 0600, written atomically through :mod:`controller.store`)
holds one entry a key: its name, the SHA-256 of the key (a key is 32 random bytes, so a
plain hash is enough: there is nothing to brute-force), its scope, the models it may
reach, its priority class and limits, when it expires. The key itself is shown once, by
``slotctl key create``, and never stored. The API token of ``<state_dir>/token`` stays an
``admin`` key; with no ``keys.json`` everything works as before.

Scopes (each route declares the scope it needs: ``controller.api.app.RouteSpec``):

    inference   the /v1 routes (and only the models its patterns name, checked on the
                model that would serve)
    read        the GET routes, the event stream, metrics (and inference), with the
                secrets withheld (controller.access.withheld); not the servers' logs
    admin       everything, secrets and logs included

A running controller sees new and revoked keys within a second (:meth:`KeyRing.current`
looks at the file's identity at most once a second, no watcher). A kept-alive client
presents the same secret again: what :meth:`KeyRing.hold` found for it (a :class:`KeyHold`)
is recognised by :meth:`KeyRing.again` while the keys are those it was found in — the same
answer as :meth:`KeyRing.identify`'s, without hashing the secret again. Pure except for
the file it reads and writes.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import hmac
import math
import re
import secrets
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.model.errors import (
    InvalidRequest,
    KeyConcurrencyLimited,
    KeyLimited,
    KeyNotFound,
    SlotctlError,
)
from controller.store.files import atomic_write_json

__all__ = [
    "KEY_PREFIX",
    "NAME_PATTERN",
    "KeyEntry",
    "KeyHold",
    "KeyLimits",
    "KeyRing",
    "Principal",
    "Scope",
    "create_key",
    "hash_key",
    "parse_duration",
    "revoke_key",
]

KEY_PREFIX: Final = "sk-slotctl-"
KEYS_FILE: Final = "keys.json"
NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$"
_RECHECK_S: Final = 1.0
_WINDOW_S: Final = 60.0  # rpm: the requests of the last minute
_DURATION: Final = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhdw])$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class Scope(IntEnum):
    """What a key may do; a higher scope includes the lower ones."""

    INFERENCE = 1
    READ = 2
    ADMIN = 3

    @classmethod
    def parse(cls, name: str) -> Scope:
        try:
            return cls[name.upper()]
        except KeyError:
            raise InvalidRequest(
                f"unknown scope {name!r}: inference, read or admin", scope=name
            ) from None

    @property
    def label(self) -> str:
        return self.name.lower()


class KeyEntry(BaseModel):
    """One key as ``keys.json`` holds it (never the key itself)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    scope: str = "inference"
    models: tuple[str, ...] = ()  # fnmatch patterns; empty: every model
    priority: str | None = None  # its class (None: the controller's default class)
    max_concurrency: int | None = Field(default=None, ge=1)
    rpm: int | None = Field(default=None, ge=1)
    created_at: float = 0.0  # wall clock
    expires_at: float | None = None  # wall clock; None: never


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: a key's name (``admin`` for the API token), its scope, limits;
    ``id``: the key's identity (its hash, never shown): what its counters are kept by, so
    a key revoked and created again under the same name starts with none of them."""

    name: str
    scope: Scope
    models: tuple[str, ...] = ()
    priority: str | None = None
    max_concurrency: int | None = None
    rpm: int | None = None
    id: str = ""  # "": the API token

    def may_use(self, model: str) -> bool:
        return not self.models or any(fnmatch.fnmatchcase(model, p) for p in self.models)

    @property
    def is_token(self) -> bool:
        return self.name == ""


TOKEN_PRINCIPAL: Final = Principal("", Scope.ADMIN)


@dataclass(frozen=True, slots=True)
class KeyHold:
    """A key's principal as :meth:`KeyRing.hold` found it: the keys it was found in (the
    ring's dict: a new one when ``keys.json`` changes), its entry, its principal."""

    keys: dict[str, KeyEntry]
    entry: KeyEntry
    principal: Principal


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``2h``, ``7d``, ``2w`` -> seconds (InvalidRequest otherwise)."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise InvalidRequest(f"invalid duration {text!r}: e.g. 90s, 15m, 2h, 7d, 2w")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _path(state_dir: Path) -> Path:
    return Path(state_dir) / KEYS_FILE


def read_entries(state_dir: Path) -> list[KeyEntry]:
    """The keys of ``keys.json`` (none when it does not exist). A file that cannot be
    read or parsed is an error, never "no keys" (that would open nothing, but hide that
    the keys were lost: a refusal says so)."""
    path = _path(state_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SlotctlError(f"cannot read {path}: {exc.strerror}", path=str(path)) from None
    try:
        import json

        raw = json.loads(data)
        return [KeyEntry.model_validate(item) for item in raw.get("keys", [])]
    except (ValueError, AttributeError, ValidationError) as exc:
        raise SlotctlError(f"{path} is not a valid keys file: {exc}", path=str(path)) from None


def _write(state_dir: Path, entries: Iterable[KeyEntry]) -> None:
    data = {"keys": [e.model_dump(mode="json") for e in sorted(entries, key=lambda e: e.name)]}
    atomic_write_json(_path(state_dir), data, mode=0o600)


def create_key(
    state_dir: Path,
    name: str,
    *,
    scope: Scope,
    models: Iterable[str] = (),
    priority: str | None = None,
    max_concurrency: int | None = None,
    rpm: int | None = None,
    expires_in_s: float | None = None,
    now: float | None = None,
) -> tuple[str, KeyEntry]:
    """A new key (returned once, with its entry); a name in use is refused."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise InvalidRequest(f"invalid key name {name!r}: lower-case letters, digits, - _ .")
    entries = read_entries(state_dir)
    if any(e.name == name for e in entries):
        raise InvalidRequest(f"a key named {name!r} exists: revoke it first", name=name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    stamp = time.time() if now is None else now
    entry = KeyEntry(
        name=name,
        sha256=hash_key(key),
        scope=scope.label,
        models=tuple(models),
        priority=priority,
        max_concurrency=max_concurrency,
        rpm=rpm,
        created_at=stamp,
        expires_at=stamp + expires_in_s if expires_in_s is not None else None,
    )
    _write(state_dir, [*entries, entry])
    return key, entry


def revoke_key(state_dir: Path, name: str) -> KeyEntry:
    entries = read_entries(state_dir)
    found = [e for e in entries if e.name == name]
    if not found:
        raise KeyNotFound(f"no key named {name!r}", name=name)
    _write(state_dir, [e for e in entries if e.name != name])
    return found[0]


@dataclass(slots=True)
class KeyRing:
    """The keys a running controller accepts, kept current with ``keys.json``."""

    state_dir: Path
    token: str
    _by_hash: dict[str, KeyEntry] = field(default_factory=dict)
    _identity: tuple[int, int, int] | None = None
    _checked: float = -1e9
    error: str | None = None  # why keys.json could not be read (its keys are refused)
    last_used: dict[str, float] = field(default_factory=dict)  # name -> wall clock

    def current(self, now: float) -> dict[str, KeyEntry]:
        """The keys by hash; ``keys.json`` looked at again at most once a second."""
        if now - self._checked >= _RECHECK_S:
            self._checked = now
            self._reload()
        return self._by_hash

    def _reload(self) -> None:
        path = _path(self.state_dir)
        try:
            st = path.stat()
        except FileNotFoundError:
            self._by_hash, self._identity, self.error = {}, None, None
            return
        except OSError as exc:
            self.error = f"cannot read {path}: {exc.strerror}"
            return
        identity = (st.st_ino, st.st_mtime_ns, st.st_size)
        if identity == self._identity:
            return
        try:
            entries = read_entries(self.state_dir)
        except SlotctlError as exc:
            self._by_hash, self.error = {}, exc.message  # fail closed: no key is accepted
            return
        self._by_hash = {e.sha256: e for e in entries}
        self._identity, self.error = identity, None

    def refresh(self) -> None:
        """Read ``keys.json`` again now (after this process changed it)."""
        self._checked = -1e9
        self._identity = None

    def identify(self, presented: str, now: float, wall: float) -> Principal | None:
        """Who presents this secret: the token's admin, a key's principal, or None."""
        found = self.hold(presented, now, wall)
        return found.principal if isinstance(found, KeyHold) else found

    def hold(self, presented: str, now: float, wall: float) -> KeyHold | Principal | None:
        """:meth:`identify`'s answer, a key's as the :class:`KeyHold` that :meth:`again`
        recognises (the token's admin as itself)."""
        if hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self.token.encode()):
            return TOKEN_PRINCIPAL
        keys = self.current(now)
        entry = keys.get(hash_key(presented))
        if entry is None:
            return None
        if entry.expires_at is not None and wall >= entry.expires_at:
            return None
        self.last_used[entry.name] = wall
        principal = Principal(
            entry.name,
            Scope.parse(entry.scope),
            entry.models,
            entry.priority,
            entry.max_concurrency,
            entry.rpm,
            entry.sha256,
        )
        return KeyHold(keys, entry, principal)

    def again(self, held: KeyHold, now: float, wall: float) -> Principal | None:
        """What :meth:`identify` says now of the secret ``held`` was found for, while the
        keys are still those it was found in (``keys.json`` looked at as ever, at most once
        a second): its principal (marked used), or None when it expired; None too when
        the keys changed (identify it again)."""
        if self.current(now) is not held.keys:
            return None
        entry = held.entry
        if entry.expires_at is not None and wall >= entry.expires_at:
            return None
        self.last_used[entry.name] = wall
        return held.principal

    def describe(
        self, wall: float, in_flight: Mapping[str, int] | None = None
    ) -> list[dict[str, Any]]:
        """Every key for ``slotctl key list`` (with ``in_flight``: its requests in flight,
        :attr:`KeyLimits.in_flight`): never a secret or its hash."""
        running = in_flight or {}
        with contextlib.suppress(SlotctlError):
            entries = read_entries(self.state_dir)
            out = [_public(e, self.last_used.get(e.name), wall) for e in entries]
            if in_flight is not None:
                for entry, item in zip(entries, out, strict=True):
                    item["in_flight"] = running.get(entry.sha256, 0)
            return out
        return []


def _public(entry: KeyEntry, last_used: float | None, wall: float) -> dict[str, Any]:
    data = entry.model_dump(mode="json", exclude={"sha256"})
    data["last_used"] = last_used
    data["expired"] = entry.expires_at is not None and wall >= entry.expires_at
    return data


class KeyLimits:
    """Per key: its requests in flight (``max_concurrency``) and those of the last minute
    (``rpm``); the API token has none. One per controller, counted by the routed call.
    Kept by the key's id (:attr:`Principal.id`), never its name: a key revoked and made
    again under the same name starts afresh."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}

    def admit(self, principal: Principal, now: float) -> KeyLimited | None:
        """Count one more request of ``principal`` (None), or the 429 that refuses it."""
        name, flow = principal.name, principal.id
        if principal.max_concurrency is not None:
            running = self.in_flight.get(flow, 0)
            if running >= principal.max_concurrency:
                return KeyConcurrencyLimited(
                    f"the key {name!r} has {running} requests in flight "
                    f"(max_concurrency={principal.max_concurrency})",
                    retry_after_s=1.0,
                    key=name,
                )
        if principal.rpm is not None:
            recent = self._recent.setdefault(flow, deque())
            while recent and recent[0] <= now - _WINDOW_S:
                recent.popleft()
            if len(recent) >= principal.rpm:
                return KeyLimited(
                    f"the key {name!r} made {len(recent)} requests in the last minute "
                    f"(rpm={principal.rpm})",
                    retry_after_s=max(1.0, math.ceil(recent[0] + _WINDOW_S - now)),
                    key=name,
                )
            recent.append(now)
        if name:
            self.in_flight[flow] = self.in_flight.get(flow, 0) + 1
        return None

    def done(self, principal: Principal) -> None:
        """One request of ``principal`` that :meth:`admit` counted ended."""
        left = self.in_flight.get(principal.id, 0) - 1
        if left > 0:
            self.in_flight[principal.id] = left
        else:
            self.in_flight.pop(principal.id, None)
