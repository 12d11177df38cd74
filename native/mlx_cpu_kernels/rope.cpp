#include "rope.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

// Vectors of D features (one per (b, ..., t)) per pool chunk: a prefill's call spreads
// over the cores, a decode step's stays on the caller.
constexpr int64_t kVectorsPerChunk = 256;
constexpr int64_t kPositionsPerChunk = 64;  // angle rows per pool chunk

// Each (b, t)'s cosines and sines are computed once into a table: with t the fastest
// index, every head of a multi-position call would otherwise recompute them (a 4-position
// verify spent ~25 us a SmolLM2 layer in std::cos and std::sin).
struct AnglesJob {
  const RopeArgs* args;
  std::vector<double> inv_freqs;  // (dims / 2,)
  RopeAngles* angles;  // (B * T, dims / 2) each
};

struct RotateJob {
  const RopeArgs* args;
  const RopeAngles* angles;
};

void fill_angles(void* context, int64_t chunk) {
  const auto* job = static_cast<const AnglesJob*>(context);
  const RopeArgs& a = *job->args;
  const int half = a.dims / 2;
  for (int64_t r = chunk * kPositionsPerChunk; r < std::min(a.num_b * a.num_t, (chunk + 1) * kPositionsPerChunk); ++r) {
    const int64_t position = a.offsets[r / a.num_t * a.offset_stride] + r % a.num_t;
    const double angle_scale = static_cast<double>(static_cast<float>(position) * a.scale);
    for (int i = 0; i < half; ++i) {
      const double angle = angle_scale * job->inv_freqs[i];
      job->angles->cosines[r * half + i] = static_cast<float>(a.mscale * std::cos(angle));
      job->angles->sines[r * half + i] = static_cast<float>(a.mscale * std::sin(angle));
    }
  }
}

void rotate_vectors(void* context, int64_t chunk) {
  const auto* job = static_cast<const RotateJob*>(context);
  const RopeArgs& a = *job->args;
  const int64_t num_vectors = a.num_b * a.num_m * a.num_t;
  const int half = a.dims / 2;
  for (int64_t v = chunk * kVectorsPerChunk; v < std::min(num_vectors, (chunk + 1) * kVectorsPerChunk); ++v) {
    const int64_t t = v % a.num_t, m = v / a.num_t % a.num_m, b = v / (a.num_t * a.num_m);
    const float* cosines = job->angles->cosines.data() + (b * a.num_t + t) * half;
    const float* sines = job->angles->sines.data() + (b * a.num_t + t) * half;
    const float* x = a.x + b * a.stride_b + m * a.stride_m + t * a.stride_t;
    const int64_t sd = a.stride_d;
    float* y = a.y + v * a.num_d;
    for (int i = 0; i < half; ++i) {
      // traditional: pairs (2i, 2i + 1); else (i, i + dims / 2), as mx.fast.rope.
      const int64_t p = a.traditional ? 2 * i : i;
      const int64_t q = a.traditional ? 2 * i + 1 : i + half;
      const float x1 = x[p * sd], x2 = x[q * sd];
      y[p] = x1 * cosines[i] - x2 * sines[i];
      y[q] = x1 * sines[i] + x2 * cosines[i];
    }
    for (int64_t d = a.dims; d < a.num_d; ++d) y[d] = x[d * sd];
  }
}

}  // namespace

void fill_rope_angles(const RopeArgs& args, RopeAngles& angles) {
  const int half = args.dims / 2;
  AnglesJob job{&args, std::vector<double>(half), &angles};
  for (int i = 0; i < half; ++i) {
    job.inv_freqs[i] = args.freqs != nullptr ? 1.0 / static_cast<double>(args.freqs[i])
                                             : std::pow(static_cast<double>(args.base), -static_cast<double>(i) / half);
  }
  const int64_t num_positions = args.num_b * args.num_t;
  angles.cosines.resize(num_positions * half);
  angles.sines.resize(num_positions * half);
  run_on_pool(fill_angles, &job, (num_positions + kPositionsPerChunk - 1) / kPositionsPerChunk);
}

void rotate_with(const RopeArgs& args, const RopeAngles& angles) {
  assert(angles.cosines.size() >= static_cast<size_t>(args.num_b * args.num_t * (args.dims / 2)));
  RotateJob job{&args, &angles};
  const int64_t num_vectors = args.num_b * args.num_m * args.num_t;
  run_on_pool(rotate_vectors, &job, (num_vectors + kVectorsPerChunk - 1) / kVectorsPerChunk);
}

void rotate(const RopeArgs& args) {
  RopeAngles angles;
  fill_rope_angles(args, angles);
  rotate_with(args, angles);
}

void check_rope(int dims, const std::vector<float>& freqs, int64_t head_dim, const std::string& who) {
  if (dims <= 0 || dims % 2 != 0 || dims > head_dim) {
    throw std::invalid_argument(who + ": dims " + std::to_string(dims) + " must be even and at most D = " +
                                std::to_string(head_dim));
  }
  if (!freqs.empty() && freqs.size() != static_cast<size_t>(dims / 2)) {
    throw std::invalid_argument(who + ": " + std::to_string(freqs.size()) + " freqs for rope dims " +
                                std::to_string(dims) + " (expected none or dims / 2)");
  }
  for (float f : freqs) {
    if (!(f > 0.0f) || !std::isfinite(f)) throw std::invalid_argument(who + ": freqs must be positive and finite");
  }
}

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, const mx::array& offset,
               const std::vector<float>& freqs, float mscale) {
  if (x.ndim() < 2) throw std::invalid_argument("rope: x needs >= 2 dims (..., T, D)");
  check_rope(dims, freqs, x.shape(-1), "rope");
  const bool is_per_row = x.ndim() >= 3 && offset.size() == static_cast<size_t>(x.shape(0));
  if (offset.ndim() > 1 || (offset.ndim() == 1 && offset.size() != 1 && !is_per_row)) {
    throw std::invalid_argument("rope: offset must be a scalar or one per row of x's first dim");
  }
  if (!mx::issubdtype(offset.dtype(), mx::integer)) throw std::invalid_argument("rope: offset must be integer");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, dims, traditional, base, scale, freqs, mscale),
                   {as_dtype(x, mx::float32, s), as_dtype(offset, mx::int32, s)});
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& offset = inputs[1];
  auto& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(offset);
  encoder.set_output_array(y);
  // The task may outlive this primitive: it holds its own copy of the frequencies.
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), offset = mx::array::unsafe_weak_copy(offset),
                    y_data = y.data<float>(), dims = dims_, traditional = traditional_, base = base_,
                    scale = scale_, freqs = freqs_, mscale = mscale_]() {
    RopeArgs job;
    const int ndim = x.ndim();
    job.num_b = ndim > 2 ? x.shape(0) : 1;
    job.num_m = 1;
    for (int i = 1; i < ndim - 2; ++i) job.num_m *= x.shape(i);
    job.num_t = x.shape(-2);
    job.num_d = x.shape(-1);
    // The middle dims (heads) must collapse to one stride; mlx-lm's (B, H, T, D) views
    // have one middle dim, so only a rare >4-dim view pays for a contiguous copy.
    bool is_collapsible = true;
    for (int i = 1; i + 1 < ndim - 2; ++i) {
      if (x.strides(i) != x.strides(i + 1) * x.shape(i + 1)) is_collapsible = false;
    }
    std::vector<float> copy;
    const float* data = x.data<float>();
    if (is_collapsible) {
      job.stride_b = ndim > 2 ? x.strides(0) : 0;
      job.stride_m = ndim > 3 ? x.strides(ndim - 3) : 0;
      job.stride_t = x.strides(ndim - 2);
      job.stride_d = x.strides(ndim - 1);
    } else {
      copy.resize(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        copy[i] = data[mx::elem_to_loc(static_cast<int>(i), x.shape(), x.strides())];
      }
      data = copy.data();
      job.stride_d = 1;
      job.stride_t = job.num_d;
      job.stride_m = job.num_t * job.num_d;
      job.stride_b = job.num_m * job.stride_m;
    }
    job.x = data;
    job.offsets = offset.data<int32_t>();
    job.offset_stride = per_row_stride(offset);
    job.y = y_data;
    job.dims = dims;
    job.traditional = traditional;
    job.base = base;
    job.scale = scale;
    job.freqs = freqs.empty() ? nullptr : freqs.data();
    job.mscale = mscale;
    rotate(job);
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxRope runs on the CPU only");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ &&
         freqs_ == o.freqs_ && mscale_ == o.mscale_;
}

}  // namespace gmlx_kernels
