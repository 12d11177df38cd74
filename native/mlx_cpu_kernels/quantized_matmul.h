// The MLX primitive and op around the few-row quantized product (qmm_kernels.h).
#pragma once

#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases).T for float32 x (..., K); scales and biases
// float32 (out, K / group_size); bits 4 or 8; group size 32, 64 or 128. With
// int8_activations x is quantized per 32 inputs and the products are
// integer dots (int8_dot_kernels.h): other numerics than the float path; it also reads
// float16 scales and biases without a conversion node.
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool int8_activations);

// The int8-activation product over weights in the quad-interleaved layout
// (int8_dot_kernels.h, pack_quads): the same bits as quantized_matmul's int8 path over the
// plain rows, the weights read as one stream. quads: uint8, quad_layout_bytes long.
mx::array quantized_matmul_quads(const mx::array& x, const mx::array& quads, int num_outputs, int bits);
// Throws std::invalid_argument, naming `what`, unless quads is that layout of num_outputs x num_inputs.
void check_quad_layout(const mx::array& quads, int64_t num_outputs, int64_t num_inputs, int bits,
                       const std::string& what);
// Several such products of one x (q/k/v, gate/up) as one graph node: x quantized once, one
// pool job over all their outputs; each result has its own call's bits.
std::vector<mx::array> quantized_matmul_quads_group(const mx::array& x, const std::vector<mx::array>& quads,
                                                   const std::vector<int>& num_outputs, int bits);

// The same products on raw buffers (the fused decoder-layer ops call it): x (num_rows,
// num_inputs) row-major, each part's y (num_rows, num_outputs) row-major.
struct QuadsPart {
  const uint8_t* quads;
  int64_t num_outputs;
  float* y;
};
void quads_products(const float* x, int64_t num_rows, int64_t num_inputs, int bits, const std::vector<QuadsPart>& parts);

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool int8_activations, bool is_quads)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), int8_activations_(int8_activations),
        is_quads_(is_quads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  bool int8_activations_;
  bool is_quads_;  // inputs (x, quads) instead of (x, w, scales, biases)

  void eval_quads(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs);
};

// The instruction set the kernels use; set_isa refuses one this CPU lacks.
void set_isa(const std::string& name);
std::string current_isa();
std::string best_isa_name();

// Calls of at least num_rows rows take the many-row (panel) kernels, whose bits per row
// equal the few-row kernels'; < 1 restores the default. A tuning and testing knob.
void set_panel_min_rows(int64_t num_rows);
int64_t panel_min_rows();
void set_min_pool_macs(int64_t num_macs);
// fn over num_chunks chunks: on the caller for a product under that many multiply-adds, else on the pool.
void run_sized(ThreadPool::ChunkFn fn, void* context, int64_t num_chunks, int64_t num_macs);
int64_t min_pool_macs();

// DRAM read rate: GB/s of the best of num_passes sums over a num_bytes buffer, on the pool.
double read_bandwidth(int64_t num_bytes, int num_passes);

}  // namespace gmlx_kernels
