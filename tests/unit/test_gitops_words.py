"""GitOps says what ``stack validate`` says (issue 40, item 14): a problem's hint (the
"did you mean" of a misspelt key) was dropped from up's output."""

from __future__ import annotations

from pathlib import Path

from controller.daemon.gitops import GitOps


def test_an_invalid_stack_dir_keeps_the_did_you_mean_hint(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    (stacks / "s.toml").write_text(
        '[stack]\nname = "s"\n[[slot]]\nname = "a"\nprovider = "demo"\nprioirty = 5\n'
    )
    said: list[str] = []
    assert GitOps(stacks, tmp_path / "config", said.append).apply() is False
    line = next(x for x in said if "slot.unknown_key" in x)
    assert "unknown key 'prioirty'" in line and "did you mean 'priority'?" in line, said
