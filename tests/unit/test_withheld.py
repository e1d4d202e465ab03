"""What a key below ``admin`` may not read (issue 40, item 2): the pure rules of
:mod:`controller.access.withheld`; the API's use of them is tested in
``tests/integration/test_keys.py::test_a_read_key_sees_no_secrets_and_admin_sees_them``."""

from __future__ import annotations

from controller.access.keys import TOKEN_PRINCIPAL, Principal, Scope
from controller.access.withheld import (
    REDACTED,
    sees_secrets,
    withhold_argv,
    withhold_slot,
    withhold_spec,
    withhold_text,
)

R = REDACTED


def test_only_admin_sees_secrets() -> None:
    assert sees_secrets(TOKEN_PRINCIPAL)
    assert sees_secrets(Principal("ops", Scope.ADMIN))
    assert not sees_secrets(Principal("grafana", Scope.READ))
    assert not sees_secrets(Principal("app", Scope.INFERENCE))
    assert not sees_secrets(None)  # fails closed


def test_secret_flags_lose_their_values_in_both_forms() -> None:
    argv = ["--api-key", "sk-1", "--hf-token=hf_2", "--password", "p", "--auth-bearer", "b"]
    want = ["--api-key", R, f"--hf-token={R}", "--password", R, "--auth-bearer", R]
    assert withhold_argv(argv) == want
    plain = ["--tokens-per-second", "50", "--max-num-batched-tokens", "8192", "--tokenizer", "t"]
    assert withhold_argv(plain) == plain  # words, not substrings
    assert withhold_argv(["--api-key", "--port", "8000"]) == ["--api-key", "--port", "8000"]


def test_urls_lose_their_credentials_and_query() -> None:
    text = "pulling https://bot:pw@hub.example/x.gguf?sig=abc and s3://k@b/p"
    assert withhold_text(text) == f"pulling https://{R}@hub.example/x.gguf?{R} and s3://{R}@b/p"
    assert withhold_text("hf://org/repo/file.gguf") == "hf://org/repo/file.gguf"
    assert withhold_text("no url here") == "no url here"


def test_a_spec_and_a_slot_view_are_withheld_without_changing_the_original() -> None:
    spec = {
        "name": "chat",
        "server": {
            "env": {"HF_TOKEN": "hf_x", "OMP_NUM_THREADS": "4"},
            "extra_args": ["--api-key", "sk"],
            "cmd": ["vllm", "serve", "--hf-token", "t"],
        },
    }
    out = withhold_spec(spec)
    assert out["server"]["env"] == {"HF_TOKEN": R, "OMP_NUM_THREADS": R}
    assert out["server"]["extra_args"] == ["--api-key", R]
    assert out["server"]["cmd"] == ["vllm", "serve", "--hf-token", R]
    assert spec["server"]["env"]["HF_TOKEN"] == "hf_x"  # a copy
    view = {"name": "chat", "message": "pulling https://u:p@h/f?s=1", "spec": spec}
    shown = withhold_slot(view)
    assert shown["message"] == f"pulling https://{R}@h/f?{R}"
    assert shown["spec"]["server"]["env"]["HF_TOKEN"] == R
    assert withhold_slot({"name": "x"}) == {"name": "x"}
