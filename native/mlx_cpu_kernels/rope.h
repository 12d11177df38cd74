// Rotary position embedding as one MLX primitive, with a position per batch row.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// mx.fast.rope's arithmetic for float32 x (B, ..., T, D): element pairs of the first
// `dims` features turn by (offset[b] + t) * scale * base^(-2i / dims); offset is an int
// scalar or one per row b. The angle's cosine and sine come from double precision, so
// a position's rotation is the same bits in every call, whatever else the call holds.
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, const mx::array& offset);

class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxRope"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

}  // namespace gmlx_kernels
