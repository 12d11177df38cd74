// The bulk of a Q4_K_M GGUF as MLX affine triplets (group 32, float16 scales and biases) at
// load, threaded over rows: Q4_K read at 4 bits, Q6_K requantized to 8. The numpy decoders in
// gmlx/models/gguf_blocks.py, float operation for float operation (the same values), which stay
// the fallback. numpy took 1.2 ns a Q4_K value and 6-7 ns a Q6_K one (an 8B file: ~20 s).
#pragma once

#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// [weight (rows, values * bits / 32) uint32, scales (rows, values / 32) float16, biases] from
// blocks (rows, block bytes x blocks) uint8 of `kind`: "Q4_K" (144-byte blocks, 4 bits) or
// "Q6_K" (210-byte blocks, 8 bits).
std::vector<mx::array> decode_gguf_blocks(const mx::array& blocks, const std::string& kind);

class DecodeGgufBlocks : public mx::Primitive {
 public:
  DecodeGgufBlocks(mx::Stream stream, bool is_q6_k) : mx::Primitive(stream), is_q6_k_(is_q6_k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxDecodeGgufBlocks"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return is_q6_k_ == static_cast<const DecodeGgufBlocks&>(other).is_q6_k_;
  }

 private:
  bool is_q6_k_;  // else Q4_K
};

}  // namespace gmlx_kernels
