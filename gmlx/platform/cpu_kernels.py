"""gmlx's CPU decode kernels (native/mlx_cpu_kernels), an MLX extension built at install.

The extension adds MLX ops: a product with affine-quantized weights (4 or 8 bits,
group size 32/64/128) built for decode's few rows, that reads the weights once for all rows, runs
AVX-512 or AVX2 chosen at run time and spreads output columns over a thread pool. Each
output element is summed in a fixed order, so a row's result does not depend on how
many rows or threads share the call (what keeps speculative verification lossless).
Beside it, the decode step's small ops as one graph node each (RoPE with per-row
offsets, RMSNorm, attention over the ragged KV), under the same row-independence.
Calls of 8 rows or more (wide verifies, prefill chunks) take a blocked path that dequantizes each
weight panel once for all rows and sums in that same order, near float32 BLAS speed.
With GMLX_CPU_QUANT_ACTIVATIONS=int8 (the default) the 4-bit products instead quantize their
input rows to int8 per 32 inputs and run integer dot products at every row count (llama.cpp's
Q4 x Q8 scheme), under the same row, thread and ISA independence.
When the extension is not built, or was built against another mlx release, gmlx runs
on MLX's own ops; `status()` says which and why.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from gmlx import config

logger = logging.getLogger(__name__)

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# Modules the int8 mode swaps in: 4- and 8-bit ones (the head included). 8-bit layers stayed on
# float x until session 51: then, on SmolLM2 Q8_0 (Zen 4), int8 x decoded 3.1x faster (AVX2
# kernels forced: 3.0x) and prefilled 2.2-2.5x faster (AVX2: 1.1x) (BENCHMARKS.md, session 51).
INT8_ACTIVATIONS_BITS = (4, 8)
INT8_ACTIVATIONS_HEAD_BITS = (4, 8)
# Load-time probe of the int8-activation path: largest |error| against dequantize + float32
# matmul, relative to the largest |reference|. Measured on random normal x: 0.3-0.7%
# (quantizing x to 8 bits per 32 inputs); the float path's probe allows 1e-4.
INT8_ACTIVATIONS_RTOL = 2e-2
# The float32 panel layout (native/mlx_cpu_kernels/float_matmul.h): outputs per panel, and the
# bits value the fused layer ops take for it.
PANEL_OUTPUTS = 64
FLOAT_BITS = 32
K4_BITS = 260  # the K-tile layouts' tags beside bits 4 and 8 (int8_dot_kernels.h: kK4Bits, kK5Bits, ...)
K2_BITS = 258
K3_BITS = 259
K5_BITS = 261
K6_BITS = 262
FIVE_BITS = 5  # the 5-bit tiles: 8-bit rows whose levels fit 5 bits (a GGUF's Q5_0, Q5_1), VNNI CPUs
IQ4_BITS = 263  # the IQ4 tiles: 8-bit rows whose levels are IQ4's codebook (IQ4_NL, IQ4_XS), VNNI CPUs
# The 16 levels of IQ4's codebook (llama.cpp's non-linear grid plus 128), as int8_dot_kernels.h has them.
IQ4_LEVELS = (1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241)
# The GGUF types the K layouts hold, by the tag of each; all but Q4_K's are walked on VNNI only.
K_TILE_KINDS = {"Q2_K": K2_BITS, "Q3_K": K3_BITS, "Q4_K": K4_BITS, "Q5_K": K5_BITS, "Q6_K": K6_BITS}


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """(the extension module, "") or (None, why it is unavailable)."""
    try:
        import mlx.core as mx  # first: the extension binds mlx.core's array type

        from gmlx.platform import _cpu_kernels as ext
    except ImportError as exc:
        return None, f"not built ({exc})"
    if ext.MLX_VERSION != mx.__version__:
        # MLX keeps no C++ ABI across releases: a mismatched build could crash.
        return None, (f"built against mlx {ext.MLX_VERSION}, running mlx {mx.__version__} "
                      "(reinstall gmlx with --no-build-isolation to build against this mlx)")
    try:
        # nanobind passes mx.array between modules only when both share its ABI.
        w, scales, biases = mx.quantize(mx.ones((1, 32)), group_size=32, bits=4)
        mx.eval(ext.quantized_matmul(mx.ones((1, 32)), w, scales, biases, 32, 4))
    except TypeError as exc:
        return None, f"cannot exchange arrays with mlx ({exc}); rebuild with mlx's nanobind version"
    layout = (ext.PANEL_OUTPUTS, ext.FLOAT_BITS, getattr(ext, "K2_BITS", None), getattr(ext, "K3_BITS", None),
              ext.K4_BITS, getattr(ext, "K5_BITS", None), ext.K6_BITS, getattr(ext, "IQ4_BITS", None))
    if layout != (PANEL_OUTPUTS, FLOAT_BITS, K2_BITS, K3_BITS, K4_BITS, K5_BITS, K6_BITS, IQ4_BITS):
        return None, "built with other weight layouts (float32 panels, K-tiles) than this gmlx (reinstall to rebuild)"
    isa = config.cpu_kernels_isa()
    if isa is not None:
        ext.set_isa(isa)  # ValueError naming the ISA when this CPU lacks it
    tiles = config.cpu_tile_layout()
    if tiles is not None or (isa is not None and isa != "avx512"):
        ext.set_tile_layout(bool(tiles))  # tiles run fast on VNNI only; a forced ISA keeps quads
    amx = config.cpu_amx()
    if amx is not None and hasattr(ext, "set_amx"):
        ext.set_amx(int(amx))
    num_threads = config.cpu_kernels_threads()
    if num_threads is not None:
        ext.set_num_threads(num_threads)
    return ext, ""


def build_files() -> list[Path]:
    """The loaded extension's file (its size and time identify the build); none when not loaded."""
    ext = _load()[0]
    return [Path(ext.__file__)] if ext is not None else []


def is_built() -> bool:
    """Is the extension built and loadable against this mlx (whatever GMLX_CPU_KERNELS says)?"""
    return _load()[0] is not None


def is_available() -> bool:
    """Are the fast quantized CPU kernels built, loadable and switched on (GMLX_CPU_KERNELS)?

    A compute-format chooser asks this before preferring 4-bit weights on the CPU.
    """
    return config.is_cpu_kernels_enabled() and is_built()


def extension() -> ModuleType:
    ext, reason = _load()
    if ext is None:
        raise RuntimeError(f"gmlx CPU kernels unavailable: {reason}")
    return ext


def can_run(bits: int, group_size: int, mode: str = "affine") -> bool:
    return mode == "affine" and bits in SUPPORTED_BITS and group_size in SUPPORTED_GROUP_SIZES


def quantized_matmul(x, w, scales, biases, group_size: int, bits: int, int8_activations: bool = False):
    """x @ dequantize(w, scales, biases, group_size, bits).T, x float32 (..., K); float32 out.

    int8_activations: x quantized to int8 per 32 inputs and integer dots,
    within INT8_ACTIVATIONS_RTOL of the float product rather than bit-close to it."""
    return extension().quantized_matmul(x, w, scales, biases, group_size, bits, int8_activations)


def pack_quads(w, scales, biases, group_size: int, bits: int, layout_bits: int | None = None):
    """The int8 path's weights as one stream (int8_dot_kernels.h): 16-output tiles where the
    extension's tile_layout() is on (VNNI CPUs), else quads (per four outputs and 128-input
    chunk, their packed weights, then 16 float16 scales and 16 biases; a K of at most 64 past
    whole chunks ends in a half chunk where half_tails() is on). One node of the extension's,
    packed under the settings of this call.

    scales and biases must be float16 (exact: the kernels read those very values). layout_bits
    FIVE_BITS packs 8-bit rows whose levels all fit 5 bits as the 5-bit tiles, IQ4_BITS those whose
    levels all are IQ4_LEVELS as the IQ4 tiles (narrow_tiles_available; the caller checks the levels:
    others are not kept)."""
    import mlx.core as mx

    assert scales.dtype == mx.float16 and biases.dtype == mx.float16, (scales.dtype, biases.dtype)
    return extension().pack_quads(w, scales, biases, group_size, bits, layout_bits or bits)


def narrow_tiles_available() -> bool:
    """Can 8-bit rows of narrower levels be packed as the 5-bit or IQ4 tiles now (the extension's tile
    layout, on a CPU with VNNI: other ISAs would walk them in portable code)?"""
    return is_built() and extension().tile_layout() and extension().has_avx512_vnni()


def k_tile_bits(kind: str) -> int | None:
    """The K-tile layout a GGUF matrix of `kind` can be packed in now, as the kernels name it, else
    None: Q4_K's under the extension's tile layout; the other K-quants' (Q2_K, Q3_K, Q5_K, Q6_K) there on
    a CPU with VNNI only (its other ISAs would walk their K-tiles in portable code)."""
    if not is_built() or not extension().tile_layout() or kind not in K_TILE_KINDS:
        return None
    return K_TILE_KINDS[kind] if kind == "Q4_K" or extension().has_avx512_vnni() else None


def pack_k_quant_tiles(blocks, kind: str):
    """A GGUF K-quant (Q2_K to Q6_K) matrix's blocks (numpy uint8, rows x block bytes, read where they lie)
    as K-tiles (int8_dot_kernels.h), whose kernels take bits K_TILE_KINDS[kind]: the type's own
    float16 super-block scales and integer sub-block scales, exact. Under the tile layout only."""
    import numpy as np

    return extension().pack_k_quant_tiles(np.ascontiguousarray(blocks), kind)


def lookup_quads(quads, ids, num_outputs: int, num_inputs: int, bits: int):
    """Rows `ids` of the weights pack_quads laid out, dequantized: an embedding's lookup when its
    weights live only in that layout (the tied output head). The very floats of the plain rows,
    in one graph node (mx.dequantize over gathered lanes took ~75 a step)."""
    return extension().quad_rows(quads, ids, num_outputs, num_inputs, bits)


def quantized_matmul_quads(x, quads, num_outputs: int, bits: int):
    """quantized_matmul(..., int8_activations=True) over pack_quads's layout: the same bits."""
    return extension().quantized_matmul_quads(x, quads, num_outputs, bits)


def quantized_matmul_quads_group(x, quads: list, num_outputs: list[int], bits: int) -> list:
    """quantized_matmul_quads of one x over several weights (q/k/v, gate/up) as one graph node:
    x quantized once, one pool job; each result has the bits of its own call."""
    return extension().quantized_matmul_quads_group(x, quads, num_outputs, bits)


def packed_weights(module):
    """A kernel product's weights as the fused layer ops take them: quads (4/8 bits) or float32 panels."""
    return module["quads"] if "quads" in module else module["panels"]


def packed_bits(module) -> int:
    """The layout packed_weights(module) is in, as the kernels name it: 4, 5, 8, IQ4_BITS, a K layout's or
    FLOAT_BITS."""
    return module.layout_bits if "quads" in module else module.bits


class LayerCall:
    """A fused llama (or qwen3) layer's weights and constants in the order its ops take them, read
    from the modules once: building a step's graph re-read them through ~18 module attribute
    lookups a layer (~0.6 ms a SmolLM2 step). A layer's weights never change after load."""

    def __init__(self, block, rope: tuple):
        """rope: the attention's (dims, traditional, base, scale, freqs, mscale) (cpu_decode_ops.rope_constants)."""
        attention, mlp = block.self_attn, block.mlp
        norm = block.input_layernorm
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        # qwen3's q and k norms over each head ride after the products (the ops take them there).
        head_norms = [attention.q_norm["weight"], attention.k_norm["weight"]] if "q_norm" in attention else []
        self.inputs_weights = (norm["weight"], norm.eps, [packed_weights(p) for p in projections] + head_norms)
        # qwen2's q, k and v biases (all three or none: is_fusable), added as mlx adds them.
        self.qkv_biases = [p["bias"] for p in projections] if "bias" in attention.q_proj else []
        self.inputs_shape = (attention.n_heads, attention.n_kv_heads, attention.q_proj.num_outputs // attention.n_heads,
                             [packed_bits(p) for p in projections], *rope)
        self.scale = attention.scale
        self.output_weights, self.output_bits = packed_weights(attention.o_proj), packed_bits(attention.o_proj)
        post_norm = block.post_attention_layernorm
        mlp_products = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        self.mlp = (post_norm["weight"], post_norm.eps, *[packed_weights(p) for p in mlp_products],
                    mlp.gate_proj.num_outputs, [packed_bits(p) for p in mlp_products])
        # The whole layer in one node needs one eps for both norms (llama's config has one).
        self.is_one_node = config.is_one_node_layers_enabled() and post_norm.eps == norm.eps
        products = (*projections, attention.o_proj, *mlp_products)
        self.layer_weights = (norm["weight"], post_norm["weight"], norm.eps,
                              [packed_weights(p) for p in products] + head_norms)
        # Each product's bits: a K-quant GGUF mixes 4 and 8 bits within a layer and between layers.
        self.layer_bits = [packed_bits(p) for p in products]
        self.layer_sizes = (attention.n_heads, attention.n_kv_heads, attention.q_proj.num_outputs // attention.n_heads,
                            mlp.gate_proj.num_outputs)
        self.layer_constants = (attention.scale, *rope)
        self.kv_heads_and_dim = self.layer_sizes[1:3]  # the KV buffers' (Hkv, Dh)

    def layer(self, x, offset, keys, values):
        """The whole layer as one node: [h, keys, values], row b's new keys and values written at
        offset[b] into the buffers themselves (no other array may share them:
        RaggedKVCache.writable_buffers); the returned keys and values alias them."""
        input_norm, post_norm, eps, weights = self.layer_weights
        return extension().decoder_layer(x, offset, keys, values, input_norm, post_norm, eps, weights,
                                         *self.layer_sizes, self.layer_bits, *self.layer_constants, self.qkv_biases)

    def attention_inputs(self, x, offset):
        """Norm, q/k/v products and RoPE as one node: q (B, Hq, T, Dh), k and v (B, Hkv, T, Dh),
        the bits of the separate ops (gmlx/platform/cpu_layers.py)."""
        weight, eps, quads = self.inputs_weights
        return extension().attention_inputs(x, weight, eps, offset, quads, *self.inputs_shape, self.qkv_biases)

    def project_add(self, a, residual):
        """residual + o_proj(a) as one node."""
        return extension().project_add(a, self.output_weights, residual, self.output_bits)

    def mlp_block(self, h):
        """h + mlp(norm(h)) as one node."""
        return extension().mlp_block(h, *self.mlp)


def float_matmul(x, panels, num_outputs: int):
    """x @ W.T for float32 x (..., K), W (N, K) kept as panels (gmlx/platform/cpu_float.py)."""
    return extension().float_matmul(x, panels, num_outputs)


def swiglu(gate, up):
    """mlx-lm's swiglu (silu(gate) * up) for float32 gate and up of one shape, elementwise."""
    return extension().swiglu(gate, up)


def rms_norm(x, weight, eps: float):
    """mx.fast.rms_norm for float32 x (..., D) and weight (D,)."""
    return extension().rms_norm(x, weight, eps)


def token_logprobs(logits, tokens, num_top: int) -> list:
    """[chosen (N,), top ids (N, K), top logprobs (N, K)] for float32 logits (N, V), int32 tokens
    (N,) and K = num_top >= 1: each row's log-softmax at its token and its K likeliest, most
    likely first (ties by lower id)."""
    return extension().token_logprobs(logits, tokens, num_top)


def has_token_logprobs() -> bool:
    return is_available() and hasattr(extension(), "token_logprobs")


def rope(x, dims: int, traditional: bool, base: float, scale: float, offset, freqs=(), mscale: float = 1.0):
    """mx.fast.rope for float32 x (B, ..., T, D); offset an int32 array, scalar or one per row b;
    freqs: mx.fast.rope's (dims / 2 of them; base is then unused); mscale: YaRN's factor on the
    rotated features."""
    return extension().rope(x, dims, traditional, base, scale, offset, list(freqs), mscale)


def ragged_attention(q, keys, values, offset, scale: float):
    """softmax(q k^T * scale) v, q (B, Hq, T, D) against (B, Hkv, S, D) keys and values;
    row b's query t sees keys [0, offset[b] + t]. Returns (B, T, Hq * D)."""
    return extension().ragged_attention(q, keys, values, offset, scale)


def is_close_to(got, expected, tolerance: float) -> bool:
    """The swaps' load-time probe: |got - expected| <= tolerance x max(|expected|, 1) everywhere."""
    import mlx.core as mx

    return (mx.abs(got - expected).max() <= tolerance * mx.maximum(mx.abs(expected).max(), 1.0)).item()


def read_bandwidth_gbs(num_bytes: int = 512 << 20, num_passes: int = 5) -> float:
    """DRAM read rate: the best of num_passes threaded sums over a num_bytes buffer."""
    return extension().read_bandwidth(num_bytes, num_passes)


def status() -> dict:
    """What `gmlx doctor` reports about the kernels."""
    ext, reason = _load()
    report = {"built": ext is not None, "enabled": config.is_cpu_kernels_enabled(), "reason": reason or None}
    if ext is not None:
        report.update(isa=ext.isa(), best_isa=ext.best_isa(), num_threads=ext.num_threads(),
                      decode_ops=config.is_cpu_decode_ops_enabled() and hasattr(ext, "ragged_attention"),
                      quant_activations=config.cpu_quant_activations() if hasattr(ext, "has_avx512_vnni") else "float",
                      has_vnni=hasattr(ext, "has_avx512_vnni") and ext.has_avx512_vnni(),
                      has_amx=hasattr(ext, "has_amx") and ext.has_amx(),
                      amx=hasattr(ext, "is_amx_enabled") and ext.is_amx_enabled(),
                      quad_layout=config.is_quad_layout_enabled() and hasattr(ext, "quantized_matmul_quads"),
                      half_tails=hasattr(ext, "half_tails") and ext.half_tails(),
                      tile_layout=hasattr(ext, "tile_layout") and ext.tile_layout(),
                      gfni=hasattr(ext, "is_gfni_enabled") and ext.is_gfni_enabled(),
                      five_bit_tiles=config.is_five_bit_tiles_enabled() and narrow_tiles_available(),
                      iq4_tiles=config.is_iq4_tiles_enabled() and narrow_tiles_available(),
                      k_tiles=[kind for kind in K_TILE_KINDS
                               if config.is_k_tile_layout_enabled() and k_tile_bits(kind) is not None],
                      tile_prefetch_blocks=ext.tile_prefetch_blocks() if hasattr(ext, "tile_prefetch_blocks") else 0,
                      panel_prefetch_bytes=ext.panel_prefetch_bytes() if hasattr(ext, "panel_prefetch_bytes") else 0,
                      fused_layers=config.is_fused_layers_enabled() and hasattr(ext, "mlp_block"),
                      float_panels=config.is_cpu_float_kernels_enabled() and hasattr(ext, "float_matmul"),
                      token_logprobs=config.is_cpu_kernels_enabled() and hasattr(ext, "token_logprobs"))
    return report


def format_status(report: dict) -> str:
    if not report["built"]:
        return f"cpu kernels: unavailable, {report['reason']}; quantized products run in mlx"
    state = "on" if report["enabled"] else "off (GMLX_CPU_KERNELS=0)"
    ops = "on" if report["decode_ops"] else "off"
    vnni = ", VNNI" if report.get("has_vnni") else ""
    if not report.get("quad_layout"):
        layout = "row layout"
    elif report.get("tile_layout"):
        ahead = report.get("tile_prefetch_blocks", 0)
        layout = ("one-stream layout as 16-output tiles (GMLX_CPU_TILE_LAYOUT), "
                  + (f"prefetched {ahead} blocks ahead" if ahead else "no software prefetch"))
        if report.get("has_amx"):
            layout += ", wide products on AMX (GMLX_CPU_AMX)" if report.get("amx") else ", AMX off (GMLX_CPU_AMX=0)"
        kinds = report.get("k_tiles")
        named = " and ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
        gfni = "; top bits by GFNI" if {"Q3_K", "Q5_K", "Q6_K"} & set(kinds or []) and report.get("gfni") else ""
        layout += f", GGUF {named} as K-tiles (GMLX_CPU_K_TILES{gfni})" if kinds else ", no K-tiles"
        if report.get("five_bit_tiles"):
            layout += ", 8-bit rows of 5-bit levels as 5-bit tiles (GMLX_CPU_FIVE_BIT_TILES)"
        if report.get("iq4_tiles"):
            layout += ", of IQ4 levels as IQ4 tiles (GMLX_CPU_IQ4_TILES)"
    else:
        layout = "one-stream layout as quads" + (", half tail chunks" if report.get("half_tails") else "")
    layers = "layers apart"
    if report.get("fused_layers") and report["decode_ops"]:
        if not config.is_one_node_layers_enabled():
            layers = "fused llama layers, six nodes each"
        else:
            layers = "fused llama layers, " + ("one node a step where they stack" if config.is_layer_stack_enabled()
                                               else "one node each")
    floats = "float32 products in the BLAS"
    if report.get("float_panels"):
        ahead = report.get("panel_prefetch_bytes", 0)
        floats = "float32 products on panels" + (f" prefetched {ahead} bytes ahead" if ahead else "")
    return (f"cpu kernels: {state}, {report['isa']} (best {report['best_isa']}{vnni}), {report['num_threads']} "
            f"threads; norm/rope/attention/swiglu ops {ops}; activations {report.get('quant_activations', 'float')}; "
            f"{layout} where scales allow (GMLX_CPU_QUAD_LAYOUT); {layers} (GMLX_CPU_FUSED_LAYERS, "
            "GMLX_CPU_ONE_NODE_LAYERS, GMLX_CPU_LAYER_STACK); "
            f"{floats} (GMLX_CPU_FLOAT_KERNELS)"
            + ("; logprobs in the kernels" if report.get("token_logprobs") else "; logprobs in mlx ops"))
