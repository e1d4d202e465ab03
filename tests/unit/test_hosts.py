"""The Host policy against DNS rebinding (controller/api/hostcheck.py, issue 26): pure."""

from __future__ import annotations

import pytest

from controller.api.hostcheck import HostPolicy, host_name


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("Example.COM:8800", "example.com"),
        ("example.com.", "example.com"),
        ("[::1]:8800", "::1"),
        ("[fe80::1]", "fe80::1"),
        ("::1", "::1"),
        ("10.0.0.1:80", "10.0.0.1"),
        ("", ""),
    ],
)
def test_host_name_drops_the_port_brackets_case_and_root_dot(value: str, name: str) -> None:
    assert host_name(value) == name


def test_the_default_policy_takes_addresses_localhost_and_the_listen_host() -> None:
    policy = HostPolicy("gpu-box")
    for host in (None, "", "127.0.0.1:1", "10.9.8.7", "[::1]:8800", "localhost:8800", "GPU-BOX"):
        assert policy.allows(host), host
    for host in ("evil.example", "gpu-box.evil.example", "localhost.evil", "127.0.0.1.nip.io"):
        assert not policy.allows(host), host


def test_configured_names_domains_and_any() -> None:
    policy = HostPolicy("127.0.0.1", ["models.lan", ".corp.example", " "])
    assert policy.allows("models.lan:1") and policy.allows("corp.example")
    assert policy.allows("a.b.corp.example")
    assert not policy.allows("xcorp.example") and not policy.allows("models.lan.evil")
    assert HostPolicy("127.0.0.1", ["*"]).allows("anything.example")


def test_raw_values_are_judged_once_and_the_memo_stays_bounded() -> None:
    policy = HostPolicy("127.0.0.1")
    assert policy.allows_raw(b"127.0.0.1:8800") and not policy.allows_raw(b"evil.example")
    assert policy._seen == {b"127.0.0.1:8800": True, b"evil.example": False}
    for i in range(3000):
        policy.allows_raw(b"h%d.example" % i)
    assert len(policy._seen) <= 1024
