"""``slotctl model pull|rm|gc`` and the files of ``slotctl model list`` (issue 35).

Through the controller's API (``cli.client`` finds it, as every imperative command):

* ``model pull ID [--wait] [--refresh]``: the model's files pulled ahead of any load (a
  GitOps commit can prefetch everything it declares); with ``--wait`` a progress bar
  (``cli.progress.PullBar``: redrawn in place on a terminal, coloured unless
  ``NO_COLOR``) until the pull is done or failed;
* ``model rm ID``: its pulled files removed (refused while a slot serves or loads it);
* ``model gc [--dry-run]``: model files no declared model references removed, least
  recently used first, never a pinned model's; ``--dry-run`` lists what would go.

Without a controller, ``model pull ID --source SRC`` pulls in this process into
``--models-dir``: the init container of a Kubernetes slot's pod runs it so (the same
image's ``slotctl``), the model given on the command line since no catalogue is there. A
typed failure is written to ``--termination-log`` (the pod's termination message) too.

Exit codes: 0 done (or nothing to do); 1 ``--wait`` that ends with the pull failed or out
of time; 2 any error: no controller, a typed refusal (``model.insufficient_disk``,
``model.file_missing``, ``model.in_use``...), an unknown model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Final

from controller.cli.client import ApiClient, ApiError, find_controller, quote_segment
from controller.cli.output import Style, format_memory, table
from controller.cli.progress import PullBar
from controller.model.errors import SlotctlError
from controller.model.exitcode import ExitCode

__all__ = ["cmd_model_gc", "cmd_model_pull", "cmd_model_rm", "files_by_model", "files_cell"]

_PULL_TIMEOUT_S: Final = 60.0  # one request; the pull itself runs in the controller
_POLL_S: Final = 0.2


def _client(args: argparse.Namespace, timeout: float = _PULL_TIMEOUT_S) -> ApiClient:
    endpoint = find_controller(
        args.state_dir, getattr(args, "api_server", None), getattr(args, "api_token", None)
    )
    return ApiClient(endpoint, timeout=timeout)


def _print(args: argparse.Namespace, data: Any, text: str) -> None:
    if getattr(args, "output", "text") == "json":
        print(json.dumps(data, indent=2))
    else:
        print(text)


# ====================================================================== pull


def cmd_model_pull(args: argparse.Namespace) -> ExitCode:
    if args.source:
        return _pull_here(args)
    client = _client(args)
    path = f"/api/models/{quote_segment(args.model_id)}"
    _, answer = client.post(f"{path}/pull", query={"refresh": args.refresh or None})
    status = answer.get("status") if isinstance(answer, dict) else None
    message = str(answer.get("message") or "") if isinstance(answer, dict) else ""
    if not args.wait or status != "pulling":
        _print(args, answer, f"model {args.model_id}: {status} ({message})")
        return ExitCode.OK
    text = args.output == "text"
    if text:
        print(f"model {args.model_id}: pulling ({message}); waiting ...", flush=True)
    return _follow(args, client, path, int(answer.get("pull") or 0), text)


def _follow(
    args: argparse.Namespace, client: ApiClient, path: str, pull_id: int, text: bool
) -> ExitCode:
    """Poll the model's files until the pull ``pull_id`` is done or failed, a bar meanwhile."""
    started = time.time()
    bar = PullBar(args.model_id, started=started)
    while True:
        files = client.get(f"{path}/files")
        last = files.get("last_pull") or {}
        progress = files.get("progress")
        if text and isinstance(progress, dict):
            bar.show(progress)
        ended = last.get("id") == pull_id and last.get("status") in ("done", "failed")
        if ended or time.time() - started > args.timeout:
            break
        time.sleep(_POLL_S)
    bar.end()
    took = time.time() - started
    if last.get("id") == pull_id and last.get("status") == "done":
        if text:
            size = format_memory(files.get("size_bytes"))
            print(f"model {args.model_id}: {last.get('action')} ({size}) in {took:.1f}s")
        else:
            _print(args, {"status": "done", "files": files}, "")
        return ExitCode.OK
    if not text:
        status = "failed" if last.get("status") == "failed" else "timeout"
        _print(args, {"status": status, "files": files}, "")
    if last.get("status") == "failed" and last.get("id") == pull_id:
        error = last.get("error") or {}
        print(
            f"slotctl: model {args.model_id}: the pull failed: "
            f"[{error.get('code', '?')}] {error.get('message', '')}",
            file=sys.stderr,
        )
    else:
        print(
            f"slotctl: model {args.model_id}: still pulling after {args.timeout:g}s",
            file=sys.stderr,
        )
    return ExitCode.NEGATIVE


def _pull_here(args: argparse.Namespace) -> ExitCode:
    """``--source``: pull in this process (no controller: a pod's init container)."""
    import asyncio

    from controller.modelfiles.progress import PullProgress
    from controller.modelfiles.pull import ModelFiles
    from controller.providers.base import default_models_dir
    from controller.spec.schema import ModelSpec

    models_dir = Path(args.models_dir) if args.models_dir else default_models_dir()
    try:
        model = ModelSpec.model_validate(
            {
                "id": args.model_id,
                "source": args.source,
                **({"sha256": args.sha256} if args.sha256 else {}),
                **({"revision": args.revision} if args.revision else {}),
                **({"include": args.include} if args.include else {}),
                **({"exclude": args.exclude} if args.exclude else {}),
            }
        )
    except ValueError as exc:
        from controller.model.errors import InvalidRequest

        raise InvalidRequest(f"model {args.model_id}: {exc}") from None
    # What the engine remembers (verified digests, last use) lives with the files: the
    # node's cache volume outlives each pod.
    files = ModelFiles(models_dir, models_dir / ".slotctl", progress_interval_s=1.0)
    bar = PullBar(args.model_id, started=time.time())

    def show(progress: PullProgress) -> None:
        bar.show(progress.details())

    async def pull() -> Any:
        return await files.ensure(model, on_progress=show, refresh=args.refresh)

    try:
        outcome = asyncio.run(pull())
    except SlotctlError as exc:
        bar.end()
        if args.termination_log:
            _termination(Path(args.termination_log), exc)
        raise
    bar.end()
    print(
        f"model {args.model_id}: {outcome.action} {outcome.path} "
        f"({outcome.bytes_pulled} bytes fetched, {outcome.bytes_resumed} resumed)",
        flush=True,
    )
    return ExitCode.OK


def _termination(path: Path, exc: SlotctlError) -> None:
    """The typed error as the pod's termination message (the runtime reads it back)."""
    body = json.dumps(exc.to_dict()["error"], default=str)[:4000]  # the kubelet keeps 4 KiB
    try:
        path.write_text(body, encoding="utf-8")
    except OSError as err:
        print(f"slotctl: cannot write {path}: {err}", file=sys.stderr)


# ====================================================================== rm, gc


def cmd_model_rm(args: argparse.Namespace) -> ExitCode:
    _, answer = _client(args).request("DELETE", f"/api/models/{quote_segment(args.model_id)}/files")
    freed = int(answer.get("freed_bytes") or 0) if isinstance(answer, dict) else 0
    _print(args, answer, f"model {args.model_id}: removed its files ({format_memory(freed)})")
    return ExitCode.OK


def cmd_model_gc(args: argparse.Namespace) -> ExitCode:
    _, answer = _client(args, timeout=600.0).post(
        "/api/models/gc", query={"dry_run": args.dry_run or None}
    )
    if args.output == "json":
        _print(args, answer, "")
        return ExitCode.OK
    entries = [e for e in (answer.get("entries") or []) if isinstance(e, dict)]
    style = Style(sys.stdout)
    verb = "would remove" if args.dry_run else "removed"
    rows = [
        [
            (style.yellow(verb) if e.get("action") == "remove" else "keep"),
            format_memory(e.get("size_bytes")),
            str(e.get("path")),
            "" if e.get("action") == "remove" else str(e.get("reason") or ""),
        ]
        for e in entries
    ]
    for line in table(("ACTION", "SIZE", "PATH", "WHY"), rows):
        print(line)
    freed = format_memory(answer.get("freed_bytes"))
    gone = sum(1 for e in entries if e.get("action") == "remove")
    print(f"{verb} {gone} entr{'y' if gone == 1 else 'ies'} ({freed})")
    return ExitCode.OK


# ====================================================================== model list


def files_by_model(client: ApiClient) -> dict[str, dict[str, Any]] | None:
    """Each model's files (``/api/models/files``); None where the controller manages no
    model files (the kubernetes runtime), or is older than the files routes."""
    try:
        answer = client.get("/api/models/files")
    except ApiError as exc:
        if exc.status in (400, 404):
            return None
        raise
    models = answer.get("models") if isinstance(answer, dict) else None
    return {str(m.get("model")): m for m in models or [] if isinstance(m, dict)}


def files_cell(files: dict[str, Any] | None) -> tuple[str, str]:
    """(FILES, SIZE) of ``model list``: absent, partial n %, pulling n %, present,
    verified, and the size on disk (of the whole file, when known)."""
    if files is None:
        return "-", "-"
    state = str(files.get("state") or "-")
    percent = files.get("percent")
    if state in ("pulling", "partial") and isinstance(percent, int | float):
        state = f"{state} {percent:.0f}%"
    if state == "none":
        state = "-"
    size = files.get("bytes_total") or files.get("size_bytes")
    return state, format_memory(size)
