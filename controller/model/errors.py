"""The typed error tree: every failure a user can see has a stable code and HTTP status.

Pure module (imports nothing from the package). The API and the CLI render these errors
through :meth:`SlotctlError.to_dict`; nothing renders a bare traceback.

::

    SlotctlError                      internal                      500
    ├── SlotNotFound                  slot.not_found                404
    ├── IllegalSlotTransition         slot.illegal_transition       409
    ├── SlotNotReady                  slot.not_ready                503
    ├── SlotLoadStopped               slot.load_stopped             503  (+ retry_after_s)
    ├── SlotSpawnFailed               slot.spawn_failed             500
    ├── SlotHealthFailed              slot.health_failed            503
    ├── SlotCrashLooping              slot.crash_looping            503  (+ retry_after_s)
    ├── SlotTerminateTimeout          slot.terminate_timeout        504
    ├── SlotUpstreamTimeout           slot.upstream_timeout         504  (+ idle_s)
    ├── SlotWakeFailed                slot.wake_failed              503  (restarted instead)
    ├── SlotConfigError               slot.config_error             400  (+ keys, problems)
    │   ├── NpuExclusivityViolation   slot.npu_exclusive            409
    │   └── ServerNotAllowed          slot.server_not_allowed       403  (allowlists)
    ├── SlotPinned                    slot.pinned                   409
    ├── SlotOwnedByStack              slot.owned_by_stack           409  (+ stack, stack_dir)
    ├── SlotQueueFull                 slot.queue_full               429  (+ retry_after_s)
    ├── InsufficientMemory            model.insufficient_memory     409  (+ needed_bytes...)
    ├── DeviceUnavailable             device.unavailable            409  (+ device, gpus)
    ├── ModelNotFound                 model.not_found               404
    ├── ModelFileMissing              model.file_missing            409  (nothing to pull)
    ├── InsufficientDisk              model.insufficient_disk       507  (+ needed_bytes...)
    ├── ModelPullFailed               model.pull_failed             502  (+ source, reason)
    │   └── ModelAccessDenied         model.access_denied           403  (gated/private: token)
    ├── ModelVerifyFailed             model.verify_failed           502  (+ quarantined)
    ├── ModelInUse                    model.in_use                  409  (+ slots: rm refused)
    ├── AdapterNotFound               adapter.not_found             404  (no such adapter)
    ├── AdapterUnavailable            adapter.unavailable           503  (+ retry_after_s)
    ├── AdapterLoadFailed             adapter.load_failed           502  (the server said no)
    ├── DockerEngineError             runtime.engine_error          502  (engine said no)
    │   └── DockerUnavailable         runtime.unavailable           503  (no engine)
    ├── ControllerAlreadyRunning      controller.already_running    409  (one per state dir)
    ├── StateWriteFailed              state.write_failed            503  (+ path, errno...)
    ├── ListenUnavailable             controller.listen_unavailable 409  (--listen in use)
    ├── InvalidRequest                request.invalid               400  (bad JSON/params)
    ├── ImportSourceError             import.invalid_source         400  (slotctl import)
    ├── HostNotAllowed                request.host_not_allowed      421  (DNS rebinding)
    ├── Forbidden                     auth.forbidden                403  (a key's scope, models)
    ├── KeyNotFound                   key.not_found                 404
    ├── KeyLimited                    key.rate_limited              429  (rpm; + retry_after_s)
    │   └── KeyConcurrencyLimited     key.concurrency_limit         429  (max_concurrency)
    └── Unauthorized                  auth.unauthorized             401  (missing/bad key)
"""

from __future__ import annotations

import errno as errno_names
from typing import Any, ClassVar

__all__ = [
    "AdapterLoadFailed",
    "AdapterNotFound",
    "AdapterUnavailable",
    "ControllerAlreadyRunning",
    "DeviceUnavailable",
    "DockerEngineError",
    "DockerUnavailable",
    "Forbidden",
    "HostNotAllowed",
    "IllegalSlotTransition",
    "ImportSourceError",
    "InsufficientDisk",
    "InsufficientMemory",
    "InvalidRequest",
    "KeyConcurrencyLimited",
    "KeyLimited",
    "KeyNotFound",
    "ListenUnavailable",
    "ModelAccessDenied",
    "ModelFileMissing",
    "ModelInUse",
    "ModelNotFound",
    "ModelPullFailed",
    "ModelVerifyFailed",
    "NpuExclusivityViolation",
    "ServerNotAllowed",
    "SlotConfigError",
    "SlotCrashLooping",
    "SlotHealthFailed",
    "SlotLoadStopped",
    "SlotNotFound",
    "SlotNotReady",
    "SlotOwnedByStack",
    "SlotPinned",
    "SlotQueueFull",
    "SlotSpawnFailed",
    "SlotTerminateTimeout",
    "SlotUpstreamTimeout",
    "SlotWakeFailed",
    "SlotctlError",
    "StateWriteFailed",
    "Unauthorized",
]


class SlotctlError(Exception):
    """Base of every typed error: a stable ``code``, an ``http_status`` and details."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details
        # Set once the refusal was reported (an event and a log line): whoever renders it
        # later (API, router) reports only those nobody reported yet — one each.
        self.reported = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON body every renderer uses: ``{"error": {"code", "message", ...}}``.

        ``code`` and ``message`` always win over a detail of the same name (an exit
        ``code``, say), so the stable code can not be replaced by accident.
        """
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        body.update((k, v) for k, v in self.details.items() if k not in body)
        return {"error": body}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class SlotNotFound(SlotctlError):
    code = "slot.not_found"
    http_status = 404

    def __init__(self, slot: str) -> None:
        super().__init__(f"slot {slot!r} does not exist", slot=slot)


class IllegalSlotTransition(SlotctlError):
    code = "slot.illegal_transition"
    http_status = 409


class SlotNotReady(SlotctlError):
    code = "slot.not_ready"
    http_status = 503


class SlotLoadStopped(SlotctlError):
    """The load a request waited for was stopped before it finished (the controller
    stops, the slot was removed or unloaded): the router answers 503 with Retry-After,
    never a dropped connection."""

    code = "slot.load_stopped"
    http_status = 503


class SlotSpawnFailed(SlotctlError):
    code = "slot.spawn_failed"
    http_status = 500


class SlotHealthFailed(SlotctlError):
    code = "slot.health_failed"
    http_status = 503


class SlotCrashLooping(SlotctlError):
    code = "slot.crash_looping"
    http_status = 503

    def __init__(self, message: str, *, retry_after_s: float, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class SlotTerminateTimeout(SlotctlError):
    code = "slot.terminate_timeout"
    http_status = 504


class SlotUpstreamTimeout(SlotctlError):
    """The router heard nothing from a slot's server for ``upstream_idle_s`` (or could
    not connect within its connect timeout): the request is ended, its lease released."""

    code = "slot.upstream_timeout"
    http_status = 504


class SlotWakeFailed(SlotctlError):
    """An asleep server did not wake (its wake calls failed, or it was not ready within
    ``wake_timeout_s``): it is stopped and loaded cold instead, once (an event, not an
    answer: the request that woke it waits for that load)."""

    code = "slot.wake_failed"
    http_status = 503


class SlotConfigError(SlotctlError):
    """Bad desired state. ``problems`` lists every located problem (see ``spec.problems``)."""

    code = "slot.config_error"
    http_status = 400

    def __init__(
        self,
        message: str,
        *,
        keys: list[str] | None = None,
        problems: list[dict[str, Any]] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message, keys=keys or [], problems=problems or [], **details)
        self.keys = keys or []
        self.problems = problems or []


class NpuExclusivityViolation(SlotConfigError):
    code = "slot.npu_exclusive"
    http_status = 409


class ServerNotAllowed(SlotConfigError):
    """A slot names a server binary or image outside the controller's allowlists
    (``allowed_binaries`` / ``allowed_images`` in ``controller.toml``)."""

    code = "slot.server_not_allowed"
    http_status = 403


class SlotPinned(SlotctlError):
    code = "slot.pinned"
    http_status = 409

    def __init__(self, slot: str, action: str) -> None:
        super().__init__(
            f"slot {slot!r} is pinned: {action} needs --force (slotctl) or force=true (API)",
            slot=slot,
            action=action,
        )


class SlotOwnedByStack(SlotctlError):
    """An API change to a slot that the GitOps stack dir declares (it would come back)."""

    code = "slot.owned_by_stack"
    http_status = 409

    def __init__(self, slot: str, stack: str, stack_dir: str, action: str) -> None:
        super().__init__(
            f"slot {slot!r} is declared by stack {stack!r} in the GitOps stack dir "
            f"{stack_dir}: {action} it there (the stack dir is the source of truth)",
            slot=slot,
            stack=stack,
            stack_dir=stack_dir,
        )


class SlotQueueFull(SlotctlError):
    """More requests wait for a cold slot than its ``max_queue`` allows (router: 429)."""

    code = "slot.queue_full"
    http_status = 429

    def __init__(self, message: str, *, retry_after_s: float, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class InsufficientMemory(SlotctlError):
    code = "model.insufficient_memory"
    http_status = 409

    def __init__(
        self,
        message: str,
        *,
        needed_bytes: int,
        free_bytes: int,
        evictable_bytes: int,
        **details: Any,
    ) -> None:
        super().__init__(
            message,
            needed_bytes=needed_bytes,
            free_bytes=free_bytes,
            evictable_bytes=evictable_bytes,
            **details,
        )


class DeviceUnavailable(SlotctlError):
    """The GPU(s) a slot needs are not on this host: a pinned GPU that does not exist or
    was lost (NVML error, card removed), or more GPUs than the host has. Details: the
    slot's ``device``, the ``reason`` (``not_found``, ``lost``, ``too_few``) and the host's
    ``gpus`` with their figures."""

    code = "device.unavailable"
    http_status = 409


class ModelNotFound(SlotctlError):
    code = "model.not_found"
    http_status = 404

    def __init__(self, model_id: str) -> None:
        super().__init__(f"model {model_id!r} is not in the catalogue", model=model_id)


class AdapterNotFound(SlotctlError):
    """A request or command named an adapter that is not declared (or one no slot of its
    base model can serve)."""

    code = "adapter.not_found"
    http_status = 404


class AdapterUnavailable(SlotctlError):
    """The adapter cannot be made resident now (every place is pinned or in use, it is
    being unloaded): asked again after ``retry_after_s`` it may be. Never answered by the
    base model or another adapter instead."""

    code = "adapter.unavailable"
    http_status = 503

    def __init__(self, message: str, *, retry_after_s: float, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class AdapterLoadFailed(SlotctlError):
    """The slot's server refused or failed to load the adapter."""

    code = "adapter.load_failed"
    http_status = 502


class ModelFileMissing(SlotctlError):
    """A model's file (or snapshot directory) is not on disk and its source cannot be
    pulled (a local path, ``file://``): the server would start on nothing."""

    code = "model.file_missing"
    http_status = 409

    def __init__(self, model: str, path: str, source: str) -> None:
        super().__init__(
            f"model {model!r}: {path} does not exist and its source {source!r} cannot be "
            "pulled (put the file there, or give the model an hf:// or https:// source)",
            model=model,
            path=path,
            source=source,
        )


class InsufficientDisk(SlotctlError):
    """A pull that does not fit the models dir's free space (less the margin kept free and
    what pulls in flight will still write), refused before a byte is written.
    ``reclaimable_bytes``: what a cache GC could free (model files no slot references)."""

    code = "model.insufficient_disk"
    http_status = 507

    def __init__(
        self,
        message: str,
        *,
        needed_bytes: int,
        free_bytes: int,
        margin_bytes: int = 0,
        reserved_bytes: int = 0,
        reclaimable_bytes: int = 0,
        **details: Any,
    ) -> None:
        super().__init__(
            message,
            needed_bytes=needed_bytes,
            free_bytes=free_bytes,
            margin_bytes=margin_bytes,
            reserved_bytes=reserved_bytes,
            reclaimable_bytes=reclaimable_bytes,
            **details,
        )
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class ModelPullFailed(SlotctlError):
    """A model file could not be fetched: the hub or URL answered an error, the
    connection failed past its retries, the hub is switched off (``HF_HUB_OFFLINE``) or
    the file is not there. ``reason`` says which; the bytes already on disk are kept for
    the next pull to resume."""

    code = "model.pull_failed"
    http_status = 502

    def __init__(self, message: str, *, source: str, reason: str, **details: Any) -> None:
        super().__init__(message, source=source, reason=reason, **details)
        self.reason = reason


class ModelAccessDenied(ModelPullFailed):
    """The hub refused the repository: gated or private, and no token (or a token
    without access) was sent. The token comes from ``HF_TOKEN`` or a token file, never
    from a stack file; ``token_sent`` says whether one was (its value is never shown)."""

    code = "model.access_denied"
    http_status = 403


class ModelVerifyFailed(SlotctlError):
    """Pulled (or declared) bytes whose digest is not the expected one: the hub's sha256
    (or git blob hash), or the model's ``sha256``. The bytes are moved to the quarantine
    (``quarantined``), never served."""

    code = "model.verify_failed"
    http_status = 502


class ModelInUse(SlotctlError):
    """A model's files can not be removed (``slotctl model rm``) while a slot serves or
    loads the model: its server reads them. ``slots`` names them; unload them first."""

    code = "model.in_use"
    http_status = 409

    def __init__(self, model: str, slots: list[str]) -> None:
        super().__init__(
            f"model {model!r} is in use by slot(s) {', '.join(slots)}: unload them first "
            f"(`slotctl model unload {model}`)",
            model=model,
            slots=slots,
        )


class DockerEngineError(SlotctlError):
    """The Docker engine answered a request with an error (its message is kept)."""

    code = "runtime.engine_error"
    http_status = 502


class DockerUnavailable(DockerEngineError):
    """The Docker engine could not be reached at all."""

    code = "runtime.unavailable"
    http_status = 503


class ControllerAlreadyRunning(SlotctlError):
    """Another controller holds the state dir's lock."""

    code = "controller.already_running"
    http_status = 409


class StateWriteFailed(SlotctlError):
    """A state file could not be written (disk full, read-only, I/O error).

    Nothing changed: the slot keeps its state in memory and on disk. Retry once the state
    dir is writable again (``Retry-After``).
    """

    code = "state.write_failed"
    http_status = 503

    def __init__(self, path: str, error: OSError, *, retry_after_s: float = 5.0) -> None:
        number = error.errno or 0
        name = errno_names.errorcode.get(number, str(number))
        super().__init__(
            f"cannot write {path}: [{name}] {error.strerror or error}; nothing changed, "
            "retry once the state dir is writable",
            path=path,
            errno=number,
            errno_name=name,
            retry_after_s=retry_after_s,
        )
        self.errno = number
        self.retry_after_s = retry_after_s


class ListenUnavailable(SlotctlError):
    """``slotctl up``: a listen address cannot be bound (in use, not local, no permission).

    Checked before anything is written, so the failed start changes nothing."""

    code = "controller.listen_unavailable"
    http_status = 409


class InvalidRequest(SlotctlError):
    """An API request that is not well-formed (body, parameters)."""

    code = "request.invalid"
    http_status = 400


class ImportSourceError(SlotctlError):
    """``slotctl import``: a source file that cannot be read as the format it claims (YAML
    or INI syntax, a macro that never resolves, an unset ``${env.VAR}``); nothing is
    written. Details: ``source``, ``key``."""

    code = "import.invalid_source"
    http_status = 400


class HostNotAllowed(SlotctlError):
    """A request whose ``Host`` is none of the names the API answers to (a DNS-rebinding
    page would send its own name): refused before any route runs."""

    code = "request.host_not_allowed"
    http_status = 421


class Forbidden(SlotctlError):
    """A key whose scope does not reach the route, or a model its patterns do not name."""

    code = "auth.forbidden"
    http_status = 403


class KeyNotFound(SlotctlError):
    """No API key of that name (``slotctl key revoke``)."""

    code = "key.not_found"
    http_status = 404


class KeyLimited(SlotctlError):
    """A key over its ``rpm`` (429 with ``Retry-After``)."""

    code = "key.rate_limited"
    http_status = 429

    def __init__(self, message: str, *, retry_after_s: float, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class KeyConcurrencyLimited(KeyLimited):
    """A key at its ``max_concurrency`` requests in flight (429 with ``Retry-After``)."""

    code = "key.concurrency_limit"


class Unauthorized(SlotctlError):
    """Missing or wrong bearer token."""

    code = "auth.unauthorized"
    http_status = 401
