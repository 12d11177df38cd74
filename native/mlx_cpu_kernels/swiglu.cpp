#include "swiglu.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "exp_fixed.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

// A decode step's rows (a few thousand values) stay on the caller; a prefill chunk's spread.
constexpr int64_t kValuesPerChunk = 1 << 15;

struct SwiGluJob {
  const float* gate;
  const float* up;
  float* y;
  int64_t num_values;
};

void swiglu_values(void* context, int64_t chunk) {
  const auto* job = static_cast<const SwiGluJob*>(context);
  const int64_t begin = chunk * kValuesPerChunk;
  const int64_t end = std::min(job->num_values, begin + kValuesPerChunk);
  swiglu_span(job->gate + begin, job->up + begin, job->y + begin, end - begin, kernels_isa());
}

}  // namespace

void apply_swiglu(const float* gate, const float* up, float* y, int64_t num_values) {
  SwiGluJob job{gate, up, y, num_values};
  run_on_pool(swiglu_values, &job, (num_values + kValuesPerChunk - 1) / kValuesPerChunk);
}

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  if (gate.shape() != up.shape()) throw std::invalid_argument("swiglu: gate and up must have one shape");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGlu>(s),
                   {as_dtype(gate, mx::float32, s), as_dtype(up, mx::float32, s)});
}

void SwiGlu::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  encoder.dispatch([in = std::move(arrays.inputs), y_data = arrays.outputs[0]]() {
    const auto& gate = in[0];
    const auto& up = in[1];
    std::vector<float> gate_copy, up_copy;
    apply_swiglu(row_major_data<float>(gate, gate_copy), row_major_data<float>(up, up_copy), y_data,
                 static_cast<int64_t>(gate.size()));
  });
}

void SwiGlu::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxSwiGlu runs on the CPU only");
}

}  // namespace gmlx_kernels
