"""The demo server's prefix cache: what an engine's KV cache reuses, modelled so tests and
benchmarks can see a router keep a replica's cache warm (issue 38). Standard library only.

An engine keeps the KV of the sequences it served (llama.cpp: per server slot, the last
prompt and its answer; vLLM's automatic prefix caching: blocks by hash) and evaluates a
new prompt only past the longest prefix it already holds. Here a "token" is a
whitespace-separated word (:func:`controller.demo.generate.count_tokens`); the cache holds
the last ``entries`` sequences (each a prompt followed by the answer generated for it),
least recently used out first, and a prompt's cached tokens are its longest common
prefix with any of them. Per server: two replicas of one model keep two caches.

The answer says it as the engines do: ``usage.prompt_tokens_details.cached_tokens``
(OpenAI's Chat Completions) and ``timings.cache_n`` / ``timings.prompt_n`` (llama.cpp's
server). Thread-safe: the demo serves each request on a thread of its own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["PrefixCache"]


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The last ``entries`` token sequences a server evaluated (0: no cache)."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._held: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # prompt tokens served from the cache, in all
        self.prompt = 0  # prompt tokens seen, in all

    def lookup(self, prompt: tuple[str, ...]) -> int:
        """The tokens of ``prompt`` the cache holds (its longest cached prefix)."""
        if not self.entries:
            return 0
        with self._lock:
            best, held = 0, None
            for seq in self._held:
                n = _common(seq, prompt)
                if n > best:
                    best, held = n, seq
            if held is not None:
                self._held.move_to_end(held)
            self.hits += best
            self.prompt += len(prompt)
            return best

    def store(self, sequence: tuple[str, ...]) -> None:
        """``sequence`` (a prompt and its answer) evaluated: held, the oldest out."""
        if not self.entries or not sequence:
            return
        with self._lock:
            self._held[sequence] = None
            self._held.move_to_end(sequence)
            # a sequence that extends a held one replaces it (the same KV, grown)
            for seq in [s for s in self._held if s is not sequence]:
                if len(seq) <= len(sequence) and sequence[: len(seq)] == seq:
                    del self._held[seq]
            while len(self._held) > self.entries:
                self._held.popitem(last=False)
