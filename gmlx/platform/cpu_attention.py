"""Attention over gmlx's ragged KV as one graph node, in gmlx's CPU kernels.

mx.fast.scaled_dot_product_attention has no CPU kernel: with grouped heads and a mask
one call is ~15 graph nodes (scale, flatten/unflatten, two matmuls, softmax,
transposes), plus the mask built for it. With a RaggedKVCache the mask is the cache's
row lengths, causal within the new positions, so the kernel takes the per-row offsets
and needs no mask; it also returns (B, T, Hq * D), the layout o_proj reads.

At load, attention modules of exactly mlx-lm's llama (mistral), qwen2 and qwen3
classes become subclasses whose call with a RaggedKVCache runs the kernel at every
query count: each query's bits then depend only on its own vector and the keys it
sees, so a prompt gives the same KV however it is chunked, and a verify of k+1
positions what k+1 plain steps give. Without a cache they run mlx-lm's own code.
"""

from __future__ import annotations

import importlib
import logging

import mlx.core as mx
import mlx.nn as nn

from gmlx.cache.ragged import RaggedKVCache
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_quantized import output_dims, project

logger = logging.getLogger(__name__)

_PROBE_ATOL = 1e-4  # |kernel - mx.fast| on probe outputs of magnitude ~1
_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # mistral loads as llama


class _KernelAttention:
    """Mixed into an mlx-lm Attention class (q/k/v/o_proj, rope, n_heads, n_kv_heads,
    scale; q_norm and k_norm where qwen3 has them)."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if not isinstance(cache, RaggedKVCache):
            return super().__call__(x, mask, cache)
        num_rows, num_new, _ = x.shape  # (B, T, D)
        queries, keys, values = project(x, (self.q_proj, self.k_proj, self.v_proj))
        queries = queries.reshape(num_rows, num_new, self.n_heads, -1)
        keys = keys.reshape(num_rows, num_new, self.n_kv_heads, -1)
        values = values.reshape(num_rows, num_new, self.n_kv_heads, -1)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        offset = cache.offset  # (B,) each row's first new position
        queries = self.rope(queries.transpose(0, 2, 1, 3), offset=offset)  # (B, Hq, T, Dh)
        keys = self.rope(keys.transpose(0, 2, 1, 3), offset=offset)  # (B, Hkv, T, Dh)
        cache.update_and_fetch(keys, values.transpose(0, 2, 1, 3))
        # The whole buffers (B, Hkv, capacity, Dh): the kernel reads only the keys each
        # query sees, and skipping the fetched slices saves two graph nodes a layer.
        output = cpu_kernels.ragged_attention(queries, cache.keys, cache.values, offset, self.scale)  # (B, T, Hq * Dh)
        return self.o_proj(output)


def _kernel_classes() -> dict[type, type]:
    swaps = {}
    for name in _ARCHITECTURES:
        cls = importlib.import_module(f"mlx_lm.models.{name}").Attention
        swaps[cls] = type(f"Kernel{name.capitalize()}Attention", (_KernelAttention, cls), {})
    return swaps


_SWAPS = _kernel_classes()


def _reference(q, keys, values, offsets, scale) -> mx.array:
    """mlx's sdpa with the ragged cache's mask, in the kernel's (B, T, Hq * D) layout."""
    num_rows, _, num_new, _ = q.shape
    query_pos = offsets[:, None] + mx.arange(num_new)[None, :]  # (B, T)
    mask = (mx.arange(keys.shape[2])[None, None, :] <= query_pos[:, :, None])[:, None]  # (B, 1, T, S)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(num_rows, num_new, -1)


def is_kernel_close(num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> bool:
    """Does the kernel match mlx's sdpa on a ragged probe of this head layout?"""
    key_q, key_k, key_v = mx.random.split(mx.random.key(head_dim), 3)
    offsets = mx.array([0, 9, 33], dtype=mx.int32)  # ragged rows
    q = mx.random.normal((3, num_q_heads, 4, head_dim), key=key_q)  # (B, Hq, T, D)
    keys = mx.random.normal((3, num_kv_heads, 40, head_dim), key=key_k)  # (B, Hkv, S, D)
    values = mx.random.normal((3, num_kv_heads, 40, head_dim), key=key_v)
    got = cpu_kernels.ragged_attention(q, keys, values, offsets, scale)
    return (mx.abs(got - _reference(q, keys, values, offsets, scale)).max() <= _PROBE_ATOL).item()


def _layout(module: nn.Module) -> tuple[int, int, int, float]:
    head_dim = output_dims(module.q_proj) // module.n_heads
    return module.n_heads, module.n_kv_heads, head_dim, module.scale


def use_kernel_attention(model: nn.Module) -> int:
    """Swap the model's attention modules for kernel-backed ones; how many.

    0 (the model untouched) when the kernel is unavailable or a probe disagrees.
    """
    if not cpu_kernels.is_built() or not hasattr(cpu_kernels.extension(), "ragged_attention"):
        return 0
    modules = [m for _, m in model.named_modules() if type(m) in _SWAPS]
    for layout in {_layout(m) for m in modules}:
        if not is_kernel_close(*layout):
            logger.warning("not using the CPU attention kernel: heads %s disagree with mlx's sdpa", layout)
            return 0
    for module in modules:
        module.__class__ = _SWAPS[type(module)]
    return len(modules)
