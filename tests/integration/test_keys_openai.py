"""The official ``openai`` client against a key's 429s (issue 23): it reads the typed
error (``RateLimitError`` with the code), and its retries wait for ``Retry-After`` instead
of hammering the router. The data plane, real demo servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.integration.test_keys import create
from tests.integration.test_router import Harness, chat, harness, model

__all__ = ["harness"]  # the fixture, imported for this module's tests


def _client(r_base: str, key: str, retries: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=r_base + "/v1", api_key=key, max_retries=retries, timeout=30)


async def test_the_openai_client_sees_a_typed_429_and_backs_off_on_retry_after(
    harness: Harness,
) -> None:
    r = await harness.start(
        [harness.slot("chat", "m-chat", "--tokens-per-second", "20")], [model("m-chat")]
    )
    key = await create(r, "one", max_concurrency=1)
    body = chat("m-chat", max_tokens=24, stream=True)  # ~1.2 s at 20 tokens a second
    headers = {"Authorization": f"Bearer {key}"}
    async with r.post("/v1/chat/completions", body, headers=headers) as held:
        assert held.status == 200
        await held.content.readline()  # the key's one request is in flight

        def no_retry() -> openai.RateLimitError:
            with _client(r.base, key, 0) as client, pytest.raises(openai.RateLimitError) as caught:
                client.chat.completions.create(
                    model="m-chat", messages=[{"role": "user", "content": "hi"}]
                )
            return caught.value

        error = await asyncio.to_thread(no_retry)
        assert error.status_code == 429 and error.code == "key.concurrency_limit"
        assert error.response.headers["retry-after"] == "1"

        def with_retries() -> tuple[float, str]:
            began = time.monotonic()
            with _client(r.base, key, 3) as client:
                answer = client.chat.completions.create(
                    model="m-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            return time.monotonic() - began, answer.choices[0].message.content or ""

        retried = asyncio.ensure_future(asyncio.to_thread(with_retries))
        await held.read()  # the held stream ends: the key's place frees
    took, text = await retried
    assert text  # answered after its retries
    assert took >= 0.9  # it waited for Retry-After (1 s), not its own short backoff
    async with r.get("/metrics") as resp:
        metrics = await resp.text()
    refused = [
        line
        for line in metrics.splitlines()
        if line.startswith("slotctl_key_requests_total") and 'key="one"' in line and "429" in line
    ]
    count = float(refused[0].rsplit(" ", 1)[1])
    assert 2 <= count <= 3, refused  # the first refusal, and one a second while held
