"""The ragged batch KV cache: each row keeps its own length, so rollbacks are per row.

Rows are left-aligned at position 0 and end at their own length. A write of T tokens lands
at each row's own end; attention masks every key past a row's end. Trimming a row is a
length change, so a verify round rolls each row back by its own rejected count.
(mlx-lm's BatchKVCache shares one write index across the batch: not enough for that.)
"""

from __future__ import annotations

import mlx.core as mx

from gmlx import config

STEP_TOKENS = 256  # buffer growth granularity


class RaggedKVCache:
    def __init__(self, num_rows: int = 1, min_capacity: int = 0, stored_dtype: mx.Dtype | None = None):
        # A prompt's length known up front: its prefill then never copies the buffer to grow it.
        self.min_capacity = min_capacity
        # The buffers' element type (its model's kv_dtype, from GMLX_KV_DTYPE); None: the type written first.
        self.stored_dtype = stored_dtype
        self._keys: mx.array | None = None  # (B, H, S, Dk)
        self._values: mx.array | None = None  # (B, H, S, Dv)
        # Whether no array outside this cache may share the buffers' memory: true for buffers its
        # own methods made (mlx ops' fresh or donated outputs), false for ones assigned from
        # outside (a prompt-cache entry's slices). Only such buffers are written in place.
        self._is_exclusive = True
        # An array computed by the last in-place write into the buffers that left them as they
        # were in the graph (the layer stack's h, written_by): their next reader must depend on it.
        self._writer: mx.array | None = None
        self.lengths: list[int] = [0] * num_rows
        self._offset: mx.array | None = None

    @property
    def keys(self) -> mx.array | None:
        self._settle()
        return self._keys

    @keys.setter
    def keys(self, keys: mx.array | None) -> None:
        self._settle()
        self._keys, self._is_exclusive = keys, False

    @property
    def values(self) -> mx.array | None:
        self._settle()
        return self._values

    @values.setter
    def values(self, values: mx.array | None) -> None:
        self._settle()
        self._values, self._is_exclusive = values, False

    def _own(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Buffers this cache holds alone (an mlx op's output it just made)."""
        self._settle()
        self._keys, self._values, self._is_exclusive = keys, values, True

    def _settle(self) -> None:
        """The buffers as arrays that depend on the last in-place write (the same memory, lazily)."""
        if self._writer is not None:
            self._keys, self._values = mx.depends([self._keys, self._values], [self._writer])
            self._writer = None

    # --- the contract mlx-lm's attention layers call ---------------------------------

    @property
    def offset(self) -> mx.array:
        # Per-row RoPE offsets; the array form is what mlx's rope takes for ragged rows.
        if self._offset is None:
            self._offset = mx.array(self.lengths, dtype=mx.int32)
        return self._offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        end = self.append(keys, values)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def append(self, keys: mx.array, values: mx.array) -> int:
        """update_and_fetch without the fetch (the fused layers read the whole buffers): the new end."""
        num_rows, _, num_new, _ = keys.shape  # (B, H, T, D)
        assert num_rows == len(self.lengths), (num_rows, len(self.lengths))
        end = max(self.lengths) + num_new
        self._reserve(end, keys, values)
        if self.is_uniform:
            start = self.lengths[0]
            self.keys[..., start : start + num_new, :] = keys
            self.values[..., start : start + num_new, :] = values
            self._is_exclusive = True  # slice updates' outputs: fresh, or donated (held by nothing else)
        else:
            positions = self.offset[:, None] + mx.arange(num_new)[None, :]  # (B, T)
            index = positions[:, None, :, None]  # (B, 1, T, 1)
            self._own(mx.put_along_axis(self.keys, index, keys, axis=2),
                      mx.put_along_axis(self.values, index, values, axis=2))
        self.advance(num_new)
        return end

    def writable_buffers(self, num_new: int, num_heads: int, head_dim: int, dtype) -> tuple[mx.array, mx.array]:
        """Buffers with room for num_new more positions past the longest row that a writer may
        fill in place (the one-node layer, gmlx/platform/cpu_layers.py): held by this cache
        alone, else first copied; row-contiguous. The writer's outputs come back through
        wrote_in_place."""
        self._settle()
        return self.stack_buffers(num_new, num_heads, head_dim, dtype)[:2]

    def stack_buffers(self, num_new: int, num_heads: int, head_dim: int,
                      dtype) -> tuple[mx.array, mx.array, mx.array | None]:
        """writable_buffers for the layer stack, which writes them without making new arrays of
        them, with the array of the last such write (None if settled), which the stack must
        depend on: written_by then records its own."""
        dtype = self.stored_dtype or dtype
        self._reserve_shape(max(self.lengths) + num_new, num_heads, head_dim, head_dim, dtype)
        if not self._is_exclusive:
            # Strictly more room: a slice update covering a whole buffer may return its source.
            self._copy_into((self._keys.shape[2] // STEP_TOKENS + 1) * STEP_TOKENS, num_heads, head_dim, head_dim,
                            dtype)
        return self._keys, self._values, self._writer

    def written_by(self, writer: mx.array, num_new: int) -> None:
        """The layer stack wrote num_new more positions a row into stack_buffers' buffers, in
        place, and left them as they were in the graph: later readers depend on `writer`."""
        self._writer = writer
        self.advance(num_new)

    def wrote_in_place(self, keys: mx.array, values: mx.array, num_new: int) -> None:
        """The writer's outputs (the same buffers, now depending on its write) and num_new more
        positions a row."""
        self._own(keys, values)
        self.advance(num_new)

    def advance(self, num_new: int) -> None:
        self.lengths = [n + num_new for n in self.lengths]
        self._offset = None

    def make_mask(self, num_new: int, return_array: bool = False, window_size=None):
        assert window_size is None, "sliding-window attention is not supported"
        if self.is_uniform and not return_array:
            return None if num_new == 1 else "causal"
        num_keys = max(self.lengths) + num_new
        query_pos = self.offset[:, None] + mx.arange(num_new)[None, :]  # (B, T)
        key_pos = mx.arange(num_keys)  # (S,)
        return (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # (B, 1, T, S)

    @property
    def state(self):
        return self.keys, self.values

    def is_trimmable(self) -> bool:
        return True

    def trim(self, num_tokens: int) -> int:
        """Trim every row by the same count (mlx-lm's contract)."""
        num_tokens = min(num_tokens, min(self.lengths))
        self.trim_rows([num_tokens] * len(self.lengths))
        return num_tokens

    def size(self) -> int:
        return max(self.lengths, default=0)

    @property
    def buffer_tokens(self) -> int:
        """Positions the buffers are wide (0 before the first write): their shape, read without
        making the arrays that wait on a pending in-place write (the engine asks every step)."""
        return 0 if self._keys is None else self._keys.shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self._keys is None else self._keys.nbytes + self._values.nbytes

    # --- ragged operations ----------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def is_uniform(self) -> bool:
        return all(n == self.lengths[0] for n in self.lengths)

    def trim_rows(self, num_tokens_by_row: list[int]) -> None:
        assert len(num_tokens_by_row) == len(self.lengths)
        assert all(0 <= t <= n for t, n in zip(num_tokens_by_row, self.lengths))
        self.lengths = [n - t for n, t in zip(self.lengths, num_tokens_by_row)]
        self._offset = None

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order; drops buffer columns no row needs."""
        self.lengths = [self.lengths[i] for i in rows]
        self._offset = None
        if self.keys is None:
            return
        if not rows:
            self._own(None, None)
            return
        index = mx.array(rows, dtype=mx.int32)
        num_keys = max(max(self.lengths), 1)
        # Row-contiguous (the slice would be strided): the layer stack writes buffers where they lie.
        self._own(mx.contiguous(self.keys[index, :, :num_keys, :]), mx.contiguous(self.values[index, :, :num_keys, :]))

    @classmethod
    def concat(cls, caches: list[RaggedKVCache]) -> RaggedKVCache:
        """One cache holding the rows of `caches`, in order."""
        assert len({c.stored_dtype for c in caches}) == 1, "rows of one batch store one KV type"
        merged = cls(0, stored_dtype=caches[0].stored_dtype)
        merged.lengths = [n for c in caches for n in c.lengths]
        filled = [c for c in caches if c.keys is not None]
        if not filled:
            return merged
        width = max(c.keys.shape[2] for c in filled)
        proto = filled[0]
        merged._own(mx.concatenate([_pad_to(c, "keys", width, proto) for c in caches], axis=0),
                    mx.concatenate([_pad_to(c, "values", width, proto) for c in caches], axis=0))
        return merged

    def with_leading_rows(self, num_rows: int, width: int) -> RaggedKVCache:
        """This cache's rows after `num_rows` empty ones, buffers `width` positions wide: a join
        staged ahead, whose leading rows fill_leading_rows writes when it happens."""
        assert self.keys is not None and width >= self.keys.shape[2]
        staged = RaggedKVCache(0, stored_dtype=self.stored_dtype)
        staged.lengths = [0] * num_rows + self.lengths
        staged._own(*(mx.concatenate([mx.zeros((num_rows, *own.shape[1:]), own.dtype), own], axis=0)
                      for own in (_pad_to(self, name, width, self) for name in ("keys", "values"))))
        return staged

    def can_fill_leading_rows(self, source: RaggedKVCache) -> bool:
        num_rows = source.num_rows
        return (self.lengths[:num_rows] == [0] * num_rows and source.keys is not None
                and source.keys.shape[2] <= self.keys.shape[2])

    def fill_leading_rows(self, source: RaggedKVCache) -> None:
        """Write source's rows into the first rows left empty by with_leading_rows; only the
        source's bytes move (the staged buffers are updated in place)."""
        assert self.can_fill_leading_rows(source)
        num_rows, width = source.num_rows, source.keys.shape[2]
        self.keys[:num_rows, :, :width, :] = source.keys
        self.values[:num_rows, :, :width, :] = source.values
        self.lengths = source.lengths + self.lengths[num_rows:]
        self._offset = None

    def _reserve(self, end: int, keys: mx.array, values: mx.array) -> None:
        self._reserve_shape(end, keys.shape[1], keys.shape[3], values.shape[3], self.stored_dtype or keys.dtype)

    def _reserve_shape(self, end: int, num_heads: int, k_dim: int, v_dim: int, dtype) -> None:
        if self._keys is not None and end <= self._keys.shape[2]:
            return
        capacity = ((max(end, self.min_capacity) + STEP_TOKENS - 1) // STEP_TOKENS) * STEP_TOKENS
        self._copy_into(capacity, num_heads, k_dim, v_dim, dtype)

    def _copy_into(self, capacity: int, num_heads: int, k_dim: int, v_dim: int, dtype) -> None:
        """New buffers of `capacity` (> the old) positions holding the old ones' (this cache's alone)."""
        assert self.keys is None or capacity > self.keys.shape[2]
        new_k = mx.zeros((self.num_rows, num_heads, capacity, k_dim), dtype)
        new_v = mx.zeros((self.num_rows, num_heads, capacity, v_dim), dtype)
        if self.keys is not None:
            used = self.keys.shape[2]
            new_k[..., :used, :] = self.keys
            new_v[..., :used, :] = self.values
        self._own(new_k, new_v)


def _pad_to(cache: RaggedKVCache, name: str, width: int, proto: RaggedKVCache) -> mx.array:
    array = getattr(cache, name)
    if array is None:  # rows with no tokens yet
        ref = getattr(proto, name)
        return mx.zeros((cache.num_rows, ref.shape[1], width, ref.shape[3]), ref.dtype)
    if array.shape[2] == width:
        return array
    pad = mx.zeros((*array.shape[:2], width - array.shape[2], array.shape[3]), array.dtype)
    return mx.concatenate([array, pad], axis=2)


def make_ragged_cache(num_layers: int, num_rows: int = 1, min_capacity: int = 0,
                      stored_dtype: mx.Dtype | None = None) -> list[RaggedKVCache]:
    return [RaggedKVCache(num_rows, min_capacity, stored_dtype) for _ in range(num_layers)]


def stored_kv_dtype(is_int8_activations: bool) -> mx.Dtype | None:
    """A model's KV element type under GMLX_KV_DTYPE (None: the type it computes keys in).
    auto picks float16 where the products already quantize their activations to int8: the
    halves then move logits no further than the activations do (BENCHMARKS.md, session 39)."""
    setting = config.kv_cache_dtype()
    if setting == "float16" or (setting == "auto" and is_int8_activations):
        return mx.float16
    return None


def concat_layer_caches(per_request: list[list[RaggedKVCache]]) -> list[RaggedKVCache]:
    """Merge several requests' per-layer caches into one batch, layer by layer."""
    return [RaggedKVCache.concat(list(layer)) for layer in zip(*per_request)]
