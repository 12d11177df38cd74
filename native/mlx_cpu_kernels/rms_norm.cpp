#include "rms_norm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowsPerChunk = 64;  // a decode step's rows stay on the caller

struct NormJob {
  const float* x;  // (num_rows, num_features) row-major
  const float* weight;  // (num_features,) at weight_stride
  int64_t weight_stride;
  float* y;
  int64_t num_rows, num_features;
  float eps;
};

// Each lane is its own chain, so the compiler may keep the lanes in vector registers
// (any width) without changing a bit; -ffp-contract=off keeps x * x and + apart.
float sum_of_squares(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  for (; i < n; ++i) lanes[i % kLanes] += x[i] * x[i];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  }
  return lanes[0];
}

void normalize_rows(void* context, int64_t chunk) {
  const auto* job = static_cast<const NormJob*>(context);
  const int64_t n = job->num_features;
  for (int64_t r = chunk * kRowsPerChunk; r < std::min(job->num_rows, (chunk + 1) * kRowsPerChunk); ++r) {
    const float* x = job->x + r * n;
    float* y = job->y + r * n;
    const float scale = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + job->eps);
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * job->weight[i * job->weight_stride];
  }
}

}  // namespace

void normalize(const float* x, const float* weight, int64_t weight_stride, float* y, int64_t num_rows,
               int64_t num_features, float eps) {
  NormJob job{x, weight, weight_stride, y, num_rows, num_features, eps};
  run_on_pool(normalize_rows, &job, (num_rows + kRowsPerChunk - 1) / kRowsPerChunk);
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1) || x.shape(-1) == 0) {
    throw std::invalid_argument("rms_norm: weight must be (D,) for x (..., D), D > 0");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps),
                   {as_dtype(x, mx::float32, s), as_dtype(weight, mx::float32, s)});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  encoder.dispatch([in = std::move(arrays.inputs), y_data = arrays.outputs[0], eps = eps_]() {
    const auto& x = in[0];
    const auto& weight = in[1];
    std::vector<float> copy;  // rare: mlx-lm normalizes contiguous activations
    normalize(row_major_data<float>(x, copy), weight.data<float>(), weight.strides(0), y_data,
              static_cast<int64_t>(x.size() / x.shape(-1)), x.shape(-1), eps);
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxRmsNorm runs on the CPU only");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RmsNorm&>(other).eps_;
}

}  // namespace gmlx_kernels
