"""The API stack backend: a running controller's ``/api/stacks/apply|diff`` and ``/api/slots``.

The stack files travel as their TOML text (``{"files": [{"name", "text"}]}``) and the
controller validates, plans and writes them into *its* config dir with *its* runtime;
its answers become the same records the local backend returns (``cli.backend``). A 400
with located problems is :class:`~controller.cli.backend.StackRejected` (exit 1, like an
invalid stack here); any other API error keeps its own code (exit 2).
"""

from __future__ import annotations

from typing import Any

from controller.cli.backend import Applied, Closing, Diff, SlotStatus, StackRejected, StackRequest
from controller.cli.client import ApiClient, ApiError
from controller.reconcile.apply import StackPlan
from controller.reconcile.plan import Action
from controller.spec.problems import Problem

__all__ = ["ApiBackend"]


class ApiBackend(Closing):
    """:class:`~controller.cli.backend.StackBackend` through a controller's API."""

    remote = True

    def __init__(self, api: ApiClient) -> None:
        self.api = api

    @staticmethod
    def _files(request: StackRequest) -> list[dict[str, str]]:
        return [{"name": name, "text": text} for name, text in request.files]

    def diff(self, request: StackRequest, *, prune: bool) -> Diff:
        body = {"files": self._files(request), "prune": prune}
        _, answer = self.api.post("/api/stacks/diff", body)
        plan = StackPlan(
            state=request.state,
            actions=[Action(**a) for a in answer.get("actions", [])],
            config_diffs=dict(answer.get("config_diffs", {})),
            drift=dict(answer.get("drift", {})),
            notes=dict(answer.get("notes", {})),
            orphans=list(answer.get("orphans", [])),
            models_changed=list(answer.get("models_changed", [])),
            models_unused=list(answer.get("models_unused", [])),
            left_behind=list(answer.get("left_behind", [])),
            aliases_changed=list(answer.get("aliases_changed", [])),
            adapters_changed=list(answer.get("adapters_changed", [])),
        )
        return Diff(plan=plan, json_patch=list(answer.get("json_patch", [])))

    def apply(self, request: StackRequest, *, prune: bool, force: bool, dry_run: bool) -> Applied:
        body = {"files": self._files(request), "prune": prune, "force": force, "dry_run": dry_run}
        try:
            _, answer = self.api.post("/api/stacks/apply", body)
        except ApiError as exc:
            problems = _problems(exc)
            if exc.status != 400 or not problems:
                raise
            raise StackRejected(exc.message, problems) from exc
        return Applied(
            actions=[Action(**a) for a in answer.get("plan", [])],
            changed=list(answer.get("changed") or []),
            aliases=list(answer.get("aliases_changed") or []),
            left_behind=list(answer.get("left_behind") or []),
            adapters=list(answer.get("adapters_changed") or []),
        )

    def observe(self, names: list[str]) -> dict[str, SlotStatus]:
        views = {v["name"]: v for v in self.api.get("/api/slots").get("slots", [])}
        out: dict[str, SlotStatus] = {}
        for name in names:
            view = views.get(name)
            if view is None:
                out[name] = SlotStatus("pending")
            else:
                pull = view.get("pull") if isinstance(view.get("pull"), dict) else None
                out[name] = SlotStatus(str(view["state"]), str(view.get("message") or ""), pull)
        return out

    def close(self) -> None:
        """Nothing to release: every request has its own connection."""


def _problems(exc: ApiError) -> list[Problem]:
    """The located problems of a 400 answer (``details.problems``)."""
    fields = set(Problem.__dataclass_fields__)
    problems: Any = exc.details.get("problems")
    if not isinstance(problems, list):
        return []
    return [
        Problem(**{k: v for k, v in p.items() if k in fields})
        for p in problems
        if isinstance(p, dict) and "code" in p and "message" in p
    ]
