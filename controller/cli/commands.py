"""The ``slotctl`` command table: every command as data (:class:`~controller.cli.flags.Command`:
its name, help, options, examples and the handler itself), a table a group.

The handlers are the command modules' own functions, called through a module imported
when the command runs (:class:`~controller.cli.flags.LazyModule`, so ``slotctl --help``
imports none of them); mypy and import-linter see the modules as imported (the
``TYPE_CHECKING`` imports below). Each group (stack, slot, model, crd) adds its sub-parsers
to a :class:`~controller.cli.flags.Tree`; built by ``cli.parser.build_parser``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeAlias

from controller.cli.commands_control import EVENTS, controller_commands
from controller.cli.flags import Command, LazyModule, Tree, output, parse_duration

__all__ = ["add_commands"]

if TYPE_CHECKING:
    from controller.cli import declarative as cli_declarative
    from controller.cli import k8s as cli_k8s
    from controller.cli import keys as cli_keys
    from controller.cli import migrate as cli_migrate
    from controller.cli import pull as cli_pull
    from controller.cli import remote as cli_remote
    from controller.cli import slot as cli_slot
    from controller.cli import stack as cli_stack

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]
else:  # imported when a command of theirs runs
    cli_declarative = LazyModule("controller.cli.declarative")
    cli_keys = LazyModule("controller.cli.keys")
    cli_migrate = LazyModule("controller.cli.migrate")
    cli_pull = LazyModule("controller.cli.pull")
    cli_k8s = LazyModule("controller.cli.k8s")
    cli_remote = LazyModule("controller.cli.remote")
    cli_slot = LazyModule("controller.cli.slot")
    cli_stack = LazyModule("controller.cli.stack")


def add_commands(tree: Tree, sub: SubParsers) -> None:
    """Every command of ``slotctl``, in the order ``--help`` lists them."""
    _stack_commands(tree, sub)
    _slot_commands(tree, sub)
    _model_commands(tree, sub)
    _key_commands(tree, sub)
    tree.declare(sub, _IMPORT)
    controller_commands(tree, sub)


# ====================================================================== stack


def _stack_validate(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    output(p)


def _stack_show(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    p.add_argument("-o", "--output", choices=["toml", "json"], default="toml")


def _stack_apply(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    p.add_argument(
        "--prune", action="store_true", help="remove slots this stack owns but no longer declares"
    )
    p.add_argument("--force", action="store_true", help="with --prune: remove pinned slots too")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument(
        "--wait", action="store_true", help="follow the running controller until converged"
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="no controller running: reconcile in this process, then exit",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")


def _stack_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    p.add_argument(
        "--exit-code", action="store_true", help="exit 1 when anything drifted (0 in sync, 2 error)"
    )
    p.add_argument("-o", "--output", choices=["text", "json", "json-patch"], default="text")


def _stack_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["toml", "quadlet", "crd"], default="toml")
    p.add_argument("--stack", help="only this stack")
    p.add_argument("--output-dir", type=Path, help="write files here instead of stdout")
    p.add_argument("--namespace", help="crd: metadata.namespace of the objects")
    p.add_argument(
        "--from",
        dest="from_paths",
        type=Path,
        action="append",
        metavar="PATH",
        help="crd: convert these stack files instead of the live config dir",
    )


def _stack_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, metavar="FILE.yaml", help="'-' reads stdin")
    p.add_argument("--stack", default="imported", help="stack name for CRs without one")
    p.add_argument("--output-dir", type=Path, help="write <stack>.toml files here")


_STACK: Final[tuple[Command, ...]] = (
    Command(
        "validate",
        "check stack files; exit 0 valid, 1 invalid, 2 usage or internal error",
        lambda a: cli_stack.cmd_validate(a),
        _stack_validate,
        examples=("slotctl stack validate stacks/ -o json",),
    ),
    Command(
        "show",
        "print the effective desired state (defaults and migrations applied)",
        lambda a: cli_stack.cmd_show(a),
        _stack_show,
        examples=("slotctl stack show stacks/workstation.toml -o json",),
    ),
    Command(
        "apply",
        "validate, plan and apply stack files",
        lambda a: cli_declarative.cmd_apply(a),
        _stack_apply,
        description="Validate stack files, print the plan (one line per action with its "
        "reason) and write it through the guard. Through the controller's API when one "
        "answers, else on the files. Exit 0 applied, 1 invalid or not converged, 2 error.",
        examples=(
            "slotctl stack apply stacks/ --dry-run",
            "slotctl stack apply stacks/ --prune --wait --timeout 120",
            "slotctl stack apply stacks/ --once      # no controller: converge here, exit",
        ),
    ),
    Command(
        "diff",
        "show drift between stack files and the host",
        lambda a: cli_declarative.cmd_diff(a),
        _stack_diff,
        description="Config drift (a unified diff per slot) and runtime drift (a server "
        "not running the declared config). -o json-patch is the config patch only (empty "
        "when in sync); runtime drift shows in text and json. Exit 0 in sync, 1 drift "
        "(with --exit-code), 2 error.",
        examples=("slotctl stack diff stacks/ --exit-code", "slotctl stack diff stacks/ -o json"),
    ),
    Command(
        "export",
        "the live desired state as stack files or units",
        lambda a: cli_k8s.cmd_export(a),
        _stack_export,
        examples=(
            "slotctl stack export --stack workstation > workstation.toml",
            "slotctl stack export --format quadlet --output-dir ~/.config/containers/systemd",
        ),
    ),
    Command(
        "import",
        "Model/Slot YAML (kubectl) -> stack TOML",
        lambda a: cli_k8s.cmd_import(a),
        _stack_import,
        examples=(
            "slotctl stack import examples/k8s/slots.yaml > stack.toml",
            "kubectl get models,slots -o yaml | slotctl stack import - --output-dir stacks/",
        ),
    ),
)


def _slot_list(p: argparse.ArgumentParser) -> None:
    output(p, ("table", "json", "yaml"))


def _slot_get(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")


def _slot_logs(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("--tail", type=int, default=100, help="lines to show first (default 100)")


def _slot_load(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be evicted and why (or why it would be refused); exit 1 "
        "when it would be refused",
    )
    p.add_argument("--wait", action="store_true", help="wait until the slot is ready")
    p.add_argument("--timeout", type=float, default=300.0, help="for --wait (seconds)")
    output(p)


def _slot_unload(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="needed for a pinned slot")
    output(p)


def _slot_swap(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("model", help="a model id of the catalogue")
    output(p)


def _slot_reset(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    output(p)


def _slot_hold(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument(
        "--for",
        dest="duration",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="how long: 90s, 15m, 2h, 1d (a bare number is seconds)",
    )
    output(p)


_SLOT: Final[tuple[Command, ...]] = (
    Command(
        "list",
        "every slot with its state",
        lambda a: cli_slot.cmd_list(a),
        _slot_list,
        description="Every slot: NAME STATE MODEL DEVICE PRIO PINNED RESIDENT MEMORY SINCE "
        "MESSAGE. A held slot (slot hold) shows 'held until HH:MM'.",
        examples=("slotctl slot list", "slotctl slot list -o json --server http://gpu:8800"),
    ),
    Command(
        "get",
        "one slot: config and observed state",
        lambda a: cli_slot.cmd_get(a),
        _slot_get,
        examples=("slotctl slot get chat", "slotctl slot get chat -o json"),
    ),
    Command(
        "logs",
        "the server's output",
        lambda a: cli_slot.cmd_logs(a),
        _slot_logs,
        description="The server's output (the last --tail lines); -f follows it until "
        "Ctrl-C, which exits 130 quietly. An unknown slot is an error (exit 2).",
        examples=("slotctl slot logs chat --tail 20", "slotctl slot logs chat -f"),
    ),
    Command(
        "load",
        "load a slot (through the API)",
        lambda a: cli_remote.cmd_slot_load(a),
        _slot_load,
        examples=("slotctl slot load coder --dry-run", "slotctl slot load coder --wait"),
    ),
    Command(
        "unload",
        "unload a slot: drain, then stop",
        lambda a: cli_remote.cmd_slot_unload(a),
        _slot_unload,
        examples=("slotctl slot unload coder", "slotctl slot unload chat --force   # pinned"),
    ),
    Command(
        "swap",
        "serve another catalogue model on a slot",
        lambda a: cli_remote.cmd_slot_swap(a),
        _slot_swap,
        examples=("slotctl slot swap chat qwen2.5-7b-instruct-q4",),
    ),
    Command(
        "reset",
        "clear the crash-loop breaker of a slot",
        lambda a: cli_remote.cmd_slot_reset(a),
        _slot_reset,
        examples=("slotctl slot reset chat",),
    ),
    Command(
        "hold",
        "batch lease: keep a slot loaded and unevictable for a while",
        lambda a: cli_remote.cmd_slot_hold(a),
        _slot_hold,
        examples=("slotctl slot hold chat --for 2h", "slotctl slot hold chat --for 1h30m"),
    ),
)


def _model_list(p: argparse.ArgumentParser) -> None:
    output(p, ("table", "json", "yaml"))


def _model_load(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_id", metavar="MODEL")
    p.add_argument("--wait", action="store_true", help="wait until it is loaded")
    p.add_argument("--timeout", type=float, default=300.0, help="for --wait (seconds)")
    output(p)


def _model_unload(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_id", metavar="MODEL")
    output(p)


def _model_pull(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_id", metavar="MODEL")
    p.add_argument("--wait", action="store_true", help="follow the pull (a progress bar)")
    p.add_argument("--timeout", type=float, default=3600.0, help="for --wait (seconds)")
    p.add_argument(
        "--refresh",
        action="store_true",
        help="ask the hub or URL whether present files are current",
    )
    local = p.add_argument_group(
        "without a controller (a pod's init container): the model on the command line"
    )
    local.add_argument("--source", help="pull this source here, in this process")
    local.add_argument("--sha256", help="the file's pinned digest (required for URLs)")
    local.add_argument("--revision", help="hf://: the branch, tag or commit")
    local.add_argument("--include", action="append", metavar="GLOB", help="hf://org/repo")
    local.add_argument("--exclude", action="append", metavar="GLOB", help="hf://org/repo")
    local.add_argument(
        "--models-dir", help="where the files land (default $SLOTCTL_MODELS_DIR, else /models)"
    )
    local.add_argument(
        "--termination-log", metavar="PATH", help="write a typed failure here (a pod's)"
    )
    output(p)


def _model_rm(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_id", metavar="MODEL")
    output(p)


def _model_footprint(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_id", metavar="MODEL")
    output(p)


def _model_gc(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    output(p)


_MODEL: Final[tuple[Command, ...]] = (
    Command(
        "list",
        "every catalogue model with its state and its files",
        lambda a: cli_remote.cmd_model_list(a),
        _model_list,
        description="Every catalogue model: MODEL KIND STATE MEMORY RESIDENT LOADABLE "
        "SLOTS, and its files: FILES (absent, partial n%, pulling n%, present, verified) "
        "and SIZE.",
        examples=("slotctl model list", "slotctl model list -o json"),
    ),
    Command(
        "pull",
        "pull a model's files ahead of any load",
        lambda a: cli_pull.cmd_model_pull(a),
        _model_pull,
        description="Pull a model's files into the models dir without loading it (a "
        "GitOps commit can prefetch everything it declares): refused at once when it "
        "does not fit the disk (model.insufficient_disk) or no source can pull it "
        "(model.file_missing). --wait follows it with a progress bar until done. With "
        "--source, pull in this process without a controller (a pod's init container). "
        "Exit 0 done or started, 1 --wait ended with the pull failed or out of time, 2 "
        "error.",
        examples=(
            "slotctl model pull qwen2.5-7b-q4 --wait",
            "slotctl model pull tiny --source hf://org/repo/tiny.gguf --models-dir /models",
        ),
    ),
    Command(
        "rm",
        "remove a model's pulled files",
        lambda a: cli_pull.cmd_model_rm(a),
        _model_rm,
        description="Remove a model's pulled files (and any partial ones) from the models "
        "dir. Refused while a slot serves or loads it (model.in_use), for a local path "
        "(not slotctl's to delete) and while it is being pulled.",
        examples=("slotctl model rm qwen2.5-7b-q4",),
    ),
    Command(
        "gc",
        "remove model files no declared model references",
        lambda a: cli_pull.cmd_model_gc(a),
        _model_gc,
        description="Remove model files no declared model references, least recently "
        "used first; never a pinned slot's model, never a pull in flight. --dry-run lists "
        "each entry with remove or keep and why.",
        examples=("slotctl model gc --dry-run", "slotctl model gc"),
    ),
    Command(
        "footprint",
        "what a model would hold, part by part, and what admission counts",
        lambda a: cli_remote.cmd_model_footprint(a),
        _model_footprint,
        description="For each slot that binds the model: the estimate read from its file "
        "(weights by tensor type, the KV cache at the slot's context, parallel sequences "
        "and cache types, compute buffers, what stays in host memory), the declared "
        "memory_gb, the most its server was seen to hold, and which one admission counts "
        "(declared, else the larger of estimated and observed).",
        examples=("slotctl model footprint qwen2.5-7b-q4", "slotctl model footprint tiny -o json"),
    ),
    Command(
        "load",
        "load a model on the best slot that serves it",
        lambda a: cli_remote.cmd_model_load(a),
        _model_load,
    ),
    Command(
        "unload",
        "unload every slot serving a model",
        lambda a: cli_remote.cmd_model_unload(a),
        _model_unload,
    ),
)


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
    tree.declare(cmds, _STACK)


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
    tree.declare(cmds, _SLOT)


def _model_commands(tree: Tree, sub: SubParsers) -> None:
    model = tree.add(
        sub,
        "model",
        "the model catalogue and its files (through the API)",
        examples=(
            "slotctl model list",
            "slotctl model pull demo-chat --wait",
            "slotctl model load demo-chat --wait",
            "slotctl model gc --dry-run",
        ),
    )
    cmds = tree.group(model, "model_cmd")
    tree.declare(cmds, _MODEL)
    tree.declare(sub, EVENTS)


def _key_create(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the key's name (lower-case letters, digits, - _ .)")
    p.add_argument(
        "--scope",
        choices=["inference", "read", "admin"],
        default="inference",
        help="inference: /v1 only; read: also every GET, events, metrics; admin: all",
    )
    p.add_argument(
        "--models", nargs="+", metavar="PATTERN", help="only these models (fnmatch patterns)"
    )
    p.add_argument("--priority", metavar="CLASS", help="its priority class (a declared one)")
    p.add_argument("--max-concurrency", type=int, metavar="N", help="requests in flight at once")
    p.add_argument("--rpm", type=int, metavar="N", help="requests a minute")
    p.add_argument("--expires", metavar="DURATION", help="e.g. 12h, 30d (default: never)")
    output(p, ("table", "json"))


def _key_list_options(p: argparse.ArgumentParser) -> None:
    output(p, ("table", "json"))


def _key_name(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    output(p, ("table", "json"))


_KEY: Final[tuple[Command, ...]] = (
    Command(
        "create",
        "create an API key (printed once)",
        lambda a: cli_keys.cmd_key_create(a),
        _key_create,
        description="Create an API key with a scope, the models it may use, its priority "
        "class and limits. The key is printed once, on stdout; keys.json keeps only its "
        "hash. The running controller accepts it at once.",
        examples=(
            "slotctl key create chat-ui --scope inference --priority interactive",
            "slotctl key create ci --priority batch --max-concurrency 8 --rpm 600 --expires 30d",
            "slotctl key create grafana --scope read",
        ),
    ),
    Command(
        "list",
        "the API keys with their scope, limits and last use (never a secret)",
        lambda a: cli_keys.cmd_key_list(a),
        _key_list_options,
    ),
    Command(
        "revoke",
        "revoke an API key (its requests in flight finish)",
        lambda a: cli_keys.cmd_key_revoke(a),
        _key_name,
    ),
)


def _key_commands(tree: Tree, sub: SubParsers) -> None:
    key = tree.add(
        sub,
        "key",
        "API keys: scopes, priority classes, limits (through the API, admin scope)",
        examples=("slotctl key create ci --priority batch", "slotctl key list"),
    )
    cmds = tree.group(key, "key_cmd")
    tree.declare(cmds, _KEY)


# ====================================================================== import


def _import(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, metavar="FILE", help="config.yaml or FILE.ini; '-': stdin")
    p.add_argument(
        "--from",
        dest="source_format",
        choices=["llama-swap", "llama-server-presets"],
        help="the source's format (default: .ini is presets, anything else llama-swap)",
    )
    p.add_argument("--stack", help="the stack's name (default: llama-swap / llama-router)")
    p.add_argument("--output", metavar="FILE.toml", help="write the stack here (default: stdout)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 and write nothing when any key is not carried over exactly "
        "(dropped, approximated or needing input)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="never ask the hub: -hf user/model:quant stays for you to name its file",
    )
    p.add_argument("--binary", help="presets: the llama-server binary (default: on the PATH)")
    p.add_argument(
        "-o", "--format", choices=["toml", "json"], default="toml", help="json: stack + report"
    )


_IMPORT: Final[tuple[Command, ...]] = (
    Command(
        "import",
        "a llama-swap config.yaml or llama.cpp router presets -> a stack file",
        lambda a: cli_migrate.cmd_import(a),
        _import,
        description="Turn a llama-swap config.yaml (models and their cmd, ttl, aliases, "
        "groups, hooks, apiKeys, macros) or a llama.cpp router presets file "
        "(llama-server --models-preset) into a stack file, checked as `stack validate` "
        "checks it. Every key not carried over exactly is listed on stderr with why "
        "(dropped, approximated, owned by slotctl, or needing your input); apiKeys become "
        "the `slotctl key create` commands to run (printed, not run). -hf "
        "user/model:quant is resolved against the hub's listing unless --offline. Exit 0 "
        "imported, 1 the stack does not validate or --strict refused it, 2 the source "
        "cannot be read.",
        examples=(
            "slotctl import ~/llama-swap/config.yaml --output stacks/llama-swap.toml",
            "slotctl import models.ini --strict --offline",
            "slotctl import config.yaml -o json | jq .findings",
        ),
        skip=("--server", "--token"),  # no controller: files in, a file out
    ),
)
