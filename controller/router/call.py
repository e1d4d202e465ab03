"""One routed request, sans I/O: the script every ``/v1`` request to a slot follows, in one
place, driven by whatever reads and writes its bytes (after h11's one ``Connection``).

Where it sits: the top of :mod:`controller.router`; the data plane
(:mod:`controller.dataplane.connection`) is its one driver. A :class:`RoutedCall` is made
when a routed request's head is taken (who asks is known: the key it presents) and goes
through its :class:`Phase` s, each step a method the transport calls:

1. :meth:`~RoutedCall.begin` (the body read): the requester and its priority class, the
   body's ``model`` (as the endpoint reads it), an alias' member, the candidates (ranked,
   of a slot type that serves the endpoint), the key's models and limits, then a lease
   now (True: :data:`Phase.LEASED`) or a wait (False: :data:`Phase.WAITING`); a refusal
   raises :class:`~controller.router.refusals.Refusal`, its answer.
2. :meth:`~RoutedCall.wait` (a coroutine, the one await): a cold slot's load or a turn.
3. :meth:`~RoutedCall.upstream`: the slot's endpoint and the body its server sees (an
   alias' member's ``model`` written in): :data:`Phase.UPSTREAM`.
4. :meth:`~RoutedCall.answered` and :meth:`~RoutedCall.keep` as the answer passes (its
   status; a key's ``usage`` in the answer's tail).
5. :meth:`~RoutedCall.finish`, once, however the request ends: the lease released, the key's
   request counted out of its limits, the request reported to the metrics.

Between them, the failures are the script's too: what a given-up request answers
(:meth:`~RoutedCall.interrupted`: a revoked lease, a silent server, the stop, the client
gone), an upstream that cannot be reached or breaks (:meth:`~RoutedCall.upstream_failed`).
Rendering answers, framing, keep-alive and the in-band end of a broken event stream are
the transport's.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Final

from controller.access.keys import Principal
from controller.model.errors import AdapterNotFound, ModelNotFound, SlotctlError, SlotNotReady
from controller.router.access import model_refused, permitted, requester
from controller.router.adapters import adapter_body, named_adapter
from controller.router.aliases import alias_candidates
from controller.router.body import model_of, with_model
from controller.router.context import (
    CLIENT_CLOSED,
    USAGE_TAIL,
    RouterContext,
    cached_of,
    upstream_idle_s,
    usage_of,
)
from controller.router.leasing import Pending, acquire_now, acquire_rest
from controller.router.memo import RouteMemo
from controller.router.refusals import (
    Refusal,
    model_not_found,
    report_refusal,
    revoked,
    shutting_down,
    slot_refusal,
    upstream_failed,
    upstream_timeout,
    upstream_unreachable,
    wrong_endpoint,
)
from controller.router.replicas import route_replicas
from controller.router.selection import fitting, route
from controller.slots.interfaces import RouterPort
from controller.slots.records import AdapterHold, Lease, Requester
from controller.spec.schema import AdapterSpec, AliasSpec, ControllerSettings, ModelSpec

__all__ = ["Phase", "RoutedCall", "record_unserved"]

log = logging.getLogger("slotctl.router")


class Phase(enum.IntEnum):
    """Where a routed call is (an ``IntEnum``: compared and hashed as ints, in C)."""

    BEGUN = 0  # its head was taken (who asks is known); its body is being read
    WAITING = 1  # waits for a cold slot's load or for its turn (:meth:`RoutedCall.wait`)
    LEASED = 2  # holds its lease
    UPSTREAM = 3  # sent to the slot's server; its answer passes
    DONE = 4  # finished: the lease released, the call recorded


# The phases each phase may move to (h11's transition table: one place says them all).
_NEXT: Final[dict[Phase, tuple[Phase, ...]]] = {
    Phase.BEGUN: (Phase.WAITING, Phase.LEASED, Phase.DONE),
    Phase.WAITING: (Phase.LEASED, Phase.DONE),
    Phase.LEASED: (Phase.UPSTREAM, Phase.DONE),
    Phase.UPSTREAM: (Phase.DONE,),
    Phase.DONE: (),
}
_BEGUN, _WAITING, _LEASED, _UPSTREAM, _DONE = Phase


class CallStateError(RuntimeError):
    """A step asked of a call in a phase that does not allow it (a driver's bug)."""


class _Who:
    """The requester of a principal and the class it asks for, per settings object (the
    settings are replaced whole when they change): a dict lookup a request, not a scan
    of the classes."""

    __slots__ = ("by", "settings")

    def __init__(self) -> None:
        self.settings: ControllerSettings | None = None
        self.by: dict[tuple[str, str, str | None, str | None], Requester] = {}

    def of(
        self, settings: ControllerSettings, principal: Principal, asked: str | None
    ) -> Requester:
        if settings is not self.settings:
            self.settings, self.by = settings, {}
        key = (principal.id, principal.name, principal.priority, asked)  # by the key's id
        found = self.by.get(key)
        if found is None:
            found = requester(settings, principal, asked)  # a refusal raises, not kept
            if len(self.by) >= 4096:
                self.by.clear()
            self.by[key] = found
        return found


_WHO: Final = _Who()


class RoutedCall:
    """One routed request's script (see the module docstring). ``kind`` is what the
    endpoint asks of a slot (:data:`~controller.router.endpoints.SERVES`' words; "" an
    invalid audio path, refused with ``path``), ``forms`` whether it reads a multipart
    form's ``model``."""

    # What every call starts with, as class attributes: __init__ writes only what differs
    # from call to call (each store a few bytecodes of every request; docs/performance.md,
    # the router), a call's own value shadowing its class' once written.
    phase: Phase = _BEGUN
    who: Requester | None = None  # the key and the class it waits in
    model = ""  # the model served (an alias': its member)
    alias = ""  # the alias the request named
    adapter = ""  # the LoRA adapter the request named (``model``: its base)
    hold: AdapterHold | None = None  # the adapter held in the leased slot
    slot = ""
    status = 0
    lease: Lease | None = None
    pending: Pending | None = None
    counted = False  # in the key's limits until finish
    waited: float | None = None  # seconds it waited for its lease (None: no wait)
    # A key's call keeps the last bytes of its answer, where a server reports ``usage``
    # (None: not kept: the API token's calls, which no key's figures count).
    tail: bytearray | None = None
    keyed = False  # a key's call (its usage counted for it)
    group = ""  # the leased slot is a replica of this slot (its tokens counted)
    content_type = ""
    body = b""

    def __init__(
        self,
        ctx: RouterContext,
        principal: Principal | None,
        kind: str,
        forms: bool = False,
        path: str = "",
        started: float | None = None,
        memo: RouteMemo | None = None,
    ) -> None:
        self.ctx = ctx
        self.principal = principal  # who asks (the key; the token's admin)
        self.kind = kind
        self.forms = forms
        self.path = path
        self.started = time.monotonic() if started is None else started
        self.memo = memo  # the connection's last route (router/memo.py; None: none kept)

    def _move(self, to: Phase) -> None:
        if to not in _NEXT[self.phase]:
            raise CallStateError(f"a routed call cannot go from {self.phase.name} to {to.name}")
        self.phase = to

    # ------------------------------------------------------------------ the steps

    def begin(self, asked: str | None, content_type: str, body: bytes) -> bool:
        """The request's body is read: lease a slot serving its model. True: leased now;
        False: :meth:`wait` first. Raises the :class:`Refusal` to answer."""
        if self.phase is not _BEGUN:
            raise CallStateError(f"begin in {self.phase.name}")
        ctx, principal, kind = self.ctx, self.principal, self.kind
        if ctx.closed:
            raise shutting_down()
        if not kind:  # before any lease or load (plain segments only: AUDIO_TAIL)
            raise Refusal(
                400, f"invalid audio endpoint {self.path!r}", code="invalid_request_error"
            )
        manager = ctx.manager
        routing = manager.routing()
        memo = self.memo
        candidates: Sequence[str]
        if (
            memo is not None
            and memo.routing == routing
            and memo.principal is principal
            and memo.asked == asked
        ):  # the connection's last request's requester (router/memo.py)
            self.who = memo.who
            model = model_of(content_type, body, self.forms)
            self.content_type, self.body = content_type, body
            if model == memo.model and kind == memo.kind:  # and its route
                candidates = memo.candidates
                self.model = model
            else:
                candidates = self._decide(asked, model, routing)
        else:
            if principal is not None:  # _WHO.of's common case, in line (see below)
                who = _WHO
                settings = routing[0]
                found = (
                    who.by.get((principal.id, principal.name, principal.priority, asked))
                    if settings is who.settings
                    else None
                )
                self.who = found if found is not None else who.of(settings, principal, asked)
            model = model_of(content_type, body, self.forms)
            self.content_type, self.body = content_type, body
            candidates = self._decide(asked, model, routing)
        if principal is not None and principal.name:  # a key (the API token has no limits)
            limited = ctx.limits.admit(principal, time.monotonic())
            if limited is not None:
                raise slot_refusal(limited)
            self.counted = self.keyed = True
            self.tail = bytearray()  # a key's call: its answer's usage counts for it
        now: Lease | Pending | None
        try:
            if len(candidates) == 1:  # acquire_now's common case, in line: a
                # request's code runs from cold caches, where each function more it touches
                # costs (docs/performance.md, the router)
                try:
                    now = manager.try_acquire(candidates[0], self.who)
                except SlotNotReady:
                    now = Pending(candidates, 0, 1, [])  # unloading: queue again (awaited)
                if now is None:
                    now = Pending(candidates, 0, 0, [])
            else:
                now = acquire_now(manager, candidates, self.who)
        except SlotctlError as exc:
            report_refusal(ctx, exc, model)
            raise slot_refusal(exc) from None
        if isinstance(now, Lease):
            self.lease, self.slot = now, now.slot
            if self.adapter and not self._hold_now():
                self.phase = _WAITING  # its adapter is loaded (or joined) in wait()
                return False
            self.phase = _LEASED
            return True
        self.pending, self.phase = now, _WAITING
        return False

    def _decide(
        self,
        asked: str | None,
        model: str,
        routing: tuple[
            ControllerSettings,
            dict[str, ModelSpec],
            dict[str, AliasSpec],
            Mapping[str, AdapterSpec],
            int,
        ],
    ) -> Sequence[str]:
        """:meth:`begin`'s decision: the slots that may serve ``model`` (the body's) for
        the endpoint, best first (``self.model``: the one served), or the refusal. A
        plain route is kept in the connection's memo (router/memo.py)."""
        ctx, principal, kind, manager = self.ctx, self.principal, self.kind, self.ctx.manager
        _, models, aliases, adapters, _ = routing
        alias = aliases.get(model) if aliases else None
        adapter = None
        if model not in models and alias is None:
            try:
                adapter = named_adapter(manager, model)
            except SlotctlError as exc:
                report_refusal(ctx, exc, model)
                raise slot_refusal(exc) from None
        served: Sequence[str]
        candidates: Sequence[str]
        plain = False  # neither an alias nor an adapter (router/memo.py)
        if alias is not None and model not in models:  # (a model's id wins)
            model, served = alias_candidates(ctx, principal, alias, kind)
            self.alias = alias.id
            candidates, refused = fitting(manager, served, kind)
        elif adapter is not None:  # a slot of its base that can serve it, holders first
            if principal is not None and principal.models and not principal.may_use(adapter.id):
                raise model_refused(principal, adapter.id)
            self.adapter, model = adapter.id, adapter.base
            served = manager.adapter_slots(adapter.id)
            if not served:  # declared, but no slot of its base can hold adapters
                error = AdapterNotFound(
                    f"adapter {adapter.id!r} is declared but no slot of {adapter.base!r} "
                    "serves adapters (max_loras, or a slot's adapters)",
                    adapter=adapter.id,
                )
                report_refusal(ctx, error, adapter.id)
                raise slot_refusal(error)
            candidates, refused = fitting(manager, served, kind)
        else:
            served, candidates, refused = route(manager, model, kind)
            plain = True
        if not self.adapter and adapters:  # (a model's, an alias' member's request)
            # never a slot whose server applies an adapter to every request
            kept = [n for n in served if not _adapter_only(manager, n)]
            if len(kept) != len(served):
                served = kept
                candidates, refused = fitting(manager, served, kind)
        if principal is not None and principal.models and not self.adapter:
            if not principal.may_use(model):  # a key with --models patterns
                raise model_refused(principal, model)
            # decided on the model(s) that would serve, before any lease or load
            kept = permitted(principal, manager, model, list(served))
            if len(kept) != len(served):
                served = kept
                candidates, refused = fitting(manager, served, kind)
        if not served:
            report_refusal(ctx, ModelNotFound(model), model)
            raise model_not_found(model)
        self.model = model
        if len(served) > 1 and not self.adapter:  # a slot's replicas: in their routing order
            names = list(served)
            ordered = route_replicas(manager, names, model, self.content_type, self.body)
            if ordered is not names:
                served = ordered
                candidates, refused = fitting(manager, served, kind)
        if not candidates:  # before anything is leased or loaded (400)
            raise wrong_endpoint(model, kind, refused)
        memo = self.memo
        if memo is not None:
            if plain and len(served) == 1:  # a plain route, kept for the next request
                memo.keep(routing, principal, asked, self.who, model, kind, tuple(candidates))
            else:
                memo.forget()
        return candidates

    def _hold_now(self) -> bool:
        """The named adapter held in the leased slot without a wait (resident, or given
        at start). Raises the refusal (the lease released by :meth:`finish`)."""
        try:
            self.hold = self.ctx.manager.try_adapter(self.slot, self.adapter)
        except SlotctlError as exc:
            report_refusal(self.ctx, exc, self.adapter)
            raise slot_refusal(exc) from None
        return self.hold is not None

    async def wait(self) -> None:
        """Wait for the lease :meth:`begin` could not take at once (a cold slot's load,
        joined; a turn in the slot's fair queue). Raises the :class:`Refusal`."""
        pending = self.pending
        if self.phase is not _WAITING or (pending is None and self.lease is None):
            raise CallStateError(f"wait in {self.phase.name}")
        began = time.monotonic()
        manager = self.ctx.manager
        try:
            if pending is not None:
                lease = await acquire_rest(manager, pending, self.who)
                self.pending = None
                self.lease, self.slot = lease, lease.slot
            if self.adapter and self.hold is None:  # its load, joined: never the base's
                self.hold = await manager.acquire_adapter(self.slot, self.adapter)
        except SlotctlError as exc:
            report_refusal(self.ctx, exc, self.adapter or self.model)
            raise slot_refusal(exc) from None
        finally:
            self.waited = time.monotonic() - began
        self._move(_LEASED)

    def upstream(self) -> tuple[str, bytes]:
        """Where the request goes: the leased slot's endpoint (``http://host:port``) and
        the body its server sees. Raises the :class:`Refusal` (the slot went away)."""
        if self.phase is not _LEASED:
            raise CallStateError(f"upstream in {self.phase.name}")
        body = self.body
        if self.alias:  # the member's server sees the model it serves
            body = with_model(self.content_type, body, self.model, forms=self.forms)
        elif self.hold is not None:  # the adapter, as the slot's engine names it
            body = adapter_body(body, self.hold, self.model)
        try:
            endpoint, group = self.ctx.manager.upstream_of(self.slot)
        except SlotctlError as exc:  # e.g. the slot was removed while we looked it up
            raise slot_refusal(exc) from None
        if endpoint is None:
            raise Refusal(
                503, f"slot {self.slot!r} has no endpoint", code="slot.not_ready", retry_after_s=1
            )
        if group:  # a replica: its cached tokens count
            self.group = group
            if self.tail is None:
                self.tail = bytearray()
        self.phase = _UPSTREAM
        return endpoint, body

    def answered(self, status: int) -> None:
        """The server's answer began with ``status``."""
        self.status = status

    def keep(self, data: bytes) -> None:
        """The answer's bytes as they pass (a key's: the last :data:`USAGE_TAIL` kept)."""
        tail = self.tail
        if tail is not None:
            tail += data
            if len(tail) > 2 * USAGE_TAIL:
                del tail[:-USAGE_TAIL]

    def idle_s(self) -> float:
        """How long the slot's server may send nothing (its ``upstream_idle_s``)."""
        return upstream_idle_s(self.ctx, self.slot)

    # ------------------------------------------------------------------ the failures

    def refused(self, refusal: Refusal) -> Refusal:
        """The call ends with ``refusal`` (its status recorded)."""
        self.status = refusal.status
        return refusal

    def upstream_failed(
        self, detail: str, *, unreachable: bool = False, timed_out_s: float | None = None
    ) -> Refusal:
        """The slot's server could not be reached (``unreachable``; no connection within
        ``timed_out_s``) or broke: the refusal, its status recorded."""
        if timed_out_s is not None:
            refusal = upstream_timeout(
                self.ctx, self.slot, self.model, timed_out_s, connecting=True
            )
        elif unreachable:
            refusal = upstream_unreachable(self.slot, detail)
        else:
            refusal = upstream_failed(self.slot, detail)
        return self.refused(refusal)

    def failed(self, exc: BaseException) -> Refusal:
        """A bug while serving it: logged, a 500."""
        log.error("router: unexpected error serving a request for %r", self.model, exc_info=exc)
        return self.refused(Refusal(500, "internal error (see the log)", code="internal"))

    def interrupted(self, reason: str, idle_s: float = 0.0) -> Refusal | None:
        """The answer of a request given up for ``reason``: ``lease`` (revoked: its slot
        crashed or was unloaded), ``timeout`` (its server sent nothing for ``idle_s``),
        ``shutdown`` (the router stops); None for ``client`` (gone: nobody to answer)."""
        if reason == "lease":
            return self.refused(revoked(self.slot, self.lease))
        if reason == "timeout":
            return self.refused(upstream_timeout(self.ctx, self.slot, self.model, idle_s))
        if reason == "shutdown":
            return self.refused(shutting_down())
        self.status = CLIENT_CLOSED
        return None

    # ------------------------------------------------------------------ the end

    def finish(self, status: int = 0) -> None:
        """The request is over (``status``: its answer's, when the call does not know it):
        the lease released, the key's request counted out, the call reported. Once."""
        if self.phase is _DONE:
            return
        self.phase = _DONE
        if status:
            self.status = status
        ctx = self.ctx
        hold = self.hold
        if hold is not None:
            self.hold = None
            ctx.manager.release_adapter(hold)
        lease = self.lease
        if lease is not None:
            ctx.manager.release(lease)
        principal = self.principal
        if self.counted and principal is not None:
            self.counted = False
            ctx.limits.done(principal)
        recorder = ctx.recorder
        if recorder is None:
            return
        try:
            who = self.who
            if who is None:  # no requester: the request series only
                recorder.call_done(
                    self.slot,
                    self.adapter or self.model,
                    self.status,
                    time.monotonic() - self.started,
                    None,
                    "",
                    self.waited,
                )
            else:
                recorder.call_done(  # an adapter's requests counted as its own model's
                    self.slot,
                    self.adapter or self.model,
                    self.status,
                    time.monotonic() - self.started,
                    who.key,
                    who.cls,
                    self.waited,
                )
                if self.keyed and self.tail:
                    used = usage_of(self.tail)
                    if used is not None:
                        recorder.key_tokens(who.key, who.cls, *used)
            if self.group and self.tail:
                cached = cached_of(self.tail)
                if cached is not None:
                    recorder.slot_tokens(self.slot, self.group, *cached)
        except Exception:  # metrics must never fail a request: log it and answer anyway
            log.exception("metrics call_done failed")


def _adapter_only(manager: RouterPort, name: str) -> bool:
    """``name``'s server applies one adapter to every request (llama-cpp-python's, given
    one at start): it never answers for the base model."""
    spec = manager.known(name)
    return spec is not None and spec.lora_api == "llama-cpp-python" and bool(spec.adapters)


def record_unserved(ctx: RouterContext, started: float, status: int) -> None:
    """A routed request refused from its head alone (a 413, a 503 while stopping) or
    given up by its client before its body came (499): reported as a call."""
    call = RoutedCall(ctx, None, "", started=started)
    call.finish(status)
