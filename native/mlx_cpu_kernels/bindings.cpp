// Python bindings of gmlx's CPU decode kernels (module gmlx.platform._cpu_kernels).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "mlx/version.h"
#include "attention.h"
#include "decoder_layer.h"
#include "float_matmul.h"
#include "int8_dot_kernels.h"
#include "int8_many_rows.h"
#include "gguf_blocks.h"
#include "pack_layout.h"
#include "quad_rows.h"
#include "quantized_matmul.h"
#include "rms_norm.h"
#include "rope.h"
#include "swiglu.h"
#include "thread_pool.h"
#include "token_logprobs.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {
// Python's handle on a LayerStack. The node's task holds the stack by a C++ shared_ptr: one
// from nanobind's caster would drop a Python reference on mlx's stream thread, without the GIL.
struct LayerStackHandle {
  std::shared_ptr<const gmlx_kernels::LayerStack> stack;
};
}  // namespace

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "gmlx CPU decode kernels for MLX (few-row quantized products, RoPE, RMSNorm, attention)";
  // The loader compares this with mlx.__version__: the C++ ABI is only kept per release.
  m.attr("MLX_VERSION") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
                          std::to_string(MLX_VERSION_PATCH);
  m.def("quantized_matmul", &gmlx_kernels::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "int8_activations"_a = false,
        "x @ dequantize(w, scales, biases, group_size, bits).T for float32 x; fixed order per output "
        "(int8_activations: x quantized to int8 per 32 inputs, integer dots)");
  m.def("float_matmul", &gmlx_kernels::float_matmul, "x"_a, "panels"_a, "num_outputs"_a,
        "x @ W.T for float32 x (..., K) and W kept as panels (ceil(N / 64), K, 64): one fma chain per output "
        "over k, the same at every row count, thread count and ISA");
  m.attr("PANEL_OUTPUTS") = gmlx_kernels::kPanelOutputs;
  m.def("set_panel_prefetch_bytes", &gmlx_kernels::set_panel_prefetch_bytes, "num_bytes"_a,
        "Bytes ahead a float32 panel stream prefetches (0: off, < 0: the CPU's default, 3072 on Intel and 0 elsewhere; same bits)");
  m.def("panel_prefetch_bytes", &gmlx_kernels::panel_prefetch_bytes);
  m.attr("FLOAT_BITS") = gmlx_kernels::kFloatBits;
  m.def("quantized_matmul_quads", &gmlx_kernels::quantized_matmul_quads, "x"_a, "quads"_a, "num_outputs"_a, "bits"_a,
        "quantized_matmul's int8 path over weights in the quad-interleaved layout (same bits)");
  m.def("set_prefetch_chunks", &gmlx_kernels::set_prefetch_chunks, "num_chunks"_a,
        "Steps ahead the one-stream kernels prefetch (quads: chunks, tiles: blocks; 0: off, < 0: each layout's default; same bits)");
  m.def("prefetch_chunks", &gmlx_kernels::prefetch_chunks);
  m.def("tile_prefetch_blocks", &gmlx_kernels::tile_prefetch_blocks,
        "Blocks ahead the tile kernels prefetch now (the setting, else 8 on Intel CPUs and 0 on others)");
  m.def("quantized_matmul_quads_group", &gmlx_kernels::quantized_matmul_quads_group, "x"_a, "quads"_a,
        "num_outputs"_a, "bits"_a, "quantized_matmul_quads of one x over several weights, one graph node");
  m.def("pack_quads", &gmlx_kernels::pack_quads, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "layout_bits"_a = 0,
        "mlx's affine rows (float16 scales and biases) in the one-stream layout: tiles or quads, as set now "
        "(layout_bits 5: 8-bit rows whose levels fit 5 bits as the 5-bit tiles; IQ4_BITS: whose levels are "
        "IQ4's codebook, as the IQ4 tiles)");
  m.attr("IQ4_BITS") = gmlx_kernels::kIq4Bits;
  m.def(
      "decode_gguf_blocks",
      [](nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> blocks, const std::string& kind) {
        nb::gil_scoped_release unlocked;  // the call holds the buffer's owner
        return gmlx_kernels::decode_gguf_blocks(blocks.data(), static_cast<int64_t>(blocks.shape(0)),
                                                static_cast<int64_t>(blocks.shape(1)), kind);
      },
      "blocks"_a, "kind"_a,
      "GGUF K-quant rows (Q2_K to Q6_K; a uint8 buffer, rows x block bytes, read in place) as MLX "
      "triplets [weight, scales, biases] (4 and 8 bits, group 32), decoded now: gguf_blocks.py's numpy decoders, "
      "operation for operation");
  m.def("lazy_gguf_triplets", &gmlx_kernels::lazy_gguf_triplets, "path"_a, "offset"_a, "num_rows"_a, "row_bytes"_a,
        "kind"_a,
        "decode_gguf_blocks's triplets of a file's K-quant rows at a byte offset, as lazy nodes: decoded "
        "when evaluated (the file mapped while they live)");
  m.def(
      "pack_k_quant_tiles",
      [](nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> blocks, const std::string& kind) {
        nb::gil_scoped_release unlocked;
        return gmlx_kernels::pack_k_quant_tiles(blocks.data(), static_cast<int64_t>(blocks.shape(0)),
                                                static_cast<int64_t>(blocks.shape(1)), kind);
      },
      "blocks"_a, "kind"_a,
      "GGUF K-quant rows (Q2_K to Q6_K; a uint8 buffer, rows x block bytes, read in place) as K-tiles "
      "(bits K2_BITS to K6_BITS), packed now; the tile layout only");
  m.attr("K2_BITS") = gmlx_kernels::kK2Bits;
  m.attr("K3_BITS") = gmlx_kernels::kK3Bits;
  m.attr("K4_BITS") = gmlx_kernels::kK4Bits;
  m.attr("K5_BITS") = gmlx_kernels::kK5Bits;
  m.attr("K6_BITS") = gmlx_kernels::kK6Bits;
  m.def("quad_rows", &gmlx_kernels::quad_rows, "quads"_a, "ids"_a, "num_outputs"_a, "num_inputs"_a, "bits"_a,
        "Rows `ids` of weights kept in the quad layout, dequantized (mx.dequantize's floats), one node");
  m.def("set_half_tails", &gmlx_kernels::set_half_tails, "is_enabled"_a,
        "Whether quad layouts packed from now on end a K of 64 past a chunk in a half chunk (same bits)");
  m.def("half_tails", &gmlx_kernels::half_tails);
  m.def("set_tile_layout", &gmlx_kernels::set_tile_layout, "is_enabled"_a,
        "Whether one-stream layouts packed from now on are 16-output tiles (default: VNNI CPUs) or quads");
  m.def("tile_layout", &gmlx_kernels::tile_layout);
  m.def("has_amx", &gmlx_kernels::has_amx);
  m.def("set_amx", &gmlx_kernels::set_amx, "setting"_a,
        "AMX for the tiles' groups of 8-16 rows: 0 off, 1 on where has_amx(), -1 the default (on where it is)");
  m.def("amx_setting", &gmlx_kernels::amx_setting);
  m.def("is_amx_enabled", &gmlx_kernels::is_amx_enabled);
  m.def("quad_layout_bytes", &gmlx_kernels::quad_layout_bytes, "num_outputs"_a, "num_inputs"_a, "bits"_a);
  m.def("has_avx512_vnni", &gmlx_kernels::has_avx512_vnni);
  m.def("has_gfni", &gmlx_kernels::has_gfni);
  m.def("set_gfni", &gmlx_kernels::set_gfni, "setting"_a,
        "GFNI for the K5- and K6-tiles' top bits: 0 off, 1 on where has_gfni(), -1 the default (on where it is)");
  m.def("gfni_setting", &gmlx_kernels::gfni_setting);
  m.def("is_gfni_enabled", &gmlx_kernels::is_gfni_enabled);
  m.def("rope", &gmlx_kernels::rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a,
        "freqs"_a = std::vector<float>{}, "mscale"_a = 1.0f,
        "mx.fast.rope for float32 x (B, ..., T, D) with an int32 offset scalar or one per row b (freqs: "
        "mx.fast.rope's, dims / 2 of them, base then unused; mscale: YaRN's factor on the rotated features)");
  m.def("attention_inputs", &gmlx_kernels::attention_inputs, "x"_a, "norm_weight"_a, "eps"_a, "offset"_a, "quads"_a,
        "num_q_heads"_a, "num_kv_heads"_a, "head_dim"_a, "bits"_a, "rope_dims"_a, "rope_traditional"_a, "rope_base"_a,
        "rope_scale"_a, "rope_freqs"_a = std::vector<float>{}, "rope_mscale"_a = 1.0f,
        "qkv_biases"_a = std::vector<mlx::core::array>{},
        "rms_norm, the q/k/v quad-layout products (plus qwen2's biases) and RoPE of a llama layer as one node: "
        "[q, k, v]");
  m.def("project_add", &gmlx_kernels::project_add, "a"_a, "quads"_a, "residual"_a, "bits"_a,
        "residual + a @ W.T over a quad-layout W, one node");
  m.def("mlp_block", &gmlx_kernels::mlp_block, "h"_a, "norm_weight"_a, "eps"_a, "gate_quads"_a, "up_quads"_a,
        "down_quads"_a, "hidden_dims"_a, "bits"_a, "h + down(swiglu(gate(n), up(n))), n = rms_norm(h), one node");
  m.def("decoder_layer", &gmlx_kernels::decoder_layer, "x"_a, "offset"_a, "keys"_a, "values"_a,
        "input_norm_weight"_a, "post_norm_weight"_a, "eps"_a, "weights"_a, "num_q_heads"_a, "num_kv_heads"_a,
        "head_dim"_a, "hidden_dims"_a, "bits"_a, "attention_scale"_a, "rope_dims"_a, "rope_traditional"_a,
        "rope_base"_a, "rope_scale"_a, "rope_freqs"_a = std::vector<float>{}, "rope_mscale"_a = 1.0f,
        "qkv_biases"_a = std::vector<mlx::core::array>{},
        "A whole llama layer as one node (attention_inputs, the KV write at offset, ragged attention, project_add, "
        "mlp_block): [h, keys, values], the KV buffers (no other array may share them) written in place");
  nb::class_<LayerStackHandle>(m, "LayerStack", "The weights of a model's llama layers, one shape, for decoder_stack")
      .def(
          "__init__",
          [](LayerStackHandle* self, const std::vector<mlx::core::array>& input_norms,
             const std::vector<mlx::core::array>& post_norms, const std::vector<std::vector<mlx::core::array>>& weights,
             const std::vector<std::vector<int>>& bits, float eps, int num_q_heads, int num_kv_heads, int head_dim,
             int hidden_dims, float attention_scale, int rope_dims, bool rope_traditional, float rope_base,
             float rope_scale, const std::vector<float>& rope_freqs, float rope_mscale,
             const std::vector<std::vector<mlx::core::array>>& qkv_biases) {
            new (self) LayerStackHandle{std::make_shared<const gmlx_kernels::LayerStack>(
                input_norms, post_norms, weights, bits, eps, num_q_heads, num_kv_heads, head_dim, hidden_dims,
                attention_scale, rope_dims, rope_traditional, rope_base, rope_scale, rope_freqs, rope_mscale,
                qkv_biases)};
          },
          "input_norms"_a, "post_norms"_a, "weights"_a, "bits"_a, "eps"_a, "num_q_heads"_a, "num_kv_heads"_a,
          "head_dim"_a, "hidden_dims"_a, "attention_scale"_a, "rope_dims"_a, "rope_traditional"_a, "rope_base"_a,
          "rope_scale"_a, "rope_freqs"_a = std::vector<float>{}, "rope_mscale"_a = 1.0f,
          "qkv_biases"_a = std::vector<std::vector<mlx::core::array>>{})
      .def_prop_ro("num_layers", [](const LayerStackHandle& h) { return h.stack->num_layers(); });
  m.def(
      "decoder_stack",
      [](const LayerStackHandle& h, const std::vector<mlx::core::array>& xs,
         const std::vector<mlx::core::array>& offsets, const std::vector<mlx::core::array>& keys,
         const std::vector<mlx::core::array>& values, const std::vector<mlx::core::array>& after) {
        return gmlx_kernels::decoder_stack(h.stack, xs, offsets, keys, values, after);
      },
      "stack"_a, "xs"_a, "offsets"_a, "keys"_a, "values"_a, "after"_a = std::vector<mlx::core::array>{},
      "Every layer of the stack as one node, each as decoder_layer runs it, over segments of rows (one x and "
      "offset each, their products sharing one pass over the weights): [each h]. keys and values segment by "
      "segment, layer by layer, row-contiguous, written in place (no other array may share them): their readers "
      "must depend on the h (RaggedKVCache.written_by). after: arrays the node runs after (the last writes)");
  m.def("swiglu", &gmlx_kernels::swiglu, "gate"_a, "up"_a, "silu(gate) * up for float32 gate and up of one shape");
  m.def("rms_norm", &gmlx_kernels::rms_norm, "x"_a, "weight"_a, "eps"_a,
        "mx.fast.rms_norm for float32 x (..., D); fixed summation order per row");
  m.def("token_logprobs", &gmlx_kernels::token_logprobs, "logits"_a, "tokens"_a, "num_top"_a,
        "[chosen (N,), top_ids (N, K), top_logprobs (N, K)]: each row's log-softmax at its token and its K >= 1 "
        "likeliest (ties by lower id) for float32 logits (N, V); fixed summation order per row");
  m.def("ragged_attention", &gmlx_kernels::ragged_attention, "q"_a, "keys"_a, "values"_a, "offset"_a, "scale"_a,
        "softmax(q k^T * scale) v over per-row key lengths (offset + t + 1), grouped heads; out (B, T, Hq * D)");
  m.def("set_num_threads", &gmlx_kernels::set_num_threads, "num_threads"_a,
        "Size the kernels' thread pool (< 1: one per CPU this process may use)");
  m.def("num_threads", &gmlx_kernels::pool_num_threads);
  m.def("set_yielding_spin", &gmlx_kernels::set_yielding_spin, "is_yielding"_a);
  m.def("num_pool_jobs", &gmlx_kernels::num_pool_jobs, "Jobs handed to the pool's workers so far");
  m.def("default_num_threads", &gmlx_kernels::default_num_threads);
  m.def("set_isa", &gmlx_kernels::set_isa, "name"_a, "Force 'avx512', 'avx2' or 'portable'");
  m.def("isa", &gmlx_kernels::current_isa);
  m.def("best_isa", &gmlx_kernels::best_isa_name);
  m.def("set_panel_min_rows", &gmlx_kernels::set_panel_min_rows, "num_rows"_a,
        "Rows from which calls take the many-row kernels (same bits; < 1: the default)");
  m.def("panel_min_rows", &gmlx_kernels::panel_min_rows);
  m.def("set_many_rows_min", &gmlx_kernels::set_many_rows_min, "num_rows"_a,
        "Rows from which 4-bit quad products on AVX2 take the unpacked-panel kernel (same bits; < 1: the default)");
  m.def("many_rows_min", &gmlx_kernels::many_rows_min);
  m.def("set_min_pool_macs", &gmlx_kernels::set_min_pool_macs, "num_macs"_a,
        "Products from this many multiply-adds run on the thread pool (same bits; < 0: the default)");
  m.def("min_pool_macs", &gmlx_kernels::min_pool_macs);
  m.def("read_bandwidth", &gmlx_kernels::read_bandwidth, "num_bytes"_a, "num_passes"_a,
        "GB/s of the best of num_passes threaded sums over a num_bytes buffer");
}
