"""The trust boundary (issue 26, item 5): the controller's allowlists, enforced by the
guard on every writer of slot config (one slot: the API; a set: stack apply), failing
closed on an unreadable ``controller.toml``; the root warning; the private state dir.
See docs/reliability.md, "Security model"."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from controller.daemon.main import root_warning
from controller.model.errors import ServerNotAllowed, SlotConfigError
from controller.spec.guard import write_slot_config, write_slot_configs
from controller.spec.schema import SlotSpec
from controller.store.lock import ensure_private_dir


def settings(config: Path, text: str) -> None:
    config.mkdir(parents=True, exist_ok=True)
    (config / "controller.toml").write_text(text)


def payload(name: str, port: int, **server: Any) -> dict[str, Any]:
    return {"name": name, "provider": "openai-compatible", "port": port, "server": server}


def slot_files(config: Path) -> list[str]:
    return sorted(p.name for p in (config / "slots").glob("*.toml"))


def test_allowed_binaries_bound_server_binary_and_cmd(tmp_path: Path) -> None:
    config = tmp_path / "config"
    settings(config, 'allowed_binaries = ["/usr/bin/llama-server", "vllm"]\n')
    for key, server in (
        ("server.binary", {"binary": "/bin/sh"}),
        ("server.cmd", {"cmd": ["/bin/sh", "-c", "id"]}),
        ("server.cmd", {"binary": "vllm", "cmd": ["/usr/bin/llama-server/../../sh"]}),
    ):
        with pytest.raises(ServerNotAllowed) as caught:
            write_slot_config(config, payload("s", 9001, **server), create=True)
        assert caught.value.keys == [key]
        assert caught.value.http_status == 403 and caught.value.code == "slot.server_not_allowed"
        assert "allowed_binaries" in caught.value.message
        assert slot_files(config) == []  # refused: nothing written
    write_slot_config(config, payload("a", 9001, binary="vllm"), create=True)
    write_slot_config(config, payload("b", 9002, cmd=["/usr/bin/llama-server", "-m", "x"]))
    # A provider's own default binary is the controller's choice, not the file's.
    write_slot_config(config, {"name": "c", "provider": "demo", "port": 9003})
    assert slot_files(config) == ["a.toml", "b.toml", "c.toml"]


def test_allowed_images_take_exact_names_and_prefix_patterns(tmp_path: Path) -> None:
    config = tmp_path / "config"
    settings(config, 'allowed_images = ["vllm/vllm-openai:v0.9.0", "ghcr.io/ggml-org/*"]\n')
    write_slot_config(config, payload("a", 9001, image="vllm/vllm-openai:v0.9.0"))
    write_slot_config(config, payload("b", 9002, image="ghcr.io/ggml-org/llama.cpp:server"))
    for image in ("vllm/vllm-openai:latest", "ghcr.io/evil/llama.cpp:server", "alpine"):
        with pytest.raises(ServerNotAllowed) as caught:
            write_slot_config(config, payload("c", 9003, image=image))
        assert caught.value.keys == ["server.image"]
    assert slot_files(config) == ["a.toml", "b.toml"]


def test_stack_apply_is_refused_whole_for_one_server_not_allowed(tmp_path: Path) -> None:
    config = tmp_path / "config"
    settings(config, 'allowed_binaries = ["vllm"]\n')
    good = SlotSpec.model_validate({**payload("a", 9001, binary="vllm"), "autoload": False})
    bad = SlotSpec.model_validate({**payload("b", 9002, binary="/tmp/x"), "autoload": False})
    writes = [(s.model_dump(mode="json", exclude_unset=True), "st") for s in (good, bad)]
    with pytest.raises(ServerNotAllowed, match="'/tmp/x'"):
        write_slot_configs(config, writes, final=[good, bad], catalogue={})
    assert slot_files(config) == []
    write_slot_configs(config, writes[:1], final=[good], catalogue={})
    assert slot_files(config) == ["a.toml"]


def test_an_invalid_controller_toml_fails_closed(tmp_path: Path) -> None:
    """It may be hiding the allowlists: no slot is written until it is fixed."""
    config = tmp_path / "config"
    settings(config, 'allowed_binaries = "vllm"\n')  # a string, not a list
    with pytest.raises(SlotConfigError, match=r"controller\.toml is invalid") as caught:
        write_slot_config(config, payload("a", 9001, binary="/bin/sh"))
    assert not isinstance(caught.value, ServerNotAllowed)
    assert caught.value.problems and caught.value.problems[0]["key"] == "allowed_binaries"
    assert slot_files(config) == []
    settings(config, "")
    write_slot_config(config, payload("a", 9001, binary="/bin/sh"))  # no allowlist: any


def test_the_root_warning_is_for_root_on_the_process_runtime_only() -> None:
    warning = root_warning(0, "process")
    assert warning is not None and "runs as root with the process runtime" in warning
    assert "allowed_binaries" in warning and "Security model" in warning
    assert root_warning(1000, "process") is None
    assert root_warning(0, "docker") is None and root_warning(0, "kubernetes") is None


def test_the_state_dir_is_made_private(tmp_path: Path) -> None:
    fresh = tmp_path / "a" / "state"
    assert ensure_private_dir(fresh) is False  # created 0700: nothing to tighten
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    assert ensure_private_dir(shared) is True
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700
    assert ensure_private_dir(shared) is False
