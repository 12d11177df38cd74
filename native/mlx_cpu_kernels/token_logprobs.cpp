#include "token_logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "exp_fixed.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

constexpr int kLanes = 16;

struct LogprobJob {
  const float* logits;  // (num_rows, vocab) row-major
  const int32_t* tokens;  // (num_rows,)
  int64_t vocab;
  int num_top;
  float* chosen;  // (num_rows,)
  int32_t* top_ids;  // (num_rows, num_top)
  float* top_logprobs;  // (num_rows, num_top)
};

// Each lane is its own chain (the compiler may keep the lanes in vector registers without
// changing a bit), then a fixed tree: max and sum alike.
float row_max(const float* x, int64_t n) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  }
  for (; i < n; ++i) lanes[i % kLanes] = x[i] > lanes[i % kLanes] ? x[i] : lanes[i % kLanes];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l + width] > lanes[l] ? lanes[l + width] : lanes[l];
  }
  return lanes[0];
}

float row_sum(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  }
  for (; i < n; ++i) lanes[i % kLanes] += x[i];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  }
  return lanes[0];
}

// The num_top largest of x, most likely first, ties by lower id: one pass against the smallest
// kept value (most entries fail that one compare), inserting the rare ones that pass.
void select_top(const float* x, int64_t n, int num_top, int32_t* ids, float* values) {
  int count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (count == num_top && !(v > values[num_top - 1])) continue;
    int at = count < num_top ? count++ : num_top - 1;
    // Later ids sort after equal values: move only strictly smaller ones down.
    while (at > 0 && values[at - 1] < v) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    values[at] = v;
    ids[at] = static_cast<int32_t>(i);
  }
}

void logprob_rows(void* context, int64_t row) {
  const auto* job = static_cast<const LogprobJob*>(context);
  const int64_t n = job->vocab;
  const float* x = job->logits + row * n;
  thread_local std::vector<float> shifted;
  shifted.assign(x, x + n);
  const float max = row_max(x, n);
  exp_shifted(shifted.data(), n, max, kernels_isa());
  const float lse = max + std::log(row_sum(shifted.data(), n));
  const int32_t token = job->tokens[row];
  job->chosen[row] = token >= 0 && token < n ? x[token] - lse : std::numeric_limits<float>::quiet_NaN();
  int32_t* ids = job->top_ids + row * job->num_top;
  float* values = job->top_logprobs + row * job->num_top;
  select_top(x, n, job->num_top, ids, values);
  for (int k = 0; k < job->num_top; ++k) values[k] -= lse;
}

}  // namespace

std::vector<mx::array> token_logprobs(const mx::array& logits, const mx::array& tokens, int num_top) {
  if (logits.ndim() != 2 || tokens.ndim() != 1 || tokens.shape(0) != logits.shape(0)) {
    throw std::invalid_argument("token_logprobs: logits must be (N, V) and tokens (N,)");
  }
  if (num_top < 1 || num_top > logits.shape(1)) {
    throw std::invalid_argument("token_logprobs: num_top must be in [1, V]");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  const int num_rows = logits.shape(0);
  return mx::array::make_arrays({{num_rows}, {num_rows, num_top}, {num_rows, num_top}},
                                {mx::float32, mx::int32, mx::float32},
                                std::make_shared<TokenLogprobs>(s, num_top),
                                {as_dtype(logits, mx::float32, s), as_dtype(tokens, mx::int32, s)});
}

void TokenLogprobs::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);
  auto* top_ids = reinterpret_cast<int32_t*>(arrays.outputs[1]);  // encode_arrays sized it as int32
  encoder.dispatch([in = std::move(arrays.inputs), chosen = arrays.outputs[0], top_ids,
                    top_logprobs = arrays.outputs[2], num_top = num_top_]() {
    const auto& logits = in[0];
    std::vector<float> logits_copy;
    std::vector<int32_t> tokens_copy;
    LogprobJob job{row_major_data<float>(logits, logits_copy), row_major_data<int32_t>(in[1], tokens_copy),
                   logits.shape(1), num_top, chosen, top_ids, top_logprobs};
    run_on_pool(logprob_rows, &job, logits.shape(0));
  });
}

void TokenLogprobs::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxTokenLogprobs runs on the CPU only");
}

bool TokenLogprobs::is_equivalent(const mx::Primitive& other) const {
  return num_top_ == static_cast<const TokenLogprobs&>(other).num_top_;
}

}  // namespace gmlx_kernels
