"""Cached prompt tokens (issue 38, item 5): what the router reads from an answer's tail
(OpenAI's ``usage.prompt_tokens_details.cached_tokens``, llama.cpp's ``timings.cache_n``)
and the demo server's prefix cache that reports them."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from controller.demo.prefixcache import PrefixCache
from controller.router.context import cached_of


def test_openai_usage_details() -> None:
    tail = json.dumps(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 2006,
                "completion_tokens": 300,
                "total_tokens": 2306,
                "prompt_tokens_details": {"cached_tokens": 1920},
            },
        }
    ).encode()
    assert cached_of(b'data: {"x": 1}\n\ndata: ' + tail + b"\n\ndata: [DONE]\n\n") == (2006, 1920)


def test_llama_cpp_timings() -> None:
    tail = b'{"content": "hi", "timings": {"cache_n": 236, "prompt_n": 1, "prompt_ms": 30.9}}'
    assert cached_of(tail) == (237, 236)


def test_usage_without_details_and_no_usage_at_all() -> None:
    assert cached_of(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 1}}') is None
    assert cached_of(b'{"choices": []}') is None
    assert cached_of(b"") is None


def test_the_demo_cache_holds_the_longest_prefix_it_served() -> None:
    cache = PrefixCache(2)
    assert cache.lookup(("a", "b", "c")) == 0
    cache.store(("a", "b", "c", "x"))
    assert cache.lookup(("a", "b", "c", "x", "d")) == 4  # the next turn of it
    cache.store(("a", "b", "c", "x", "d", "y"))  # replaces the sequence it extends
    cache.store(("q",))
    assert cache.lookup(("a", "b", "c", "x", "d", "y", "e")) == 6
    cache.store(("r",))
    cache.store(("s",))  # two entries: the oldest went
    assert cache.lookup(("a", "b", "z")) == 0
    assert PrefixCache(0).lookup(("a",)) == 0


words = st.lists(st.sampled_from("abc"), max_size=8).map(tuple)


@given(st.lists(words, max_size=12), words)
def test_the_cached_prefix_is_a_real_common_prefix(
    served: list[tuple[str, ...]], prompt: tuple[str, ...]
) -> None:
    cache = PrefixCache(4)
    for seq in served:
        cache.store(seq)
    n = cache.lookup(prompt)
    assert 0 <= n <= len(prompt)
    if n:
        assert any(seq[:n] == prompt[:n] for seq in served[-4:] + served)
