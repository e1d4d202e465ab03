"""The ``slotctl`` command line: the top-level parser over the command table.

Sits under ``cli.main`` and above the command modules (``cli.stack``, ``cli.slot``,
``cli.remote``, ``cli.declarative``, ``cli.control``, ``cli.export``, ``cli.k8s``). It
imports none of them: the command table (``cli.commands``) names each command's function
as ``"module:function"``, imported only when that command runs, so ``slotctl --help``
and the light commands never pay for aiohttp, the daemon or the spec models. The global
options and the help machinery are ``cli.flags``.
"""

from __future__ import annotations

import argparse
import os
from typing import Final

from controller import __version__
from controller.cli.commands import add_commands
from controller.cli.flags import Formatter, HelpOf, Tree, add_globals, examples_text

__all__ = ["EXIT_CODES", "build_parser"]

EXIT_CODES: Final = (
    "exit codes: 0 success; 1 the command's negative answer (invalid stack, drift with "
    "--exit-code, not converged, a refused dry run); 2 usage or any error; 130 interrupted "
    "(Ctrl-C)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotctl",
        description="Declarative lifecycle controller for local model-serving slots: "
        "keeps llama.cpp / vLLM / speech servers converged with TOML stack files.",
        epilog=examples_text(
            "slotctl up examples/quickstart           # run the controller (GitOps on a dir)",
            "slotctl slot list                        # every slot, state, model, memory",
            "slotctl slot load chat --dry-run         # what a load would evict, and why",
            "slotctl stack diff stacks/ --exit-code   # 0 in sync, 1 drift, 2 error",
            "slotctl slot list --server http://gpu-box:8800 --token $TOKEN",
        )
        + "\n\n"
        + EXIT_CODES
        + "\n\nGlobal options are accepted before or after the command.",
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"slotctl {__version__}")
    add_globals(parser, top=True)
    parser.set_defaults(func=HelpOf(parser), runtime_given="SLOTCTL_RUNTIME" in os.environ)
    tree = Tree()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    add_commands(tree, sub)
    tree.finish()
    return parser
