"""A llama decoder layer in one kernel node on the CPU, where its weights allow (qwen3's too:
the same layer with RMSNorm over each q and k head before RoPE, which the node runs with the
separate op's code).

With the decode ops swapped in (gmlx/platform/cpu_decode_ops.py) a SmolLM2 layer is still
~20 graph nodes (norms, grouped products, reshapes, transposes, RoPE, the KV writes,
attention, residual adds), and building and walking ~680 nodes a step costs the Python
thread ~3 ms: on two cores, time the kernels' second thread needed. Where every product of
a layer has packed weights (the quad layout, gmlx/platform/cpu_quantized.py, or float32
panels, gmlx/platform/cpu_float.py), its call with a RaggedKVCache becomes one node
(decoder_layer): norm, q/k/v, RoPE, the KV write, ragged attention, o_proj + residual,
norm, gate/up, SwiGLU, down + residual. Even at six nodes a layer (attention_inputs, two KV
writes, ragged attention, project_add, mlp_block) mlx's dispatch took the Python thread
~11 us a node, ~2 ms of a SmolLM2 step. The one node writes the cache's buffers in place,
which the cache hands over only when no other array shares them (RaggedKVCache.
writable_buffers). Each stage runs the separate ops' code, so the bits are the separate
graph's (a probe at load checks it); calls without a ragged cache (a packed forward's
PackedLayerCache) run the layer as mlx-lm builds it, so where layers are fused a round with
prompt chunks does not pack (LoadedModel.is_layer_fused; segment_bodies below).

Where every layer of the model is such a one-node layer of one shape, a step runs them all as
one node (decoder_stack) that holds their weights, instead of ~30 nodes of ~13 inputs each:
mlx's dispatch costs the Python thread per node and per input, and that thread shares the
second core with the kernels' worker. The stack runs each layer's code, so the bits are the
per-layer nodes'. It takes several segments (rows of their own caches: a round's decode rows
and the prompt chunks it carries), whose products share one pass over the weights, as a packed
forward's do, with each segment's RoPE, KV write and attention over its own cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3

from gmlx import config
from gmlx.cache.ragged import RaggedKVCache
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_attention import _KernelAttention
from gmlx.platform.cpu_decode_ops import (KernelLlama3RoPE, KernelRMSNorm, KernelRoPE, KernelYarnRoPE, _KernelMLP,
                                          rope_constants)
from gmlx.platform.cpu_float import KernelLinear
from gmlx.platform.cpu_quantized import KernelQuantizedLinear

if TYPE_CHECKING:
    from gmlx.models.packed import Segment

logger = logging.getLogger(__name__)


class _FusedBlock:
    """Mixed into mlx-lm's llama TransformerBlock whose layer passed is_fusable."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if not isinstance(cache, RaggedKVCache):
            return super().__call__(x, mask, cache)
        call = self.__dict__.get("_layer_call") or layer_call(self)  # set by use_fused_layers
        offset = cache.offset  # (B,) each row's first new position, before the write
        if call.is_one_node:
            num_new = x.shape[1]
            keys, values = cache.writable_buffers(num_new, *call.kv_heads_and_dim, mx.float32)
            h, keys, values = call.layer(x, offset, keys, values)
            cache.wrote_in_place(keys, values, num_new)
            return h
        queries, keys, values = call.attention_inputs(x, offset)
        cache.append(keys, values)
        out = cpu_kernels.ragged_attention(queries, cache.keys, cache.values, offset, call.scale)
        h = call.project_add(out, x)  # out: (B, T, Hq * Dh)
        return call.mlp_block(h)


class FusedLlamaBlock(_FusedBlock, llama.TransformerBlock):
    pass


class FusedQwen2Block(_FusedBlock, qwen2.TransformerBlock):
    """qwen2's layer: llama's with biases on the q, k and v products."""


class FusedQwen3Block(_FusedBlock, qwen3.TransformerBlock):
    """qwen3's layer: llama's with RMSNorm over each q and k head before RoPE."""


_FUSED_BLOCKS = {llama.TransformerBlock: FusedLlamaBlock, qwen2.TransformerBlock: FusedQwen2Block,
                 qwen3.TransformerBlock: FusedQwen3Block}


class LayerStackCall:
    """A model's one-node layers as one decoder_stack node: the stack of their weights (built once)."""

    def __init__(self, calls: list[cpu_kernels.LayerCall]):
        assert can_stack(calls), "a stack needs one-node layers of one shape"
        first = calls[0]
        # The node reads the norms without a graph edge: evaluated float32 arrays.
        norms = [[mx.array(c.layer_weights[i], dtype=mx.float32) for c in calls] for i in (0, 1)]
        weights = [c.layer_weights[3] for c in calls]
        biases = [[mx.array(b, dtype=mx.float32) for b in c.qkv_biases] for c in calls if c.qkv_biases]
        mx.eval(norms, weights, biases)
        self.stack = cpu_kernels.extension().LayerStack(*norms, weights, [c.layer_bits for c in calls],
                                                        first.layer_weights[2], *first.layer_sizes,
                                                        *first.layer_constants, biases)
        self.kv_heads_and_dim = first.kv_heads_and_dim
        self.num_layers = len(calls)

    def __call__(self, hs: list[mx.array], caches: list[list[RaggedKVCache]]) -> list[mx.array]:
        """Every layer over each segment's h (B, T, D) and its layers' caches, whose buffers are
        written in place and advanced; all segments' products share one pass over the weights."""
        offsets, keys, values, writers = [], [], [], {}
        for h, segment_caches in zip(hs, caches, strict=True):
            first = segment_caches[0]
            assert all(c.lengths == first.lengths for c in segment_caches), "the layers' caches hold different rows"
            buffers = [c.stack_buffers(h.shape[1], *self.kv_heads_and_dim, mx.float32) for c in segment_caches]
            offsets.append(first.offset)
            keys += [k for k, _, _ in buffers]
            values += [v for _, v, _ in buffers]
            writers.update((id(w), w) for _, _, w in buffers if w is not None)
        out = cpu_kernels.extension().decoder_stack(self.stack, hs, offsets, keys, values, list(writers.values()))
        for h, segment_caches in zip(out, caches):  # the buffers' next readers depend on the h that wrote them
            for cache in segment_caches:
                cache.written_by(h, h.shape[1])
        return out


def can_stack(calls: list) -> bool:
    """Layers (their LayerCall, or None where not fused) that one decoder_stack node can run: all
    one-node, of one shape, one eps, and each with the same weights (head norms or none)."""
    if not calls or calls[0] is None:
        return False
    first = calls[0]
    return all(c is not None and c.is_one_node and c.layer_sizes == first.layer_sizes
               and c.layer_constants == first.layer_constants and bool(c.qkv_biases) == bool(first.qkv_biases)
               and c.layer_weights[2] == first.layer_weights[2]
               and len(c.layer_weights[3]) == len(first.layer_weights[3]) for c in calls)


class _StackedModel:
    """Mixed into mlx-lm's LlamaModel or Qwen3Model whose layers make a LayerStackCall (use_fused_layers)."""

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        if not self.is_stacked(cache) or input_embeddings is not None:
            return super().__call__(inputs, cache, input_embeddings)
        return self.norm(self._stack_call([self.embed_tokens(inputs)], [cache])[0])

    def is_stacked(self, cache) -> bool:
        """Does a forward over these layer caches run as the stack's one node?"""
        return (self.__dict__.get("_stack_call") is not None and cache is not None
                and all(isinstance(c, RaggedKVCache) for c in cache))

    def segment_forwards(self, segments: list[Segment]) -> list[mx.array]:
        """Each segment's hidden states (B, T, D), every segment stacked (is_stacked): one node."""
        hs = self._stack_call([self.embed_tokens(s.tokens) for s in segments], [s.caches for s in segments])
        return [self.norm(h) for h in hs]


class StackedLlamaModel(_StackedModel, llama.LlamaModel):
    pass


class StackedQwen2Model(_StackedModel, qwen2.Qwen2Model):
    pass


class StackedQwen3Model(_StackedModel, qwen3.Qwen3Model):
    pass


_STACKED_BODIES = {llama.LlamaModel: StackedLlamaModel, qwen2.Qwen2Model: StackedQwen2Model,
                   qwen3.Qwen3Model: StackedQwen3Model}


def segment_bodies(body: nn.Module, segments: list[Segment]) -> list[mx.array]:
    """Each segment's hidden states (B, T, D) from the body over its own caches: where the body
    runs its layers as a stack, one node for all, whose products share one pass over the weights
    (a round's decode rows and the prompt chunks it carries); else each segment's own forward.
    Either way each row has the bits of its segment's forward alone."""
    if isinstance(body, _StackedModel) and all(body.is_stacked(s.caches) for s in segments):
        return body.segment_forwards(segments)
    return [body(s.tokens, s.caches) for s in segments]


def _is_packed(module: nn.Module, may_have_bias: bool = False) -> bool:
    """Weights in the quad layout or float32 panels (a bias only where may_have_bias): what the
    fused ops multiply."""
    if "bias" in module and not may_have_bias:
        return False
    return (type(module) is KernelQuantizedLinear and "quads" in module) or type(module) is KernelLinear


def is_fusable(block: nn.Module) -> bool:
    """A llama (qwen2, qwen3) block whose products all have packed weights (quads of 4 or 8 bits,
    each its own, or float32 panels; qwen2's biases on q, k and v), with the kernels' attention,
    RoPE, norms (qwen3's q and k head norms too) and MLP."""
    if type(block) not in _FUSED_BLOCKS:
        return False
    attn, mlp = block.self_attn, block.mlp
    products = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    norms = [block.input_layernorm, block.post_attention_layernorm]
    if type(block) is qwen3.TransformerBlock:
        # The fused ops normalize the heads with the input norm's eps.
        if attn.q_norm.eps != block.input_layernorm.eps or attn.k_norm.eps != block.input_layernorm.eps:
            return False
        norms += [attn.q_norm, attn.k_norm]
    elif "q_norm" in attn:
        return False
    return (isinstance(attn, _KernelAttention) and type(attn.rope) in (KernelRoPE, KernelLlama3RoPE, KernelYarnRoPE)
            and isinstance(mlp, _KernelMLP) and all(_is_packed(p, may_have_bias=i < 3) for i, p in enumerate(products))
            and len({"bias" in p for p in products[:3]}) == 1 and all(type(n) is KernelRMSNorm for n in norms))


def layer_call(block: nn.Module) -> cpu_kernels.LayerCall:
    """The block's fused-op arguments, its rope's constants included."""
    return cpu_kernels.LayerCall(block, rope_constants(block.self_attn.rope))


def _is_probe_exact(block: nn.Module) -> bool:
    """The fused call against the block's own on a ragged probe (two rows at other lengths, 3
    new positions): the same output and KV bits?"""
    hidden = block.input_layernorm["weight"].shape[0]
    x = mx.random.normal((2, 3, hidden), key=mx.random.key(3))
    prefix = mx.random.normal((2, 5, hidden), key=mx.random.key(4))
    results = []
    own_call = type(block).__call__
    for call in (own_call, _FUSED_BLOCKS[type(block)].__call__):
        cache = RaggedKVCache(num_rows=2)
        own_call(block, prefix, None, cache)
        cache.lengths = [5, 2]  # ragged: the second row's last 3 prefix positions are overwritten
        cache._offset = None
        out = call(block, x, None, cache)
        results.append((out, cache.keys[:, :, :8], cache.values[:, :, :8]))
    return all(mx.array_equal(a, b).item() for a, b in zip(*results))


def use_fused_layers(model: nn.Module) -> int:
    """Swap the model's fusable llama (qwen3) blocks for FusedLlamaBlock (FusedQwen3Block); how many
    (0 if the probe fails)."""
    if not cpu_kernels.is_built() or not hasattr(cpu_kernels.extension(), "mlp_block"):
        return 0
    blocks = [b for b in getattr(model.model, "layers", []) if is_fusable(b)]
    if not blocks:
        return 0
    if not _is_probe_exact(blocks[0]):
        logger.warning("not fusing the decoder layers: the fused call differs from the layer's own")
        return 0
    for block in blocks:
        block.__class__ = _FUSED_BLOCKS[type(block)]
        # Outside the module's dict (object's setattr), so the arguments are no parameters or children.
        object.__setattr__(block, "_layer_call", layer_call(block))
    _use_layer_stack(model.model)
    return len(blocks)


def _use_layer_stack(body: nn.Module) -> bool:
    """Run a llama (qwen3) body's layers as one node a step where they are all one-node layers of one shape."""
    layers = getattr(body, "layers", [])
    calls = [layer.__dict__.get("_layer_call") for layer in layers]
    if (type(body) not in _STACKED_BODIES or not config.is_layer_stack_enabled()
            or not hasattr(cpu_kernels.extension(), "decoder_stack") or not can_stack(calls)):
        return False
    body.__class__ = _STACKED_BODIES[type(body)]
    object.__setattr__(body, "_stack_call", LayerStackCall(calls))
    return True
