"""The ``slotctl`` command line: every command, option, description and example.

Sits under ``cli.main`` and above the command modules (``cli.stack``, ``cli.slot``,
``cli.remote``, ``cli.declarative``). It imports none of them: each command's function is
named as ``"module:function"`` and imported only when that command runs, so ``slotctl
--help`` and the light commands never pay for aiohttp, the daemon or the spec models.

Global options (``--config-dir``, ``--state-dir``, ``--runtime``, ``--server``,
``--token``, ``--debug``) are accepted before the command *and* after it, anywhere on
the line (as kubectl does): every sub-parser carries them with a suppressed default, so
a value given after the command wins over one given before it, and one not given
leaves the top-level default alone.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from controller import __version__

__all__ = ["RUNTIME_KINDS", "SERVER_ENV", "TOKEN_ENV", "build_parser", "parse_duration"]

SERVER_ENV: Final = "SLOTCTL_SERVER"
TOKEN_ENV: Final = "SLOTCTL_TOKEN"  # noqa: S105 (a variable name, not a secret)
# The same tuple as controller.runtime.RUNTIME_KINDS (importing it would import aiohttp).
RUNTIME_KINDS: Final = ("process", "docker", "kubernetes")

_NUMBER: Final = r"\d+(?:\.\d+)?"
_DURATION_RE: Final = re.compile(rf"(?:{_NUMBER}[smhd])+")
_PART_RE: Final = re.compile(rf"({_NUMBER})([smhd])")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}

EXIT_CODES: Final = (
    "exit codes: 0 success; 1 the command's negative answer (invalid stack, drift with "
    "--exit-code, not converged, a refused dry run); 2 usage or any error; 130 interrupted "
    "(Ctrl-C)"
)


def parse_duration(text: str) -> float:
    """``90`` (seconds), ``90s``, ``15m``, ``2h``, ``1d``, ``1h30m`` -> seconds (> 0)."""
    value = text.strip().lower()
    total = 0.0
    if re.fullmatch(_NUMBER, value):
        total = float(value)
    elif _DURATION_RE.fullmatch(value):
        total = sum(float(n) * _UNITS[unit] for n, unit in _PART_RE.findall(value))
    if total <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use e.g. 90s, 15m, 2h, 1d or 1h30m"
        )
    return total


class Lazy:
    """A command function named ``module:function``, imported when the command runs."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __call__(self, args: argparse.Namespace) -> int:
        module, _, name = self.target.partition(":")
        func: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
        return func(args)


def _cmd(target: str) -> Lazy:
    return Lazy(f"controller.cli.{target}")


class _Formatter(argparse.HelpFormatter):
    """Wraps prose paragraphs; keeps the lines of ``examples:`` as they are."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith("examples:"):
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)


class _RuntimeGiven(argparse.Action):
    """``--runtime``, remembering that it was given (``runtime_given``): the operator
    picks ``kubernetes`` inside a pod only when nobody chose."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.runtime_given = True


def _add_globals(parser: argparse.ArgumentParser, *, top: bool, skip: tuple[str, ...] = ()) -> None:
    """The global options; on sub-parsers with suppressed defaults (see the docstring)."""
    group = parser.add_argument_group("global options") if not top else parser

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    group.add_argument(
        "--config-dir",
        type=Path,
        default=default(None),
        help="live desired state (default: $SLOTCTL_CONFIG_DIR, $XDG_CONFIG_HOME/slotctl)",
    )
    group.add_argument(
        "--state-dir",
        type=Path,
        default=default(None),
        help="observed state (default: $SLOTCTL_STATE_DIR, $XDG_STATE_HOME/slotctl)",
    )
    group.add_argument(
        "--runtime",
        choices=RUNTIME_KINDS,
        action=_RuntimeGiven,
        default=default(os.environ.get("SLOTCTL_RUNTIME", "process")),
        help="process (default), docker or kubernetes (the operator's default inside a "
        "pod); a running controller's own runtime wins",
    )
    if "--server" not in skip:
        group.add_argument(
            "--server",
            dest="api_server",
            metavar="URL",
            default=default(None),
            help=f"the controller's API (default: ${SERVER_ENV}, else the controller running "
            "on --state-dir, found through its controller.json)",
        )
    if "--token" not in skip:
        group.add_argument(
            "--token",
            dest="api_token",
            metavar="TOKEN",
            default=default(None),
            help=f"API bearer token (default: ${TOKEN_ENV}, else <state_dir>/token of the "
            "local controller)",
        )
    group.add_argument(
        "--debug",
        action="store_true",
        default=default(False),
        help="print tracebacks on errors",
    )


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


class _Tree:
    """Builds sub-parsers that all carry the global options and a description."""

    def __init__(self) -> None:
        self.parsers: list[tuple[argparse.ArgumentParser, tuple[str, ...]]] = []

    def add(
        self,
        sub: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        help: str,
        *,
        description: str | None = None,
        examples: tuple[str, ...] = (),
        skip: tuple[str, ...] = (),
    ) -> argparse.ArgumentParser:
        parser = sub.add_parser(
            name,
            help=help,
            description=description or help[:1].upper() + help[1:] + ".",
            epilog=_examples(*examples) if examples else None,
            formatter_class=_Formatter,
        )
        self.parsers.append((parser, skip))
        return parser

    def group(
        self, parser: argparse.ArgumentParser, dest: str
    ) -> argparse._SubParsersAction[argparse.ArgumentParser]:
        """Sub-commands of ``parser``; bare ``slotctl GROUP`` prints the group's help."""
        parser.set_defaults(func=_HelpOf(parser))
        return parser.add_subparsers(dest=dest, metavar="COMMAND", title="commands")

    def finish(self) -> None:
        # Globals go last so each command's own options come first in its help.
        for parser, skip in self.parsers:
            _add_globals(parser, top=False, skip=skip)


class _HelpOf:
    """``func`` of a command group typed without a sub-command: its help, exit 0."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def __call__(self, args: argparse.Namespace) -> int:
        self.parser.print_help()
        return 0


def _output(parser: argparse.ArgumentParser, choices: tuple[str, ...] = ("text", "json")) -> None:
    parser.add_argument("-o", "--output", choices=choices, default=choices[0])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotctl",
        description="Declarative lifecycle controller for local model-serving slots: "
        "keeps llama.cpp / vLLM / speech servers converged with TOML stack files.",
        epilog=_examples(
            "slotctl up examples/quickstart           # run the controller (GitOps on a dir)",
            "slotctl slot list                        # every slot, state, model, memory",
            "slotctl slot load chat --dry-run         # what a load would evict, and why",
            "slotctl stack diff stacks/ --exit-code   # 0 in sync, 1 drift, 2 error",
            "slotctl slot list --server http://gpu-box:8800 --token $TOKEN",
        )
        + "\n\n"
        + EXIT_CODES
        + "\n\nGlobal options are accepted before or after the command.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"slotctl {__version__}")
    _add_globals(parser, top=True)
    parser.set_defaults(func=_HelpOf(parser), runtime_given="SLOTCTL_RUNTIME" in os.environ)
    tree = _Tree()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _stack_commands(tree, sub)
    _slot_commands(tree, sub)
    _model_commands(tree, sub)
    _controller_commands(tree, sub)
    tree.finish()
    return parser


# ====================================================================== stack


def _stack_commands(tree: _Tree, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    stack = tree.add(
        sub,
        "stack",
        "work with stack files (desired state)",
        examples=(
            "slotctl stack validate stacks/",
            "slotctl stack apply stacks/workstation.toml --wait",
            "slotctl stack diff stacks/ -o json-patch",
        ),
    )
    cmds = tree.group(stack, "stack_cmd")

    validate = tree.add(
        cmds,
        "validate",
        "check stack files; exit 0 valid, 1 invalid, 2 usage or internal error",
        examples=("slotctl stack validate stacks/ -o json",),
    )
    validate.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    _output(validate)
    validate.set_defaults(func=_cmd("stack:cmd_validate"))

    show = tree.add(
        cmds,
        "show",
        "print the effective desired state (defaults and migrations applied)",
        examples=("slotctl stack show stacks/workstation.toml -o json",),
    )
    show.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    show.add_argument("-o", "--output", choices=["toml", "json"], default="toml")
    show.set_defaults(func=_cmd("stack:cmd_show"))

    apply = tree.add(
        cmds,
        "apply",
        "validate, plan and apply stack files",
        description="Validate stack files, print the plan (one line per action with its "
        "reason) and write it through the guard. Through the controller's API when one "
        "answers, else on the files. Exit 0 applied, 1 invalid or not converged, 2 error.",
        examples=(
            "slotctl stack apply stacks/ --dry-run",
            "slotctl stack apply stacks/ --prune --wait --timeout 120",
            "slotctl stack apply stacks/ --once      # no controller: converge here, exit",
        ),
    )
    apply.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    apply.add_argument(
        "--prune", action="store_true", help="remove slots this stack owns but no longer declares"
    )
    apply.add_argument("--force", action="store_true", help="with --prune: remove pinned slots too")
    apply.add_argument("--dry-run", action="store_true", help="print the plan only")
    apply.add_argument(
        "--wait", action="store_true", help="follow the running controller until converged"
    )
    apply.add_argument(
        "--once",
        action="store_true",
        help="no controller running: reconcile in this process, then exit",
    )
    apply.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    apply.set_defaults(func=_cmd("declarative:cmd_apply"))

    diff = tree.add(
        cmds,
        "diff",
        "show drift between stack files and the host",
        description="Config drift (a unified diff per slot) and runtime drift (a server "
        "not running the declared config). -o json-patch is the config patch only (empty "
        "when in sync); runtime drift shows in text and json. Exit 0 in sync, 1 drift "
        "(with --exit-code), 2 error.",
        examples=("slotctl stack diff stacks/ --exit-code", "slotctl stack diff stacks/ -o json"),
    )
    diff.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    diff.add_argument(
        "--exit-code", action="store_true", help="exit 1 when anything drifted (0 in sync, 2 error)"
    )
    diff.add_argument("-o", "--output", choices=["text", "json", "json-patch"], default="text")
    diff.set_defaults(func=_cmd("declarative:cmd_diff"))

    export = tree.add(
        cmds,
        "export",
        "the live desired state as stack files or units",
        examples=(
            "slotctl stack export --stack workstation > workstation.toml",
            "slotctl stack export --format quadlet --output-dir ~/.config/containers/systemd",
        ),
    )
    export.add_argument("--format", choices=["toml", "quadlet", "crd"], default="toml")
    export.add_argument("--stack", help="only this stack")
    export.add_argument("--output-dir", type=Path, help="write files here instead of stdout")
    export.add_argument("--namespace", help="crd: metadata.namespace of the objects")
    export.add_argument(
        "--from",
        dest="from_paths",
        type=Path,
        action="append",
        metavar="PATH",
        help="crd: convert these stack files instead of the live config dir",
    )
    export.set_defaults(func=_cmd("k8s:cmd_export"))

    imp = tree.add(
        cmds,
        "import",
        "Model/Slot YAML (kubectl) -> stack TOML",
        examples=(
            "slotctl stack import examples/k8s/slots.yaml > stack.toml",
            "kubectl get models,slots -o yaml | slotctl stack import - --output-dir stacks/",
        ),
    )
    imp.add_argument("file", type=Path, metavar="FILE.yaml", help="'-' reads stdin")
    imp.add_argument("--stack", default="imported", help="stack name for CRs without one")
    imp.add_argument("--output-dir", type=Path, help="write <stack>.toml files here")
    imp.set_defaults(func=_cmd("k8s:cmd_import"))


# ====================================================================== slot


def _slot_commands(tree: _Tree, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    slot = tree.add(
        sub,
        "slot",
        "inspect and drive slots (state, config, logs, load, unload, hold)",
        description="Inspect and drive slots. list/get/logs ask the controller's API "
        "when one answers (--server, $SLOTCTL_SERVER, else the local controller of "
        "--state-dir) and read the config and state dirs otherwise; the other commands "
        "need a controller.",
        examples=(
            "slotctl slot list",
            "slotctl slot get chat -o json",
            "slotctl slot logs chat -f",
            "slotctl slot load coder --wait",
            "slotctl slot hold chat --for 2h",
        ),
    )
    cmds = tree.group(slot, "slot_cmd")

    lst = tree.add(
        cmds,
        "list",
        "every slot with its state",
        description="Every slot: NAME STATE MODEL DEVICE PRIO PINNED RESIDENT MEMORY SINCE "
        "MESSAGE. A held slot (slot hold) shows 'held until HH:MM'.",
        examples=("slotctl slot list", "slotctl slot list -o json --server http://gpu:8800"),
    )
    _output(lst, ("table", "json", "yaml"))
    lst.set_defaults(func=_cmd("slot:cmd_list"))

    get = tree.add(
        cmds,
        "get",
        "one slot: config and observed state",
        examples=("slotctl slot get chat", "slotctl slot get chat -o json"),
    )
    get.add_argument("name")
    get.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    get.set_defaults(func=_cmd("slot:cmd_get"))

    logs = tree.add(
        cmds,
        "logs",
        "the server's output",
        description="The server's output (the last --tail lines); -f follows it until "
        "Ctrl-C, which exits 130 quietly. An unknown slot is an error (exit 2).",
        examples=("slotctl slot logs chat --tail 20", "slotctl slot logs chat -f"),
    )
    logs.add_argument("name")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--tail", type=int, default=100, help="lines to show first (default 100)")
    logs.set_defaults(func=_cmd("slot:cmd_logs"))

    load = tree.add(
        cmds,
        "load",
        "load a slot (through the API)",
        examples=("slotctl slot load coder --dry-run", "slotctl slot load coder --wait"),
    )
    load.add_argument("name")
    load.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be evicted and why (or why it would be refused); exit 1 "
        "when it would be refused",
    )
    load.add_argument("--wait", action="store_true", help="wait until the slot is ready")
    load.add_argument("--timeout", type=float, default=300.0, help="for --wait (seconds)")
    _output(load)
    load.set_defaults(func=_cmd("remote:cmd_slot_load"))

    unload = tree.add(
        cmds,
        "unload",
        "unload a slot: drain, then stop",
        examples=("slotctl slot unload coder", "slotctl slot unload chat --force   # pinned"),
    )
    unload.add_argument("name")
    unload.add_argument("--force", action="store_true", help="needed for a pinned slot")
    _output(unload)
    unload.set_defaults(func=_cmd("remote:cmd_slot_unload"))

    swap = tree.add(
        cmds,
        "swap",
        "serve another catalogue model on a slot",
        examples=("slotctl slot swap chat qwen2.5-7b-instruct-q4",),
    )
    swap.add_argument("name")
    swap.add_argument("model", help="a model id of the catalogue")
    _output(swap)
    swap.set_defaults(func=_cmd("remote:cmd_slot_swap"))

    reset = tree.add(
        cmds,
        "reset",
        "clear the crash-loop breaker of a slot",
        examples=("slotctl slot reset chat",),
    )
    reset.add_argument("name")
    _output(reset)
    reset.set_defaults(func=_cmd("remote:cmd_slot_reset"))

    hold = tree.add(
        cmds,
        "hold",
        "batch lease: keep a slot loaded and unevictable for a while",
        examples=("slotctl slot hold chat --for 2h", "slotctl slot hold chat --for 1h30m"),
    )
    hold.add_argument("name")
    hold.add_argument(
        "--for",
        dest="duration",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="how long: 90s, 15m, 2h, 1d (a bare number is seconds)",
    )
    _output(hold)
    hold.set_defaults(func=_cmd("remote:cmd_slot_hold"))


# ====================================================================== model, events


def _model_commands(tree: _Tree, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = tree.add(
        sub,
        "model",
        "the model catalogue (through the API)",
        examples=("slotctl model list", "slotctl model load demo-chat --wait"),
    )
    cmds = tree.group(model, "model_cmd")
    lst = tree.add(cmds, "list", "every catalogue model with its state")
    _output(lst, ("table", "json", "yaml"))
    lst.set_defaults(func=_cmd("remote:cmd_model_list"))
    load = tree.add(cmds, "load", "load a model on the best slot that serves it")
    load.add_argument("model_id", metavar="MODEL")
    load.add_argument("--wait", action="store_true", help="wait until it is loaded")
    load.add_argument("--timeout", type=float, default=300.0, help="for --wait (seconds)")
    _output(load)
    load.set_defaults(func=_cmd("remote:cmd_model_load"))
    unload = tree.add(cmds, "unload", "unload every slot serving a model")
    unload.add_argument("model_id", metavar="MODEL")
    _output(unload)
    unload.set_defaults(func=_cmd("remote:cmd_model_unload"))

    events = tree.add(
        sub,
        "events",
        "follow the controller's event stream (one line per event)",
        description="Follow the controller's event stream, one line per event, until "
        "Ctrl-C (exit 130, quietly) or -n N events (exit 0).",
        examples=("slotctl events", "slotctl events -o json -n 10", "slotctl events --since 42"),
    )
    events.add_argument("--since", metavar="ID", help="resume after this event id (Last-Event-ID)")
    events.add_argument(
        "-n", "--count", type=int, default=0, metavar="N", help="exit after N events"
    )
    _output(events)
    events.set_defaults(func=_cmd("remote:cmd_events"))


# ====================================================================== up, down


def _controller_commands(
    tree: _Tree, sub: argparse._SubParsersAction[argparse.ArgumentParser]
) -> None:
    up = tree.add(
        sub,
        "up",
        "run the controller in the foreground",
        description="Run the controller in the foreground: reconcile loop, API, "
        "OpenAI-compatible router and dashboard on --listen. With STACK_DIR, GitOps: "
        "every saved change is validated and applied. The listen addresses are checked "
        "before anything is written: one in use exits 2 ([controller.listen_unavailable]). "
        "Ctrl-C stops it: it says what it waits for (drains, up to each slot's "
        "drain_timeout_s); a second Ctrl-C stops the servers without waiting.",
        examples=(
            "slotctl up examples/quickstart",
            "slotctl up stacks/ --listen 127.0.0.1:8900 --metrics-listen 0.0.0.0:9100",
            "slotctl up --keep-running   # leave servers running for the next up to adopt",
        ),
        skip=("--token", "--server"),
    )
    up.add_argument(
        "stack_dir",
        nargs="?",
        type=Path,
        metavar="STACK_DIR",
        help="GitOps: apply this directory and every change to it",
    )
    up.add_argument(
        "--keep-running",
        action="store_true",
        help="on exit leave servers running for the next `up` to adopt",
    )
    up.add_argument("--resync", type=float, default=30.0, help="resync period in seconds")
    up.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text: readable progress; json: one JSON object per log line",
    )
    up.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")
    up.add_argument(
        "--listen",
        default="127.0.0.1:8800",
        help="API, router and dashboard address (HOST:PORT, port 0 = any; "
        "'none' = no API). Default 127.0.0.1:8800",
    )
    up.add_argument(
        "--metrics-listen",
        default=None,
        metavar="HOST:PORT",
        help="also serve /metrics, /healthz and /readyz WITHOUT a token here (Prometheus, "
        "Kubernetes probes); off by default",
    )
    up.add_argument(
        "--token",
        default=None,
        help="API bearer token (or SLOTCTL_TOKEN); default: generated into "
        "<state_dir>/token. Required for a non-loopback --listen",
    )
    up.set_defaults(func=_cmd("declarative:cmd_up"))

    dashboard = tree.add(
        sub,
        "dashboard",
        "print a one-time login link to the dashboard",
        description="Ask the controller for a one-time login link to its dashboard "
        "(valid 15 minutes, one use): open it and the page logs in without pasting the "
        "token. The code is in the URL fragment, which browsers never send to a server.",
        examples=("slotctl dashboard", "xdg-open $(slotctl dashboard)"),
    )
    dashboard.set_defaults(func=_cmd("remote:cmd_dashboard"))

    down = tree.add(
        sub,
        "down",
        "stop the controller and every server it manages",
        description="Stop the running controller (SIGTERM; it drains, then stops its "
        "servers) and any managed server left. Without a controller it says so and "
        "stops leftover servers only; it creates nothing.",
        examples=("slotctl down", "slotctl down --timeout 120"),
    )
    down.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the controller"
    )
    down.set_defaults(func=_cmd("declarative:cmd_down"))
    _kubernetes_commands(tree, sub)


# ====================================================================== kubernetes


def _kubernetes_commands(
    tree: _Tree, sub: argparse._SubParsersAction[argparse.ArgumentParser]
) -> None:
    crd = tree.add(sub, "crd", "Kubernetes CustomResourceDefinitions (Model, Slot)")
    crd_cmds = tree.group(crd, "crd_cmd")
    generate = tree.add(
        crd_cmds,
        "generate",
        "write the Model and Slot CRDs generated from the stack schema",
        examples=("slotctl crd generate", "slotctl crd generate --check   # CI: exit 1 if stale"),
    )
    generate.add_argument(
        "--output-dir",
        type=Path,
        action="append",
        help="directory to write into (repeatable; default: crds)",
    )
    generate.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when a file differs"
    )
    generate.set_defaults(func=_cmd("k8s:cmd_crd_generate"))

    op = tree.add(
        sub,
        "operator",
        "run the Kubernetes operator (Model and Slot CRs)",
        description="Run the kopf operator: Model and Slot resources become the same "
        "desired state stack files give, reconciled by the same core; status and Events "
        "follow the slots. Kubeconfig from $KUBECONFIG or ~/.kube/config, in-cluster "
        "inside a pod.",
        examples=(
            "slotctl operator --all-namespaces --runtime docker",
            "slotctl operator -n models --state-dir /var/lib/slotctl",
        ),
        skip=("--token", "--server"),
    )
    scope = op.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch this namespace (repeatable; globs as kopf takes them)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    op.add_argument(
        "--listen",
        default="none",
        help="the slotctl API and OpenAI router (HOST:PORT, default none)",
    )
    op.add_argument("--token", default=None, help="API bearer token (or SLOTCTL_TOKEN)")
    op.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    op.add_argument("--resync", type=float, default=30.0, help="resync period in seconds")
    op.add_argument("--log-format", choices=["text", "json"], default="text")
    op.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")
    op.set_defaults(func=_cmd("k8s:cmd_operator"))
