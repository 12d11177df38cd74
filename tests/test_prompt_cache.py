"""The prompt cache against a plain scan of every entry: random offers and fetches of token
sequences that share prefixes (and first tokens) give the same prefix lengths, the same KV
bits, the same entries and bytes, and the same LRU evictions; a row over the whole budget is
refused before it is copied."""

from __future__ import annotations

import random

import mlx.core as mx

from gmlx.cache.prompt_cache import PromptCache
from gmlx.cache.ragged import RaggedKVCache, make_ragged_cache

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 2, 4
TOKEN_BYTES = NUM_LAYERS * 2 * NUM_HEADS * HEAD_DIM * 4  # float32 keys and values, every layer


def _caches_for(token_ids: list[int]) -> list[RaggedKVCache]:
    """One row per layer whose KV at position p is a function of the tokens up to p (as a causal
    model's is): a prefix's KV is the same whichever sequence it came from."""
    code = mx.array([hash(tuple(token_ids[: p + 1])) % 1000 for p in range(len(token_ids))], dtype=mx.float32)
    caches = []
    for layer in range(NUM_LAYERS):
        kv = mx.broadcast_to(code[None, None, :, None] + layer, (1, NUM_HEADS, len(token_ids), HEAD_DIM))
        cache = RaggedKVCache(1)
        cache.keys, cache.values = mx.array(kv), mx.array(kv + 0.5)
        cache.lengths = [len(token_ids)]
        caches.append(cache)
    return caches


class _ScanAll:
    """What the cache must do, written as the plain scan: every entry, least recently used first."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.entries = max_bytes, []  # (token ids), least recently used first

    def fetch(self, prompt: list[int]) -> int:
        best, best_len = None, 0
        for key in self.entries:
            n = 0
            while n < min(len(key), len(prompt) - 1) and key[n] == prompt[n]:
                n += 1
            if n > best_len:
                best, best_len = key, n
        if best is not None:
            self.entries.remove(best)
            self.entries.append(best)
        return best_len

    def offer(self, token_ids: list[int]) -> None:
        key = tuple(token_ids)
        if len(key) <= 1 or len(key) * TOKEN_BYTES > self.max_bytes:
            return
        self.entries = [k for k in self.entries if key[: len(k)] != k] + [key]
        while sum(len(k) for k in self.entries) * TOKEN_BYTES > self.max_bytes:
            self.entries.pop(0)


def test_random_offers_and_fetches_match_a_scan_of_every_entry():
    rng = random.Random(17)
    stems = [[rng.randrange(40) for _ in range(rng.randint(1, 12))] for _ in range(6)]  # shared starts

    def sequence() -> list[int]:
        stem = rng.choice(stems)[: rng.randint(1, 12)] if rng.random() < 0.7 else []
        return stem + [rng.randrange(40) for _ in range(rng.randint(0 if stem else 1, 20))]

    max_bytes = 120 * TOKEN_BYTES
    cache, scan = PromptCache(max_bytes), _ScanAll(max_bytes)
    num_hits, offered = 0, []
    for _ in range(600):
        token_ids = rng.choice(offered) if offered and rng.random() < 0.15 else sequence()  # some offered again
        if rng.random() < 0.5:
            cache.offer(token_ids, _caches_for(token_ids), 0)
            scan.offer(token_ids)
            offered.append(token_ids)
        else:
            expected = scan.fetch(token_ids)
            caches, num_cached = cache.fetch(token_ids)
            assert num_cached == expected, token_ids
            if caches is not None:
                num_hits += 1
                for got, want in zip(caches, _caches_for(token_ids[:num_cached]), strict=True):
                    assert mx.array_equal(got.keys, want.keys) and mx.array_equal(got.values, want.values)
        assert list(cache._entries) == scan.entries
        assert cache.num_bytes == sum(len(k) for k in scan.entries) * TOKEN_BYTES <= max_bytes
        assert {k for keys in cache._by_first.values() for k in keys} == set(scan.entries)
    assert num_hits > 50 and len(cache._by_first) > 1


def test_a_prompt_cache_keeps_a_row_within_its_budget_and_not_one_past_it(builtin_target):
    """An evicted row goes to the prompt cache; one larger than its whole budget is refused
    before it is copied, one within it is kept at its size."""
    prompt = [11 + i % 50 for i in range(100)]
    caches = make_ragged_cache(builtin_target.num_layers, stored_dtype=builtin_target.kv_dtype)
    mx.eval(builtin_target.forward(mx.array([prompt]), caches)[1])
    row_bytes = len(prompt) * builtin_target.kv_bytes_per_token
    small, large = PromptCache(max_bytes=row_bytes - 1), PromptCache(max_bytes=row_bytes)
    small.offer(prompt, caches, 0)
    large.offer(prompt, caches, 0)
    assert (small.num_bytes, len(small._entries)) == (0, 0)
    assert (large.num_bytes, len(large._entries)) == (row_bytes, 1)
    assert large.fetch(prompt + [7])[1] == len(prompt)
