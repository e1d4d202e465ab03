"""The byte reader of model pulls (controller/modelfiles/stream.py, issue 35) against the
suite's hub-compatible server (tests/integration/hubserver.py) and its fault knobs: hub files
resolved by the real ``huggingface_hub`` client, URLs as they are. Each test waits on state
(the server's counters and events, the reader's thread), never on time.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from controller.model.errors import ModelPullFailed, ModelVerifyFailed
from controller.modelfiles import stream
from controller.modelfiles.digests import Digest
from controller.modelfiles.hub import HubClient, HubSettings
from controller.modelfiles.partial import PartialFile, PullCancelled
from controller.modelfiles.pull import ModelFiles
from controller.modelfiles.remote import RemoteFile
from controller.modelfiles.sources import HubFile, HubSnapshot
from controller.modelfiles.stream import READ_BYTES, StreamSettings, fetch, redirect_headers
from controller.modelfiles.urls import UrlClient
from controller.spec.schema import ModelSpec
from tests.integration.hubserver import HubServer

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
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fetch(remote, partial, StreamSettings(read_timeout_s=600.0))
        except BaseException as exc:  # what the test asserts
            failed.append(exc)

    reader = threading.Thread(target=run)
    reader.start()
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
