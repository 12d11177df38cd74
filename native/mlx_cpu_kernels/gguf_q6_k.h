// GGUF Q6_K matrices requantized to MLX 8-bit affine triplets (group 32, float16 scales and
// biases) at load: gmlx/models/gguf_blocks.py's numpy requantization, float operation for float
// operation (the same bytes for finite blocks), threaded over rows. numpy took 6 ns a value,
// the most of any type a Q4_K_M file holds (its head, half its down projections).
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// [weight (rows, 64 * blocks) uint32, scales (rows, 8 * blocks) float16, biases float16] from
// blocks (rows, 210 * blocks) uint8, the rows' Q6_K blocks.
std::vector<mx::array> requantize_q6_k(const mx::array& blocks);

class RequantizeQ6K : public mx::Primitive {
 public:
  explicit RequantizeQ6K(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxRequantizeQ6K"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace gmlx_kernels
