"""The router's wait-free steps (issue 12, item 1): each gives what the general path gives.

- ``acquire_now`` (a lease without an await) and ``acquire_rest`` (the waits from where it
  stopped) against a real SlotManager on FakeRuntime: a ready slot is leased at once, a
  cold one is left to the wait in candidate order, a refusing candidate is skipped;
- ``_json_object`` (json's C scanner called directly) against ``json.loads``;
- the request series counted with plain updates against prometheus_client's own
  Counter and Histogram: the same exposition, text and OpenMetrics; ``call_done`` (the
  router's one call a request) against ``request_done`` and the keys' counter;
- the manager's one-look answers (``upstream_of``, ``routing``) against the seams they
  fold (``endpoint``, ``known(..).replica_group``; ``settings``, ``models``, ``aliases``,
  ``adapters``), before and after a change of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from controller.api.metrics import REQUEST_BUCKETS, Metrics, _Counts, _RequestSeries
from controller.dataplane.upstream import Upstream, UpstreamError, UpstreamPool
from controller.model.errors import SlotNotFound
from controller.model.lifecycle import SlotState
from controller.router.body import _json_object, model_of
from controller.router.leasing import Pending, acquire, acquire_now, acquire_rest
from controller.router.refusals import Refusal
from controller.slots.records import Lease
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

S = SlotState


async def two_slots(tmp_path: Path, *, load: tuple[str, ...]) -> Harness:
    h = Harness(tmp_path)
    specs = [slot_spec(n, "m", idle_timeout_s=10) for n in ("a", "b")]
    await h.manager.set_desired(desired(specs, [model_spec("m", 1)]))
    for name in load:
        await h.manager.load(name)
    return h


# ============================================================================ leases


async def test_a_ready_slot_is_leased_without_a_wait(tmp_path: Path) -> None:
    h = await two_slots(tmp_path, load=("a",))
    lease = acquire_now(h.manager, ["a", "b"])
    assert isinstance(lease, Lease) and lease.slot == "a"
    assert h.manager.view("a").state is S.SERVING
    h.manager.release(lease)
    assert h.manager.view("a").state is S.READY


async def test_a_cold_first_candidate_is_waited_for_in_order(tmp_path: Path) -> None:
    """The ready second candidate is not taken instead: the general path would wait for
    the first one's load, and so does the rest of this one."""
    h = await two_slots(tmp_path, load=("b",))
    pending = acquire_now(h.manager, ["a", "b"])
    assert isinstance(pending, Pending)
    assert (pending.start, pending.tried, pending.errors) == (0, 0, [])
    assert h.manager.view("a").state is S.OFFLINE  # nothing started by the wait-free step
    lease = await acquire_rest(h.manager, pending)
    assert lease.slot == "a" and h.manager.view("a").state is S.SERVING
    assert h.manager.view("b").leases == 0


async def test_a_refusing_candidate_is_skipped_and_all_refusing_raise_the_first(
    tmp_path: Path,
) -> None:
    h = await two_slots(tmp_path, load=("b",))
    lease = acquire_now(h.manager, ["gone", "b"])
    assert isinstance(lease, Lease) and lease.slot == "b"
    with pytest.raises(SlotNotFound, match="first"):
        acquire_now(h.manager, ["first", "second"])
    with pytest.raises(SlotNotFound, match="first"):
        await acquire(h.manager, ["first", "second"])


async def test_the_rest_keeps_the_refusals_before_the_wait(tmp_path: Path) -> None:
    h = await two_slots(tmp_path, load=())
    pending = acquire_now(h.manager, ["gone", "a"])
    assert isinstance(pending, Pending) and pending.start == 1
    assert [type(e) for e in pending.errors] == [SlotNotFound]
    lease = await acquire_rest(h.manager, pending)
    assert lease.slot == "a"


# ============================================================================ the body's model


CASES = [
    b'{"model":"a"}',
    b' {"model":"a"}',
    b'{"model":"a"} \n\r\t',
    b'{"model":"a"}x',
    b'{"model":"a"}\x0b',
    b'{"a":1}{"b":2}',
    '{"model":"é"}'.encode(),
    b'{"model":"\xff"}',
    b'\xef\xbb\xbf{"model":"a"}',
    b"{",
    b"{}",
    b"[1]",
    b'{"model": NaN}',
    b'{"model":"a","model":"b"}',
    '{"model":"x"}'.encode("utf-16-le"),
    b'{"a":' * 100_000,
    b'{"messages":[{"content":"{\\"model\\":\\"no\\"}"}],"model":"yes"}',
]


@pytest.mark.parametrize("body", CASES, ids=range(len(CASES)))
def test_the_direct_scan_reads_what_json_loads_reads(body: bytes) -> None:
    try:
        expected: object = json.loads(body)
    except (ValueError, RecursionError):
        expected = None
    got = _json_object(body)
    if got is not None:  # taken: exactly json.loads' object
        assert got == expected
    else:  # left to json.loads: anything it refuses, anything not a UTF-8 object
        assert not isinstance(expected, dict) or body[:1] != b"{" or body[1:2] == b"\x00"


def reference_model_of(body: bytes) -> str:
    """``model_of`` of a JSON body before the direct scan (json.loads only)."""
    if not body.strip():
        raise Refusal(400, "a JSON request body is required", code="invalid_body")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise Refusal(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise Refusal(400, "request body must be a JSON object", code="invalid_body")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise Refusal(
            400, "'model' is required and must be a non-empty string", code="invalid_model"
        )
    return model


def outcome(read: Callable[[], str]) -> tuple[str, ...]:
    try:
        return ("model", read())
    except Refusal as refusal:
        return ("refused", str(refusal.status), refusal.message, refusal.code)


@pytest.mark.parametrize("body", [*CASES, b"", b"  ", b'{"model":""}', b'{"model":1}'])
def test_model_of_answers_as_before(body: bytes) -> None:
    assert outcome(lambda: model_of("application/json", body)) == outcome(
        lambda: reference_model_of(body)
    )


# ============================================================================ metrics


def test_the_request_series_expose_what_prometheus_client_would() -> None:
    reference = CollectorRegistry(auto_describe=False)
    counter = Counter(
        "slotctl_requests_total",
        "Requests through the router by slot, model and HTTP status",
        ["slot", "model", "status"],
        registry=reference,
    )
    histogram = Histogram(
        "slotctl_request_duration_seconds",
        "Router request latency (until the last byte of the answer)",
        ["slot", "model"],
        buckets=REQUEST_BUCKETS,
        registry=reference,
    )
    ours = CollectorRegistry(auto_describe=False)
    series = _RequestSeries()
    ours.register(series)

    def created_as_t(text: bytes) -> str:
        return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())

    for exposition in (generate_latest, generate_openmetrics):
        assert created_as_t(exposition(ours)) == created_as_t(exposition(reference))
    for slot, model, status, seconds in [
        ("a", "m", 200, 0.003),
        ("a", "m", 200, 0.005),  # on a bound: counted in it (le)
        ("a", "m", 503, 0.2),
        ("b", "n", "client_closed", 700.0),  # past the last bound: +Inf only
        ("a", "m", 200, -1.0),  # a clock step back: as 0
        ("a", "m", 200, 0.01),
    ]:
        counter.labels(slot, model, str(status)).inc()
        histogram.labels(slot, model).observe(max(0.0, seconds))
        series.done(slot, model, status, seconds)
    for exposition in (generate_latest, generate_openmetrics):
        assert created_as_t(exposition(ours)) == created_as_t(exposition(reference))


def test_call_done_counts_what_request_done_and_the_key_counter_count() -> None:
    """The router's one call a request: the request series as ``request_done`` counts
    them, and a request with a requester in the keys' series (the API token's as
    ``@token``; none for a request no requester was resolved for), each set of labels
    twice (the second time in the series kept from the first)."""
    ours, reference = Metrics.__new__(Metrics), Metrics.__new__(Metrics)
    for metrics in (ours, reference):
        metrics.requests = _RequestSeries()
        metrics.key_requests = _Counts("slotctl_key_requests", "doc", ["key", "class", "status"])
    ours._cells = {}  # call_done's series by their labels, kept from the first call on
    calls = 2 * [
        ("a", "m", 200, 0.003, "alice", "interactive"),
        ("a", "m", 200, 0.005, "", "batch"),  # the API token
        ("a", "m", 503, 0.2, None, ""),  # no requester: the request series only
        ("", "", 413, -1.0, "alice", "interactive"),  # a clock step back: as 0
        ("b", "n", "client_closed", 700.0, "bob", "batch"),
    ]
    for slot, model, status, seconds, key, cls in calls:
        ours.call_done(slot, model, status, seconds, key, cls, None)
        reference.requests.done(slot, model, status, seconds)
        if key is not None:
            reference.key_requests.inc(key or "@token", cls, str(status))
    assert {k: v[0] for k, v in ours.requests.counts.items()} == {
        k: v[0] for k, v in reference.requests.counts.items()
    }
    assert {k: v[:-1] for k, v in ours.requests.durations.items()} == {
        k: v[:-1] for k, v in reference.requests.durations.items()
    }
    assert {k: v[0] for k, v in ours.key_requests.counts.items()} == {
        k: v[0] for k, v in reference.key_requests.counts.items()
    }


async def test_upstream_of_and_routing_answer_as_the_seams_they_fold(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    m = h.manager
    specs = [slot_spec("a", "m"), slot_spec("r", "n", replicas=2)]
    await m.set_desired(desired(specs, [model_spec("m", 1), model_spec("n", 1)]))

    def folded(name: str) -> tuple[str | None, str]:
        spec = m.known(name)
        assert spec is not None
        return m.endpoint(name), spec.replica_group

    for name in m.names():  # no server yet: no endpoint
        assert m.upstream_of(name) == folded(name)
    assert m.upstream_of("a") == (None, "")
    assert m.upstream_of("r")[1] == "r"  # (replicas = 2: the group its own name)
    await m.load("a")
    assert m.upstream_of("a") == folded("a") and m.upstream_of("a")[0] is not None
    # a changed spec: its group read again (one slot's replicas)
    await m.set_desired(desired([slot_spec("a", "m", replicas=2)], [model_spec("m", 1)]))
    assert m.upstream_of("a") == folded("a") and m.upstream_of("a")[1] == "a"
    with pytest.raises(SlotNotFound):
        m.upstream_of("nope")
    assert m.routing()[:4] == (m.settings, m.models, m.aliases, m.adapters)
    m.set_models({"x": model_spec("x", 1)})
    m.set_aliases({})
    m.set_adapters({})
    m.settings = m.settings.model_copy(update={"memory_budget_gb": {"gpu": 0.5}})
    settings, models, aliases, adapters, _ = m.routing()
    assert settings is m.settings and models is m.models and set(models) == {"x"}
    assert aliases is m.aliases and adapters == m.adapters


def test_the_plain_counts_expose_what_prometheus_client_would() -> None:
    """The transitions (two lease flips a request) and the keys' series, counted with
    plain updates: the same exposition as prometheus_client's labelled Counter."""
    reference = CollectorRegistry(auto_describe=False)
    counter = Counter(
        "slotctl_key_tokens_total", "Tokens", ["key", "class", "kind"], registry=reference
    )
    ours = CollectorRegistry(auto_describe=False)
    counts = _Counts("slotctl_key_tokens_total", "Tokens", ["key", "class", "kind"])
    ours.register(counts)

    def created_as_t(text: bytes) -> str:
        return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())

    for exposition in (generate_latest, generate_openmetrics):
        assert created_as_t(exposition(ours)) == created_as_t(exposition(reference))
    for labels, amount in [
        (("a", "interactive", "prompt"), 3),
        (("a", "interactive", "completion"), 1),
        (("@token", "batch", "prompt"), 7),
        (("a", "interactive", "prompt"), 2),
    ]:
        counter.labels(*labels).inc(amount)
        counts.inc(*labels, amount=amount)
    for exposition in (generate_latest, generate_openmetrics):
        assert created_as_t(exposition(ours)) == created_as_t(exposition(reference))


# ============================================================================ answer heads


class Heard:
    """The upstream client's listener: what it heard of each exchange."""

    def __init__(self) -> None:
        self.heads: list[tuple[object, ...]] = []
        self.body = b""
        self.ended = asyncio.Event()
        self.error: UpstreamError | None = None

    def on_head(self, up: Upstream) -> None:
        self.heads.append((up.status, up.reason, up.fields, up.content_type, up.framing, up.length))

    def relay(self, data: bytes) -> None:
        self.body += data

    def on_end(self) -> None:
        self.ended.set()

    def on_error(self, error: UpstreamError) -> None:
        self.error = error
        self.ended.set()

    def on_answer(self, up: Upstream, body: bytes) -> None:
        """A whole answer at once: what on_head, relay and on_end say."""
        self.on_head(up)
        if body:
            self.relay(body)
        self.on_end()


async def exchange(up: Upstream, server: socket.socket, answer: bytes) -> Heard:
    heard = Heard()
    up.send([b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"], heard)
    await asyncio.get_running_loop().sock_sendall(server, answer)
    await asyncio.wait_for(heard.ended.wait(), 5)
    return heard


@contextlib.asynccontextmanager
async def upstream_pair() -> AsyncIterator[Callable[[bytes], Awaitable[Heard]]]:
    """An upstream connection (a real socket pair); each call answers one exchange on
    it, on a fresh connection when the last one was closed."""
    loop = asyncio.get_running_loop()
    pool = UpstreamPool()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[tuple[Upstream, socket.socket]] = []

    async def answer(data: bytes) -> Heard:
        if not held or held[-1][0].transport is None:
            _, up = await loop.create_connection(
                lambda: Upstream(pool, ("x", 1)), "127.0.0.1", port
            )
            theirs, _ = listener.accept()
            theirs.setblocking(False)
            held.append((up, theirs))
        up, theirs = held[-1]
        heard = await exchange(up, theirs, data)
        with contextlib.suppress(BlockingIOError):
            theirs.recv(65536)  # the request, read and dropped
        return heard

    try:
        yield answer
    finally:
        pool.close()
        for up, theirs in held:
            up.abort()
            theirs.close()
        listener.close()


async def test_the_upstream_client_reads_what_llhttp_reads() -> None:
    """Each answer as llhttp frames it: sized, chunked with a valid extension and a
    trailer, interim answers skipped, no body for a 204."""
    async with upstream_pair() as answer:
        sized = await answer(
            b"HTTP/1.1 200 OK\r\nContent-Type: a/b \r\nContent-Length: 2\r\n\r\n{}"
        )
        assert sized.error is None and sized.body == b"{}"
        assert sized.heads[0][:2] == (200, b"OK") and sized.heads[0][3] == b"a/b"
        chunked = await answer(
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2;ext=1\r\nab\r\n1\r\nc\r\n0\r\nX-Trailer: 1\r\n\r\n"
        )
        assert chunked.error is None and chunked.body == b"abc"
        interim = await answer(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nz"
        )
        assert interim.error is None and [h[0] for h in interim.heads] == [200]
        empty = await answer(b"HTTP/1.1 204 No Content\r\nX: y\r\n\r\n")
        assert empty.error is None and empty.body == b""


@pytest.mark.parametrize(
    "answer",
    [
        # Issue 27: each was taken before llhttp read the answers.
        b"HTTP/1.7 200 OK\r\nContent-Length: 2\r\n\r\n{}",  # no such version
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        # Two Transfer-Encoding headers: the last one won, and gzip was dropped on the way.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nab\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n",
        # Chunk extensions were never looked at.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;\x01\r\nab\r\n0\r\n\r\n",
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;a="b\r\nab\r\n0\r\n\r\n',
        # Refused before too.
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-6\r\nab\r\n0\r\n\r\n",
    ],
)
async def test_an_answer_llhttp_refuses_fails_the_exchange(answer: bytes) -> None:
    async with upstream_pair() as exchange_with:
        heard = await exchange_with(answer)
        assert heard.error is not None and not heard.heads and not heard.body, heard.heads
