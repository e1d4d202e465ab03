"""A pull in a process of its own (kill -9 and offline tests, bench/pull.py).

``python -m tests.integration.pull_child MODELS_DIR STATE_DIR SOURCE [SHA256]`` pulls one
model with :class:`controller.modelfiles.pull.ModelFiles` as the controller will: the hub
endpoint and token come from the environment (``HF_ENDPOINT``, ``HF_TOKEN``,
``HF_HUB_OFFLINE``), as huggingface_hub reads them. It prints one JSON line: the outcome,
or the typed error's ``code`` and details.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from controller.model.errors import SlotctlError
from controller.modelfiles.pull import ModelFiles
from controller.spec.schema import ModelSpec


async def main(models: Path, state: Path, source: str, sha256: str | None) -> int:
    files = ModelFiles(models, state, margin_bytes=0)
    model = ModelSpec(id="child", source=source, sha256=sha256)
    try:
        outcome = await files.ensure(model)
    except SlotctlError as err:
        print(json.dumps(err.to_dict()["error"]), flush=True)
        return 1
    print(json.dumps({**asdict(outcome), "path": str(outcome.path)}), flush=True)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(
        asyncio.run(main(Path(args[0]), Path(args[1]), args[2], args[3] if len(args) > 3 else None))
    )
