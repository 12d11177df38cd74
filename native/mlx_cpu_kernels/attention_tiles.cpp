// The key-blocked attention: the queries of one (row, kv head) run as a tile. The ISA's
// code scores each key block once for all of them and sums values for several at a
// time; the softmax between stays here, per query, as attention.cpp's per-query code.
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_job.h"
#include "exp_fixed.h"
#include "int8_dot_kernels.h"
#include "isa_target.h"

namespace gmlx_kernels {

#if GMLX_X86

namespace {

void attend_tile(const AttentionJob& job, int64_t tile, std::vector<float>& scores) {
  const int64_t num_kv_heads = job.num_q_heads / job.group;
  const int64_t b = tile / job.num_tiles_per_kv_head / num_kv_heads;
  const int64_t kv_head = tile / job.num_tiles_per_kv_head % num_kv_heads;
  const int64_t first = tile % job.num_tiles_per_kv_head * job.tile_size;  // queries ordered (t, head in group)
  const int num_queries = static_cast<int>(std::min(job.tile_size, job.group * job.num_t - first));
  const int64_t offset = job.offsets[b * job.offset_stride];
  const int64_t room = (job.num_keys + kScoreBlock - 1) / kScoreBlock * kScoreBlock;
  scores.resize(static_cast<size_t>(num_queries * room));
  TileQuery queries[kMaxAttentionTile];
  for (int n = 0; n < num_queries; ++n) {
    const int64_t t = (first + n) / job.group, h = kv_head * job.group + (first + n) % job.group;
    queries[n] = {job.q.at(b, h, t), job.out + ((b * job.num_t + t) * job.num_q_heads + h) * job.num_d,
                  std::min(job.num_keys, offset + t + 1), scores.data() + n * room};
  }
  // A float16 KV cache runs the AVX2 pieces on AVX-512 CPUs too (every one has AVX2 and F16C).
  const bool is_avx512 = job.isa == Isa::kAvx512 && !job.is_half_kv;
  if (is_avx512) {
    score_tile_avx512(job, b, kv_head, queries, num_queries);
  } else {
    score_tile_avx2(job, b, kv_head, queries, num_queries);
  }
  for (int n = 0; n < num_queries; ++n) {
    float* score = queries[n].score;
    const int64_t num_seen = queries[n].num_seen;
    const float max = is_avx512 ? max_score_avx512(score, num_seen) : max_score_avx2(score, num_seen);
    // The denominator is summed with the values, so these exps run as vectors.
    exp_shifted(score, num_seen, max, job.isa);
  }
  if (is_avx512) {
    sum_values_avx512(job, b, kv_head, queries, num_queries);
  } else {
    sum_values_avx2(job, b, kv_head, queries, num_queries);
  }
}

}  // namespace

bool can_attend_blocked(const AttentionJob& job) {
  const bool is_avx2_dim = job.num_d == 64 || job.num_d == 128;
  if (job.is_half_kv) return job.isa != Isa::kPortable && has_f16c() && is_avx2_dim;
  if (job.isa == Isa::kAvx512) return job.num_d >= 1 && job.num_d <= 256;
  return job.isa == Isa::kAvx2 && is_avx2_dim;
}

void attend_tiles(const AttentionJob& job, int64_t begin, int64_t end) {
  thread_local std::vector<float> scores;
  for (int64_t tile = begin; tile < end; ++tile) {
    attend_tile(job, tile, scores);
  }
}

#else

bool can_attend_blocked(const AttentionJob&) { return false; }
void attend_tiles(const AttentionJob&, int64_t, int64_t) {}

#endif

}  // namespace gmlx_kernels
