"""The ``slotctl`` command table, continued: the events feed, the controller (``up``,
``dashboard``, ``down``) and Kubernetes (``crd``, ``operator``), as data
(:class:`~controller.cli.flags.Command`); :mod:`controller.cli.commands` has the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeAlias

from controller.cli.flags import Command, LazyModule, Tree, output, parse_since

__all__ = ["EVENTS", "controller_commands"]

if TYPE_CHECKING:
    from controller.cli import adapters as cli_adapters
    from controller.cli import control as cli_control
    from controller.cli import feed as cli_feed
    from controller.cli import k8s as cli_k8s
    from controller.cli import remote as cli_remote

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]
else:  # imported when a command of theirs runs
    cli_adapters = LazyModule("controller.cli.adapters")
    cli_control = LazyModule("controller.cli.control")
    cli_feed = LazyModule("controller.cli.feed")
    cli_k8s = LazyModule("controller.cli.k8s")
    cli_remote = LazyModule("controller.cli.remote")


def _events(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--since",
        type=parse_since,
        metavar="DURATION|ID",
        help="the history of the last DURATION (90s, 10m, 2h), or after event ID (resume)",
    )
    p.add_argument(
        "--watch-only", action="store_true", help="no history: only the events from now on"
    )
    p.add_argument(
        "--all", action="store_true", help="every lease flip too (folded into 'requests' lines)"
    )
    p.add_argument("-n", "--count", type=int, default=0, metavar="N", help="exit after N events")
    output(p)


EVENTS: Final[tuple[Command, ...]] = (
    Command(
        "events",
        "the controller's recent events, then the new ones as they come",
        lambda a: cli_feed.cmd_events(a),
        _events,
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
    ),
)


def _up(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "stack_dir",
        nargs="?",
        type=Path,
        metavar="STACK_DIR",
        help="GitOps: apply this directory and every change to it",
    )
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="on exit leave servers running for the next `up` to adopt",
    )
    p.add_argument("--resync", type=float, default=30.0, help="resync period in seconds")
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text: readable progress; json: one JSON object per log line",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")
    p.add_argument(
        "--listen",
        default="127.0.0.1:8800",
        help="API, router and dashboard address (HOST:PORT, port 0 = any; "
        "'none' = no API). Default 127.0.0.1:8800",
    )
    p.add_argument(
        "--metrics-listen",
        default=None,
        metavar="HOST:PORT",
        help="also serve /metrics, /healthz and /readyz WITHOUT a token here (Prometheus, "
        "Kubernetes probes); off by default",
    )
    p.add_argument(
        "--token",
        default=None,
        help="API bearer token (or SLOTCTL_TOKEN); default: generated into "
        "<state_dir>/token. Required for a non-loopback --listen",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name the API also answers (repeatable; '.example.com' takes its "
        "subdomains, '*' any): besides its address, localhost and IP literals, every other "
        "Host is refused with 421 (DNS rebinding)",
    )


def _down(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the controller")


_CONTROLLER: Final[tuple[Command, ...]] = (
    Command(
        "up",
        "run the controller in the foreground",
        lambda a: cli_control.cmd_up(a),
        _up,
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
    ),
    Command(
        "dashboard",
        "print a one-time login link to the dashboard",
        lambda a: cli_remote.cmd_dashboard(a),
        description="Ask the controller for a one-time login link to its dashboard "
        "(valid 15 minutes, one use): open it and the page logs in without pasting the "
        "token. The code is in the URL fragment, which browsers never send to a server.",
        examples=("slotctl dashboard", "xdg-open $(slotctl dashboard)"),
    ),
    Command(
        "down",
        "stop the controller and every server it manages",
        lambda a: cli_control.cmd_down(a),
        _down,
        description="Stop the running controller (SIGTERM; it drains, then stops its "
        "servers) and any managed server left. Without a controller it says so and "
        "stops leftover servers only; it creates nothing.",
        examples=("slotctl down", "slotctl down --timeout 120"),
    ),
)


def _crd_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output-dir",
        type=Path,
        action="append",
        help="directory to write into (repeatable; default: crds)",
    )
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")


def _operator(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch this namespace (repeatable; globs as kopf takes them)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument(
        "--listen",
        default="none",
        help="the slotctl API and OpenAI router (HOST:PORT, default none)",
    )
    p.add_argument("--token", default=None, help="API bearer token (or SLOTCTL_TOKEN)")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name the API also answers (repeatable; '.example.com' takes its "
        "subdomains, '*' any): besides its address, localhost and IP literals, every other "
        "Host is refused with 421 (DNS rebinding)",
    )
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    p.add_argument("--resync", type=float, default=30.0, help="resync period in seconds")
    p.add_argument(
        "--inference-pools",
        action="store_true",
        help="kubernetes runtime: keep one InferencePool (inference.networking.k8s.io/v1) per "
        "model selecting the pods of its Ready slots, for Gateway API Inference Extension "
        "gateways (the CRD must be installed)",
    )
    p.add_argument(
        "--endpoint-picker",
        default=None,
        metavar="NAME:PORT[:FailOpen|FailClose]",
        help="with --inference-pools: the pools' endpointPickerRef, a Service of the release "
        "namespace (default: none; optional since the extension's v1.6)",
    )
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")


_CRD: Final[tuple[Command, ...]] = (
    Command(
        "generate",
        "write the Model and Slot CRDs generated from the stack schema",
        lambda a: cli_k8s.cmd_crd_generate(a),
        _crd_generate,
        examples=("slotctl crd generate", "slotctl crd generate --check   # CI: exit 1 if stale"),
    ),
)

_OPERATOR: Final[tuple[Command, ...]] = (
    Command(
        "operator",
        "run the Kubernetes operator (Model and Slot CRs)",
        lambda a: cli_k8s.cmd_operator(a),
        _operator,
        description="Run the kopf operator: Model and Slot resources become the same "
        "desired state stack files give, reconciled by the same core; status and Events "
        "follow the slots. Kubeconfig from $KUBECONFIG or ~/.kube/config, in-cluster "
        "inside a pod.",
        examples=(
            "slotctl operator --all-namespaces --runtime docker",
            "slotctl operator -n models --state-dir /var/lib/slotctl",
        ),
        skip=("--token", "--server"),
    ),
)


def controller_commands(tree: Tree, sub: SubParsers) -> None:
    tree.declare(sub, _CONTROLLER)
    _adapter_commands(tree, sub)
    _kubernetes_commands(tree, sub)


def _adapter_list(p: argparse.ArgumentParser) -> None:
    output(p, ("table", "json", "yaml"))


def _adapter_one(p: argparse.ArgumentParser) -> None:
    p.add_argument("adapter", metavar="ADAPTER")
    p.add_argument("--slot", metavar="SLOT", help="this slot (default: the best one / every one)")
    output(p)


_ADAPTER: Final[tuple[Command, ...]] = (
    Command(
        "list",
        "every declared adapter and the slots it is resident in",
        lambda a: cli_adapters.cmd_adapter_list(a),
        _adapter_list,
        description="Every [[adapter]]: ADAPTER BASE RANK PRIO PINNED RESIDENT IN (the "
        "slots holding it; loading or draining ones say so).",
        examples=("slotctl adapter list", "slotctl adapter list -o json"),
    ),
    Command(
        "load",
        "load an adapter into a ready slot of its base model",
        lambda a: cli_adapters.cmd_adapter_load(a),
        _adapter_one,
        description="Load an adapter ahead of its first request, into the best ready slot "
        "of its base model (or --slot): evicting idle adapters by priority, then least "
        "recently used, when the slot is full; 503 adapter.unavailable when every place "
        "is pinned or in use.",
        examples=("slotctl adapter load sql-lora", "slotctl adapter load sql-lora --slot a"),
    ),
    Command(
        "unload",
        "drain and unload an adapter",
        lambda a: cli_adapters.cmd_adapter_unload(a),
        _adapter_one,
        description="Unload an adapter from every slot holding it (or --slot): its "
        "requests in flight finish first (drain_timeout_s), new ones meanwhile get 503.",
        examples=("slotctl adapter unload sql-lora",),
    ),
)


def _adapter_commands(tree: Tree, sub: SubParsers) -> None:
    adapter = tree.add(
        sub,
        "adapter",
        "LoRA adapters inside slots (through the API)",
        examples=("slotctl adapter list", "slotctl adapter load sql-lora"),
    )
    tree.declare(tree.group(adapter, "adapter_cmd"), _ADAPTER)


def _kubernetes_commands(tree: Tree, sub: SubParsers) -> None:
    crd = tree.add(sub, "crd", "Kubernetes CustomResourceDefinitions (Model, Slot)")
    crd_cmds = tree.group(crd, "crd_cmd")
    tree.declare(crd_cmds, _CRD)
    tree.declare(sub, _OPERATOR)
