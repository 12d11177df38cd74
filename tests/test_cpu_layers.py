"""Fused llama decoder layers (gmlx/platform/cpu_layers.py): one kernel node a step for all the
layers, one a layer, or the six-node form, where every product has packed weights (the quad
layout or float32 panels), with the separate graph's bits in every shape the engine runs
(ragged rows, verify widths, prefill chunks), writing the KV buffers in place only where no
other array shares them."""

import re

import mlx.core as mx
import numpy as np
import pytest

from gmlx.cache.prompt_cache import PromptCache
from gmlx.cache.ragged import RaggedKVCache
from gmlx.config import env_overrides
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from gmlx.models.packed import Segment
from gmlx.platform.cpu_layers import (FusedLlamaBlock, FusedQwen2Block, FusedQwen3Block, StackedLlamaModel,
                                     StackedQwen2Model, StackedQwen3Model, segment_bodies)
from kernel_support import requires_kernels

pytestmark = requires_kernels


FUSED_BLOCKS = (FusedLlamaBlock, FusedQwen2Block, FusedQwen3Block)
STACKED_BODIES = (StackedLlamaModel, StackedQwen2Model, StackedQwen3Model)


@pytest.fixture(scope="module", params=["gguf_like_target", "kquant_like_target", "qwen2_gguf_like_target",
                                        "tiny_target", "builtin_target"])
def fused_and_unfused(request):
    """A model loaded with its layers fused (quad layout, or float32 panels) and without: llama
    layers (4-bit, 4 and 8 bits mixed, float32), qwen2's (q, k and v biases) and the built-in
    model's qwen3 layers (q and k head norms)."""
    fused = request.getfixturevalue(request.param)
    with env_overrides({"GMLX_CPU_FUSED_LAYERS": "0"}):
        return fused, load_model(fused.path)


def test_layers_are_fused_and_the_switch_keeps_them_apart(fused_and_unfused):
    fused, unfused = fused_and_unfused
    assert all(type(layer) in FUSED_BLOCKS for layer in fused.model.model.layers)
    assert not any(type(layer) in FUSED_BLOCKS for layer in unfused.model.model.layers)


def test_products_of_mixed_bits_fuse_into_one_stack(kquant_like_target):
    # A Q4_K_M file's layers mix 4 and 8 bits, each layer its own way: still one node a step.
    layers = kquant_like_target.model.model.layers
    assert [layer._layer_call.layer_bits for layer in layers] == [[4, 4, 8, 4, 4, 4, 8], [8, 4, 4, 4, 4, 8, 4]]
    assert type(kquant_like_target.model.model) in STACKED_BODIES


def test_the_one_node_switch_keeps_six_nodes(fused_and_unfused):
    fused = fused_and_unfused[0]
    with env_overrides({"GMLX_CPU_ONE_NODE_LAYERS": "0"}):
        six = load_model(fused.path)
    assert all(type(layer) in FUSED_BLOCKS and not layer._layer_call.is_one_node for layer in six.model.model.layers)


def test_the_stack_switch_keeps_a_node_a_layer(fused_and_unfused):
    fused = fused_and_unfused[0]
    assert type(fused.model.model) in STACKED_BODIES
    with env_overrides({"GMLX_CPU_LAYER_STACK": "0"}):
        per_layer = load_model(fused.path)
    assert type(per_layer.model.model) not in STACKED_BODIES
    assert all(layer._layer_call.is_one_node for layer in per_layer.model.model.layers)


FORMS = ("stack", "one-node", "six-node")


@pytest.fixture(params=[mx.float32, mx.float16], ids=["float32", "float16"])
def kv_dtype(request):
    """The type the caches a test makes store: the model's float32, or halves (GMLX_KV_DTYPE)."""
    return request.param


def _set_form(target, form: str, stack_call) -> None:
    """Run the body's layers as one stack node, a node a layer, or six a layer (the same bits)."""
    object.__setattr__(target.model.model, "_stack_call", stack_call if form == "stack" else None)
    for layer in target.model.model.layers:
        layer._layer_call.is_one_node = form != "six-node"


@pytest.mark.parametrize("form", FORMS)
def test_fused_layers_give_the_separate_graphs_bits_on_ragged_rows(fused_and_unfused, code_prompts, form, kv_dtype):
    """Two rows at their own lengths through prefill chunks, a 4-position verify and single
    steps: logits and every KV position bit for bit the unfused layers' (whose KV writes are
    mlx's; a float16 cache's halves rounded the same way by both)."""
    fused_target, unfused_target = fused_and_unfused
    stack_call = fused_target.model.model._stack_call
    assert stack_call is not None and all(layer._layer_call.is_one_node for layer in fused_target.model.model.layers)
    _set_form(fused_target, form, stack_call)
    try:
        _check_ragged_rows(fused_target, unfused_target, code_prompts, kv_dtype)
    finally:
        _set_form(fused_target, "stack", stack_call)


def _check_ragged_rows(fused_target, unfused_target, code_prompts, kv_dtype):
    num_layers = len(fused_target.model.model.layers)
    caches = {name: [RaggedKVCache(num_rows=2, stored_dtype=kv_dtype) for _ in range(num_layers)]
              for name in ("fused", "unfused")}
    targets = {"fused": fused_target, "unfused": unfused_target}
    text = [t for prompt in code_prompts for t in prompt]
    rows = [text[:43], text[100:143]]
    for start, width in ((0, 20), (20, 17), (37, 4), (41, 1), (42, 1)):
        tokens = mx.array([row[start : start + width] for row in rows])
        logits = {name: target.forward(tokens, caches[name])[1] for name, target in targets.items()}
        assert mx.array_equal(logits["fused"], logits["unfused"]).item(), (start, width)
        if start == 37:  # the verify: roll the second row back as a rejection would
            for cache in caches["fused"] + caches["unfused"]:
                cache.trim_rows([0, 3])
    for fused, unfused in zip(caches["fused"], caches["unfused"]):
        assert fused.lengths == unfused.lengths
        assert fused.keys.dtype == unfused.keys.dtype == fused.values.dtype == kv_dtype
        end = max(fused.lengths)
        assert mx.array_equal(fused.keys[..., :end, :], unfused.keys[..., :end, :]).item()
        assert mx.array_equal(fused.values[..., :end, :], unfused.values[..., :end, :]).item()


def test_fused_ops_refuse_mismatched_shapes():
    ext = cpu_kernels.extension()
    x = mx.zeros((1, 2, 64))
    with pytest.raises(ValueError, match="attention_inputs: x must be"):
        ext.attention_inputs(mx.zeros((2, 64)), mx.ones((64,)), 1e-5, mx.array([0]), [], 4, 2, 16, [4] * 3, 16,
                             False, 1e4, 1.0)
    with pytest.raises(ValueError, match="attention_inputs: the products. weights, then optionally the q and k"):
        ext.attention_inputs(x, mx.ones((64,)), 1e-5, mx.array([0]), [], 4, 2, 16, [4] * 3, 16, False, 1e4, 1.0)
    with pytest.raises(ValueError, match="project_add: quads must be the uint8 layout of 64 outputs x 64 inputs"):
        ext.project_add(x, mx.zeros((10,), dtype=mx.uint8), x, 4)
    with pytest.raises(ValueError, match="qkv_biases must be none or q's, k's and v's"):
        ext.attention_inputs(x, mx.ones((64,)), 1e-5, mx.array([0]), [mx.zeros((10,), dtype=mx.uint8)] * 3, 4, 2,
                             16, [4] * 3, 16, False, 1e4, 1.0, [], 1.0, [mx.zeros((64,))])
    with pytest.raises(ValueError, match="mlp_block gate"):
        ext.mlp_block(x, mx.ones((64,)), 1e-5, mx.zeros((10,), dtype=mx.uint8), mx.zeros((10,), dtype=mx.uint8),
                      mx.zeros((10,), dtype=mx.uint8), 128, [4] * 3)


def test_the_layer_stack_refuses_bad_weights_and_buffers(fused_and_unfused):
    target = fused_and_unfused[0]
    ext, stack_call = cpu_kernels.extension(), target.model.model._stack_call
    call = target.model.model.layers[0]._layer_call
    input_norm, post_norm, eps, weights = call.layer_weights
    with pytest.raises(ValueError, match="LayerStack: the products. weights, then optionally the q and k head norms"):
        ext.LayerStack([input_norm], [post_norm], [weights[:6]], [call.layer_bits], eps, *call.layer_sizes,
                       *call.layer_constants)
    with pytest.raises(ValueError, match="LayerStack q"):
        ext.LayerStack([input_norm], [post_norm], [[weights[4], *weights[1:]]], [call.layer_bits], eps,
                       *call.layer_sizes, *call.layer_constants)
    with pytest.raises(ValueError, match="must be evaluated"):  # the node reads them with no graph edge
        ext.LayerStack([input_norm * 1], [post_norm], [weights], [call.layer_bits], eps, *call.layer_sizes,
                       *call.layer_constants)
    x = mx.zeros((1, 1, input_norm.shape[0]))
    heads, head_dim = call.kv_heads_and_dim
    buffer = mx.zeros((1, heads, 16, head_dim))
    num_layers = stack_call.num_layers
    with pytest.raises(ValueError, match="one keys and one values buffer per segment and layer"):
        ext.decoder_stack(stack_call.stack, [x], [mx.array([0])], [buffer], [buffer])
    with pytest.raises(ValueError, match="one keys and one values buffer per segment and layer"):
        ext.decoder_stack(stack_call.stack, [x, x], [mx.array([0])] * 2, [buffer] * num_layers, [buffer] * num_layers)
    with pytest.raises(ValueError, match="one offset per segment, at least one segment"):
        ext.decoder_stack(stack_call.stack, [x, x], [mx.array([0])], [buffer] * num_layers, [buffer] * num_layers)
    with pytest.raises(ValueError, match="one offset per segment, at least one segment"):
        ext.decoder_stack(stack_call.stack, [], [], [], [])
    with pytest.raises(ValueError, match=r"\(B, Hkv, S, Dh\)"):
        ext.decoder_stack(stack_call.stack, [x], [mx.array([0])], [buffer[:, :, :, :4]] * num_layers,
                          [buffer] * num_layers)
    wide = mx.zeros((2, 1, input_norm.shape[0]))  # the second segment's buffers hold one row, not two
    with pytest.raises(ValueError, match=r"\(B, Hkv, S, Dh\)"):
        ext.decoder_stack(stack_call.stack, [x, wide], [mx.array([0]), mx.array([0, 0])], [buffer] * 2 * num_layers,
                          [buffer] * 2 * num_layers)
    with pytest.raises(ValueError, match="keys and values of one dtype"):  # a cast would be written, not the buffer
        ext.decoder_stack(stack_call.stack, [x], [mx.array([0])], [buffer] * num_layers,
                          [buffer.astype(mx.float16)] * num_layers)


def test_a_stack_write_is_ordered_after_the_last_and_before_the_next_read(gguf_like_target):
    # The stack writes the KV buffers in place without new arrays for them: two forwards built
    # before any eval, of inputs that do not depend on each other, must still run in order, and
    # the keys read after must hold both writes (as with an eval between them).
    body, tokens = gguf_like_target.model.model, mx.array([[5, 17, 300, 41], [9, 1000, 77, 3]])
    num_layers = len(body.layers)
    results = []
    for is_eval_between in (True, False):
        caches = [RaggedKVCache(num_rows=2, stored_dtype=mx.float16) for _ in range(num_layers)]
        first = body(tokens[:, :3], caches)
        if is_eval_between:
            mx.eval(first)
        body(tokens[:, 3:], caches)  # its input does not depend on the first forward's output
        results.append([(c.keys[..., :4, :], c.values[..., :4, :]) for c in caches])
    assert type(body) in STACKED_BODIES
    for (k, v), (k_lazy, v_lazy) in zip(*results):
        assert mx.array_equal(k, k_lazy).item() and mx.array_equal(v, v_lazy).item()
        assert mx.abs(k_lazy.astype(mx.float32)).sum(axis=(0, 1, 3)).min().item() > 0  # every position written


def _address(array: mx.array) -> int:
    return np.asarray(memoryview(array)).ctypes.data


@pytest.mark.parametrize("form", FORMS[:2])
def test_a_decode_step_is_one_node_writing_the_kv_in_place(fused_and_unfused, tmp_path, form, kv_dtype):
    """The point of the one-node forms: a step's graph holds one kernel node for all the layers
    (or one per layer) and no separate KV writes, and the cache's buffers stay where they are
    from step to step."""
    target = fused_and_unfused[0]
    stack_call = target.model.model._stack_call
    num_layers = len(target.model.model.layers)
    cache = [RaggedKVCache(stored_dtype=kv_dtype) for _ in range(num_layers)]
    _set_form(target, form, stack_call)
    try:
        mx.eval(target.forward(mx.array([[5, 6, 7, 8]]), cache)[1])
        addresses = [(_address(c.keys), _address(c.values)) for c in cache]
        logits = target.forward(mx.array([[9]]), cache)[1]
    finally:
        _set_form(target, "stack", stack_call)
    path = tmp_path / "step.dot"
    mx.export_to_dot(str(path), logits)
    labels = re.findall(r'label ="([^"]+)"', path.read_text())
    expected = {"GmlxDecoderStackOp": 1, "GmlxDecoderLayerOp": 0} if form == "stack" else {
        "GmlxDecoderStackOp": 0, "GmlxDecoderLayerOp": num_layers}
    assert {name: labels.count(name) for name in expected} == expected
    assert "SliceUpdate" not in labels
    mx.eval(logits)
    assert [(_address(c.keys), _address(c.values)) for c in cache] == addresses  # a float16 cache too: no cast
    assert all(c.keys.dtype == c.values.dtype == kv_dtype for c in cache)


def test_a_round_with_prompt_chunks_is_one_node_writing_every_kv_in_place(fused_and_unfused, tmp_path):
    """A round's decode rows and the chunks it carries run as segments of one stack node, their
    products sharing a pass over the weights; each segment's buffers stay where they are."""
    target = fused_and_unfused[0]
    num_layers = len(target.model.model.layers)
    caches = [[RaggedKVCache(num_rows=n) for _ in range(num_layers)] for n in (2, 1, 1)]
    for cache, prefix in zip(caches, ([[3, 4, 5], [6, 7, 8]], [[9, 10]], [[11]])):
        mx.eval(target.body(mx.array(prefix), cache))
    addresses = [(_address(c.keys), _address(c.values)) for cache in caches for c in cache]
    segments = [Segment(mx.array([[12, 13], [14, 15]]), caches[0]), Segment(mx.array([[16, 17, 18]]), caches[1]),
                Segment(mx.array([[19] * 5]), caches[2])]
    hidden = segment_bodies(target.model.model, segments)
    path = tmp_path / "round.dot"
    mx.export_to_dot(str(path), *hidden)
    labels = re.findall(r'label ="([^"]+)"', path.read_text())
    assert labels.count("GmlxDecoderStackOp") == 1 and "GmlxDecoderLayerOp" not in labels
    mx.eval(hidden)
    assert [h.shape[:2] for h in hidden] == [(2, 2), (1, 3), (1, 5)]
    assert [c.lengths for c in (cache[0] for cache in caches)] == [[5, 5], [5], [6]]
    assert [(_address(c.keys), _address(c.values)) for cache in caches for c in cache] == addresses


def test_buffers_shared_with_a_prompt_cache_entry_are_copied_before_a_write(fused_and_unfused, kv_dtype):
    """A cache restored from a prompt-cache entry views the entry's arrays: the one-node layer
    must leave the entry's bits alone, and an offered entry must not view a live buffer."""
    target = fused_and_unfused[0]
    num_layers = len(target.model.model.layers)
    prompt = [11 + i % 50 for i in range(256)]  # the buffers' whole capacity: a contiguous slice
    store = PromptCache(max_bytes=1 << 30)
    cache = [RaggedKVCache(stored_dtype=kv_dtype) for _ in range(num_layers)]
    mx.eval(target.forward(mx.array([prompt]), cache)[1])
    store.offer(prompt, cache, 0)
    entry = store._entries[tuple(prompt)]
    assert all(k.dtype == v.dtype == kv_dtype for k, v in zip(entry.keys, entry.values))
    assert all(_address(k) != _address(c.keys) for k, c in zip(entry.keys, cache))
    before = [np.array(k) for k in entry.keys]
    restored, num_hit = store.fetch(prompt + [7])
    assert num_hit == len(prompt)
    for c in restored:  # a write inside the entry's span (rolled back two positions, two written)
        c.trim_rows([2])
    mx.eval(target.forward(mx.array([[99, 7]]), restored)[1])
    assert all(np.array_equal(b, np.array(k)) for b, k in zip(before, entry.keys))
