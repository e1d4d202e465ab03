"""Shared helpers for integration tests: free ports, demo launch specs, probing."""

from __future__ import annotations

import socket
from collections.abc import Sequence

import aiohttp

from controller.probes.readiness import ProbeResult, probe_once, wait_ready
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.runtime.base import LaunchSpec, Runtime
from controller.spec.schema import ModelSpec, SlotSpec


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (held together while picked)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def demo_launch(
    name: str,
    extra_args: Sequence[str] = (),
    *,
    port: int | None = None,
    runtime: str = "process",
    image: str | None = None,
    slot_type: str = "llm",
    stack: str = "test",
) -> LaunchSpec:
    server: dict[str, object] = {"extra_args": list(extra_args)}
    if image:
        server["image"] = image
    slot = SlotSpec.model_validate(
        {
            "name": name,
            "provider": "demo",
            "port": port or free_port(),
            "model": {"default": f"{name}-model"},
            "device": "cpu",
            "type": slot_type,
            "server": server,
        }
    )
    model = ModelSpec(id=f"{name}-model", source=f"demo://{name}")
    return build_launch(slot, model, BuildContext(runtime=runtime, stack=stack))


async def probe_until_settled(
    runtime: Runtime, launch: LaunchSpec, *, warmup_timeout_s: float = 20.0
) -> ProbeResult:
    async with aiohttp.ClientSession() as session:

        async def alive() -> bool:
            return (await runtime.inspect(launch.slot)).running

        return await wait_ready(
            lambda: probe_once(session, launch.endpoint, launch.probe),
            alive=alive,
            warmup_timeout_s=warmup_timeout_s,
        )
