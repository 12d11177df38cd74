// A llama decoder layer's decode path in three MLX nodes instead of ~20, for weights in the quad
// layout (bits 4 or 8) or float32 panels (bits kFloatBits, float_matmul.h), each product its own:
//   attention_inputs: rms_norm, the q/k/v products, RoPE on q and k -> q, k, v (B, H, T, Dh)
//   (the KV write and ragged_attention stay their own nodes)
//   project_add:      residual + a @ W.T (o_proj and the residual add)
//   mlp_block:        h + down(swiglu(gate(n), up(n))), n = rms_norm(h)
//   decoder_layer:    all of a layer in one node: the three stages above with the KV write and
//                     ragged attention between them (h, keys, values out; the KV buffers written in
//                     place), so a step's main thread hands mlx ~40 nodes, not ~190 (each costs it
//                     ~11 us, time the second core's kernels need)
// Each stage calls the code of the separate op (normalize, quads_products or panels_products, rotate,
// apply_swiglu), so every value has the separate graph's bits; the node count and the Python
// that builds it are what shrink (a SmolLM2 step: 682 nodes, ~3 ms of graph building).
#pragma once

#include "mlx/ops.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include <memory>
#include <vector>

namespace gmlx_kernels {

namespace mx = mlx::core;

struct RopeSpec {
  int dims;
  bool traditional;
  float base, scale;
  std::vector<float> freqs;  // dims / 2 (Llama 3's scaled rope) or none: base^(2i / dims) (rope.h)
  float mscale = 1.0f;  // YaRN's factor on the rotated features
};

// A llama layer's sizes and constants (what its weights do not say).
struct LayerShape {
  float eps;
  int num_q_heads, num_kv_heads, head_dim, hidden_dims;
  RopeSpec rope;
  float attention_scale;
};

// A norm's weight as a task reads it.
struct NormWeight {
  const float* data;
  int64_t stride;
};

// qwen2's q, k and v biases (float32 vectors read as norms' weights are), added to the products.
struct QkvBiases {
  bool is_present = false;
  NormWeight vectors[3] = {};
};

// A layer's weights as its task reads them: raw pointers. A stack takes them once at load: read
// through each array's descriptor every step, which a step's stream of weights has evicted,
// they cost a cache miss a product.
struct LayerWeights {
  NormWeight input_norm, post_norm;
  const void* products[7];  // q, k, v, o, gate, up, down: quads or panels
  int bits[7];  // each product's layout (a K-quant GGUF mixes 4 and 8 bits in a layer)
  bool has_head_norms;  // qwen3's q and k norms over each head
  NormWeight head_norms[2];
  QkvBiases qkv_biases;
};

// The weights of a model's llama layers, all of one shape, held for decoder_stack: a decode
// step's one node reads them from here, not as ~270 graph inputs (mlx's dispatch costs the
// Python thread per input: a set entry, a weak copy). Weights are evaluated arrays that never
// change after load.
class LayerStack {
 public:
  // Per layer: the two norms' weights (D,) and q, k, v, o, gate, up, down (quads or panels), then
  // qwen3's q and k head norms (Dh,) for every layer or none; bits: per layer, the seven products';
  // qkv_biases: per layer qwen2's q, k and v biases (evaluated float32), or none for every layer.
  LayerStack(const std::vector<mx::array>& input_norms, const std::vector<mx::array>& post_norms,
             const std::vector<std::vector<mx::array>>& weights, const std::vector<std::vector<int>>& bits, float eps,
             int num_q_heads, int num_kv_heads, int head_dim, int hidden_dims, float attention_scale, int rope_dims,
             bool rope_traditional, float rope_base, float rope_scale, const std::vector<float>& rope_freqs = {},
             float rope_mscale = 1.0f, const std::vector<std::vector<mx::array>>& qkv_biases = {});
  int num_layers() const { return static_cast<int>(input_norms_.size()); }
  int dims() const { return input_norms_[0].shape(0); }
  const LayerShape& shape() const { return shape_; }
  const LayerWeights& layer(int layer) const { return layers_[layer]; }

 private:
  std::vector<mx::array> input_norms_, post_norms_;
  std::vector<std::vector<mx::array>> weights_, qkv_biases_;  // what layers_ points into, held
  std::vector<LayerWeights> layers_;
  LayerShape shape_;
};

// x (B, T, D), norm_weight (D,), offset (B,) or scalar int32: each row's first position. bits:
// one per product (q, k, v; gate, up, down; a layer's seven).
std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight, float eps,
                                        const mx::array& offset, const std::vector<mx::array>& quads,
                                        int num_q_heads, int num_kv_heads, int head_dim, const std::vector<int>& bits,
                                        int rope_dims, bool rope_traditional, float rope_base, float rope_scale,
                                        const std::vector<float>& rope_freqs = {}, float rope_mscale = 1.0f,
                                        const std::vector<mx::array>& qkv_biases = {});
// a (..., K), residual (..., N).
mx::array project_add(const mx::array& a, const mx::array& quads, const mx::array& residual, int bits);
// h (..., D); gate and up quads (F outputs of D), down quads (D outputs of F).
mx::array mlp_block(const mx::array& h, const mx::array& norm_weight, float eps, const mx::array& gate_quads,
                    const mx::array& up_quads, const mx::array& down_quads, int hidden_dims,
                    const std::vector<int>& bits);

// x (B, T, D); keys and values (B, Hkv, S, Dh) float32 buffers with S >= offset[b] + T for every
// row, which no other array may share (they are written in place); weights as for the three
// stages: [q, k, v, o, gate, up, down], then qwen3's q and k head norms (Dh,) where the layer has
// them (attention_inputs takes [q, k, v] and the same optional two). Row b's new keys and values land at positions
// offset[b] .. offset[b] + T - 1. Returns [h_out, keys, values], keys and values on the same memory.
std::vector<mx::array> decoder_layer(const mx::array& x, const mx::array& offset, const mx::array& keys,
                                     const mx::array& values, const mx::array& input_norm_weight,
                                     const mx::array& post_norm_weight, float eps,
                                     const std::vector<mx::array>& weights, int num_q_heads, int num_kv_heads,
                                     int head_dim, int hidden_dims, const std::vector<int>& bits,
                                     float attention_scale, int rope_dims, bool rope_traditional, float rope_base,
                                     float rope_scale, const std::vector<float>& rope_freqs = {},
                                     float rope_mscale = 1.0f, const std::vector<mx::array>& qkv_biases = {});

// Every layer of the stack in one node, each as decoder_layer runs it (the same bits), over one or
// more segments: rows of their own caches (a round's decode rows and the prompt chunks it carries)
// whose products share one pass over the weights. Segment i: xs[i] (B_i, T_i, D) from offsets[i];
// keys[i * L + l] and values[i * L + l] its layer l's (B_i, Hkv, S, Dh) row-contiguous buffers, all
// float16 or all float32, written in place: no new arrays stand for them, so their readers must
// depend on the returned h. after: arrays the node must run after (the buffers' last writers).
// Returns [each h_out].
std::vector<mx::array> decoder_stack(std::shared_ptr<const LayerStack> stack, const std::vector<mx::array>& xs,
                                     const std::vector<mx::array>& offsets, const std::vector<mx::array>& keys,
                                     const std::vector<mx::array>& values, const std::vector<mx::array>& after = {});

class DecoderStackOp : public mx::Primitive {
 public:
  DecoderStackOp(mx::Stream stream, std::shared_ptr<const LayerStack> stack, int num_segments)
      : mx::Primitive(stream), stack_(std::move(stack)), num_segments_(num_segments) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxDecoderStackOp"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecoderStackOp&>(other);
    return stack_ == o.stack_ && num_segments_ == o.num_segments_;
  }

 private:
  std::shared_ptr<const LayerStack> stack_;
  int num_segments_;
};

class DecoderLayerOp : public mx::Primitive {
 public:
  enum class Kind { kAttentionInputs, kProjectAdd, kMlpBlock, kLayer };
  DecoderLayerOp(mx::Stream stream, Kind kind, std::vector<int> bits, float eps, int num_q_heads, int num_kv_heads,
                 int head_dim, int hidden_dims, RopeSpec rope, float attention_scale = 0.0f,
                 bool has_qkv_biases = false)
      : mx::Primitive(stream), kind_(kind), bits_(std::move(bits)), eps_(eps), num_q_heads_(num_q_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), hidden_dims_(hidden_dims), rope_(rope),
        attention_scale_(attention_scale), has_qkv_biases_(has_qkv_biases) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxDecoderLayerOp"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  void eval_layer(mx::cpu::CommandEncoder& encoder, const std::vector<mx::array>& inputs,
                  std::vector<mx::array>& outputs);

  Kind kind_;
  std::vector<int> bits_;  // one per product
  float eps_;
  int num_q_heads_, num_kv_heads_, head_dim_, hidden_dims_;
  RopeSpec rope_;
  float attention_scale_;
  bool has_qkv_biases_;  // the node's last three inputs: qwen2's q, k and v biases
};

}  // namespace gmlx_kernels
