"""The demo server's own HTTP/1.1 layer (``controller/demo/httpd.py``) on the wire.

The OpenAI behaviour is tested in ``test_demo_server.py`` through aiohttp's client; here
a raw socket and the standard library's ``http.client`` check the protocol paths that a
client library hides: keep-alive and pipelining, HTTP/1.0, chunked request bodies,
``Expect: 100-continue``, streamed responses (chunked and close-delimited), HEAD, and the
JSON bodies of 404/405/413/400. One demo server (a real child process) serves the module.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "wire-model"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.demo", "--port", "0", "--model", MODEL],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        listening = proc.stdout.readline()
        assert listening.startswith("slotctl-demo listening "), listening
        assert proc.stdout.readline().startswith("slotctl-demo ready "), "never ready"
        yield int(listening.split(" port=", 1)[1].split()[0])
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_response(reader: object) -> tuple[int, dict[str, str], bytes]:
    """One response from a raw socket's file: status, lower-cased headers, body."""
    assert hasattr(reader, "readline") and hasattr(reader, "read")
    status = int(reader.readline().split()[1])
    headers: dict[str, str] = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, reader.read(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while size := int(reader.readline(), 16):
            body += reader.read(size)
            assert reader.read(2) == b"\r\n"
        assert reader.readline() == b"\r\n"
        return status, headers, body
    return status, headers, reader.read()  # close-delimited


def _request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}"
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def _completion(prompt: str) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 2}).encode()


def test_start_path_imports_neither_aiohttp_nor_asyncio() -> None:
    code = (
        "import sys, controller.demo.server; "
        "print(sorted(m for m in ('aiohttp', 'asyncio', 'dataclasses', 'typing') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_keep_alive_and_pipelined_requests_share_one_connection(port: int) -> None:
    with _connect(port) as sock, sock.makefile("rb") as reader:
        sock.sendall(
            _request("GET", "/health")
            + _request("POST", "/v1/completions", _completion("a"))
            + _request("GET", "/v1/models?x=1")
        )
        answers = [_read_response(reader) for _ in range(3)]
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert json.loads(answers[0][2]) == {"status": "ok"}
        assert answers[0][1]["content-type"] == "application/json; charset=utf-8"
        assert json.loads(answers[1][2])["usage"]["completion_tokens"] == 2
        assert json.loads(answers[2][2])["data"][0]["id"] == MODEL
        sock.sendall(_request("GET", "/health", extra="Connection: close\r\n"))
        status, headers, _ = _read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert reader.read() == b""  # the server closed it


def test_http_1_0_is_answered_and_closed(port: int) -> None:
    with _connect(port) as sock, sock.makefile("rb") as reader:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        status, headers, body = _read_response(reader)
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert headers["connection"] == "close" and reader.read() == b""


def test_http_1_0_stream_is_close_delimited(port: int) -> None:
    body = json.dumps({"prompt": "a", "max_tokens": 2, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n"
    with _connect(port) as sock, sock.makefile("rb") as reader:
        sock.sendall(head.encode() + body)
        status, headers, raw = _read_response(reader)
    assert status == 200 and "transfer-encoding" not in headers
    events = [line for line in raw.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) == 2 + 1 + 1


def test_chunked_request_body_and_100_continue(port: int) -> None:
    body = _completion("one two")
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (5, body[:5], len(body) - 5, body[5:])
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        "Expect: 100-continue\r\n\r\n"
    )
    with _connect(port) as sock, sock.makefile("rb") as reader:
        sock.sendall(head.encode())
        assert reader.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert reader.readline() == b"\r\n"
        sock.sendall(chunked)
        status, _, answer = _read_response(reader)
    assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] == 2


def test_stream_through_http_client_is_chunked(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
    assert resp.getheader("Content-Type") == "text/event-stream"
    assert resp.getheader("Cache-Control") == "no-cache"
    events = [e for e in resp.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["object"] == "chat.completion.chunk"
    conn.request("GET", "/health")  # the same connection carries the next request
    assert conn.getresponse().status == 200
    conn.close()


def test_head_answers_headers_only(port: int) -> None:
    with _connect(port) as sock, sock.makefile("rb") as reader:
        sock.sendall(_request("HEAD", "/health") + _request("GET", "/health"))
        assert reader.readline() == b"HTTP/1.1 200 OK\r\n"
        while (line := reader.readline()) != b"\r\n":
            assert line
        # no body follows: the next bytes are the GET's status line
        assert reader.readline() == b"HTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (_request("GET", "/v1/nothing"), 404, "Invalid URL (GET /v1/nothing)"),
        (_request("DELETE", "/v1/models"), 405, "Method DELETE is not allowed"),
        (
            b"POST /v1/embeddings HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n",
            413,
            "Maximum request body size 1048576 exceeded",
        ),
        (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
        (b"GET / HTTP/2.0\r\n\r\n", 505, "unsupported HTTP version"),
        (
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: x1\r\n\r\n",
            400,
            "invalid Content-Length",
        ),
        (b"GET /health HTTP/1.1\r\nX: " + b"y" * 9000 + b"\r\n\r\n", 431, "header line"),
    ],
)
def test_refusals_have_openai_error_bodies(
    port: int, raw: bytes, status: int, message: str
) -> None:
    with _connect(port) as sock, sock.makefile("rb") as reader:
        sock.sendall(raw)
        got, headers, body = _read_response(reader)
    assert got == status
    error = json.loads(body)["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    if status == 405:
        assert headers["allow"] == "GET, HEAD"


def test_help_lists_the_knobs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "controller.demo", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "100"},
        check=True,
    )
    assert done.stdout.startswith("usage: python -m controller.demo")
    assert "--crash-after" in done.stdout and "fault injection" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 98
