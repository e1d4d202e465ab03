"""Model files on disk — the one façade: ensure a model's files are there and verified.

:class:`ModelFiles` is what the slot manager calls before it starts a server
(``offline → pulling → starting``), and what ``slotctl model pull|list|rm|gc`` and the
API will call: :meth:`ModelFiles.ensure` (pull or verify what is missing, joined with any
pull of the same destination, with progress), :meth:`ModelFiles.needs_pull` (whether a
load goes through ``pulling`` at all), :meth:`ModelFiles.plan` (the dry run: "would pull
4.1 GB from hf://…"), :meth:`ModelFiles.state` (absent, partial, pulling n %, present,
verified), :meth:`ModelFiles.remove`, :meth:`ModelFiles.gc` and :meth:`ModelFiles.mark_used`.

One file's pull, in order — nothing is written before the disk admits it, nothing lands
before it is verified:

1. present already? (a declared ``sha256`` is verified once and remembered by identity)
2. resolve: the hub's commit, size and digest (``HEAD …/resolve``), or the URL's size
3. admit: the bytes still to write against free space less the margin (else a GC of
   unreferenced files, if the caller gave references, else ``InsufficientDisk``)
4. fetch into the partial file from what is already there (``Range``), hashing as it goes
5. verify size and digests; a mismatch quarantines the bytes (a resumed file is tried
   once more from zero first); a match is renamed into place and remembered

A snapshot (``hf://org/repo``) pulls each file so into a staging directory and renames
the directory into place when the last one is verified. Typed errors throughout
(:mod:`controller.model.errors`); the bytes of a failed or cancelled pull stay for the
next one to resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from controller import __version__
from controller.kit.clock import SYSTEM_CLOCK, Clock
from controller.model.errors import (
    InsufficientDisk,
    InvalidRequest,
    ModelAccessDenied,
    ModelFileMissing,
    ModelPullFailed,
    ModelVerifyFailed,
    SlotctlError,
)
from controller.model.sizes import format_gib
from controller.modelfiles.admission import DiskAdmission, DiskSpace, Reservation, StatvfsDisk
from controller.modelfiles.digests import Digest, hash_file
from controller.modelfiles.gc import GcPlan, Reference, apply_gc, plan_gc
from controller.modelfiles.inventory import scan
from controller.modelfiles.joins import Joins, Shared
from controller.modelfiles.layout import CacheLayout
from controller.modelfiles.partial import (
    PartialBusy,
    PartialFile,
    PullCancelled,
    Verdict,
    fsync_dir,
)
from controller.modelfiles.progress import ProgressFeed, ProgressMeter, PullProgress
from controller.modelfiles.records import FileRecords, SnapshotRecord
from controller.modelfiles.redact import redact_url
from controller.modelfiles.remote import RemoteFile, Transfer
from controller.modelfiles.sources import HubFile, HubSnapshot, LocalFile, UrlFile, Wanted, wanted
from controller.modelfiles.stats import PullStats
from controller.spec.schema import ModelSpec
from controller.store.files import atomic_write_json

if TYPE_CHECKING:  # made on first use: the hub's client library and aiohttp load then
    from controller.modelfiles.hub import HubClient, HubSettings
    from controller.modelfiles.urls import UrlClient

__all__ = [
    "DEFAULT_MARGIN_BYTES",
    "FileState",
    "ModelFiles",
    "PullHandle",
    "PullOutcome",
    "PullPlan",
]

log = logging.getLogger(__name__)
DEFAULT_MARGIN_BYTES: Final = 512 * 1024**2
_BUSY_POLL_S: Final = 0.5

Action = Literal["none", "present", "verified", "pulled", "resumed"]


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """What :meth:`ModelFiles.ensure` did for a model."""

    model: str
    source: str
    path: Path  # what the server reads: the file, or the snapshot directory
    action: Action  # none: no file needed (demo://, no source)
    bytes_total: int = 0  # the file's (or snapshot's) size
    bytes_pulled: int = 0  # fetched over the network by this pull
    bytes_resumed: int = 0  # found on disk from an interrupted pull, not fetched again
    files: int = 0
    commit: str | None = None  # the hub commit pulled
    digest: str | None = None  # a single file's verified digest (``sha256:…``)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """The dry run of a pull (``stack validate``, ``slot load --dry-run``)."""

    model: str
    source: str
    path: Path | None
    action: Literal["none", "pull", "verify", "missing"]
    bytes: int | None = None  # still to fetch (None: not known — see ``error``)
    bytes_total: int | None = None
    error: dict[str, object] | None = None  # the resolution's typed error, if it failed
    offline: bool = False  # planned without asking the hub or the URL (sizes unknown)
    in_flight: bool = False  # a pull of these files runs now: a load would join it
    kept: int = 0  # bytes an interrupted pull left on disk (a pull resumes from them)

    @property
    def message(self) -> str:
        if self.action == "pull":
            source = redact_url(self.source)
            if self.in_flight:
                return f"would join the pull in flight from {source}"
            if self.bytes is None:
                if self.offline:
                    known = f" ({_gb(self.kept)} already on disk)" if self.kept else ""
                    return f"would pull from {source}: its size is not known offline{known}"
                return f"would pull an unknown size from {source}"
            resumed = f" (resuming: {_gb(self.kept)} on disk)" if self.kept else ""
            return f"would pull {_gb(self.bytes)} from {source}{resumed}"
        if self.action == "verify":
            return f"would verify {self.path} against its sha256"
        if self.action == "missing":
            if str(self.path) == self.source:
                return f"{self.path} is missing (a path on this host: nothing to pull it from)"
            return f"{self.path} is missing and {self.source!r} can not be pulled"
        return "files present"


@dataclass(frozen=True, slots=True)
class FileState:
    """A model's files for ``model list``."""

    model: str
    source: str
    path: Path | None
    state: Literal["none", "absent", "partial", "pulling", "present", "verified"]
    size_bytes: int = 0  # on disk (for partial: the bytes kept to resume)
    bytes_total: int | None = None
    percent: float | None = None
    progress: PullProgress | None = None


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@dataclass(slots=True)
class PullHandle:
    """One caller's view of a (maybe shared) pull: its progress and its outcome."""

    model: str
    dest: Path
    _files: ModelFiles
    _shared: Shared[PullOutcome]
    feed: ProgressFeed = field(init=False)

    def __post_init__(self) -> None:
        self.feed = self._shared.context

    @property
    def progress(self) -> PullProgress | None:
        return self.feed.latest

    def updates(self) -> AsyncIterator[PullProgress]:
        return self.feed.updates()

    def subscribe(self, callback: Callable[[PullProgress], None]) -> None:
        self.feed.add_callback(callback)

    async def wait(self) -> PullOutcome:
        """The outcome; cancelling this call leaves the pull (the last leaver cancels it)."""
        return await self._files._joins.wait(self._shared)


class ModelFiles:
    """The models dir's files: pulled, verified, admitted, collected (see the module)."""

    def __init__(
        self,
        models_dir: Path,
        state_dir: Path,
        *,
        hub: HubClient | None = None,
        hub_settings: HubSettings | None = None,
        urls: UrlClient | None = None,
        disk: DiskSpace | None = None,
        margin_bytes: int = DEFAULT_MARGIN_BYTES,
        clock: Clock = SYSTEM_CLOCK,
        references: Callable[[], Iterable[Reference]] | None = None,
        progress_interval_s: float = 0.25,
    ) -> None:
        self.models_dir = models_dir
        self.layout = CacheLayout(models_dir)
        self.records = FileRecords(state_dir)
        self._hub = hub
        self._hub_settings = hub_settings
        self._urls = urls
        self.admission = DiskAdmission(models_dir, disk or StatvfsDisk(), margin_bytes)
        self.clock = clock
        self.references = references
        self.stats = PullStats()
        self._interval = progress_interval_s
        self._joins: Joins[Path, PullOutcome] = Joins()

    # -- the transfers, made on first use ---------------------------------------------------

    @property
    def hub(self) -> HubClient:
        """The hub's client (``huggingface_hub`` is imported here, at the first hub call:
        a command that only looks at files never loads it)."""
        if self._hub is None:
            from controller.modelfiles.hub import HubClient

            self._hub = HubClient(self._hub_settings, version=__version__)
        return self._hub

    @hub.setter
    def hub(self, client: HubClient) -> None:
        self._hub = client

    @property
    def urls(self) -> UrlClient:
        """The client of plain URLs (aiohttp), made at the first URL pull."""
        if self._urls is None:
            from controller.modelfiles.urls import UrlClient

            self._urls = UrlClient()
        return self._urls

    @urls.setter
    def urls(self, client: UrlClient) -> None:
        self._urls = client

    # -- what the slot manager calls -----------------------------------------------------

    def wanted(self, model: ModelSpec) -> Wanted | None:
        return wanted(model, self.models_dir)

    def needs_pull(self, model: ModelSpec) -> bool:
        """Whether :meth:`ensure` has work (a download or a verification) for ``model``:
        the load then goes ``offline → pulling``. Cheap: a stat and a record lookup."""
        want = self.wanted(model)
        if want is None:
            return False
        if want.dest in self._joins:
            return True
        if want.is_snapshot:
            return not self._snapshot_present(want.dest)
        if not want.dest.exists():
            return True
        return bool(want.sha256) and self.records.verified(want.dest) is None

    async def ensure(
        self,
        model: ModelSpec,
        *,
        on_progress: Callable[[PullProgress], None] | None = None,
        refresh: bool = False,
    ) -> PullOutcome:
        """Make ``model``'s files present and verified; pull what is missing.

        Joins a pull of the same destination already running. ``on_progress`` is called
        on the event loop with each snapshot. ``refresh`` asks the hub or URL whether a
        present file is still current (else a present file is used without a network
        call). Raises ``ModelFileMissing``, ``InsufficientDisk``, ``ModelPullFailed``
        (``ModelAccessDenied``) or ``ModelVerifyFailed``; cancelling the call leaves the
        pull to any other waiter (the last one cancels it)."""
        handle = self.pull(model, refresh=refresh)
        if on_progress is not None:
            handle.subscribe(on_progress)
        try:
            return await handle.wait()
        finally:
            if on_progress is not None:
                handle.feed.remove_callback(on_progress)

    def pull(self, model: ModelSpec, *, refresh: bool = False) -> PullHandle:
        """Start (or join) the pull of ``model``'s files; wait with :meth:`PullHandle.wait`."""
        want = self.wanted(model)
        if want is None:  # demo://, no source: nothing to pull, an outcome all the same
            key = Path(os.devnull) / model.id
            none_feed = ProgressFeed()
            outcome = PullOutcome(model.id, model.source or "", key, "none")

            async def nothing() -> PullOutcome:
                none_feed.publish(PullProgress(model.id, model.source or "", "done"))
                return outcome

            shared, _ = self._joins.start(key, nothing, name="pull-none", context=none_feed)
            return PullHandle(model.id, key, self, shared)
        feed = ProgressFeed()
        shared, _ = self._joins.start(
            want.dest,
            lambda: self._run(want, feed, refresh),
            name=f"pull {want.model}",
            context=feed,
        )
        return PullHandle(want.model, want.dest, self, shared)

    def pulling(self) -> list[PullProgress]:
        """The progress of every pull in flight."""
        out = []
        for key in self._joins.pending():
            shared = self._joins.get(key)
            feed = shared.context if shared is not None else None
            if isinstance(feed, ProgressFeed) and feed.latest is not None:
                out.append(feed.latest)
        return out

    def mark_used(self, model: ModelSpec) -> None:
        """A server started on ``model``'s files now (the GC's least-recently-used order)."""
        want = self.wanted(model)
        if want is not None and want.dest.exists():
            self.records.touch(want.dest, self.clock.time())

    # -- one pull ----------------------------------------------------------------------

    async def _run(self, want: Wanted, feed: ProgressFeed, refresh: bool) -> PullOutcome:
        loop = asyncio.get_running_loop()
        meter = ProgressMeter(
            feed,
            PullProgress(want.model, want.text, "checking"),
            self.clock,
            loop,
            interval=self._interval,
        )
        meter.update(phase="checking")
        self.stats.in_flight += 1
        outcome_name = "failed"
        try:
            if isinstance(want.source, LocalFile):
                outcome = await self._local(want)
            elif isinstance(want.source, HubSnapshot):
                outcome = await self._snapshot(want, want.source, meter, refresh)
            else:
                outcome = await self._single(want, meter, refresh)
            outcome_name = outcome.action
            meter.update(
                phase="done", bytes_total=outcome.bytes_total, bytes_done=outcome.bytes_total
            )
            self._log_outcome(outcome)
            return outcome
        except asyncio.CancelledError:
            outcome_name = "cancelled"
            meter.update(phase="failed")
            raise
        except SlotctlError as err:
            outcome_name = {
                ModelVerifyFailed: "verify_failed",
                ModelAccessDenied: "access_denied",
                InsufficientDisk: "insufficient_disk",
            }.get(type(err), "failed")
            meter.update(phase="failed")
            log.warning("pull of model %s failed: [%s] %s", want.model, err.code, err.message)
            raise
        except OSError as exc:  # the models dir: read-only, gone, a permission
            meter.update(phase="failed")
            failure = ModelPullFailed(
                f"model {want.model}: {exc.strerror or exc} ({exc.filename or self.models_dir})",
                source=redact_url(want.text),
                reason="models_dir",
                errno=exc.errno,
                path=str(exc.filename or self.models_dir),
            )
            log.warning("pull of model %s failed: %s", want.model, failure.message)
            raise failure from None
        finally:
            self.stats.in_flight -= 1
            self.stats.finished(outcome_name)

    @staticmethod
    def _log_outcome(outcome: PullOutcome) -> None:
        if outcome.action in ("pulled", "resumed"):
            log.info(
                "pulled model %s from %s into %s: %d bytes fetched, %d resumed",
                outcome.model,
                redact_url(outcome.source),
                outcome.path,
                outcome.bytes_pulled,
                outcome.bytes_resumed,
            )

    async def _local(self, want: Wanted) -> PullOutcome:
        """A path: present (and its declared sha256 right), or ``ModelFileMissing``."""
        if not want.dest.exists():
            raise ModelFileMissing(want.model, str(want.dest), want.text)
        size = await asyncio.to_thread(_size_of, want.dest)
        if not want.sha256:
            return PullOutcome(want.model, want.text, want.dest, "present", size, files=1)
        digest = await self._verify_present(want, Digest("sha256", want.sha256), quarantine=False)
        if digest is None:  # unreachable: a mismatch raised
            raise ModelFileMissing(want.model, str(want.dest), want.text)
        return PullOutcome(
            want.model, want.text, want.dest, "verified", size, files=1, digest=str(digest)
        )

    async def _verify_present(
        self, want: Wanted, expected: Digest, *, quarantine: bool
    ) -> Digest | None:
        """Is the file at ``want.dest`` the expected bytes? Remembered by identity; a
        mismatch raises (``quarantine``: the bytes are moved aside first) — or, when
        ``quarantine`` is set, returns None so the caller pulls the file afresh."""
        recorded = self.records.verified(want.dest)
        if recorded == expected:
            return recorded
        found = Digest(
            expected.algorithm, await asyncio.to_thread(hash_file, want.dest, expected.algorithm)
        )
        if found == expected:
            self.records.remember(want.dest, found, want.text, self.clock.time())
            return found
        if not quarantine:
            raise ModelVerifyFailed(
                f"model {want.model}: {want.dest} is not the file its sha256 names "
                f"(expected {expected}, found {found}); it is left where it is",
                model=want.model,
                path=str(want.dest),
                expected=str(expected),
                found=str(found),
            )
        moved = self.layout.quarantine(
            want.dest,
            {
                "model": want.model,
                "source": want.text,
                "expected": str(expected),
                "found": str(found),
                "reason": "present file did not match",
            },
        )
        self.records.forget(want.dest)
        log.warning(
            "model %s: %s did not match %s; moved to %s, pulling it again",
            want.model,
            want.dest,
            expected,
            moved,
        )
        return None

    async def _resolve(self, want: Wanted) -> RemoteFile:
        if isinstance(want.source, HubFile):
            remote = await self.hub.resolve(want.source, want.text)
        elif isinstance(want.source, UrlFile):
            remote = await self.urls.probe(want.source.url, want.sha256)
        else:  # pragma: no cover - snapshots and paths never get here
            raise TypeError(want.source)
        digests = list(remote.digests)
        if want.sha256:
            pinned = Digest("sha256", want.sha256)
            hub_sha = next((d for d in digests if d.algorithm == "sha256"), None)
            if hub_sha is not None and hub_sha != pinned:
                raise ModelVerifyFailed(
                    f"model {want.model}: the hub's {want.text} is {hub_sha}, not the sha256 "
                    f"the model pins ({pinned}); nothing was downloaded",
                    model=want.model,
                    expected=str(pinned),
                    found=str(hub_sha),
                    quarantined=None,
                )
            if pinned not in digests:
                digests.append(pinned)
        if not digests:
            raise ModelPullFailed(
                f"model {want.model}: nothing vouches for {redact_url(want.text)} (no sha256 "
                "from the hub, none declared): refusing unverifiable bytes",
                source=redact_url(want.text),
                reason="unverifiable",
            )
        return RemoteFile(
            name=remote.name,
            url=remote.url,
            size=remote.size,
            digests=tuple(digests),
            commit=remote.commit,
            validator=remote.validator,
            source=remote.source,
            headers=remote.headers,
        )

    def _transfer(self, want: Wanted) -> Transfer:
        return self.urls if isinstance(want.source, UrlFile) else self.hub

    async def _single(self, want: Wanted, meter: ProgressMeter, refresh: bool) -> PullOutcome:
        dest = want.dest
        if dest.exists() and not refresh:
            size = await asyncio.to_thread(_size_of, dest)
            if want.sha256:
                digest = await self._verify_present(
                    want, Digest("sha256", want.sha256), quarantine=True
                )
                if digest is not None:
                    return PullOutcome(
                        want.model, want.text, dest, "verified", size, files=1, digest=str(digest)
                    )
            else:
                recorded = self.records.verified(dest)
                action: Action = "verified" if recorded else "present"
                return PullOutcome(
                    want.model,
                    want.text,
                    dest,
                    action,
                    size,
                    files=1,
                    digest=str(recorded) if recorded else None,
                )
        remote = await self._resolve(want)
        if dest.exists():  # refresh: is it still the upstream's file?
            primary = remote.digests[0]
            recorded = self.records.verified(dest)
            if recorded == primary or (
                recorded is None
                and await asyncio.to_thread(hash_file, dest, primary.algorithm) == primary.hex
            ):
                self.records.remember(dest, primary, want.text, self.clock.time())
                size = await asyncio.to_thread(_size_of, dest)
                return PullOutcome(
                    want.model,
                    want.text,
                    dest,
                    "verified",
                    size,
                    files=1,
                    commit=remote.commit,
                    digest=str(primary),
                )
        needed = _remaining(remote, self.layout.partial(dest, remote.tag))
        reservation = await self._admit(needed, want)
        try:
            kept = (remote.size - needed) if remote.size is not None else 0
            meter.update(
                phase="downloading",
                bytes_total=remote.size,
                bytes_done=kept,
                bytes_resumed=kept,
                file=remote.name,
                files_total=1,
            )
            pulled, resumed, digest = await self._fetch_file(want, remote, dest, meter, reservation)
        finally:
            reservation.release()
        return PullOutcome(
            want.model,
            want.text,
            dest,
            "resumed" if resumed else "pulled",
            pulled + resumed,
            pulled,
            resumed,
            1,
            remote.commit,
            str(digest),
        )

    async def _admit(self, needed: int, want: Wanted) -> Reservation:
        """Reserve ``needed`` bytes of the models dir, collecting unreferenced files first
        when short and the caller declared what is referenced."""
        label = f"model {want.model} ({redact_url(want.text)})"
        try:
            return self.admission.admit(needed, label)
        except InsufficientDisk as refusal:
            if self.references is None:
                raise
            shortfall = needed - (
                refusal.free_bytes - self.admission.margin_bytes - self.admission.reserved()
            )
            plan = await self.gc(self.references(), need_bytes=shortfall, dry_run=True)
            if plan.short_bytes > 0 or not plan.remove:
                raise InsufficientDisk(
                    refusal.message + f"; a GC could free only {plan.freed_bytes} bytes",
                    needed_bytes=needed,
                    free_bytes=refusal.free_bytes,
                    margin_bytes=self.admission.margin_bytes,
                    reserved_bytes=self.admission.reserved(),
                    reclaimable_bytes=plan.freed_bytes,
                    path=str(self.models_dir),
                ) from None
            await apply_gc(plan, self.layout, self.records)
            log.info(
                "made room for %s: removed %d unreferenced model file(s), %d bytes",
                label,
                len(plan.remove),
                plan.freed_bytes,
            )
            return self.admission.admit(needed, label, reclaimable=0)

    async def _open_partial(
        self,
        remote: RemoteFile,
        dest: Path,
        meter: ProgressMeter,
        reservation: Reservation,
    ) -> PartialFile | None:
        """The partial file for ``remote``, locked; None when another process finished
        ``dest`` while this one waited for its lock."""
        path = self.layout.partial(dest, remote.tag)

        def on_bytes(n: int) -> None:
            meter.add(n)
            if n > 0:
                reservation.wrote(n)
                self.stats.add_bytes(n)

        waited = False
        while True:
            partial = PartialFile(
                path,
                expected=remote.digests,
                size=remote.size,
                on_bytes=on_bytes,
                free_bytes=self.admission.free,
            )
            try:
                await asyncio.to_thread(partial.open)
            except PartialBusy:
                waited = True
                if dest.exists():
                    return None
                await self.clock.sleep(_BUSY_POLL_S)
                continue
            if waited and dest.exists():  # the other process placed it as its lock went
                partial.close()
                return None
            break
        for stale in self.layout.stale_partials(dest, keep=path):
            with contextlib.suppress(OSError):
                stale.unlink()
                stale.with_suffix(".json").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            atomic_write_json(
                path.with_suffix(".json"),
                {
                    "dest": str(dest),
                    "size": remote.size,
                    "digests": [str(d) for d in remote.digests],
                },
                durable=False,
                indent=None,
            )
        return partial

    async def _fetch_file(
        self,
        want: Wanted,
        remote: RemoteFile,
        dest: Path,
        meter: ProgressMeter,
        reservation: Reservation,
    ) -> tuple[int, int, Digest]:
        """Fetch ``remote`` into ``dest`` through its partial file; returns the bytes
        fetched, the bytes resumed and the verified digest. One retry from zero when a
        resumed file does not verify (the bytes kept may have been the bad ones)."""
        fetched_total = 0
        for attempt in (1, 2):
            partial = await self._open_partial(remote, dest, meter, reservation)
            if partial is None:  # another process pulled it meanwhile
                digest = await asyncio.to_thread(hash_file, dest, remote.digests[0].algorithm)
                found = Digest(remote.digests[0].algorithm, digest)
                if found != remote.digests[0]:
                    raise ModelVerifyFailed(
                        f"{dest} appeared (another process pulled it) but does not match "
                        f"{remote.digests[0]}",
                        model=want.model,
                        path=str(dest),
                        expected=str(remote.digests[0]),
                        found=str(found),
                    )
                self.records.remember(dest, found, want.text, self.clock.time())
                return 0, remote.size or 0, found
            committed = False
            try:
                resumed = partial.resumed
                try:
                    await self._transfer(want).fetch(remote, partial)
                except PullCancelled:  # pragma: no cover - only after a cancel
                    raise asyncio.CancelledError from None
                except asyncio.CancelledError:
                    partial.cancel()
                    raise
                fetched_total += partial.written
                meter.update(phase="verifying")
                verdict = await asyncio.to_thread(partial.finish)
                if verdict.ok:
                    await asyncio.to_thread(partial.commit, dest)
                    committed = True
                    partial.path.with_suffix(".json").unlink(missing_ok=True)
                    verified = verdict.found[0]
                    self.records.remember(dest, verified, want.text, self.clock.time())
                    return fetched_total, resumed, verified
                moved = await asyncio.to_thread(
                    self._quarantine_partial, partial, want, remote, verdict
                )
                if attempt == 1 and resumed > 0:
                    log.warning(
                        "model %s: resumed %s did not verify; moved to %s, pulling it from zero",
                        want.model,
                        remote.name,
                        moved,
                    )
                    meter.update(phase="downloading", bytes_done=0)
                    continue
                raise _verify_failed(want, remote, verdict, moved)
            finally:
                if not committed:
                    partial.close()
        raise AssertionError("unreachable")  # pragma: no cover

    def _quarantine_partial(
        self, partial: PartialFile, want: Wanted, remote: RemoteFile, verdict: Verdict
    ) -> Path:
        partial.close()
        facts = {
            "model": want.model,
            "source": redact_url(want.text),
            "file": remote.name,
            "size": verdict.size,
            "expected_size": verdict.expected_size,
            "expected": [str(e) for e, _ in verdict.mismatched] or [str(d) for d in remote.digests],
            "found": [str(f) for _, f in verdict.mismatched] or [str(d) for d in verdict.found],
        }
        moved = self.layout.quarantine(partial.path, facts)
        partial.path.with_suffix(".json").unlink(missing_ok=True)
        return moved

    # -- snapshots ---------------------------------------------------------------------

    def _snapshot_present(self, dest: Path) -> bool:
        """A snapshot directory is there when the engine recorded placing it whole, or
        when it holds no file the engine pulled (a directory put there by hand): files
        of single-file pulls (``hf://org/repo/file``) share the directory but are not
        the repository."""
        if not dest.is_dir():
            return False
        return self.records.snapshot(dest) is not None or not self.records.files_under(dest)

    async def _snapshot(
        self, want: Wanted, snap: HubSnapshot, meter: ProgressMeter, refresh: bool
    ) -> PullOutcome:
        dest = want.dest
        record = self.records.snapshot(dest)
        if not refresh and self._snapshot_present(dest):
            size, count = await asyncio.to_thread(_tree_size, dest)
            action: Action = "verified" if record is not None else "present"
            return PullOutcome(
                want.model,
                want.text,
                dest,
                action,
                size,
                files=count,
                commit=record.commit if record else None,
            )
        commit, remotes = await self.hub.snapshot(snap, want.text)
        if not remotes:
            raise ModelPullFailed(
                f"model {want.model}: no file of {want.text}@{commit[:12]} matches its "
                f"include/exclude patterns",
                source=redact_url(want.text),
                reason="empty_snapshot",
            )
        total = sum(r.size or 0 for r in remotes)
        staging = self.layout.staging(dest, commit)
        todo: list[RemoteFile] = []
        kept = 0
        for remote in remotes:
            # Already there and verified (a single-file pull of the same file, an earlier
            # commit's unchanged file, a staged file of an interrupted snapshot pull).
            if any(
                self.records.verified(where / remote.name) == remote.digests[0]
                for where in (dest, staging)
            ):
                kept += remote.size or 0
            else:
                todo.append(remote)
        needed = sum(_remaining(r, self.layout.partial(staging / r.name, r.tag)) for r in todo)
        reservation = await self._admit(needed, want)
        pulled = 0
        resumed = total - needed
        try:
            meter.update(
                phase="downloading",
                bytes_total=total,
                bytes_done=total - needed,
                bytes_resumed=total - needed - kept,
                files_total=len(remotes),
                files_done=len(remotes) - len(todo),
            )
            for i, remote in enumerate(todo):
                meter.update(file=remote.name, files_done=len(remotes) - len(todo) + i)
                fetched, _, _ = await self._fetch_file(
                    want, remote, staging / remote.name, meter, reservation
                )
                pulled += fetched
        finally:
            reservation.release()
        await asyncio.to_thread(self._place_snapshot, staging, dest, remotes)
        when = self.clock.time()
        for remote in remotes:
            self.records.remember(dest / remote.name, remote.digests[0], want.text, when)
        self.records.forget(staging)
        self.records.remember_snapshot(
            dest, SnapshotRecord(want.text, commit, len(remotes), total, when)
        )
        return PullOutcome(
            want.model,
            want.text,
            dest,
            "resumed" if resumed - kept > 0 else "pulled",
            total,
            pulled,
            resumed - kept,
            len(remotes),
            commit,
        )

    @staticmethod
    def _place_snapshot(staging: Path, dest: Path, remotes: list[RemoteFile]) -> None:
        """Move each staged file into the snapshot directory (one rename each: a file is
        there whole or not at all); the snapshot counts as there once it is recorded,
        after the last one. Files already in place (verified) stay as they are."""
        for remote in remotes:
            staged = staging / remote.name
            if not staged.exists():
                continue
            target = dest / remote.name
            target.parent.mkdir(parents=True, exist_ok=True)
            staged.replace(target)
        for directory in {(dest / r.name).parent for r in remotes}:
            fsync_dir(directory)
        shutil.rmtree(staging, ignore_errors=True)

    # -- the dry run and the list -------------------------------------------------------

    async def plan(self, model: ModelSpec, *, offline: bool = False) -> PullPlan:
        """What :meth:`ensure` would do (resolving sizes over the network, nothing
        written); a failed resolution is in ``error`` (the pull would fail the same way).
        ``offline``: no network call — what the disk and the records say; a size that
        only the hub or the URL knows stays unknown (``stack validate``)."""
        want = self.wanted(model)
        if want is None:
            return PullPlan(model.id, model.source or "", None, "none", offline=offline)
        if want.dest in self._joins:
            return PullPlan(
                want.model, want.text, want.dest, "pull", offline=offline, in_flight=True
            )
        present = self._snapshot_present(want.dest) if want.is_snapshot else want.dest.exists()
        if present:
            if want.sha256 and self.records.verified(want.dest) is None:
                return PullPlan(want.model, want.text, want.dest, "verify", offline=offline)
            return PullPlan(want.model, want.text, want.dest, "none", offline=offline)
        if isinstance(want.source, LocalFile):
            return PullPlan(want.model, want.text, want.dest, "missing", offline=offline)
        if offline:
            kept, total = await asyncio.to_thread(self._partial_bytes, want.dest)
            left = total - kept if total is not None and not want.is_snapshot else None
            return PullPlan(
                want.model, want.text, want.dest, "pull", left, total, offline=True, kept=kept
            )
        try:
            if isinstance(want.source, HubSnapshot):
                _, remotes = await self.hub.snapshot(want.source, want.text)
                staging_total = sum(r.size or 0 for r in remotes)
                return PullPlan(
                    want.model, want.text, want.dest, "pull", staging_total, staging_total
                )
            remote = await self._resolve(want)
        except SlotctlError as err:
            return PullPlan(want.model, want.text, want.dest, "pull", error=err.to_dict()["error"])
        needed = _remaining(remote, self.layout.partial(want.dest, remote.tag))
        kept = (remote.size - needed) if remote.size is not None else 0
        return PullPlan(want.model, want.text, want.dest, "pull", needed, remote.size, kept=kept)

    async def refusal(self, plan: PullPlan) -> SlotctlError | None:
        """The typed refusal ``plan``'s pull would meet before writing a byte, if any — a
        load's disk admission (the slot manager asks it before memory is admitted, the dry
        run to explain): a missing file that can not be pulled (``ModelFileMissing``), or
        bytes that do not fit the models dir's free space less the margin and what pulls
        in flight still write, even after a GC of unreferenced files when references are
        declared (``InsufficientDisk``). None: it would be admitted (a pull in flight is
        joined; a size unknown is admitted when it is known, by the pull itself)."""
        if plan.action == "missing":
            return ModelFileMissing(plan.model, str(plan.path), plan.source)
        if plan.action != "pull" or plan.in_flight or not plan.bytes:
            return None
        free = await asyncio.to_thread(self.admission.free)
        margin, reserved = self.admission.margin_bytes, self.admission.reserved()
        available = free - margin - reserved
        if plan.bytes <= available:
            return None
        reclaimable = 0
        if self.references is not None:
            gc = await self.gc(self.references(), need_bytes=plan.bytes - available, dry_run=True)
            reclaimable = gc.freed_bytes
            if gc.short_bytes == 0 and gc.remove:
                return None  # the pull makes room first (unreferenced files, oldest first)
        label = f"model {plan.model} ({redact_url(plan.source)})"
        return InsufficientDisk(
            f"{label} needs {format_gib(plan.bytes)} but the models dir {self.models_dir} has "
            f"{format_gib(max(available, 0))} to give ({format_gib(free)} free, "
            f"{format_gib(margin)} kept free"
            + (f", {format_gib(reserved)} promised to pulls in flight" if reserved else "")
            + (f"; a GC could free only {format_gib(reclaimable)}" if reclaimable else "")
            + ")",
            needed_bytes=plan.bytes,
            free_bytes=free,
            margin_bytes=margin,
            reserved_bytes=reserved,
            reclaimable_bytes=reclaimable,
            path=str(self.models_dir),
            model=plan.model,
        )

    async def state(self, model: ModelSpec) -> FileState:
        """``model``'s files now (no network call)."""
        want = self.wanted(model)
        if want is None:
            return FileState(model.id, model.source or "", None, "none")
        shared = self._joins.get(want.dest)
        if shared is not None and isinstance(shared.context, ProgressFeed):
            latest = shared.context.latest
            return FileState(
                want.model,
                want.text,
                want.dest,
                "pulling",
                latest.bytes_done if latest else 0,
                latest.bytes_total if latest else None,
                latest.percent if latest else None,
                latest,
            )
        if want.dest.exists():
            if want.is_snapshot and not self._snapshot_present(want.dest):
                return FileState(want.model, want.text, want.dest, "absent")
            if want.is_snapshot:
                size, _ = await asyncio.to_thread(_tree_size, want.dest)
                verified = self.records.snapshot(want.dest) is not None
            else:
                size = await asyncio.to_thread(_size_of, want.dest)
                verified = self.records.verified(want.dest) is not None
            return FileState(
                want.model, want.text, want.dest, "verified" if verified else "present", size, size
            )
        kept, total = await asyncio.to_thread(self._partial_bytes, want.dest)
        if kept:
            percent = 100.0 * kept / total if total else None
            return FileState(want.model, want.text, want.dest, "partial", kept, total, percent)
        return FileState(want.model, want.text, want.dest, "absent")

    def _partial_bytes(self, dest: Path) -> tuple[int, int | None]:
        """Bytes an interrupted pull of ``dest`` kept, and the size it was pulling to."""
        kept, total = 0, None
        for part in self.layout.stale_partials(dest, keep=Path()):
            with contextlib.suppress(OSError):
                kept += part.stat().st_size
                meta = json.loads(part.with_suffix(".json").read_text(encoding="utf-8"))
                total = meta.get("size")
        return kept, total

    # -- removal and GC -----------------------------------------------------------------

    async def remove(self, model: ModelSpec) -> int:
        """Remove ``model``'s pulled files (and any partial ones); returns bytes freed.
        Refused for a local path (not the engine's to delete) and while it is pulled."""
        want = self.wanted(model)
        if want is None:
            return 0
        if isinstance(want.source, LocalFile):
            raise InvalidRequest(
                f"model {want.model}'s source is a path on this host ({want.dest}): "
                "slotctl removes only the files it pulled",
                model=want.model,
            )
        if want.dest in self._joins:
            raise InvalidRequest(
                f"model {want.model} is being pulled: stop the pull first", model=want.model
            )
        freed = await asyncio.to_thread(self._remove_files, want.dest)
        self.records.forget(want.dest)
        return freed

    def _remove_files(self, dest: Path) -> int:
        freed = 0
        if dest.is_dir():
            freed, _ = _tree_size(dest)
            shutil.rmtree(dest, ignore_errors=True)
        elif dest.exists():
            freed = dest.stat().st_size
            dest.unlink()
        for part in self.layout.stale_partials(dest, keep=Path()):
            with contextlib.suppress(OSError):
                freed += part.stat().st_size
                part.unlink()
                part.with_suffix(".json").unlink(missing_ok=True)
        return freed

    async def gc(
        self,
        references: Iterable[Reference],
        *,
        need_bytes: int | None = None,
        dry_run: bool = False,
        spare_referenced: bool = True,
    ) -> GcPlan:
        """Collect model files no reference covers (see :mod:`controller.modelfiles.gc`); with
        ``dry_run`` only the plan. Files of pulls in flight are never touched."""
        entries = await asyncio.to_thread(scan, self.layout, self.records)
        busy = [Reference(path, "(pulling)", pinned=True) for path in self._joins.pending()]
        plan = plan_gc(
            entries,
            [*references, *busy],
            need_bytes=need_bytes,
            spare_referenced=spare_referenced,
        )
        if not dry_run:
            await apply_gc(plan, self.layout, self.records)
        return plan


def _remaining(remote: RemoteFile, partial: Path) -> int:
    """Bytes still to write for ``remote`` (its size less what its partial file holds)."""
    try:
        kept = partial.stat().st_size
    except OSError:
        kept = 0
    if remote.size is None:
        return 0
    if kept > remote.size:
        kept = 0
    return remote.size - kept


def _size_of(path: Path) -> int:
    return _tree_size(path)[0] if path.is_dir() else path.stat().st_size


def _tree_size(directory: Path) -> tuple[int, int]:
    size = count = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                size += (Path(root) / name).lstat().st_size
                count += 1
    return size, count


def _verify_failed(
    want: Wanted, remote: RemoteFile, verdict: Verdict, moved: Path
) -> ModelVerifyFailed:
    if verdict.expected_size is not None and verdict.size != verdict.expected_size:
        what = f"{verdict.size} bytes arrived, {verdict.expected_size} expected"
    else:
        what = "; ".join(f"expected {e}, found {f}" for e, f in verdict.mismatched)
    return ModelVerifyFailed(
        f"model {want.model}: {remote.name} from {redact_url(want.text)} did not verify "
        f"({what}); the bytes were moved to {moved} and will not be served",
        model=want.model,
        file=remote.name,
        expected=[str(d) for d in remote.digests],
        found=[str(d) for d in verdict.found],
        size=verdict.size,
        expected_size=verdict.expected_size,
        quarantined=str(moved),
    )
