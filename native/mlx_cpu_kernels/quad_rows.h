// Rows of weights kept only in the quad-interleaved layout (a tied head's embedding), as one
// MLX primitive: an id's row dequantized, the floats mx.dequantize gives for the plain row.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// (..., num_inputs) float32: for each id, s * q + b over the row's inputs (a 4- or 8-bit q
// times a float16 scale is exact in float32, so this is mx.dequantize's value). An id outside
// [0, num_outputs) gives a row of zeros: token ids are checked where they enter the server.
mx::array quad_rows(const mx::array& quads, const mx::array& ids, int num_outputs, int num_inputs, int bits);

class QuadRows : public mx::Primitive {
 public:
  QuadRows(mx::Stream stream, int num_outputs, int bits)
      : mx::Primitive(stream), num_outputs_(num_outputs), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxQuadRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int num_outputs_;
  int bits_;
};

}  // namespace gmlx_kernels
