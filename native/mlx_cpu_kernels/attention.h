// Attention over gmlx's ragged per-row KV as one MLX primitive.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// softmax(q k^T * scale) v for float32 q (B, Hq, T, D) against keys and values
// (B, Hkv, S, D), Hq a multiple of Hkv (grouped heads); float16 keys and values (a float16 KV
// cache) are read as they are, widened exactly, any other type cast to float32. Row b's T new positions start
// at offset[b] (an int scalar or one per row): query t sees keys [0, offset[b] + t], so
// the mask is the cache's own lengths, causal within the new positions. Out (B, T, Hq * D).
// Each query is computed in one fixed order (dot products in 16 lanes and a tree, softmax
// and the value sum in key order), so its bits depend only on its own vector and the keys
// it sees: not on T, B, the other rows or the thread count. AVX-512 and AVX2 run the
// queries of a kv head together (shared key reads) with the same operations per query.
mx::array ragged_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                           const mx::array& offset, float scale);

class RaggedAttention : public mx::Primitive {
 public:
  RaggedAttention(mx::Stream stream, float scale) : mx::Primitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxRaggedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
};

}  // namespace gmlx_kernels
