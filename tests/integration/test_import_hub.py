"""``slotctl import`` resolves ``-hf user/model[:quant]`` through the real hub client
(``huggingface_hub``) against the local hub (``hubserver``): llama-server's rule, the
quant case-insensitive, ``Q4_K_M`` by default; a repository the hub does not have is
``needs-input``, and the other models still resolve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.hubserver import HubServer

REPO = Path(__file__).resolve().parents[2]

CONFIG = """
models:
  q8:
    cmd: llama-server -hf org/tiny-GGUF:q8_0 --port ${PORT}
  default:
    cmd: llama-server -hf org/tiny-GGUF --port ${PORT}
  named:
    cmd: llama-server -hf org/tiny-GGUF -hff sub/other.gguf --port ${PORT}
  missing:
    cmd: llama-server -hf org/absent-GGUF:Q4_K_M --port ${PORT}
"""


def test_hf_quants_resolve_through_the_hub_client(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    with HubServer() as hub:
        hub.add_repo(
            "org/tiny-GGUF",
            {
                "README.md": b"tiny",
                "tiny-Q4_K_M.gguf": b"q4",
                "tiny-Q8_0.gguf": b"q8",
                "mmproj-tiny-F16.gguf": b"mm",
            },
        )
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HF_ENDPOINT": hub.endpoint,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HOME": str(tmp_path / "hf"),
        }
        result = subprocess.run(
            [sys.executable, "-m", "controller", "import", str(config), "-o", "json"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    stack = data["stack"]
    assert 'source = "hf://org/tiny-GGUF/tiny-Q8_0.gguf"' in stack
    assert 'source = "hf://org/tiny-GGUF/tiny-Q4_K_M.gguf"' in stack
    assert 'source = "hf://org/tiny-GGUF/sub/other.gguf"' in stack
    findings = {(f["kind"], f["key"]) for f in data["findings"]}
    assert ("approximated", "models.q8.cmd: -hf") in findings
    assert ("needs-input", "models.q8.cmd: -hf") in findings  # the projector: mmproj
    assert ("needs-input", "models.missing.cmd: -hf") in findings
    assert not data["problems"]
