"""The ``slotctl`` command table: every command, its options, description and examples.

Each group (stack, slot, model and events, up/down/dashboard, Kubernetes) adds its
sub-parsers to a :class:`~controller.cli.flags.Tree`; each command's function is named
``"module:function"`` and imported only when it runs (``cli.flags.cmd``). Built by
``cli.parser.build_parser``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from controller.cli.flags import Tree, cmd, output, parse_duration, parse_since

__all__ = ["add_commands"]

if TYPE_CHECKING:
    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def add_commands(tree: Tree, sub: SubParsers) -> None:
    """Every command of ``slotctl``, in the order ``--help`` lists them."""
    _stack_commands(tree, sub)
    _slot_commands(tree, sub)
    _model_commands(tree, sub)
    _controller_commands(tree, sub)


# ====================================================================== stack


def _stack_commands(tree: Tree, sub: SubParsers) -> None:
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
    output(validate)
    validate.set_defaults(func=cmd("stack:cmd_validate"))

    show = tree.add(
        cmds,
        "show",
        "print the effective desired state (defaults and migrations applied)",
        examples=("slotctl stack show stacks/workstation.toml -o json",),
    )
    show.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    show.add_argument("-o", "--output", choices=["toml", "json"], default="toml")
    show.set_defaults(func=cmd("stack:cmd_show"))

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
    apply.set_defaults(func=cmd("declarative:cmd_apply"))

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
    diff.set_defaults(func=cmd("declarative:cmd_diff"))

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
    export.set_defaults(func=cmd("k8s:cmd_export"))

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
    imp.set_defaults(func=cmd("k8s:cmd_import"))


# ====================================================================== slot


def _slot_commands(tree: Tree, sub: SubParsers) -> None:
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
    output(lst, ("table", "json", "yaml"))
    lst.set_defaults(func=cmd("slot:cmd_list"))

    get = tree.add(
        cmds,
        "get",
        "one slot: config and observed state",
        examples=("slotctl slot get chat", "slotctl slot get chat -o json"),
    )
    get.add_argument("name")
    get.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    get.set_defaults(func=cmd("slot:cmd_get"))

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
    logs.set_defaults(func=cmd("slot:cmd_logs"))

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
    output(load)
    load.set_defaults(func=cmd("remote:cmd_slot_load"))

    unload = tree.add(
        cmds,
        "unload",
        "unload a slot: drain, then stop",
        examples=("slotctl slot unload coder", "slotctl slot unload chat --force   # pinned"),
    )
    unload.add_argument("name")
    unload.add_argument("--force", action="store_true", help="needed for a pinned slot")
    output(unload)
    unload.set_defaults(func=cmd("remote:cmd_slot_unload"))

    swap = tree.add(
        cmds,
        "swap",
        "serve another catalogue model on a slot",
        examples=("slotctl slot swap chat qwen2.5-7b-instruct-q4",),
    )
    swap.add_argument("name")
    swap.add_argument("model", help="a model id of the catalogue")
    output(swap)
    swap.set_defaults(func=cmd("remote:cmd_slot_swap"))

    reset = tree.add(
        cmds,
        "reset",
        "clear the crash-loop breaker of a slot",
        examples=("slotctl slot reset chat",),
    )
    reset.add_argument("name")
    output(reset)
    reset.set_defaults(func=cmd("remote:cmd_slot_reset"))

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
    output(hold)
    hold.set_defaults(func=cmd("remote:cmd_slot_hold"))


# ====================================================================== model, events


def _model_commands(tree: Tree, sub: SubParsers) -> None:
    model = tree.add(
        sub,
        "model",
        "the model catalogue (through the API)",
        examples=("slotctl model list", "slotctl model load demo-chat --wait"),
    )
    cmds = tree.group(model, "model_cmd")
    lst = tree.add(cmds, "list", "every catalogue model with its state")
    output(lst, ("table", "json", "yaml"))
    lst.set_defaults(func=cmd("remote:cmd_model_list"))
    load = tree.add(cmds, "load", "load a model on the best slot that serves it")
    load.add_argument("model_id", metavar="MODEL")
    load.add_argument("--wait", action="store_true", help="wait until it is loaded")
    load.add_argument("--timeout", type=float, default=300.0, help="for --wait (seconds)")
    output(load)
    load.set_defaults(func=cmd("remote:cmd_model_load"))
    unload = tree.add(cmds, "unload", "unload every slot serving a model")
    unload.add_argument("model_id", metavar="MODEL")
    output(unload)
    unload.set_defaults(func=cmd("remote:cmd_model_unload"))

    events = tree.add(
        sub,
        "events",
        "the controller's recent events, then the new ones as they come",
        description="The controller's recent history first (what it still keeps, as "
        "kubectl events), then the events as they come, one line each, until Ctrl-C "
        "(exit 130, quietly) or -n N events (exit 0). The lease flips of every request "
        "(ready -> serving -> ready) are folded into one 'requests' line a slot and burst; "
        "--all prints each one.",
        examples=(
            "slotctl events",
            "slotctl events --since 10m",
            "slotctl events --watch-only -o json",
            "slotctl events --since 42 -n 10",
        ),
    )
    events.add_argument(
        "--since",
        type=parse_since,
        metavar="DURATION|ID",
        help="the history of the last DURATION (90s, 10m, 2h), or after event ID (resume)",
    )
    events.add_argument(
        "--watch-only", action="store_true", help="no history: only the events from now on"
    )
    events.add_argument(
        "--all", action="store_true", help="every lease flip too (folded into 'requests' lines)"
    )
    events.add_argument(
        "-n", "--count", type=int, default=0, metavar="N", help="exit after N events"
    )
    output(events)
    events.set_defaults(func=cmd("feed:cmd_events"))


# ====================================================================== up, down


def _controller_commands(tree: Tree, sub: SubParsers) -> None:
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
    up.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name the API also answers (repeatable; '.example.com' takes its "
        "subdomains, '*' any): besides its address, localhost and IP literals, every other "
        "Host is refused with 421 (DNS rebinding)",
    )
    up.set_defaults(func=cmd("control:cmd_up"))

    dashboard = tree.add(
        sub,
        "dashboard",
        "print a one-time login link to the dashboard",
        description="Ask the controller for a one-time login link to its dashboard "
        "(valid 15 minutes, one use): open it and the page logs in without pasting the "
        "token. The code is in the URL fragment, which browsers never send to a server.",
        examples=("slotctl dashboard", "xdg-open $(slotctl dashboard)"),
    )
    dashboard.set_defaults(func=cmd("remote:cmd_dashboard"))

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
    down.set_defaults(func=cmd("control:cmd_down"))
    _kubernetes_commands(tree, sub)


# ====================================================================== kubernetes


def _kubernetes_commands(tree: Tree, sub: SubParsers) -> None:
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
    generate.set_defaults(func=cmd("k8s:cmd_crd_generate"))

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
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name the API also answers (repeatable; '.example.com' takes its "
        "subdomains, '*' any): besides its address, localhost and IP literals, every other "
        "Host is refused with 421 (DNS rebinding)",
    )
    op.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    op.add_argument("--resync", type=float, default=30.0, help="resync period in seconds")
    op.add_argument("--log-format", choices=["text", "json"], default="text")
    op.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")
    op.set_defaults(func=cmd("k8s:cmd_operator"))
