#include "attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "attention_job.h"
#include "exp_fixed.h"
#include "isa_target.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

constexpr int kLanes = 16;
constexpr int64_t kQueriesPerChunk = 4;
// Below this many multiply-adds a call stays on the caller. A decode step's attention runs
// inside a layer node, between products the pool's workers have just worked on and still
// spin after: handing them a share costs ~1 us (a short context's 3 kv heads over 2 threads:
// 1.037x decode on 4-bit SmolLM2 against 1 << 17, where it stayed on the caller).
constexpr int64_t kMinPoolWork = 1 << 13;

// Each lane is its own chain in a fixed order (and -ffp-contract=off keeps * and +
// apart), so any vector width the compiler picks for an ISA gives the same bits. A Half
// key widens to float exactly, so both KV types run the same float operations.
template <int kD, typename KV>
inline __attribute__((always_inline)) float dot(const float* __restrict a, const KV* __restrict b, int64_t n) {
  if constexpr (kD > 0) n = kD;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * static_cast<float>(b[i + l]);
  }
  for (; i < n; ++i) lanes[i % kLanes] += a[i] * static_cast<float>(b[i]);
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  }
  return lanes[0];
}

// One query (row b, q head h, position t): scores, softmax and the value sum, in key
// order. kD > 0 fixes the head dim at compile time (the value sums then stay in
// registers); 0 reads it from the job. Both give the same bits. KV: float or Half.
template <int kD, typename KV>
inline __attribute__((always_inline)) void attend_one(const AttentionJob& job, int64_t b, int64_t h, int64_t t,
                                                      std::vector<float>& scores) {
  const int64_t offset = job.offsets[b * job.offset_stride];
  const int64_t num_seen = std::min(job.num_keys, offset + t + 1);
  const int64_t kv_head = h / job.group;
  const int64_t d = kD > 0 ? kD : job.num_d;
  const float* q = job.q.at(b, h, t);
  float* __restrict out = job.out + ((b * job.num_t + t) * job.num_q_heads + h) * d;
  scores.resize(num_seen);
  float* __restrict score = scores.data();
  float max_score = -INFINITY;
  for (int64_t j = 0; j < num_seen; ++j) {
    score[j] = dot<kD>(q, job.keys.at<KV>(b, kv_head, j), d) * job.scale;
    max_score = std::max(max_score, score[j]);
  }
  exp_shifted(score, num_seen, max_score, job.isa);
  float denominator = 0.0f;
  for (int64_t j = 0; j < num_seen; ++j) denominator += score[j];
  if constexpr (kD > 0) {
    float acc[kD] = {};
    for (int64_t j = 0; j < num_seen; ++j) {
      const KV* __restrict v = job.values.at<KV>(b, kv_head, j);
      const float p = score[j];
      for (int i = 0; i < kD; ++i) acc[i] += p * static_cast<float>(v[i]);
    }
    for (int i = 0; i < kD; ++i) out[i] = acc[i] / denominator;
  } else {
    for (int64_t i = 0; i < d; ++i) out[i] = 0.0f;
    for (int64_t j = 0; j < num_seen; ++j) {
      const KV* __restrict v = job.values.at<KV>(b, kv_head, j);
      const float p = score[j];
      for (int64_t i = 0; i < d; ++i) out[i] += p * static_cast<float>(v[i]);
    }
    for (int64_t i = 0; i < d; ++i) out[i] = out[i] / denominator;
  }
}

// Queries [begin, end) in (b, h, t) order.
template <int kD, typename KV>
inline __attribute__((always_inline)) void attend_queries(const AttentionJob& job, int64_t begin, int64_t end) {
  thread_local std::vector<float> scores;
  for (int64_t n = begin; n < end; ++n) {
    const int64_t t = n % job.num_t, h = n / job.num_t % job.num_q_heads, b = n / (job.num_t * job.num_q_heads);
    attend_one<kD, KV>(job, b, h, t, scores);
  }
}

template <typename KV>
inline __attribute__((always_inline)) void attend_range_of(const AttentionJob& job, int64_t begin, int64_t end) {
  if (job.num_d == 64) return attend_queries<64, KV>(job, begin, end);
  if (job.num_d == 128) return attend_queries<128, KV>(job, begin, end);
  attend_queries<0, KV>(job, begin, end);
}

inline __attribute__((always_inline)) void attend_range(const AttentionJob& job, int64_t begin, int64_t end) {
  if (job.is_half_kv) return attend_range_of<Half>(job, begin, end);
  attend_range_of<float>(job, begin, end);
}

void attend_portable(const AttentionJob& job, int64_t begin, int64_t end) { attend_range(job, begin, end); }
#if GMLX_X86
GMLX_AVX2 void attend_avx2(const AttentionJob& job, int64_t begin, int64_t end) { attend_range(job, begin, end); }
GMLX_AVX512 void attend_avx512(const AttentionJob& job, int64_t begin, int64_t end) { attend_range(job, begin, end); }
#endif

void attend(const AttentionJob& job, int64_t begin, int64_t end) {
#if GMLX_X86
  if (job.isa == Isa::kAvx512) return attend_avx512(job, begin, end);
  if (job.isa == Isa::kAvx2) return attend_avx2(job, begin, end);
#endif
  attend_portable(job, begin, end);
}

void run_attention_chunk(void* context, int64_t chunk) {
  const auto* job = static_cast<const AttentionJob*>(context);
  const int64_t num_queries = job->num_b * job->num_q_heads * job->num_t;
  attend(*job, chunk * kQueriesPerChunk, std::min(num_queries, (chunk + 1) * kQueriesPerChunk));
}

void run_attention_tile(void* context, int64_t tile) {
  attend_tiles(*static_cast<const AttentionJob*>(context), tile, tile + 1);
}

// Tiles of even size, the fewest that give each thread one: a kv head's keys and values
// then come from memory once per tile, not once per query. At one query per head over a
// long prefix that read is the cost: whole-group tiles took less CPU at 2 threads than
// halves (S 1,000-3,000) and less wall time at S 1,500, though 3 tiles leave one thread 2.
// A query's bits do not depend on its tile.
void plan_tiles(AttentionJob& job, int num_threads) {
  const int64_t per_kv_head = job.group * job.num_t;
  const int64_t num_kv_rows = job.num_b * (job.num_q_heads / job.group);
  int64_t num_tiles = (per_kv_head + kMaxAttentionTile - 1) / kMaxAttentionTile;
  while (num_kv_rows * num_tiles < num_threads && num_tiles < per_kv_head) ++num_tiles;
  job.tile_size = (per_kv_head + num_tiles - 1) / num_tiles;
  job.num_tiles_per_kv_head = (per_kv_head + job.tile_size - 1) / job.tile_size;
}

// x's data (of T) as (B, H, S, D) with unit stride along D: its own when so, else a copy.
template <typename T, typename Out>
Out strided4(const mx::array& x, std::vector<T>& copy) {
  if (x.strides(3) == 1) return {x.data<T>(), x.strides(0), x.strides(1), x.strides(2)};
  copy.resize(x.size());
  const T* src = x.data<T>();
  for (size_t i = 0; i < x.size(); ++i) copy[i] = src[mx::elem_to_loc(static_cast<int>(i), x.shape(), x.strides())];
  return {copy.data(), static_cast<int64_t>(x.shape(1)) * x.shape(2) * x.shape(3),
          static_cast<int64_t>(x.shape(2)) * x.shape(3), x.shape(3)};
}

// A key or value buffer of float or Half: its own data when unit-stride along D, else a copy.
StridedKV strided_kv(const mx::array& x, std::vector<float>& copy, std::vector<Half>& half_copy) {
  if (x.dtype() == mx::float16) return strided4<Half, StridedKV>(x, half_copy);
  return strided4<float, StridedKV>(x, copy);
}

}  // namespace

void run_attention_job(AttentionJob& job) {
  const int64_t num_queries = job.num_b * job.num_q_heads * job.num_t;
  // The keys the queries see, not the buffer's capacity.
  int64_t num_seen_keys = 0;
  for (int64_t b = 0; b < job.num_b; ++b) {
    num_seen_keys = std::max<int64_t>(num_seen_keys, job.offsets[b * job.offset_stride] + job.num_t);
  }
  const bool is_small = num_queries * std::min(num_seen_keys, job.num_keys) * job.num_d < kMinPoolWork;
  if (can_attend_blocked(job)) {
    plan_tiles(job, is_small ? 1 : pool_num_threads());
    const int64_t num_tiles = job.num_b * (job.num_q_heads / job.group) * job.num_tiles_per_kv_head;
    if (is_small) {
      attend_tiles(job, 0, num_tiles);
    } else {
      run_on_pool(run_attention_tile, &job, num_tiles);
    }
  } else if (is_small) {
    attend(job, 0, num_queries);
  } else {
    run_on_pool(run_attention_chunk, &job, (num_queries + kQueriesPerChunk - 1) / kQueriesPerChunk);
  }
}

mx::array ragged_attention(const mx::array& q, const mx::array& keys, const mx::array& values,
                           const mx::array& offset, float scale) {
  if (q.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4) {
    throw std::invalid_argument("ragged_attention: q, keys and values must be (B, H, T|S, D)");
  }
  const int num_b = q.shape(0), num_q_heads = q.shape(1), num_kv_heads = keys.shape(1);
  if (keys.shape() != values.shape() || keys.shape(0) != num_b || keys.shape(3) != q.shape(3) ||
      num_kv_heads == 0 || num_q_heads % num_kv_heads != 0) {
    throw std::invalid_argument("ragged_attention: keys and values must be (B, Hkv, S, D), Hq a multiple of Hkv");
  }
  if (offset.ndim() > 1 || (offset.ndim() == 1 && offset.size() != 1 && offset.size() != static_cast<size_t>(num_b))) {
    throw std::invalid_argument("ragged_attention: offset must be a scalar or one per row");
  }
  if (!mx::issubdtype(offset.dtype(), mx::integer)) throw std::invalid_argument("ragged_attention: offset must be integer");
  auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape out_shape = {num_b, q.shape(2), num_q_heads * q.shape(3)};
  // A float16 KV cache is read as it is; any other KV type as float32.
  const mx::Dtype kv_dtype = keys.dtype() == mx::float16 && values.dtype() == mx::float16 ? mx::float16 : mx::float32;
  return mx::array(out_shape, mx::float32, std::make_shared<RaggedAttention>(s, scale),
                   {as_dtype(q, mx::float32, s), as_dtype(keys, kv_dtype, s), as_dtype(values, kv_dtype, s),
                    as_dtype(offset, mx::int32, s)});
}

void RaggedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& input : inputs) encoder.set_input_array(input);
  encoder.set_output_array(out);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]), keys = mx::array::unsafe_weak_copy(inputs[1]),
                    values = mx::array::unsafe_weak_copy(inputs[2]), offset = mx::array::unsafe_weak_copy(inputs[3]),
                    out_data = out.data<float>(), scale = scale_]() {
    std::vector<float> q_copy, k_copy, v_copy;
    std::vector<Half> k_half_copy, v_half_copy;
    AttentionJob job;
    job.q = strided4<float, Strided4>(q, q_copy);
    job.keys = strided_kv(keys, k_copy, k_half_copy);
    job.values = strided_kv(values, v_copy, v_half_copy);
    job.is_half_kv = keys.dtype() == mx::float16;
    job.offsets = offset.data<int32_t>();
    job.offset_stride = per_row_stride(offset);
    job.out = out_data;
    job.num_b = q.shape(0);
    job.num_q_heads = q.shape(1);
    job.num_t = q.shape(2);
    job.num_d = q.shape(3);
    job.num_keys = keys.shape(2);
    job.group = q.shape(1) / keys.shape(1);
    job.scale = scale;
    job.isa = kernels_isa();
    run_attention_job(job);
  });
}

void RaggedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxRaggedAttention runs on the CPU only");
}

bool RaggedAttention::is_equivalent(const mx::Primitive& other) const {
  return scale_ == static_cast<const RaggedAttention&>(other).scale_;
}

}  // namespace gmlx_kernels
