"""Retired prefixes: finished requests offer their KV back so a shared prefix skips prefill.

Entries are whole token sequences with one KV row per layer, under a byte budget with LRU
eviction. A lookup returns the longest stored prefix of a prompt, capped at one token
short of the prompt, since the prefill must still produce the last position's logits.
Entries are grouped by their first token: only those can share a prefix with a prompt, and a
model with little KV a token keeps thousands of entries (the built-in model's 256 MiB holds
65,536 tokens), which a scan of all of them per request made a served step's largest cost.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import mlx.core as mx

from gmlx.cache.ragged import RaggedKVCache


@dataclass(frozen=True)
class _Entry:
    token_ids: tuple[int, ...]
    keys: tuple[mx.array, ...]  # per layer (1, H, n, D)
    values: tuple[mx.array, ...]
    nbytes: int
    stored_dtype: mx.Dtype | None  # the offering caches' KV type, which a restored cache keeps


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()
        # first token -> the keys starting with it, least recently used first (as in _entries)
        self._by_first: dict[int, dict[tuple[int, ...], None]] = {}
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_hit_tokens = 0

    def fetch(self, prompt: list[int]) -> tuple[list[RaggedKVCache] | None, int]:
        """Caches holding the longest stored prefix of `prompt`, and its length."""
        best, best_len = None, 0
        for key in self._by_first.get(prompt[0], ()) if prompt else ():
            n = _common_prefix(key, prompt, limit=len(prompt) - 1)
            if n > best_len:
                best, best_len = self._entries[key], n
        if best is None:
            self.num_misses += 1
            return None, 0
        self._entries.move_to_end(best.token_ids)
        same_first = self._by_first[best.token_ids[0]]
        same_first[best.token_ids] = same_first.pop(best.token_ids)
        self.num_hits += 1
        self.num_hit_tokens += best_len
        caches = []
        for keys, values in zip(best.keys, best.values):
            cache = RaggedKVCache(1, stored_dtype=best.stored_dtype)
            cache.keys, cache.values = keys[:, :, :best_len, :], values[:, :, :best_len, :]
            cache.lengths = [best_len]
            caches.append(cache)
        return caches, best_len

    def offer(self, token_ids: list[int], caches: list[RaggedKVCache], row: int) -> None:
        """Store row `row` of `caches`, whose first len(token_ids) positions hold token_ids."""
        num_tokens = min(len(token_ids), caches[0].lengths[row])
        if num_tokens <= 1:
            return
        # A row larger than the whole budget is not kept: know it before copying (an evicted
        # row of a large model can be hundreds of MiB).
        nbytes = num_tokens * sum(c.keys.shape[1] * c.keys.shape[3] * c.keys.itemsize
                                  + c.values.shape[1] * c.values.shape[3] * c.values.itemsize for c in caches)
        if nbytes > self.max_bytes:
            return
        key = tuple(token_ids[:num_tokens])
        # Copies, so an entry neither pins the batch buffer nor sees later writes to it (the
        # one-node layers write a cache's buffers in place). mx.contiguous would alias a slice
        # that is already contiguous; mx.array copies.
        keys = tuple(mx.array(c.keys[row : row + 1, :, :num_tokens, :]) for c in caches)
        values = tuple(mx.array(c.values[row : row + 1, :, :num_tokens, :]) for c in caches)
        mx.eval(keys, values)
        assert nbytes == sum(a.nbytes for a in keys + values)
        # An entry that is a prefix of the new one (the same sequence included) is redundant: it
        # goes, and the new one comes in as the most recent.
        for old in [k for k in self._by_first.get(key[0], ()) if len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(old)
        self._entries[key] = _Entry(key, keys, values, nbytes, caches[0].stored_dtype)
        self._by_first.setdefault(key[0], {})[key] = None
        self.num_bytes += nbytes
        while self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def stats(self) -> dict:
        return {
            "prompt_cache_entries": len(self._entries),
            "prompt_cache_bytes": self.num_bytes,
            "prompt_cache_hits": self.num_hits,
            "prompt_cache_misses": self.num_misses,
            "prompt_cache_hit_tokens": self.num_hit_tokens,
        }

    def _drop(self, key: tuple[int, ...]) -> None:
        self.num_bytes -= self._entries.pop(key).nbytes
        same_first = self._by_first[key[0]]
        del same_first[key]
        if not same_first:
            del self._by_first[key[0]]


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
