"""A Hugging Face hub on 127.0.0.1, for the real ``huggingface_hub`` client (issue 35).

It answers the routes the client library calls (read from huggingface_hub 2.4's source:
``file_download.get_hf_file_metadata``, ``utils._http.hf_raise_for_status``,
``hf_api.HfApi.model_info`` and ``_iter_repo_tree_pages``) as the hub does:

``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}``
    a file kept in git: ``200`` with ``ETag`` (its git blob hash), ``Content-Length``,
    ``X-Repo-Commit``, ``Accept-Ranges``; an LFS file: ``302`` to the "CDN" (another
    origin, ``127.0.0.2``, with a signed query, as the hub's CDN is), with
    ``X-Linked-Etag`` (the sha256), ``X-Linked-Size``, ``X-Repo-Commit``; errors carry
    ``X-Error-Code`` (``GatedRepo``, ``RepoNotFound``, ``RevisionNotFound``,
    ``EntryNotFound``) the way the client maps them
``GET /{cdn}/lfs/{sha256}?sig=…``
    the LFS bytes (no token needed: the signature is the credential)
``GET /api/models/{org}/{repo}[/revision/{revision}]``
    ``{"id", "sha", "siblings", "gated", "private"}``
``GET /api/models/{org}/{repo}/tree/{revision}[/{path}]?recursive=…``
    ``[{"type": "file", "oid", "size", "path", "lfs": {"oid", "size", "pointerSize"}}]``,
    paginated with a ``Link: <…>; rel="next"`` header when ``page_size`` is set
``HEAD|GET /files/{path}``
    plain URL sources: strong ``ETag``, ``Last-Modified``, ranges and ``If-Range``

Every byte route honours ``Range: bytes=N-`` / ``N-M`` (``206`` + ``Content-Range``).
Fault knobs per file (:class:`Faults`): drop the connection after N bytes (a clean close,
or a reset), serve wrong bytes, ignore ranges, hold the response after N bytes until
released (tests wait on :attr:`held`, never on time), a byte rate. A gated repository
answers ``401`` without the right bearer token. It counts the bytes it sent per file and
records each request (never a token's value).

The server runs its own event loop in a thread, so synchronous clients (the library,
``curl``, a subprocess) and asynchronous ones can use it alike.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import quote

from aiohttp import web

LFS_THRESHOLD = 64 * 1024  # files at least this big are LFS files (the hub's rule is 10 MB)
WRITE_BYTES = 1024 * 1024


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Faults:
    """What goes wrong when a file is served (set per file; all off by default)."""

    drop_after: int | None = None  # close the connection after this many bytes of a response
    drop_times: int = 1  # how many responses are dropped so (then it serves normally)
    wrong_bytes: bool = False  # flip one byte in the middle of the file
    hold_at: int | None = None  # stop after this many bytes until release() (once)
    rate_bps: int | None = None  # at most this many bytes a second
    reset_after: int | None = None  # abort (RST, unflushed bytes lost) after this many bytes (once)
    ignore_range: bool = False  # answer 200 and the whole file to a Range, as some servers do


@dataclass
class RepoFile:
    path: str
    data: bytes
    lfs: bool

    @functools.cached_property
    def sha256(self) -> str:
        return sha256(self.data)

    @functools.cached_property
    def blob_id(self) -> str:
        if self.lfs:  # the git blob of an LFS file is its pointer file
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
                f"size {len(self.data)}\n"
            ).encode()
            return git_blob_sha1(pointer)
        return git_blob_sha1(self.data)


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, RepoFile]] = field(default_factory=dict)  # commit -> files
    branches: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    gated: bool = False


@dataclass
class Request:
    method: str
    route: str  # resolve, lfs, info, tree, files
    path: str  # the file's path (or repo id)
    range: str | None
    authorized: bool  # an Authorization header was sent (its value is never kept)
    status: int = 0


class HubServer:
    """See the module text. ``with HubServer(token=…) as hub:`` starts and stops it."""

    def __init__(self, *, token: str | None = None, page_size: int | None = None) -> None:
        self.token = token
        self.page_size = page_size
        self.repos: dict[str, Repo] = {}
        self.urls: dict[str, bytes] = {}
        self._url_etags: dict[str, str] = {}  # computed once (a hash per request would be
        # the server's cost in bench/pull.py, not the client's)
        self.faults: dict[str, Faults] = {}
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.requests: list[Request] = []
        self.held = threading.Event()  # set while a response is held (Faults.hold_at)
        self._release = threading.Event()
        self._secret = hashlib.sha256(str(id(self)).encode()).digest()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.port = 0
        self.cdn_port = 0
        self._error: BaseException | None = None
        self._blob_dir: Path | None = None

    # -- content ------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        gated: bool = False,
        branch: str = "main",
    ) -> str:
        """Add (or commit anew to) ``repo_id``; returns the new commit hash."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id, gated=gated))
        repo.gated = gated
        listing = {p: RepoFile(p, d, len(d) >= LFS_THRESHOLD) for p, d in sorted(files.items())}
        commit = hashlib.sha1(
            json.dumps(
                [repo_id, len(repo.commits), [(p, f.sha256) for p, f in listing.items()]]
            ).encode(),
            usedforsecurity=False,
        ).hexdigest()
        repo.commits[commit] = listing
        repo.branches[branch] = commit
        return commit

    def add_url(self, path: str, data: bytes) -> str:
        """Serve ``data`` at ``/files/{path}``; returns its URL."""
        self.urls[path] = data
        self._url_etags[path] = f'"{sha256(data)[:32]}"'
        return f"{self.endpoint}/files/{path}"

    def fault(self, path: str, **knobs: Any) -> Faults:
        """Set fault knobs for the file at ``path`` (a path in a repo, or a URL path)."""
        faults = Faults(**knobs)
        self.faults[path] = faults
        if faults.hold_at is not None:
            self.held.clear()
            self._release.clear()
        return faults

    def release(self) -> None:
        """Let a held response go on."""
        self._release.set()

    def sent(self, path: str) -> int:
        with self._lock:
            return self.bytes_sent.get(path, 0)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.2:{self.cdn_port}"

    # -- running ------------------------------------------------------------------------

    def __enter__(self) -> HubServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hubserver", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError("hub server failed to start") from self._error

    def stop(self) -> None:
        self._release.set()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)
        if self._blob_dir is not None:
            shutil.rmtree(self._blob_dir, ignore_errors=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/api/models/{org}/{name}", self._info)
        app.router.add_route("*", "/api/models/{org}/{name}/revision/{revision}", self._info)
        app.router.add_route("*", "/api/models/{org}/{name}/tree/{revision}", self._tree)
        app.router.add_route("*", "/api/models/{org}/{name}/tree/{revision}/{path:.*}", self._tree)
        app.router.add_route("*", "/lfs/{sha}", self._lfs)
        app.router.add_route("*", "/files/{path:.*}", self._files)
        app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{path:.*}", self._resolve)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        cdn = web.TCPSite(runner, "127.0.0.2", 0)
        await cdn.start()
        self.port = runner.addresses[0][1]
        self.cdn_port = runner.addresses[1][1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    # -- helpers ------------------------------------------------------------------------

    def _note(self, request: web.Request, route: str, path: str) -> Request:
        entry = Request(
            request.method,
            route,
            path,
            request.headers.get("Range"),
            "Authorization" in request.headers,
        )
        with self._lock:
            self.requests.append(entry)
        return entry

    def _sign(self, sha: str) -> str:
        return hmac.new(self._secret, sha.encode(), "sha256").hexdigest()[:32]

    def _repo_and_commit(self, request: web.Request) -> tuple[Repo, str] | web.Response:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(401, "RepoNotFound", "Repository not found")
        revision = request.match_info.get("revision") or "main"
        commit = repo.branches.get(revision, revision)
        if commit not in repo.commits:
            return _error(404, "RevisionNotFound", "Invalid rev id")
        return repo, commit

    def _gate(self, request: web.Request, repo: Repo) -> web.Response | None:
        if not repo.gated:
            return None
        header = request.headers.get("Authorization")
        if header is None:
            return _error(
                401,
                "GatedRepo",
                f"Access to model {repo.repo_id} is restricted. You must have access to it "
                "and be authenticated to access it. Please log in.",
            )
        if self.token is None or header != f"Bearer {self.token}":
            return _error(401, None, "Invalid credentials in Authorization header")
        return None

    # -- routes -------------------------------------------------------------------------

    async def _info(self, request: web.Request) -> web.StreamResponse:
        entry = self._note(request, "info", request.path)
        found = self._repo_and_commit(request)
        if isinstance(found, web.Response):
            entry.status = found.status
            return found
        repo, commit = found
        body = {
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": commit,
            "private": False,
            "gated": "auto" if repo.gated else False,
            "siblings": [{"rfilename": p} for p in repo.commits[commit]],
        }
        entry.status = 200
        return web.json_response(body)

    async def _tree(self, request: web.Request) -> web.StreamResponse:
        entry = self._note(request, "tree", request.path)
        found = self._repo_and_commit(request)
        if isinstance(found, web.Response):
            entry.status = found.status
            return found
        repo, commit = found
        prefix = request.match_info.get("path", "").strip("/")
        recursive = request.query.get("recursive", "false").lower() == "true"
        items: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for path, f in repo.commits[commit].items():
            if prefix and not path.startswith(prefix + "/"):
                continue
            rest = path[len(prefix) + 1 :] if prefix else path
            if "/" in rest and not recursive:
                dirs.add((prefix + "/" if prefix else "") + rest.split("/", 1)[0])
                continue
            for i in range(rest.count("/")):
                dirs.add((prefix + "/" if prefix else "") + "/".join(rest.split("/")[: i + 1]))
            item: dict[str, Any] = {
                "type": "file",
                "oid": f.blob_id,
                "size": len(f.data),
                "path": path,
            }
            if f.lfs:
                item["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
            items.append(item)
        items += [
            {"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)
        ]
        items.sort(key=lambda i: i["path"])
        start = int(request.query.get("cursor", "0"))
        headers = {}
        page = items[start:]
        if self.page_size is not None and len(page) > self.page_size:
            page = page[: self.page_size]
            nxt = request.url.update_query({"cursor": str(start + self.page_size)})
            headers["Link"] = f'<{nxt}>; rel="next"'
        entry.status = 200
        return web.json_response(page, headers=headers)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        entry = self._note(request, "resolve", path)
        found = self._repo_and_commit(request)
        if isinstance(found, web.Response):
            entry.status = found.status
            return found
        repo, commit = found
        refused = self._gate(request, repo)
        if refused is not None:
            entry.status = refused.status
            return refused
        f = repo.commits[commit].get(path)
        if f is None:
            response = _error(404, "EntryNotFound", "Entry not found")
            response.headers["X-Repo-Commit"] = commit
            entry.status = 404
            return response
        headers = {"X-Repo-Commit": commit}
        if f.lfs:
            headers.update(
                {
                    "Location": f"{self.cdn}/lfs/{f.sha256}?sig={self._sign(f.sha256)}",
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(len(f.data)),
                    "ETag": f'"{f.blob_id}"',
                    "Content-Length": "0",
                }
            )
            entry.status = 302
            return web.Response(status=302, headers=headers)
        headers["ETag"] = f'"{f.blob_id}"'
        entry.status = 200
        return await self._bytes(request, f.data, path, headers)

    async def _lfs(self, request: web.Request) -> web.StreamResponse:
        sha = request.match_info["sha"]
        for repo in self.repos.values():
            for files in repo.commits.values():
                for f in files.values():
                    if f.lfs and f.sha256 == sha:
                        entry = self._note(request, "lfs", f.path)
                        if not hmac.compare_digest(request.query.get("sig", ""), self._sign(sha)):
                            entry.status = 403
                            return web.Response(status=403, text="bad signature")
                        entry.status = 200
                        if self.path_faults(f.path) is None and request.method == "GET":
                            return await self._sendfile(request, f)
                        return await self._bytes(request, f.data, f.path, {"ETag": f'"{sha}"'})
        return web.Response(status=404)

    def path_faults(self, path: str) -> Faults | None:
        faults = self.faults.get(path)
        if faults is None or faults == Faults():
            return None
        return faults

    async def _sendfile(self, request: web.Request, f: RepoFile) -> web.StreamResponse:
        """An LFS file with no fault set, served as a CDN serves it: ``sendfile`` from
        disk (the byte-by-byte path is for faults; this one keeps the server out of the
        way of the client's throughput in bench/pull.py)."""
        if self._blob_dir is None:
            self._blob_dir = Path(tempfile.mkdtemp(prefix="hubserver-"))
        path = self._blob_dir / f.sha256
        if not path.exists():
            path.write_bytes(f.data)
        wanted = request.headers.get("Range", "")
        start = int(wanted.removeprefix("bytes=").split("-")[0] or 0) if wanted else 0
        with self._lock:
            self.bytes_sent[f.path] += max(0, len(f.data) - start)
        # returned unprepared: aiohttp prepares it once (a prepared FileResponse would be
        # sent a second time, and fail, after the handler returns)
        return web.FileResponse(path, chunk_size=WRITE_BYTES)

    async def _files(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        entry = self._note(request, "files", path)
        data = self.urls.get(path)
        if data is None:
            entry.status = 404
            return web.Response(status=404)
        entry.status = 200
        headers = {
            "ETag": self._url_etags[path],
            "Last-Modified": formatdate(1_700_000_000, usegmt=True),
        }
        if (
            request.method == "GET"
            and "Range" not in request.headers
            and self.path_faults(path) is None
        ):
            return self._whole_file(path, data, self._url_etags[path])
        return await self._bytes(request, data, path, headers, if_range=True)

    def _whole_file(self, path: str, data: bytes, etag: str) -> web.StreamResponse:
        """A URL's whole file with no fault set, by ``sendfile`` as a web server or an object
        store sends it (a range, a HEAD or a fault takes the byte-by-byte path): so
        bench/pull.py measures the clients, not this server's write loop. Its ETag names
        the file on disk, so new bytes at a path are a new file."""
        if self._blob_dir is None:
            self._blob_dir = Path(tempfile.mkdtemp(prefix="hubserver-"))
        file = self._blob_dir / ("url-" + etag.strip('"'))
        if not file.exists():
            file.write_bytes(data)
        with self._lock:
            self.bytes_sent[path] += len(data)
        # returned unprepared, as _sendfile's (aiohttp prepares it once)
        return web.FileResponse(file, chunk_size=WRITE_BYTES)

    async def _bytes(
        self,
        request: web.Request,
        data: bytes,
        path: str,
        headers: dict[str, str],
        *,
        if_range: bool = False,
    ) -> web.StreamResponse:
        faults = self.faults.get(path) or Faults()
        size = len(data)
        start, end = 0, size
        status = 200
        wanted = request.headers.get("Range")
        validator = request.headers.get("If-Range")
        if wanted and if_range and validator and validator != headers.get("ETag"):
            wanted = None  # the file changed (or the validator is another's): all of it
        if faults.ignore_range:
            wanted = None
        if wanted:
            spec = wanted.removeprefix("bytes=")
            first, _, last = spec.partition("-")
            start = int(first) if first else 0
            end = int(last) + 1 if last else size
            if start >= size:
                return web.Response(
                    status=416, headers={**headers, "Content-Range": f"bytes */{size}"}
                )
            end = min(end, size)
            status = 206
        response = web.StreamResponse(status=status, headers=headers)
        response.headers["Accept-Ranges"] = "bytes"
        response.content_length = end - start
        if status == 206:
            response.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        body = bytearray(data) if faults.wrong_bytes else None
        if body is not None:
            body[size // 2] ^= 0xFF
        view = memoryview(body if body is not None else data)
        pos = start
        began = time.monotonic()
        while pos < end:
            step = min(WRITE_BYTES, end - pos)
            if faults.rate_bps:
                step = min(step, max(1, faults.rate_bps // 10))
            drop = (
                start + faults.drop_after if faults.drop_after and faults.drop_times > 0 else None
            )
            if drop is not None and pos < drop:
                step = min(step, drop - pos)
            hold = faults.hold_at
            if hold is not None and pos < hold:
                step = min(step, hold - pos)
            reset = faults.reset_after
            if reset is not None and pos < start + reset:
                step = min(step, start + reset - pos)
            await response.write(view[pos : pos + step])
            pos += step
            with self._lock:
                self.bytes_sent[path] += step
            if drop is not None and pos >= drop:
                faults.drop_times -= 1
                # close(), not abort(): the bytes counted as sent are flushed first, so
                # "sent" is what the client could read before the connection ended.
                assert request.transport is not None
                request.transport.close()
                return response
            if reset is not None and pos >= start + reset:
                faults.reset_after = None
                assert request.transport is not None
                request.transport.abort()  # a reset: what was not flushed is lost
                return response
            if hold is not None and pos >= hold:
                faults.hold_at = None
                self.held.set()
                await asyncio.to_thread(self._release.wait)
                self.held.clear()
            if faults.rate_bps:
                ahead = (pos - start) / faults.rate_bps - (time.monotonic() - began)
                if ahead > 0:
                    await asyncio.sleep(ahead)
        await response.write_eof()
        return response


def _error(status: int, code: str | None, message: str) -> web.Response:
    headers = {"X-Error-Message": message}
    if code is not None:
        headers["X-Error-Code"] = code
    return web.Response(status=status, headers=headers, text=json.dumps({"error": message}))


def resolve_url(endpoint: str, repo: str, path: str, revision: str = "main") -> str:
    return f"{endpoint}/{repo}/resolve/{quote(revision, safe='')}/{quote(path)}"
