"""The stack backend: what ``stack apply|diff`` (and ``apply --wait``) need from a controller.

One protocol, :class:`StackBackend`, and two implementations chosen once per command
(``cli.declarative.open_backend``): :class:`~controller.cli.backend_api.ApiBackend` talks to the
controller's API (``/api/stacks/apply|diff``, ``/api/slots``) when one is reachable
(``--server``/``$SLOTCTL_SERVER``, which must answer, else the local controller of
``--state-dir`` if it answers ``/healthz`` promptly: ``cli.client.reachable_api``);
:class:`~controller.cli.backend_local.LocalBackend` works on the config and state dirs and
asks the runtime, as without a controller. The commands (``cli.declarative``) have one
code path over either: same output, same exit codes.

The protocol and its records only: the implementations sit above it (they return its
records) and are imported only when chosen (the local one pulls in the planner and a
runtime, the API one only HTTP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

from controller.model.errors import SlotConfigError

if TYPE_CHECKING:
    from controller.reconcile.apply import StackPlan
    from controller.reconcile.plan import Action
    from controller.spec.loader import DesiredState, LoadReport
    from controller.spec.problems import Problem

__all__ = [
    "Applied",
    "Closing",
    "Diff",
    "SlotStatus",
    "StackBackend",
    "StackRejected",
    "StackRequest",
]


@dataclass(frozen=True, slots=True)
class StackRequest:
    """A validated desired state and the stack files it came from (name, TOML text)."""

    state: DesiredState
    files: tuple[tuple[str, str], ...]

    @classmethod
    def from_report(cls, report: LoadReport) -> StackRequest:
        assert report.state is not None
        files = tuple((f, Path(f).read_text(encoding="utf-8")) for f in report.files)
        return cls(state=report.state, files=files)


@dataclass(frozen=True, slots=True)
class Diff:
    """A stack against the host: the plan and the config patch (``-o json-patch``)."""

    plan: StackPlan
    json_patch: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Applied:
    """What an apply planned (every slot's action) and wrote (nothing on a dry run)."""

    actions: list[Action]
    changed: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # "+ id -> a, b (prefer warm)", "- id"
    # Without --prune: what the stack no longer declares and is kept ("slot NAME", "model
    # ID": a model nothing would use any more), said so an apply is never silent on it.
    left_behind: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)  # "+ id -> base (rank 8, ...)", "- id"


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """A slot as ``apply --wait`` shows it: its state, ``pending`` before it has one (on
    the files, a slot never started has no ``state.json``: ``pending`` where the API
    says ``offline``)."""

    state: str
    message: str = ""
    pull: dict[str, Any] | None = None  # pulling: its model's pull (bytes, rate, ETA)


class StackRejected(SlotConfigError):
    """The controller refused the stack as invalid (its located problems): exit 1."""

    def __init__(self, message: str, located: list[Problem]) -> None:
        super().__init__(message)
        self.located = located


class Closing:
    """``with backend: ...`` closes it (both backends; the subclass has ``close``)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class StackBackend(Protocol):
    """Where ``stack apply|diff`` read and write; see the module docstring."""

    @property
    def remote(self) -> bool:
        """True through a controller's API (its config dir, its runtime)."""

    def diff(self, request: StackRequest, *, prune: bool) -> Diff:
        """The plan of applying ``request``, without changing anything."""

    def apply(self, request: StackRequest, *, prune: bool, force: bool, dry_run: bool) -> Applied:
        """Plan and (unless ``dry_run``) write ``request``; StackRejected when the
        controller finds it invalid, a typed error for any other refusal (nothing
        written either way)."""

    def observe(self, names: list[str]) -> dict[str, SlotStatus]:
        """The state of these slots now (a slot the controller has not seen: pending)."""

    def close(self) -> None:
        """Release what the backend holds (a runtime's connections, an event loop)."""

    def __enter__(self) -> StackBackend: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
