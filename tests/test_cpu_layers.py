"""Fused llama decoder layers (gmlx/platform/cpu_layers.py): four kernel nodes a layer where
every product has packed weights (the quad layout or float32 panels), with the separate graph's bits in every shape the
engine runs (ragged rows, verify widths, prefill chunks)."""

import mlx.core as mx
import pytest

from gmlx.cache.ragged import RaggedKVCache
from gmlx.config import env_overrides
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_layers import FusedLlamaBlock
from kernel_support import requires_kernels

pytestmark = requires_kernels


@pytest.fixture(scope="module", params=["gguf_like_target", "tiny_target"])
def fused_and_unfused(request):
    """A model loaded with its layers fused (quad layout, or float32 panels) and without."""
    fused = request.getfixturevalue(request.param)
    with env_overrides({"GMLX_CPU_FUSED_LAYERS": "0"}):
        return fused, load_model(fused.path)


def test_layers_are_fused_and_the_switch_keeps_them_apart(fused_and_unfused):
    fused, unfused = fused_and_unfused
    assert all(type(layer) is FusedLlamaBlock for layer in fused.model.model.layers)
    assert not any(type(layer) is FusedLlamaBlock for layer in unfused.model.model.layers)


def test_fused_layers_give_the_separate_graphs_bits_on_ragged_rows(fused_and_unfused, code_prompts):
    """Two rows at their own lengths through prefill chunks, a 4-position verify and single
    steps: logits and every KV position bit for bit the unfused layers'."""
    fused_target, unfused_target = fused_and_unfused
    num_layers = len(fused_target.model.model.layers)
    caches = {name: [RaggedKVCache(num_rows=2) for _ in range(num_layers)] for name in ("fused", "unfused")}
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
        end = max(fused.lengths)
        assert mx.array_equal(fused.keys[..., :end, :], unfused.keys[..., :end, :]).item()
        assert mx.array_equal(fused.values[..., :end, :], unfused.values[..., :end, :]).item()


def test_fused_ops_refuse_mismatched_shapes():
    ext = cpu_kernels.extension()
    x = mx.zeros((1, 2, 64))
    with pytest.raises(ValueError, match="attention_inputs: x must be"):
        ext.attention_inputs(mx.zeros((2, 64)), mx.ones((64,)), 1e-5, mx.array([0]), [], 4, 2, 16, 4, 16, False,
                             1e4, 1.0)
    with pytest.raises(ValueError, match="quads of q, k and v"):
        ext.attention_inputs(x, mx.ones((64,)), 1e-5, mx.array([0]), [], 4, 2, 16, 4, 16, False, 1e4, 1.0)
    with pytest.raises(ValueError, match="project_add: quads must be the uint8 layout of 64 outputs x 64 inputs"):
        ext.project_add(x, mx.zeros((10,), dtype=mx.uint8), x, 4)
    with pytest.raises(ValueError, match="mlp_block gate"):
        ext.mlp_block(x, mx.ones((64,)), 1e-5, mx.zeros((10,), dtype=mx.uint8), mx.zeros((10,), dtype=mx.uint8),
                      mx.zeros((10,), dtype=mx.uint8), 128, 4)
