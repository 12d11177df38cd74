"""The ragged batch KV cache against per-row solo decoding, under random trims, merges and filters."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from gmlx.cache.ragged import RaggedKVCache, concat_layer_caches, make_ragged_cache, stored_kv_dtype


def solo_logits(target, tokens):
    cache = make_prompt_cache(target.model)
    return target.model(mx.array([tokens]), cache=cache)[0]  # (T, V)


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_ops_match_solo(seed, tiny_target):
    rng = random.Random(seed)
    vocab = tiny_target.vocab_size
    num_rows = rng.randint(2, 5)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(num_rows)]
    per_row = []
    for seq in seqs:
        caches = make_ragged_cache(tiny_target.num_layers)
        tiny_target.model(mx.array([seq]), cache=caches)
        per_row.append(caches)
    caches = concat_layer_caches(per_row)
    for _ in range(6):
        # Write T tokens to every row, check each row's logits, then trim each row its own amount.
        num_new = rng.randint(1, 4)
        new = [[rng.randrange(vocab) for _ in range(num_new)] for _ in seqs]
        logits = tiny_target.model(mx.array(new), cache=caches)
        for row, seq in enumerate(seqs):
            expected = solo_logits(tiny_target, seq + new[row])[-num_new:]
            assert mx.allclose(logits[row], expected, atol=1e-4).item()
        trims = [rng.randint(0, num_new) for _ in seqs]
        for cache in caches:
            cache.trim_rows(trims)
        seqs = [seq + row_new[: num_new - t] for seq, row_new, t in zip(seqs, new, trims)]
        if len(seqs) > 1 and rng.random() < 0.3:
            keep = sorted(rng.sample(range(len(seqs)), rng.randint(1, len(seqs))))
            for cache in caches:
                cache.select_rows(keep)
            seqs = [seqs[i] for i in keep]
        assert caches[0].lengths == [len(s) for s in seqs]


def test_uniform_rows_use_the_cheap_masks():
    cache = RaggedKVCache(3)
    assert cache.make_mask(1) is None
    assert cache.make_mask(4) == "causal"
    cache.lengths = [3, 1, 2]
    mask = cache.make_mask(2)
    assert mask.shape == (3, 1, 2, 5)
    assert mask[1, 0].tolist() == [[True, True, False, False, False], [True, True, True, False, False]]


@pytest.mark.parametrize("seed", range(4))
def test_a_staged_join_holds_what_a_merge_holds(seed):
    # with_leading_rows copies the joiner ahead; fill_leading_rows later writes only the batch's rows.
    rng = random.Random(seed)

    def filled(num_rows: int) -> RaggedKVCache:
        cache = RaggedKVCache(num_rows)
        for _ in range(rng.randint(1, 3)):
            num_new = rng.randint(1, 300)
            keys, values = (mx.random.normal((num_rows, 2, num_new, 8), key=mx.random.key(rng.randrange(1 << 30)))
                            for _ in range(2))
            cache.update_and_fetch(keys, values)
            cache.trim_rows([rng.randint(0, min(3, n)) for n in cache.lengths])
        return cache

    batch, joiner = filled(rng.randint(1, 3)), filled(1)
    width = max(batch.keys.shape[2], joiner.keys.shape[2]) + rng.choice((0, 256))
    staged = joiner.with_leading_rows(batch.num_rows, width)
    assert staged.can_fill_leading_rows(batch)
    staged.fill_leading_rows(batch)
    merged = concat_layer_caches([[batch], [joiner]])[0]
    assert staged.lengths == merged.lengths
    for row, length in enumerate(merged.lengths):
        for name in ("keys", "values"):
            assert mx.array_equal(getattr(staged, name)[row, :, :length], getattr(merged, name)[row, :, :length]).item()
    # A batch grown past the staged width cannot be filled in: the engine merges as usual then.
    wider = filled(batch.num_rows)
    wider.update_and_fetch(*(mx.zeros((batch.num_rows, 2, width + 1, 8)) for _ in range(2)))
    assert not joiner.with_leading_rows(batch.num_rows, width).can_fill_leading_rows(wider)


def test_a_float16_cache_stores_halves_through_every_operation():
    """A float16 cache (GMLX_KV_DTYPE): float32 writes land rounded to halves (as astype rounds),
    and merges, filters, staged joins and growth keep the buffers halves."""
    caches = [RaggedKVCache(1, stored_dtype=mx.float16) for _ in range(2)]
    written = []
    for cache, seed in zip(caches, (1, 2)):
        keys, values = (mx.random.normal((1, 2, 300, 8), key=mx.random.key(seed + i)) for i in (0, 10))
        cache.update_and_fetch(keys, values)  # past the first 256 positions: the buffers grow once
        written.append(keys)
        assert cache.keys.dtype == cache.values.dtype == mx.float16
        assert mx.array_equal(cache.keys[..., :300, :], keys.astype(mx.float16)).item()
    merged = RaggedKVCache.concat(caches)
    merged.trim_rows([0, 5])
    merged.update_and_fetch(*(mx.ones((2, 2, 2, 8)) for _ in range(2)))  # ragged: put_along_axis
    staged = caches[1].with_leading_rows(1, 512)
    staged.fill_leading_rows(caches[0])
    merged.select_rows([1])
    for cache in (merged, staged):
        assert cache.keys.dtype == cache.values.dtype == mx.float16
    assert mx.array_equal(staged.keys[:1, :, :300], written[0].astype(mx.float16)).item()
    assert mx.array_equal(merged.keys[0, :, 295:297], mx.ones((2, 2, 8), dtype=mx.float16)).item()


@pytest.mark.parametrize("setting, float_kv, int8_kv", [
    ("", None, mx.float16), ("auto", None, mx.float16), ("model", None, None), ("float16", mx.float16, mx.float16)])
def test_the_kv_setting_picks_halves_where_activations_are_int8(monkeypatch, setting, float_kv, int8_kv):
    """auto (the default) stores halves only for a model whose products quantize activations to
    int8; model and float16 pin the type for every model."""
    monkeypatch.setenv("GMLX_KV_DTYPE", setting)
    assert stored_kv_dtype(is_int8_activations=False) == float_kv
    assert stored_kv_dtype(is_int8_activations=True) == int8_kv


def test_an_unknown_kv_dtype_is_named(monkeypatch):
    monkeypatch.setenv("GMLX_KV_DTYPE", "bfloat16")
    with pytest.raises(ValueError, match="GMLX_KV_DTYPE='bfloat16'"):
        stored_kv_dtype(is_int8_activations=False)
