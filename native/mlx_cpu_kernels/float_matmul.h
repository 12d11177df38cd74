// Float32 products y = x @ W.T over W kept in the panel layout: W (N, K) as ceil(N / 64)
// panels, each (K, 64) row-major: the 64 outputs' weights for input k side by side, zero
// past N. A decode row then reads each panel front to back, one stream, and every output
// is one fma chain over k = 0..K-1 from 0.0f: the same chain at every row count, thread
// split, k blocking and ISA (AVX2 or portable), so a row's bits never depend on the call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

constexpr int64_t kPanelOutputs = 64;
// The bits value the fused layer ops take for float32 panels (4 and 8 mean the quad layout).
constexpr int kFloatBits = 32;

// x (..., K) float32; panels float32 (ceil(N / 64), K, 64) -> (..., N).
mx::array float_matmul(const mx::array& x, const mx::array& panels, int num_outputs);
// Throws std::invalid_argument, naming `what`, unless panels is that layout of num_outputs x num_inputs.
void check_panel_layout(const mx::array& panels, int64_t num_outputs, int64_t num_inputs, const std::string& what);

// The same products on raw buffers, several weights of one x in one pool job (the fused
// decoder-layer ops call it): x (num_rows, num_inputs) row-major, each y (num_rows, num_outputs).
struct PanelsPart {
  const float* panels;
  int64_t num_outputs;
  float* y;
};
void panels_products(const float* x, int64_t num_rows, int64_t num_inputs, const std::vector<PanelsPart>& parts);
// Bytes ahead of a panel stream its first row prefetches (0: off, < 0: the CPU's default, 3072 on
// Intel and 0 elsewhere). Same bits.
void set_panel_prefetch_bytes(int64_t num_bytes);
int64_t panel_prefetch_bytes();

class FloatMatmul : public mx::Primitive {
 public:
  explicit FloatMatmul(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxFloatMatmul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace gmlx_kernels
