"""A raw HTTP/1.x model server for the data plane's wire tests: framings and faults on demand.

Run as ``python wire_upstream.py --port N`` (a slot's ``server.cmd``). ``GET /v1/models``
lists ``wire`` (the health probe); ``GET /stats`` answers its counters as JSON; a ``POST``
answers as its JSON body's ``mode`` says (see :func:`answer`), echoing the body, the target
and the headers it got. Standalone on purpose: asyncio streams only, no project import.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import sys
from typing import Any

STATS: dict[str, Any] = {"post_connections": 0, "closed_post_connections": 0, "written": 0}
GO: list[asyncio.Event] = []  # set by GET /go: a late-sse answer sends its first event


def _head(status: str, headers: list[str]) -> bytes:
    return ("\r\n".join([status, *headers]) + "\r\n\r\n").encode("latin-1")


def _chunk(data: bytes, extension: str = "") -> bytes:
    return f"{len(data):x}{extension}\r\n".encode() + data + b"\r\n"


async def answer(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, req: Any) -> bool:
    """Write the answer ``req["mode"]`` asks for; False when the connection must end."""
    mode = req.get("mode", "length")
    payload = json.dumps(req).encode()
    json_type = "Content-Type: application/json"
    if mode == "length":
        writer.write(_head("HTTP/1.1 200 OK", [json_type, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
    elif mode == "chunked":  # three chunks, an extension and a trailer
        writer.write(_head("HTTP/1.1 201 Created", [json_type, "Transfer-Encoding: chunked"]))
        third = len(payload) // 3
        writer.write(_chunk(payload[:third], ";ext=1"))
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(_chunk(payload[third : 2 * third]) + _chunk(payload[2 * third :]))
        writer.write(b"0\r\nX-Trailer: yes\r\n\r\n")
    elif mode == "close":  # HTTP/1.0, the body ends with the connection
        writer.write(_head("HTTP/1.0 200 OK", [json_type]) + payload)
        return False
    elif mode == "reset-close":  # HTTP/1.0, part of the body, then a reset (not an end)
        writer.write(_head("HTTP/1.0 200 OK", [json_type]) + payload[:10])
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # an RST, with SO_LINGER 0
        return False
    elif mode == "hop":  # a hop-by-hop header the Connection header names
        names = ["Connection: X-Hop-Answer", "X-Hop-Answer: 1", "X-Kept-Answer: 1", json_type]
        writer.write(_head("HTTP/1.1 200 OK", [*names, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
    elif mode == "204":
        writer.write(_head("HTTP/1.1 204 No Content", ["X-Empty: yes"]))
    elif mode == "interim":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(_head("HTTP/1.1 200 OK", [json_type, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
    elif mode == "badchunk":  # a chunk size int() would take
        writer.write(_head("HTTP/1.1 200 OK", ["Transfer-Encoding: chunked"]))
        writer.write(b"0x5\r\nhello\r\n0\r\n\r\n")
        return False
    elif mode == "badhead":
        writer.write(b"THIS IS NOT HTTP\r\n\r\n")
        return False
    elif mode == "badheader":  # a bare LF in a value: a header injected into the answer
        writer.write(
            b"HTTP/1.1 200 OK\r\nX-Evil: a\nSet-Cookie: owned\r\nContent-Length: 0\r\n\r\n"
        )
    elif mode == "hugelength":  # a Content-Length int() refuses (4300 digits and more)
        writer.write(_head("HTTP/1.1 200 OK", ["Content-Length: " + "9" * 5000]))
        return False
    elif mode == "cut-length":
        writer.write(_head("HTTP/1.1 200 OK", [json_type, "Content-Length: 100000"]))
        writer.write(b"x" * 10)
        await writer.drain()
        await asyncio.sleep(0.05)
        return False
    elif mode == "cut-sse":
        sse = ["Content-Type: text/event-stream", "Transfer-Encoding: chunked"]
        writer.write(_head("HTTP/1.1 200 OK", sse) + _chunk(b'data: {"n": 1}\n\n'))
        await writer.drain()
        await asyncio.sleep(0.05)
        return False
    elif mode == "negchunk":  # a negative chunk size (int(..., 16) takes "-6")
        head = _head("HTTP/1.1 200 OK", [json_type, "Transfer-Encoding: chunked"])
        writer.write(head + b"1\r\na\r\n-6\r\nzzzzzz\r\n0\r\n\r\n")  # one read
        return False
    elif mode == "drop-idle":  # kept alive, then closed while idle
        writer.write(_head("HTTP/1.1 200 OK", [json_type, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
        await writer.drain()
        await asyncio.sleep(0.05)
        return False
    elif mode == "drop-next":  # answered; the next request here is read, then dropped
        writer.write(_head("HTTP/1.1 200 OK", [json_type, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        size = head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]
        await reader.readexactly(int(size))
        return False
    elif mode == "flood":  # as much as the reader takes, 1 MiB a chunk
        writer.write(_head("HTTP/1.1 200 OK", ["Transfer-Encoding: chunked"]))
        piece = _chunk(b"f" * (1 << 20))
        for _ in range(int(req.get("mib", 256))):
            writer.write(piece)
            await writer.drain()
            STATS["written"] += 1 << 20
        writer.write(b"0\r\n\r\n")
    elif mode == "late-sse":  # the head, then the first event only once GET /go came
        sse = ["Content-Type: text/event-stream", "Transfer-Encoding: chunked"]
        writer.write(_head("HTTP/1.1 200 OK", sse))
        await writer.drain()
        STATS["late_head_sent"] = True
        go = asyncio.Event()
        GO.append(go)
        await go.wait()
        writer.write(_chunk(b'data: {"late": true}\n\n') + b"0\r\n\r\n")
    elif mode == "gzip-te":  # a coding this client does not decode
        writer.write(_head("HTTP/1.1 200 OK", ["Transfer-Encoding: gzip"]) + b"zz")
        return False
    elif mode == "two-te":  # two Transfer-Encoding headers: gzip, then chunked
        codings = ["Transfer-Encoding: gzip", "Transfer-Encoding: chunked"]
        writer.write(_head("HTTP/1.1 200 OK", [json_type, *codings]) + _chunk(b"zz") + b"0\r\n\r\n")
        return False
    elif mode == "switch-101":  # a 101 nobody asked for, then what looks like an answer
        writer.write(_head("HTTP/1.1 101 Switching Protocols", ["Upgrade: h2c"]))
        writer.write(_head("HTTP/1.1 200 OK", [json_type, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
        return False
    elif mode == "http-1.7":  # a version that is no HTTP/1.x this client knows
        writer.write(_head("HTTP/1.7 200 OK", [json_type, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
        return False
    elif mode == "badext":  # a control character in a chunk extension
        writer.write(_head("HTTP/1.1 200 OK", [json_type, "Transfer-Encoding: chunked"]))
        writer.write(_chunk(payload, ";\x01") + b"0\r\n\r\n")
        return False
    elif mode == "hang":  # never answers; ends when the other side closes
        await reader.read()
        return False
    elif mode == "slow":
        await asyncio.sleep(float(req.get("delay", 0.5)))
        writer.write(_head("HTTP/1.1 200 OK", [json_type, f"Content-Length: {len(payload)}"]))
        writer.write(payload)
    else:
        writer.write(_head("HTTP/1.1 400 Bad Request", ["Content-Length: 0"]))
    return True


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    posted = False
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and target == "/go":
                for go in GO:
                    go.set()
            if method == "GET":
                data = json.dumps(
                    {"object": "list", "data": [{"id": "wire", "object": "model"}]}
                    if target.startswith("/v1/models")
                    else STATS
                ).encode()
                writer.write(
                    _head(
                        "HTTP/1.1 200 OK",
                        ["Content-Type: application/json", f"Content-Length: {len(data)}"],
                    )
                    + data
                )
                await writer.drain()
                continue
            if not posted:
                posted = True
                STATS["post_connections"] += 1
            req = json.loads(body)
            req["_target"], req["_headers"] = target, headers
            keep = await answer(writer, reader, req)
            await writer.drain()
            if not keep:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        if posted:
            STATS["closed_post_connections"] += 1
        writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print(f"wire upstream listening on {port}", file=sys.stderr, flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
