// A llama decoder layer's decode path in three MLX nodes instead of ~20, for weights in the quad
// layout (bits 4 or 8) or float32 panels (bits kFloatBits, float_matmul.h):
//   attention_inputs: rms_norm, the q/k/v products, RoPE on q and k -> q, k, v (B, H, T, Dh)
//   (the KV write and ragged_attention stay their own nodes)
//   project_add:      residual + a @ W.T (o_proj and the residual add)
//   mlp_block:        h + down(swiglu(gate(n), up(n))), n = rms_norm(h)
// Each stage calls the code of the separate op (normalize, quads_products or panels_products, rotate,
// apply_swiglu), so every value has the separate graph's bits; the node count and the Python
// that builds it are what shrink (a SmolLM2 step: 682 nodes, ~3 ms of graph building).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

struct RopeSpec {
  int dims;
  bool traditional;
  float base, scale;
};

// x (B, T, D), norm_weight (D,), offset (B,) or scalar int32: each row's first position.
std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight, float eps,
                                        const mx::array& offset, const std::vector<mx::array>& quads,
                                        int num_q_heads, int num_kv_heads, int head_dim, int bits,
                                        int rope_dims, bool rope_traditional, float rope_base, float rope_scale);
// a (..., K), residual (..., N).
mx::array project_add(const mx::array& a, const mx::array& quads, const mx::array& residual, int bits);
// h (..., D); gate and up quads (F outputs of D), down quads (D outputs of F).
mx::array mlp_block(const mx::array& h, const mx::array& norm_weight, float eps, const mx::array& gate_quads,
                    const mx::array& up_quads, const mx::array& down_quads, int hidden_dims, int bits);

class DecoderLayerOp : public mx::Primitive {
 public:
  enum class Kind { kAttentionInputs, kProjectAdd, kMlpBlock };
  DecoderLayerOp(mx::Stream stream, Kind kind, int bits, float eps, int num_q_heads, int num_kv_heads,
                 int head_dim, int hidden_dims, RopeSpec rope)
      : mx::Primitive(stream), kind_(kind), bits_(bits), eps_(eps), num_q_heads_(num_q_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), hidden_dims_(hidden_dims), rope_(rope) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxDecoderLayerOp"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  Kind kind_;
  int bits_;
  float eps_;
  int num_q_heads_, num_kv_heads_, head_dim_, hidden_dims_;
  RopeSpec rope_;
};

}  // namespace gmlx_kernels
