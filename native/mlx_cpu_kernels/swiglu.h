// mlx-lm's SwiGLU (silu(gate) * up) as one MLX primitive: elementwise, so each row's bits
// depend on that row alone; one scalar code path on every ISA, so they depend on nothing else.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// (gate / (1 + exp(-gate))) * up for float32 gate and up of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& up);

// The same on raw buffers of num_values floats (the fused decoder-layer ops call it).
void apply_swiglu(const float* gate, const float* up, float* y, int64_t num_values);

class SwiGlu : public mx::Primitive {
 public:
  explicit SwiGlu(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxSwiGlu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace gmlx_kernels
