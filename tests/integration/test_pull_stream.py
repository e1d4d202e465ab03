"""The byte reader of model pulls (controller/modelfiles/stream.py, issue 35) against the
suite's hub-compatible server (tests/integration/hubserver.py) and its fault knobs: hub files
resolved by the real ``huggingface_hub`` client, URLs as they are. Each test waits on state
(the server's counters and events, the reader's thread), never on time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from controller.model.errors import ModelAccessDenied, ModelPullFailed, ModelVerifyFailed
from controller.modelfiles import stream
from controller.modelfiles.digests import Digest
from controller.modelfiles.hub import HubClient, HubSettings
from controller.modelfiles.partial import PartialFile, PullCancelled
from controller.modelfiles.pull import ModelFiles
from controller.modelfiles.redact import redact_url
from controller.modelfiles.remote import RemoteFile
from controller.modelfiles.sources import HubFile, HubSnapshot
from controller.modelfiles.stream import READ_BYTES, StreamSettings, fetch, redirect_headers
from controller.modelfiles.urls import UrlClient
from controller.spec.schema import ModelSpec
from tests.integration.hubserver import HubServer
from tests.integration.proxyserver import ForwardProxy

TOKEN = "hf_TESTstreamTOKEN0123456789"
MIB = 1024 * 1024


def blob(size: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(b"stream%d" % seed).digest() * 2048  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer(token=TOKEN) as server:
        yield server


def client(hub: HubServer, tmp_path: Path, token: str = "") -> HubClient:
    path = tmp_path / "token"
    path.write_text(token)
    return HubClient(HubSettings(endpoint=hub.endpoint, token_file=path))


def partial_for(remote: RemoteFile, tmp_path: Path, moved: list[int] | None = None) -> PartialFile:
    partial = PartialFile(
        tmp_path / "f.part",
        expected=remote.digests,
        size=remote.size,
        on_bytes=(moved.append if moved is not None else lambda n: None),
    )
    partial.open()
    return partial


def fetch_in_thread(
    remote: RemoteFile, partial: PartialFile
) -> tuple[threading.Thread, list[BaseException]]:
    """A fetch on a thread of its own (as a pull runs it), started; what it raised lands
    in the list (a test cancels it and asserts what it raised)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fetch(remote, partial, StreamSettings(read_timeout_s=600.0))
        except BaseException as exc:  # what the test asserts
            failed.append(exc)

    reader = threading.Thread(target=run)
    reader.start()
    return reader, failed


def gets(hub: HubServer, route: str) -> list[str | None]:
    return [r.range for r in hub.requests if r.route == route and r.method == "GET"]


async def test_a_hub_file_dropped_mid_file_resumes_from_the_bytes_on_disk(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(12 * MIB + 7, 1)
    hub.add_repo("org/drop", {"d.gguf": data})
    drop = 5 * MIB + 3  # not a block boundary: the block being filled is written too
    hub.fault("d.gguf", drop_after=drop)
    hubs = client(hub, tmp_path)
    remote = await hubs.resolve(HubFile("org/drop", "d.gguf"), "hf://org/drop/d.gguf")
    partial = partial_for(remote, tmp_path)
    try:
        await hubs.fetch(remote, partial)
        verdict = partial.finish()
    finally:
        partial.close()
    assert verdict.ok and verdict.found == (Digest("sha256", sha(data)),)
    assert (tmp_path / "f.part").read_bytes() == data
    assert gets(hub, "lfs") == [None, f"bytes={drop}-"]
    assert hub.sent("d.gguf") == len(data)  # nothing fetched twice


async def test_a_reset_mid_file_resumes_losing_at_most_one_read(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(10 * MIB, 2)
    url = hub.add_url("r.bin", data)
    reset = 6 * MIB
    hub.fault("r.bin", reset_after=reset)
    urls = UrlClient()
    remote = await urls.probe(url, sha(data))
    partial = partial_for(remote, tmp_path)
    try:
        await urls.fetch(remote, partial)
        verdict = partial.finish()
    finally:
        partial.close()
    assert verdict.ok and (tmp_path / "f.part").read_bytes() == data
    first, resumed = gets(hub, "files")
    assert first is None and resumed is not None
    start = int(resumed.removeprefix("bytes=").rstrip("-"))
    # What a reset costs: at most the read it broke (READ_BYTES); the bytes read before it
    # were written, and the resume asks for the rest only.
    assert reset - READ_BYTES <= start <= reset
    assert hub.sent("r.bin") - len(data) <= READ_BYTES


async def test_wrong_bytes_across_a_resume_are_quarantined_never_placed(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(9 * MIB, 3)
    hub.add_repo("org/bad", {"bad.gguf": data})
    hub.fault("bad.gguf", wrong_bytes=True, drop_after=2 * MIB)
    settings = HubSettings(endpoint=hub.endpoint, token_file=tmp_path / "none")
    (tmp_path / "none").write_text("")
    files = ModelFiles(
        tmp_path / "models", tmp_path / "state", hub_settings=settings, margin_bytes=0
    )
    with pytest.raises(ModelVerifyFailed) as caught:
        await files.ensure(ModelSpec(id="bad", source="hf://org/bad/bad.gguf"))
    assert len(gets(hub, "lfs")) == 2  # dropped, resumed, then refused
    moved = Path(caught.value.details["quarantined"])
    assert moved.stat().st_size == len(data) and moved.read_bytes() != data
    assert not (files.models_dir / "org/bad/bad.gguf").exists()
    assert not list((files.models_dir / ".slotctl/partial").glob("*.part"))


async def test_a_server_that_ignores_ranges_restarts_the_file_from_zero(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(7 * MIB, 4)
    url = hub.add_url("i.bin", data)
    hub.fault("i.bin", drop_after=3 * MIB, ignore_range=True)
    urls = UrlClient()
    remote = await urls.probe(url, sha(data))
    moved: list[int] = []
    partial = partial_for(remote, tmp_path, moved)
    try:
        await urls.fetch(remote, partial)
        verdict = partial.finish()
    finally:
        partial.close()
    assert verdict.ok and (tmp_path / "f.part").read_bytes() == data
    assert gets(hub, "files") == [None, "bytes=3145728-"]  # asked for the rest, got it all
    assert -3 * MIB in moved and sum(moved) == len(data)  # progress went back to zero
    assert hub.sent("i.bin") == 3 * MIB + len(data)


async def test_the_token_goes_to_the_hub_and_not_to_the_cdn_it_redirects_to(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(MIB, 5)
    hub.add_repo("org/gated", {"g.gguf": data, "config.json": b"{}"}, gated=True)
    hubs = client(hub, tmp_path, TOKEN)
    _, remotes = await hubs.snapshot(HubSnapshot("org/gated"), "hf://org/gated")
    (big,) = [r for r in remotes if r.name == "g.gguf"]
    assert "bytes" not in repr(big) and TOKEN not in repr(big)
    partial = partial_for(big, tmp_path)
    try:
        await hubs.fetch(big, partial)  # GET .../resolve/<commit>/g.gguf, then the CDN
        assert partial.finish().ok
    finally:
        partial.close()
    resolved = [r for r in hub.requests if r.route == "resolve" and r.method == "GET"]
    cdn = [r for r in hub.requests if r.route == "lfs"]
    assert resolved and all(r.authorized and r.status == 302 for r in resolved)
    assert cdn and not any(r.authorized for r in cdn)


def test_authorization_stays_on_its_origin_or_an_https_upgrade_of_it() -> None:
    sent = {"Authorization": "Bearer x", "User-Agent": "slotctl"}
    assert redirect_headers(sent, "https://hub/a", "https://hub/b") == sent
    assert redirect_headers(sent, "http://hub/a", "https://hub/b") == sent
    for target in ("https://cdn/b", "https://hub:8443/b", "http://hub:81/b"):
        assert redirect_headers(sent, "https://hub/a", target) == {"User-Agent": "slotctl"}
    assert redirect_headers(sent, "https://hub/a", "http://hub/b") == {"User-Agent": "slotctl"}


async def test_a_cancel_wakes_a_reader_that_waits_on_a_silent_server(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(6 * MIB, 6)
    url = hub.add_url("h.bin", data)
    hub.fault("h.bin", hold_at=MIB + 1)
    remote = await UrlClient().probe(url, sha(data))
    partial = partial_for(remote, tmp_path)
    reader, failed = fetch_in_thread(remote, partial)
    try:
        await asyncio.to_thread(hub.held.wait, 60)
        assert hub.held.is_set()
        partial.cancel()
        await asyncio.to_thread(reader.join, 60)  # long before the read timeout
        assert not reader.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], PullCancelled)
        # no byte after the cancel: what was read and not yet written stays unwritten
        assert partial.size <= MIB + 1 and partial.cancelled
    finally:
        hub.release()
        partial.close()


async def test_a_stalled_response_times_out_and_is_resumed(hub: HubServer, tmp_path: Path) -> None:
    data = blob(3 * MIB, 7)
    url = hub.add_url("s.bin", data)
    hub.fault("s.bin", hold_at=2 * MIB)  # held once, until the test ends
    remote = await UrlClient().probe(url, sha(data))
    partial = partial_for(remote, tmp_path)
    try:
        await asyncio.to_thread(fetch, remote, partial, StreamSettings(read_timeout_s=0.5))
        assert partial.finish().ok
    finally:
        hub.release()
        partial.close()
    assert gets(hub, "files") == [None, f"bytes={2 * MIB}-"]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A certificate for 127.0.0.1 (self-signed: trusted only where the test says so)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"no openssl to make a certificate: {made.stderr.decode()[:200]}")
    yield cert, key


async def test_https_is_verified_and_a_refused_certificate_is_not_retried(
    tls_server: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_server
    data = blob(2 * MIB, 8)

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=data)

    app = web.Application()
    app.router.add_get("/f.bin", serve)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=served)
    await site.start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}/f.bin"
    remote = RemoteFile(
        name="f.bin", url=url, size=len(data), digests=(Digest("sha256", sha(data)),)
    )
    try:
        # the certificate is no CA's the machine trusts: refused at once, never retried
        monkeypatch.setattr(stream, "_TLS", None)
        partial = partial_for(remote, tmp_path)
        try:
            with pytest.raises(ModelPullFailed) as refused:
                await asyncio.to_thread(fetch, remote, partial, StreamSettings(attempts=5))
        finally:
            partial.close()
        assert refused.value.details["reason"] == "tls" and partial.size == 0

        monkeypatch.setattr(stream, "_TLS", ssl.create_default_context(cafile=str(cert)))
        partial = partial_for(remote, tmp_path)
        try:
            await asyncio.to_thread(fetch, remote, partial, StreamSettings())
            assert partial.finish().ok
        finally:
            partial.close()
        assert (tmp_path / "f.part").read_bytes() == data
    finally:
        await runner.cleanup()


async def test_a_url_with_credentials_and_a_space_in_its_path(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(MIB, 9)
    url = hub.add_url("with space.bin", data).replace("http://", "http://user:p%40ss@", 1)
    urls = UrlClient()
    remote = await urls.probe(url, sha(data))
    partial = partial_for(remote, tmp_path)
    try:
        await urls.fetch(remote, partial)
        assert partial.finish().ok
    finally:
        partial.close()
    (got,) = [r for r in hub.requests if r.route == "files" and r.method == "GET"]
    assert got.path == "with space.bin" and got.authorized  # Basic, from the URL


# -- the review of the reader (rv-proxy): what errors name, proxies, counts, edges ----------


async def test_errors_name_the_declared_source_never_a_signed_location_or_credentials(
    hub: HubServer, tmp_path: Path
) -> None:
    data = blob(MIB, 10)
    hub.add_repo("org/sig", {"s.gguf": data})
    hubs = client(hub, tmp_path)
    remote = await hubs.resolve(HubFile("org/sig", "s.gguf"), "hf://org/sig/s.gguf")
    assert "sig=" in remote.url and remote.url.startswith(hub.cdn)  # a signed location
    forged = dataclasses.replace(remote, url=remote.url.replace("sig=", "sig=0"))
    partial = partial_for(forged, tmp_path)
    try:
        with pytest.raises(ModelAccessDenied) as denied:
            await hubs.fetch(forged, partial)  # the CDN answers 403 to the bad signature
    finally:
        partial.close()
    shown = f"{denied.value.message} {denied.value.details}"
    assert denied.value.details["source"] == "hf://org/sig/s.gguf"
    assert "sig=" not in shown and hub.cdn not in shown

    # a URL's credentials and query (a signature) are cut from the error, as from messages
    url = hub.endpoint.replace("http://", "http://bob:s3cret@", 1) + "/files/gone.bin?tok=x1"
    remote = RemoteFile(name="gone.bin", url=url, size=None, digests=())
    partial = partial_for(remote, tmp_path)
    try:
        with pytest.raises(ModelPullFailed) as gone:
            await asyncio.to_thread(fetch, remote, partial, StreamSettings())
    finally:
        partial.close()
    shown = f"{gone.value.message} {gone.value.details}"
    assert gone.value.details["source"] == f"{hub.endpoint}/files/gone.bin?…"
    assert "s3cret" not in shown and "bob" not in shown and "x1" not in shown
    with pytest.raises(ModelPullFailed) as probed:
        await UrlClient().probe(url, None)
    shown = f"{probed.value.message} {probed.value.details}"
    assert "s3cret" not in shown and "x1" not in shown


def test_redact_url_cuts_credentials_and_queries() -> None:
    text = "from https://bob:s3cret@host:8443/a/b.gguf?X-Sig=abc and http://u@h/x ok"
    assert redact_url(text) == "from https://host:8443/a/b.gguf?… and http://h/x ok"
    assert redact_url("http://[::1]:8080/x") == "http://[::1]:8080/x"
    assert redact_url("https://h/p@q") == "https://h/p@q"  # an @ in a path is no userinfo


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


async def test_hub_files_and_urls_go_through_the_http_proxy_of_the_environment(
    hub: HubServer, tmp_path: Path, no_proxy_env: pytest.MonkeyPatch
) -> None:
    big, url_data = blob(3 * MIB, 11), blob(2 * MIB, 12)
    hub.add_repo("org/px", {"p.gguf": big}, gated=True)
    hubs = client(hub, tmp_path, TOKEN)
    remote = await hubs.resolve(HubFile("org/px", "p.gguf"), "hf://org/px/p.gguf")
    url = hub.add_url("u.bin", url_data)
    with ForwardProxy(credentials="px:pw") as proxy:
        no_proxy_env.setenv("http_proxy", proxy.url)
        partial = partial_for(remote, tmp_path)
        try:
            await hubs.fetch(remote, partial)  # straight to the (signed) CDN location
            assert partial.finish().ok
        finally:
            partial.close()
        urls = UrlClient()
        probed = await urls.probe(url, sha(url_data))  # aiohttp, through the proxy too
        partial = partial_for(probed, tmp_path)
        try:
            await urls.fetch(probed, partial)
            assert partial.finish().ok
        finally:
            partial.close()
        assert (tmp_path / "f.part").read_bytes() == url_data
        seen = list(proxy.seen)
    cdn_gets = [s for s in seen if s.method == "GET" and s.target.startswith(f"{hub.cdn}/lfs/")]
    url_gets = [s for s in seen if s.method == "GET" and s.target == url]
    assert cdn_gets and url_gets and any(s.method == "HEAD" and s.target == url for s in seen)
    for s in cdn_gets + url_gets:  # the proxy's credentials went to the proxy, and only there
        assert "proxy-authorization" in s.headers and "authorization" not in s.headers
    assert [r for r in hub.requests if r.route == "lfs"] and hub.sent("u.bin") >= len(url_data)

    # NO_PROXY names the host: straight there, the proxy not asked
    with ForwardProxy() as proxy:
        no_proxy_env.setenv("http_proxy", proxy.url)
        no_proxy_env.setenv("no_proxy", "localhost,127.0.0.1")
        remote = RemoteFile(
            name="u.bin", url=url, size=len(url_data), digests=(Digest("sha256", sha(url_data)),)
        )
        partial = partial_for(remote, tmp_path)
        try:
            await asyncio.to_thread(fetch, remote, partial, StreamSettings())
            assert partial.finish().ok
        finally:
            partial.close()
        assert proxy.seen == []


async def test_https_goes_through_connect_and_the_proxy_sees_no_header_of_the_request(
    tls_server: tuple[Path, Path], tmp_path: Path, no_proxy_env: pytest.MonkeyPatch
) -> None:
    cert, key = tls_server
    data = blob(2 * MIB, 13)
    authorized: list[str | None] = []

    async def serve(request: web.Request) -> web.Response:
        authorized.append(request.headers.get("Authorization"))
        return web.Response(body=data)

    app = web.Application()
    app.router.add_get("/t.bin", serve)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=served)
    await site.start()
    port = runner.addresses[0][1]
    remote = RemoteFile(
        name="t.bin",
        url=f"https://127.0.0.1:{port}/t.bin",
        size=len(data),
        digests=(Digest("sha256", sha(data)),),
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    no_proxy_env.setattr(stream, "_TLS", ssl.create_default_context(cafile=str(cert)))
    try:
        with ForwardProxy(credentials="px:pw") as proxy:
            no_proxy_env.setenv("HTTPS_PROXY", proxy.url)
            partial = partial_for(remote, tmp_path)
            try:
                await asyncio.to_thread(fetch, remote, partial, StreamSettings())
                assert partial.finish().ok
            finally:
                partial.close()
            seen = list(proxy.seen)
    finally:
        await runner.cleanup()
    assert (tmp_path / "f.part").read_bytes() == data
    assert [(s.method, s.target) for s in seen] == [("CONNECT", f"127.0.0.1:{port}")]
    assert "proxy-authorization" in seen[0].headers and "authorization" not in seen[0].headers
    assert authorized == [f"Bearer {TOKEN}"]  # the token went through the tunnel, to the host


async def test_a_restart_counts_once_toward_the_attempts(tmp_path: Path) -> None:
    """First answer cut short (progress), then a 206 that does not continue the bytes on
    disk (a restart, no progress), then the whole file: two attempts are enough."""
    data = blob(2 * MIB, 14)
    answers: list[str | None] = []

    async def serve(request: web.Request) -> web.StreamResponse:
        wanted = request.headers.get("Range")
        answers.append(wanted)
        if len(answers) == 1:
            response = web.StreamResponse(status=200)
            response.content_length = len(data)
            await response.prepare(request)
            await response.write(data[:MIB])
            assert request.transport is not None
            request.transport.close()
            return response
        if wanted:
            return web.Response(
                status=206,
                body=data,
                headers={"Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"},
            )
        return web.Response(body=data)

    app = web.Application()
    app.router.add_get("/r.bin", serve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    remote = RemoteFile(
        name="r.bin",
        url=f"http://127.0.0.1:{runner.addresses[0][1]}/r.bin",
        size=len(data),
        digests=(Digest("sha256", sha(data)),),
    )
    partial = partial_for(remote, tmp_path)
    try:
        await asyncio.to_thread(fetch, remote, partial, StreamSettings(attempts=2))
        assert partial.finish().ok
    finally:
        partial.close()
        await runner.cleanup()
    assert (tmp_path / "f.part").read_bytes() == data
    assert len(answers) == 3 and answers[0] is None and answers[1] is not None


async def test_a_cancel_during_a_body_without_a_length_is_a_cancel_not_an_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close-delimited body (no Content-Length, not chunked), held after one whole read
    (READ_BYTES: a read fills its buffer or waits), written at once: the reader waits in a
    read with nothing in it, and the cancel's shut socket reads as an end of the body."""
    monkeypatch.setattr(stream, "FLUSH_S", 0.0)  # every read written at once
    listener = socket.create_server(("127.0.0.1", 0))
    sent = threading.Event()
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * READ_BYTES)
            sent.set()
            done.wait(60)  # the body held (set once the test is done)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    remote = RemoteFile(
        name="n.bin",
        url=f"http://127.0.0.1:{listener.getsockname()[1]}/n.bin",
        size=None,
        digests=(),
    )
    partial = partial_for(remote, tmp_path)
    reader, failed = fetch_in_thread(remote, partial)
    try:
        await asyncio.to_thread(sent.wait, 60)
        deadline = time.monotonic() + 60
        while partial.size < READ_BYTES and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert partial.size == READ_BYTES
        partial.cancel()
        await asyncio.to_thread(reader.join, 60)
        assert not reader.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], PullCancelled)
    finally:
        done.set()
        partial.close()
        listener.close()


async def test_an_ipv6_literal_host_on_the_default_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    data = blob(MIB, 15)

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=data)

    app = web.Application()
    app.router.add_get("/v6.bin", serve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "::1", 0)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        pytest.skip(f"no IPv6 loopback here: {exc}")
    # "the default port" is the server's: http://[::1]/v6.bin, no port in the URL
    monkeypatch.setitem(stream._DEFAULT_PORTS, "http", runner.addresses[0][1])
    remote = RemoteFile(
        name="v6.bin",
        url="http://[::1]/v6.bin",
        size=len(data),
        digests=(Digest("sha256", sha(data)),),
    )
    partial = partial_for(remote, tmp_path)
    try:
        await asyncio.to_thread(fetch, remote, partial, StreamSettings(attempts=1))
        assert partial.finish().ok
    finally:
        partial.close()
        await runner.cleanup()


async def test_a_proxy_that_is_not_http_is_refused_without_its_password(
    tmp_path: Path, no_proxy_env: pytest.MonkeyPatch
) -> None:
    no_proxy_env.setenv("ALL_PROXY", "socks5://px:s3cret@127.0.0.1:1080")
    remote = RemoteFile(name="x.bin", url="https://127.0.0.1:9/x.bin", size=1, digests=())
    partial = partial_for(remote, tmp_path)
    try:
        with pytest.raises(ModelPullFailed) as refused:
            await asyncio.to_thread(fetch, remote, partial, StreamSettings())
    finally:
        partial.close()
    assert refused.value.details["reason"] == "proxy"
    assert "s3cret" not in f"{refused.value.message} {refused.value.details}"


async def test_a_proxy_that_wants_credentials_fails_the_pull_at_once(
    hub: HubServer, tmp_path: Path, no_proxy_env: pytest.MonkeyPatch
) -> None:
    data = blob(MIB, 16)
    url = hub.add_url("a.bin", data)
    remote = RemoteFile(name="a.bin", url=url, size=len(data), digests=())
    secure = RemoteFile(name="a.bin", url="https://127.0.0.1:9/a.bin", size=1, digests=())
    with ForwardProxy(credentials="px:pw") as proxy:
        no_proxy_env.setenv("HTTP_PROXY", proxy.url.replace("px:pw@", ""))
        no_proxy_env.setenv("HTTPS_PROXY", proxy.url.replace("px:pw@", ""))
        for each in (remote, secure):  # a 407 to a request, and to a CONNECT
            partial = partial_for(each, tmp_path)
            try:
                with pytest.raises(ModelPullFailed) as refused:
                    await asyncio.to_thread(fetch, each, partial, StreamSettings(attempts=5))
            finally:
                partial.close()
            assert refused.value.details["reason"] == "proxy"
            assert refused.value.details["status"] == 407
        assert [s.method for s in proxy.seen] == ["GET", "CONNECT"]  # none retried
    assert hub.sent("a.bin") == 0
