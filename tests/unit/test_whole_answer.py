"""A whole answer heard at once (issue 41 item 4): when a model server's answer comes in one
read and its head is recalled by its bytes, the upstream tells the connection in one call
(``Listener.on_answer``) and the connection writes the head and the body at once. The
client must get exactly the bytes, and the metrics exactly the record, that the same
answer gets through llhttp (the first answer on a connection) and through the recalled
head's step by step path (its body in a later read: ``on_head``, ``relay``, ``on_end``).

The data plane over a real SlotManager on FakeRuntime, its transports fakes that keep
what is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controller.access.keys import KeyLimits, KeyRing
from controller.dataplane.answers import address
from controller.dataplane.connection import Connection
from controller.dataplane.plane import DataPlane
from controller.dataplane.upstream import Upstream
from controller.kit.eventbus import EventBus
from controller.router.hosts import HostPolicy
from controller.slots.interfaces import RouterPort
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def request(version: str = "1.1", extra: str = "") -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/{version}\r\nHost: 127.0.0.1:8800\r\n"
        f"Authorization: Bearer t\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    )
    return head.encode() + BODY


def answer(body: bytes, *, status: str = "200 OK", date: bool = True, extra: str = "") -> bytes:
    head = f"HTTP/1.1 {status}\r\nServer: BaseHTTP/0.6 Python/3.11\r\n"
    if date:
        head += "Date: Fri, 04 Dec 2026 21:00:00 GMT\r\n"
    head += f"Content-Type: application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def writelines(self, data: list[bytes]) -> None:
        self.written.append(b"".join(data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@dataclass
class Recorder:
    done: list[tuple[str, str, int | str]] = field(default_factory=list)
    keys: list[tuple[str, str, int | str]] = field(default_factory=list)

    def call_done(
        self,
        slot: str,
        model: str,
        status: int | str,
        seconds: float,
        key: str | None,
        cls: str,
        waited: float | None,
    ) -> None:
        self.done.append((slot, model, status))
        if key is not None:
            self.keys.append((key, cls, status))

    def key_tokens(self, key: str, cls: str, prompt: int, completion: int) -> None:
        pass


@dataclass
class Ctx:
    manager: RouterPort
    events: EventBus
    keys: KeyRing
    limits: KeyLimits = field(default_factory=KeyLimits)
    recorder: Recorder = field(default_factory=Recorder)
    closed: bool = False


# How the model server's answer comes: in one read, or cut after its head or in its body.
CUTS = {"whole": None, "after the head": "head", "in the body": 7}
ANSWERS = {
    "sized": answer(b'{"id": "a", "choices": []}'),
    "no Date": answer(b'{"id": "b"}', date=False),
    "hop-by-hop": answer(b"{}", extra="Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n"),
    "an error": answer(b'{"error": {}}', status="404 Not Found"),
    "a sized event stream": answer(b"data: {}\n\n").replace(
        b"application/json", b"text/event-stream"
    ),
}
REQUESTS = {
    "kept alive": request(),
    "closing": request(extra="Connection: close\r\n"),
    "HTTP/1.0": request("1.0"),
    "HTTP/1.0 kept alive": request("1.0", "Connection: keep-alive\r\n"),
}


async def served(tmp_path: Path, req: bytes, ans: bytes, cut: str | int | None) -> list[Any]:
    """What a fresh connection's client gets for ``req`` answered with ``ans`` — the
    upstream connection's first answer (llhttp), then its second (recalled, in the way
    ``cut`` says) — and what the recorder recorded of each."""
    h = Harness(tmp_path)
    await h.manager.set_desired(desired([slot_spec("s", "m", idle_timeout_s=0)], [model_spec("m")]))
    await h.manager.load("s")
    ctx = Ctx(h.manager, h.manager.events, KeyRing(tmp_path, "t"))
    plane = DataPlane(ctx, lambda: None, hosts=HostPolicy("127.0.0.1"))  # type: ignore[arg-type,return-value]
    endpoint = h.manager.endpoint("s")
    assert endpoint is not None
    upstream = Upstream(plane.pool, address(endpoint)[0])
    upstream.connection_made(Transport())  # type: ignore[arg-type]
    plane.pool.put(address(endpoint)[0], upstream)
    out: list[Any] = []
    for turn in range(2):
        client = Transport()
        front = plane()
        assert isinstance(front, Connection)
        front.connection_made(client)  # type: ignore[arg-type]
        front.data_received(req)
        if turn == 0 or cut is None:
            upstream.data_received(ans)
        else:
            at = ans.index(b"\r\n\r\n") + 4 if cut == "head" else ans.index(b"\r\n\r\n") + 4 + 1
            upstream.data_received(ans[:at])
            upstream.data_received(ans[at:])
        out.append((b"".join(client.written), client.closed, list(ctx.recorder.done)))
        ctx.recorder.done.clear()
        if upstream.transport is None or upstream.transport.is_closing():
            upstream = Upstream(plane.pool, address(endpoint)[0])  # a closing request's
            upstream.connection_made(Transport())  # type: ignore[arg-type]
            plane.pool.put(address(endpoint)[0], upstream)
    assert plane.in_flight == 0
    await plane.shutdown(0.1)
    await h.manager.close()
    return out


@pytest.mark.parametrize("req", REQUESTS, ids=list(REQUESTS))
@pytest.mark.parametrize("ans", ANSWERS, ids=list(ANSWERS))
async def test_a_whole_answer_is_what_the_same_answer_is_step_by_step(
    tmp_path: Path, req: str, ans: str
) -> None:
    got = {
        name: await served(tmp_path / name.replace(" ", "-"), REQUESTS[req], ANSWERS[ans], cut)
        for name, cut in CUTS.items()
    }
    first = got["whole"][0]  # llhttp's: the upstream connection's first answer
    assert first[0].startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")) and first[2]
    for name, (llhttp, recalled) in got.items():
        assert llhttp == first, name  # the same answer, the same bytes and record
        assert recalled == first, name  # recalled: whole, or its body in a later read
