"""Stack apply is O(N) and stack files are size-limited (issue 13, item 5).

``apply_to_config`` reads the config dir once and writes its slots through the guard's
batch writer (one lock, one cross-slot check, each file parsed once); it used to re-read
and re-parse the whole config dir at every slot write (O(N²)). The figures are in
``bench/apply_scale.py``; here the number of parses is counted. A stack or config file
over ``MAX_FILE_BYTES`` is refused unparsed with ``stack.too_large``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import controller.spec.configdir as configdir
from controller.model.errors import SlotConfigError
from controller.reconcile.apply import apply_to_config
from controller.spec.configdir import read_config_dir
from controller.spec.loader import MAX_FILE_BYTES, DesiredState, load_stack_texts, load_stacks


def stack(n: int, *, name: str = "scale", base_port: int = 20000, first: int = 0) -> str:
    out = [f'[stack]\nname = "{name}"\n']
    for i in range(first, first + n):
        out.append(f'[[model]]\nid = "m{i}"\nsource = "demo://m{i}"\n')
    for i in range(first, first + n):
        out.append(
            f'[[slot]]\nname = "s{i}"\nprovider = "demo"\nmodel.default = "m{i}"\n'
            f'device = "cpu"\nport = {base_port + i}\nautoload = false\n'
        )
    return "\n".join(out)


def state_of(text: str) -> DesiredState:
    report = load_stack_texts([("s.toml", text)])
    assert report.ok and report.state is not None, report.errors
    return report.state


def test_apply_parses_each_config_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config"
    apply_to_config(state_of(stack(40, name="old")), config, prune=True)
    parses: list[str] = []
    real = configdir.parse_toml_file

    def counting(path: Path) -> object:
        parses.append(path.name)
        return real(path)

    monkeypatch.setattr(configdir, "parse_toml_file", counting)
    changed = apply_to_config(state_of(stack(40, name="new", first=40)), config, prune=True)
    assert len(changed) == 41  # the catalogue and 40 slots
    # One read of the config dir before writing: 40 slot files and the catalogue (the
    # per-slot writes used to re-read the whole dir each time: ~40 x 60 parses).
    assert len(parses) <= 41 + 1, len(parses)
    assert len(read_config_dir(config).slots) == 80


def test_batch_apply_is_all_or_nothing_and_judges_the_set(tmp_path: Path) -> None:
    config = tmp_path / "config"
    apply_to_config(state_of(stack(2)), config, prune=True)
    before = {p.name: p.read_bytes() for p in (config / "slots").iterdir()}
    # Two slots swapping ports is legal as a set (never as two single writes).
    swapped = stack(2).replace("port = 20000", "port = X").replace("port = 20001", "port = 20000")
    assert apply_to_config(
        state_of(swapped.replace("port = X", "port = 20001")), config, prune=True
    )
    snapshot = read_config_dir(config)
    assert (snapshot.slots["s0"].spec.port, snapshot.slots["s1"].spec.port) == (20001, 20000)
    # A set with a conflict (another stack's slots, one on s1's port) writes nothing.
    after_swap = {p.name: p.read_bytes() for p in (config / "slots").iterdir()}
    assert after_swap != before
    clash = state_of(stack(2, name="other", first=8, base_port=20000 - 9))
    with pytest.raises(SlotConfigError):
        apply_to_config(clash, config, prune=True)
    assert {p.name: p.read_bytes() for p in (config / "slots").iterdir()} == after_swap


def test_an_oversized_stack_file_is_refused_unparsed(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text(stack(1) + "# " + "x" * MAX_FILE_BYTES + "\n")
    report = load_stacks([big])
    assert not report.ok
    assert [(p.code, p.file) for p in report.errors] == [("stack.too_large", str(big))]
    assert "1024 KiB" in report.errors[0].message
    # Just under the limit loads.
    fits = tmp_path / "fits.toml"
    text = stack(1)
    fits.write_text(text + "#" * (MAX_FILE_BYTES - len(text) - 1) + "\n")
    assert load_stacks([fits]).ok


def test_an_oversized_stack_text_is_refused_unparsed() -> None:
    report = load_stack_texts([("api.toml", stack(1) + "#" + "é" * (MAX_FILE_BYTES // 2))])
    assert [p.code for p in report.errors] == ["stack.too_large"]
