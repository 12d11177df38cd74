// Ragged attention on AVX-512 for several queries of one (row, kv head) at a time: a block
// of 16 keys is read once for the tile's queries, its 16 dot products are reduced
// together, and the value sums of up to 4 queries run side by side. Every query keeps the
// per-query code's operations and orders (attention.cpp), so the bits are the same.
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_job.h"
#include "isa_target.h"

namespace gmlx_kernels {

#if GMLX_X86

namespace {

constexpr int kKeysPerBlock = 16;

struct TileQuery {
  const float* q;  // (D,)
  float* out;  // (D,)
  int64_t num_seen;  // keys [0, num_seen) are visible
  float* score;  // scores, then probabilities, of keys [0, num_seen)
};

// One key's 16 lane sums over D, each lane's chain in d order from 0 (as dot()).
template <int kChunks>
GMLX_AVX512 inline __attribute__((always_inline)) __m512 lane_sums(const __m512* q, const float* key) {
  __m512 sums = _mm512_setzero_ps();
  for (int c = 0; c < kChunks; ++c) sums = _mm512_add_ps(sums, _mm512_mul_ps(q[c], _mm512_loadu_ps(key + 16 * c)));
  return sums;
}

// The 16 keys' dot products, key k in lane k. The lane tree of dot() (width 8, 4, 2, 1)
// runs on all keys at once: each add pairs the same two lanes, only transposed.
template <int kChunks>
GMLX_AVX512 inline __attribute__((always_inline)) __m512 dot_block(const __m512* q, const float* const* key) {
  __m512 halves[8];  // keys 2i, 2i+1: lanes l + l+8 in lanes 0-7 and 8-15
  for (int i = 0; i < 8; ++i) {
    const __m512 a = lane_sums<kChunks>(q, key[2 * i]), b = lane_sums<kChunks>(q, key[2 * i + 1]);
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  __m512 quarters[4];  // keys 4i..4i+3, one per 128-bit block: lanes l + l+4
  for (int i = 0; i < 4; ++i) {
    const __m512 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  __m512 eighths[2];  // block m: key 8i+m in lanes 0-1, key 8i+4+m in lanes 2-3: l + l+2
  for (int i = 0; i < 2; ++i) {
    const __m512 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 a = eighths[0], b = eighths[1];
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4m + r now holds key 4r + m.
  const __m512i key_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(key_order, sums);
}

// Scores of keys [0, num_seen) for every query of the tile, a key block at a time.
template <int kChunks>
GMLX_AVX512 inline __attribute__((always_inline)) void score_tile(const AttentionJob& job, int64_t b, int64_t kv_head,
                                                                  TileQuery* queries, int num_queries) {
  __m512 q[kMaxAttentionTile][kChunks];
  for (int n = 0; n < num_queries; ++n) {
    for (int c = 0; c < kChunks; ++c) q[n][c] = _mm512_loadu_ps(queries[n].q + 16 * c);
  }
  const __m512 scale = _mm512_set1_ps(job.scale);
  const int64_t num_seen = queries[num_queries - 1].num_seen;  // the tile's most
  const float* key[kKeysPerBlock];
  for (int64_t j0 = 0; j0 < num_seen; j0 += kKeysPerBlock) {
    // Past the last visible key the block rereads it: those lanes are never used.
    for (int k = 0; k < kKeysPerBlock; ++k) key[k] = job.keys.at(b, kv_head, std::min(j0 + k, num_seen - 1));
    for (int n = 0; n < num_queries; ++n) {
      if (j0 >= queries[n].num_seen) continue;
      _mm512_storeu_ps(queries[n].score + j0, _mm512_mul_ps(dot_block<kChunks>(q[n], key), scale));
    }
  }
}

// The running max of dot()'s loop: NaN scores never win a comparison there, nor in
// max_ps(score, best), and which of +0 and -0 wins cannot change exp(score - max).
GMLX_AVX512 inline float max_score(const float* score, int64_t num_seen) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= num_seen; j += 16) best = _mm512_max_ps(_mm512_loadu_ps(score + j), best);
  const __mmask16 tail = static_cast<__mmask16>((1u << (num_seen - j)) - 1);
  best = _mm512_mask_max_ps(best, tail, _mm512_maskz_loadu_ps(tail, score + j), best);
  return _mm512_reduce_max_ps(best);
}

// The value sums of kNum queries (key order from 0, then / denominator), each value
// vector read once for all of them; keys past a query's num_seen go to it alone.
template <int kChunks, int kNum>
GMLX_AVX512 inline __attribute__((always_inline)) void sum_values(const AttentionJob& job, int64_t b, int64_t kv_head,
                                                                  const TileQuery* queries) {
  __m512 acc[kNum][kChunks];
  float denominator[kNum];  // the probabilities' sum, in key order as the values'
  for (int n = 0; n < kNum; ++n) {
    for (int c = 0; c < kChunks; ++c) acc[n][c] = _mm512_setzero_ps();
    denominator[n] = 0.0f;
  }
  const int64_t num_shared = queries[0].num_seen;  // the fewest: num_seen grows along the tile
  for (int64_t j = 0; j < num_shared; ++j) {
    const float* value = job.values.at(b, kv_head, j);
    __m512 v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = _mm512_loadu_ps(value + 16 * c);
    for (int n = 0; n < kNum; ++n) {
      denominator[n] += queries[n].score[j];
      const __m512 p = _mm512_set1_ps(queries[n].score[j]);
      for (int c = 0; c < kChunks; ++c) acc[n][c] = _mm512_add_ps(acc[n][c], _mm512_mul_ps(p, v[c]));
    }
  }
  for (int n = 0; n < kNum; ++n) {
    for (int64_t j = num_shared; j < queries[n].num_seen; ++j) {
      const float* value = job.values.at(b, kv_head, j);
      denominator[n] += queries[n].score[j];
      const __m512 p = _mm512_set1_ps(queries[n].score[j]);
      for (int c = 0; c < kChunks; ++c) {
        acc[n][c] = _mm512_add_ps(acc[n][c], _mm512_mul_ps(p, _mm512_loadu_ps(value + 16 * c)));
      }
    }
    const __m512 sum = _mm512_set1_ps(denominator[n]);
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(queries[n].out + 16 * c, _mm512_div_ps(acc[n][c], sum));
  }
}

template <int kChunks>
GMLX_AVX512 void attend_tile(const AttentionJob& job, int64_t tile, std::vector<float>& scores) {
  const int64_t per_kv_head = job.group * job.num_t;
  const int64_t b = tile / job.num_tiles_per_kv_head / (job.num_q_heads / job.group);
  const int64_t kv_head = tile / job.num_tiles_per_kv_head % (job.num_q_heads / job.group);
  const int64_t first = tile % job.num_tiles_per_kv_head * job.tile_size;
  const int num_queries = static_cast<int>(std::min(job.tile_size, per_kv_head - first));
  const int64_t offset = job.offsets[b * job.offset_stride];
  const int64_t d = kChunks * 16;
  // Room for each query's scores, whole key blocks.
  const int64_t stride = (job.num_keys + kKeysPerBlock - 1) / kKeysPerBlock * kKeysPerBlock;
  scores.resize(static_cast<size_t>(num_queries * stride));
  TileQuery queries[kMaxAttentionTile];
  for (int n = 0; n < num_queries; ++n) {
    const int64_t t = (first + n) / job.group, h = kv_head * job.group + (first + n) % job.group;
    queries[n].q = job.q.at(b, h, t);
    queries[n].out = job.out + ((b * job.num_t + t) * job.num_q_heads + h) * d;
    queries[n].num_seen = std::min(job.num_keys, offset + t + 1);
    queries[n].score = scores.data() + n * stride;
  }
  score_tile<kChunks>(job, b, kv_head, queries, num_queries);
  for (int n = 0; n < num_queries; ++n) {
    TileQuery& query = queries[n];
    // No chain runs through these calls (the denominator is summed with the values),
    // so successive exps overlap.
    const float max = max_score(query.score, query.num_seen);
    for (int64_t j = 0; j < query.num_seen; ++j) query.score[j] = std::exp(query.score[j] - max);
  }
  constexpr int kValueGroup = kChunks <= 4 ? 4 : 2;  // accumulators: 16 registers
  int n = 0;
  for (; n + kValueGroup <= num_queries; n += kValueGroup) sum_values<kChunks, kValueGroup>(job, b, kv_head, queries + n);
  for (; n + 2 <= num_queries; n += 2) sum_values<kChunks, 2>(job, b, kv_head, queries + n);
  for (; n < num_queries; ++n) sum_values<kChunks, 1>(job, b, kv_head, queries + n);
}

}  // namespace

bool can_attend_blocked(const AttentionJob& job) {
  return job.isa == Isa::kAvx512 && (job.num_d == 64 || job.num_d == 128);
}

GMLX_AVX512 void attend_tiles_avx512(const AttentionJob& job, int64_t begin, int64_t end) {
  thread_local std::vector<float> scores;
  for (int64_t tile = begin; tile < end; ++tile) {
    if (job.num_d == 64) {
      attend_tile<4>(job, tile, scores);
    } else {
      attend_tile<8>(job, tile, scores);
    }
  }
}

#else

bool can_attend_blocked(const AttentionJob&) { return false; }
void attend_tiles_avx512(const AttentionJob&, int64_t, int64_t) {}

#endif

}  // namespace gmlx_kernels
