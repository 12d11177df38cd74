"""Packed forwards: several caches' rows in one target forward, sharing one pass over the weights.

A prompt chunk prefilled beside running rows used to cost its own forward: on a CPU a
forward's floor is reading every weight once, so the running rows' next token waited for
two weight passes. Packed, the decode rows' tokens and the chunk's lie end to end on one
sequence axis (1, N): the projections, norms and MLP run once over all N tokens (every
product is row-independent, so each token's bits are those of its own forward), and only
attention splits them back, each segment over its own cache, with the very ops the
model's attention runs alone. So every row gets the bits a forward of its own would give.

Where the target's layers are fused kernel nodes (platform/cpu_layers.py, the CPU default) a
round with chunks runs them as segments of the fused stack's one node instead (spec/speculative.py
`_forward`, cpu_layers.segment_bodies), which shares the weight pass the same way: the packed
body is mlx-lm's ~20 nodes a layer, which cost more than a whole extra weight pass.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from gmlx.cache.ragged import RaggedKVCache
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_attention import _KernelAttention
from gmlx.platform.cpu_quantized import project
from gmlx.platform.row_invariance import RowRules, attend_each_query_alone, attend_one_query_a_call

_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # the attention classes whose layout this mirrors


@dataclass(frozen=True)
class Segment:
    """Rows of one cache in a packed forward: num_rows x num_tokens tokens, row-major."""

    tokens: mx.array  # (num_rows, num_tokens) int32
    caches: list[RaggedKVCache]  # one per layer, num_rows rows each

    @property
    def num_packed(self) -> int:
        return self.tokens.shape[0] * self.tokens.shape[1]


class PackedLayerCache:
    """One layer's caches for a packed forward; the model sees it as its layer cache."""

    def __init__(self, segments: list[tuple[RaggedKVCache, int, int]], masks: list[mx.array] | None = None,
                 is_padded: bool = False):
        self.segments = segments  # (cache, num_rows, num_tokens) in packing order
        # Row invariance: the packed axis may end in padding rows past the segments, and under the
        # masked rule each segment's array mask is built once for every layer (its caches share lengths).
        self.masks = masks
        self.is_padded = is_padded

    def make_mask(self, *_args, **_kwargs):
        return None  # each segment builds its own mask from its cache


class _PackedAttention:
    """Mixed into an attention class: a PackedLayerCache runs the projections once over
    every segment, then each segment's attention as the class would run it alone."""

    row_attention: str | None = None  # under row invariance, its attention rule (gmlx/platform/row_invariance.py)

    @property
    def is_row_invariant(self) -> bool:
        return self.row_attention is not None

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if self.is_row_invariant and isinstance(cache, RaggedKVCache):
            cache = PackedLayerCache([(cache, x.shape[0], x.shape[1])])  # one segment: the same attention
        if not isinstance(cache, PackedLayerCache):
            return super().__call__(x, mask, cache)
        shape = x.shape  # (1, N, D) packed; (B, T, D) for a lone cache's forward
        x = x.reshape(1, -1, shape[-1])
        queries, keys, values = project(x, (self.q_proj, self.k_proj, self.v_proj))  # (1, N, *)
        outputs, start = [], 0
        for i, (segment_cache, num_rows, num_tokens) in enumerate(cache.segments):
            end = start + num_rows * num_tokens

            def rows(a, start=start, end=end, num_rows=num_rows, num_tokens=num_tokens):
                return a[0, start:end].reshape(num_rows, num_tokens, -1)

            mask = cache.masks[i] if cache.masks else None
            out = self._attend_segment(rows(queries), rows(keys), rows(values), segment_cache, mask)
            outputs.append(out.reshape(1, end - start, -1))
            start = end
        if start < x.shape[1]:
            # Padding rows attend to nothing and nothing reads them: their own queries (the width
            # of attention's output) fill their place in o_proj's block without a kernel to fill it.
            outputs.append(queries[:, start:])
        out = self.o_proj(outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1))
        return out.reshape(*shape[:-1], out.shape[-1])

    def _attend_segment(self, queries, keys, values, cache: RaggedKVCache, shared_mask=None) -> mx.array:
        """(B, T, Hq * D) for one segment: mlx-lm's attention body (or gmlx's kernel) after the
        projections. shared_mask: the segment's array mask when the forward built it once."""
        num_rows, num_new, _ = queries.shape
        queries = queries.reshape(num_rows, num_new, self.n_heads, -1)
        keys = keys.reshape(num_rows, num_new, self.n_kv_heads, -1)
        values = values.reshape(num_rows, num_new, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        offset = cache.offset
        queries = self.rope(queries.transpose(0, 2, 1, 3), offset=offset)  # (B, Hq, T, D)
        keys = self.rope(keys.transpose(0, 2, 1, 3), offset=offset)
        if isinstance(self, _KernelAttention):
            cache.update_and_fetch(keys, values)
            return cpu_kernels.ragged_attention(queries, cache.keys, cache.values, offset, self.scale)
        if self.row_attention == "unmasked":
            lengths = cache.lengths  # before the write
            keys, values = cache.update_and_fetch(keys, values)
            out = attend_each_query_alone(queries, keys, values, self.scale, lengths)
            return out.transpose(0, 2, 1, 3).reshape(num_rows, num_new, -1)
        mask = shared_mask
        if mask is None:  # before the write, as mlx-lm's model builds it
            mask = cache.make_mask(num_new, return_array=self.is_row_invariant)
        keys, values = cache.update_and_fetch(keys, values)
        if self.is_row_invariant:
            out = attend_one_query_a_call(queries, keys, values, self.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(num_rows, num_new, -1)


def _attention_classes() -> tuple[type, ...]:
    return tuple(importlib.import_module(f"mlx_lm.models.{name}").Attention for name in _ARCHITECTURES)


class _BlockPaddedBody:
    """Mixed into the model's body under row invariance: every forward over ragged caches runs
    packed, its tokens padded to whole product blocks. Each product then runs on its input as
    it comes, a block at a time, instead of padding a block of its own (ops a GPU pays for)."""

    row_rules: RowRules

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        if input_embeddings is not None or not cache:
            return super().__call__(inputs, cache, input_embeddings)
        if isinstance(cache[0], RaggedKVCache):  # a lone batch's forward: one segment
            segments = [Segment(inputs, cache)]
            return unpack(packed_body(self, segments), segments)[0]
        if not isinstance(cache[0], PackedLayerCache) or cache[0].is_padded:
            return super().__call__(inputs, cache, input_embeddings)
        num_tokens = inputs.shape[1]
        num_padding = -num_tokens % self.row_rules.block_rows
        if num_padding:
            inputs = mx.concatenate([inputs, mx.zeros((1, num_padding), dtype=inputs.dtype)], axis=1)
        masks = None
        if self.row_rules.attention == "masked":
            masks = [c.make_mask(n, return_array=True) for c, _, n in cache[0].segments]
        hidden = super().__call__(inputs, [PackedLayerCache(c.segments, masks, is_padded=True) for c in cache])
        return hidden[:, :num_tokens] if num_padding else hidden


_BASES = _attention_classes()
_PACKED: dict[type, type] = {}


def use_packed_attention(model: nn.Module, row_rules: RowRules | None = None) -> bool:
    """Let the model's attention take PackedLayerCache; False (model untouched) when some
    attention module is of a class this does not mirror. With row rules every forward runs
    packed, padded to whole product blocks, and its attention by the rules' attention rule."""
    modules = [getattr(layer, "self_attn", None) for layer in model.model.layers]
    if not modules or not all(isinstance(m, _BASES) for m in modules):
        return False
    for module in modules:
        cls = type(module)
        if not issubclass(cls, _PackedAttention):
            if cls not in _PACKED:
                _PACKED[cls] = type(f"Packed{cls.__name__}", (_PackedAttention, cls), {})
            module.__class__ = _PACKED[cls]
        module.row_attention = row_rules.attention if row_rules else None
    body = model.model
    if row_rules:
        cls = type(body)
        if cls not in _PACKED:
            _PACKED[cls] = type(f"BlockPadded{cls.__name__}", (_BlockPaddedBody, cls), {})
        body.__class__ = _PACKED[cls]
        body.row_rules = row_rules
    return True


def unpacked_class(cls: type) -> type:
    """The attention class a packed one was made from (itself when not packed)."""
    return cls.__bases__[1] if issubclass(cls, _PackedAttention) else cls


def packed_body(body, segments: list[Segment]) -> mx.array:
    """The body's hidden states (1, N, D) for every segment's tokens, packed in order."""
    num_layers = len(segments[0].caches)
    tokens = mx.concatenate([s.tokens.reshape(1, -1) for s in segments], axis=1)
    caches = [PackedLayerCache([(s.caches[i], s.tokens.shape[0], s.tokens.shape[1]) for s in segments])
              for i in range(num_layers)]
    return body(tokens, caches)


def unpack(hidden: mx.array, segments: list[Segment]) -> list[mx.array]:
    """Each segment's hidden states (num_rows, num_tokens, D) out of a packed (1, N, D)."""
    parts, start = [], 0
    for s in segments:
        parts.append(hidden[0, start:start + s.num_packed].reshape(*s.tokens.shape, -1))
        start += s.num_packed
    return parts
