// RMS normalization as one MLX primitive, summed in a fixed order per row.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// mx.fast.rms_norm for float32 x (..., D) and weight (D,): x * rsqrt(mean(x^2) + eps) * w.
// A row's sum of squares takes 16 lane sums (lane i % 16, in i order) and a fixed tree
// over them, so its bits never depend on the other rows or the thread count.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps);

// The same on raw row-major buffers (the fused decoder-layer ops call it).
void normalize(const float* x, const float* weight, int64_t weight_stride, float* y, int64_t num_rows,
               int64_t num_features, float eps);

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

}  // namespace gmlx_kernels
