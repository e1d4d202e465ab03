"""One word, one meaning in the docs (issue 40, item 14): "pinned" meant both "never
evicted" (the ``pinned`` key) and "bound to a GPU" (``device = "gpu:1"``). It means the
first only; a slot's fixed GPU is *bound to* it. The user docs (README, docs/, not the
design notes' history) keep it so."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_PIN = re.compile(
    r"\b(pin(s|ned|ning)?\s+(to|it|the pod|its pod|a GPU|on)\b|unpinned slot|per pinned GPU)",
    re.IGNORECASE,
)


def test_pinned_means_never_evicted_only() -> None:
    said = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8").replace("\n", " ")
        for match in GPU_PIN.finditer(text):
            said.append(f"{path.name}: ...{text[max(0, match.start() - 40) : match.end() + 20]}...")
    assert said == []
