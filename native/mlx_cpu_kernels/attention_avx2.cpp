// The AVX2 pieces of a key-blocked attention tile (attention_tiles.cpp): a key's 16 lane
// sums are two registers (lanes 0-7, 8-15), whose add is the lane tree's first level; a
// block of 8 keys then runs the other levels together. Same operations and orders as the
// per-query code (attention.cpp), so the same bits. A float16 cache's rows are widened once
// per tile into float blocks; AVX-512 CPUs run these pieces for it too.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attention_job.h"
#include "isa_target.h"

namespace gmlx_kernels {

#if GMLX_X86

namespace {

constexpr int kKeysPerBlock = 8;

// A float16 cache's key or value row as floats (F16C widens exactly), into a block every query
// of the tile then reads from L1: widened once per tile, not once per query (a verify's tiles
// hold up to 8 queries).
template <int kD>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void widen_row(const Half* row, float* out) {
  for (int i = 0; i < kD; i += 8) {
    _mm256_store_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
  }
}

// Row j of a tile's keys or values as floats: a float32 cache's own, a float16 one's widened into slot.
template <int kD, typename KV>
GMLX_AVX2_F16C inline __attribute__((always_inline)) const float* float_row(const StridedKV& kv, int64_t b,
                                                                           int64_t kv_head, int64_t j, float* slot) {
  if constexpr (std::is_same_v<KV, float>) {
    return kv.at<float>(b, kv_head, j);
  } else {
    widen_row<kD>(kv.at<Half>(b, kv_head, j), slot);
    return slot;
  }
}

// One key's lane sums, lanes l and l+8 added (the tree's width-8 level): each lane's chain
// in d order from 0, as dot().
template <int kChunks>
GMLX_AVX2 inline __attribute__((always_inline)) __m256 half_sums(const float* q, const float* key) {
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  for (int c = 0; c < kChunks; ++c) {
    low = _mm256_add_ps(low, _mm256_mul_ps(_mm256_loadu_ps(q + 16 * c), _mm256_loadu_ps(key + 16 * c)));
    high = _mm256_add_ps(high, _mm256_mul_ps(_mm256_loadu_ps(q + 16 * c + 8), _mm256_loadu_ps(key + 16 * c + 8)));
  }
  return _mm256_add_ps(low, high);
}

// The 8 keys' dot products, key k in lane k: the widths 4, 2 and 1 of dot()'s lane tree
// for all keys at once, each add pairing the same two lanes.
template <int kChunks>
GMLX_AVX2 inline __attribute__((always_inline)) __m256 dot_block(const float* q, const float* const* key) {
  __m256 quarters[4];  // keys 2i, 2i+1 in the two 128-bit halves: lanes l + l+4
  for (int i = 0; i < 4; ++i) {
    const __m256 a = half_sums<kChunks>(q, key[2 * i]), b = half_sums<kChunks>(q, key[2 * i + 1]);
    quarters[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  __m256 eighths[2];  // half m: key 4i+m in lanes 0-1, key 4i+2+m in lanes 2-3: l + l+2
  for (int i = 0; i < 2; ++i) {
    const __m256 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m256 a = eighths[0], b = eighths[1];
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4m + r now holds key 2r + m.
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Keys of a block whose values every query of a tile sums before the next block: the block's
// rows (8-16 KB) come from memory once and stay in L1 for the other queries.
constexpr int64_t kValueBlockKeys = 32;

// The tile's value sums (key order from 0, then / denominator), with the probabilities',
// block by block, one query at a time within a block (at D 128 its accumulators alone fill the
// 16 registers): per lane the same adds in the same order as one query over all its keys, so
// the same bits, with each value row read from memory once per tile, not once per query.
template <int kChunks, typename KV>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void sum_values(const AttentionJob& job, int64_t b, int64_t kv_head,
                                                                const TileQuery* queries, int num_queries) {
  constexpr int kAccumulators = 2 * kChunks;
  constexpr int kD = 8 * kAccumulators;
  alignas(32) float sums[kMaxAttentionTile][kD] = {};
  float denominators[kMaxAttentionTile] = {};
  int64_t num_keys = 0;
  for (int n = 0; n < num_queries; ++n) num_keys = std::max(num_keys, queries[n].num_seen);
  alignas(32) float widened[std::is_same_v<KV, float> ? 1 : kValueBlockKeys][kD];
  const float* rows[kValueBlockKeys];
  for (int64_t j0 = 0; j0 < num_keys; j0 += kValueBlockKeys) {
    const int64_t block_end = std::min(j0 + kValueBlockKeys, num_keys);
    for (int64_t j = j0; j < block_end; ++j) {
      rows[j - j0] = float_row<kD, KV>(job.values, b, kv_head, j, widened[std::is_same_v<KV, float> ? 0 : j - j0]);
    }
    for (int n = 0; n < num_queries; ++n) {
      const int64_t end = std::min(j0 + kValueBlockKeys, queries[n].num_seen);
      if (end <= j0) continue;
      __m256 acc[kAccumulators];
      for (int c = 0; c < kAccumulators; ++c) acc[c] = _mm256_load_ps(sums[n] + 8 * c);
      float denominator = denominators[n];
      for (int64_t j = j0; j < end; ++j) {
        const float* value = rows[j - j0];
        denominator += queries[n].score[j];
        const __m256 p = _mm256_set1_ps(queries[n].score[j]);
        for (int c = 0; c < kAccumulators; ++c) {
          acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(p, _mm256_loadu_ps(value + 8 * c)));
        }
      }
      for (int c = 0; c < kAccumulators; ++c) _mm256_store_ps(sums[n] + 8 * c, acc[c]);
      denominators[n] = denominator;
    }
  }
  for (int n = 0; n < num_queries; ++n) {
    const __m256 sum = _mm256_set1_ps(denominators[n]);
    for (int c = 0; c < kAccumulators; ++c) {
      _mm256_storeu_ps(queries[n].out + 8 * c, _mm256_div_ps(_mm256_load_ps(sums[n] + 8 * c), sum));
    }
  }
}

template <int kD, typename KV>
GMLX_AVX2_F16C void score_tile(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries,
                               int num_queries) {
  const __m256 scale = _mm256_set1_ps(job.scale);
  const int64_t num_seen = queries[num_queries - 1].num_seen;  // the tile's most
  alignas(32) float widened[std::is_same_v<KV, float> ? 1 : kKeysPerBlock][kD];
  const float* key[kKeysPerBlock];
  for (int64_t j0 = 0; j0 < num_seen; j0 += kKeysPerBlock) {
    // Past the last visible key the block rereads it: those lanes are never used.
    for (int k = 0; k < kKeysPerBlock; ++k) {
      key[k] = float_row<kD, KV>(job.keys, b, kv_head, std::min(j0 + k, num_seen - 1),
                                 widened[std::is_same_v<KV, float> ? 0 : k]);
    }
    for (int n = 0; n < num_queries; ++n) {
      if (j0 >= queries[n].num_seen) continue;
      _mm256_storeu_ps(queries[n].score + j0, _mm256_mul_ps(dot_block<kD / 16>(queries[n].q, key), scale));
    }
  }
}

}  // namespace

GMLX_AVX2_F16C void score_tile_avx2(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries,
                                    int num_queries) {
  if (job.is_half_kv) {
    if (job.num_d == 64) return score_tile<64, Half>(job, b, kv_head, queries, num_queries);
    return score_tile<128, Half>(job, b, kv_head, queries, num_queries);
  }
  if (job.num_d == 64) return score_tile<64, float>(job, b, kv_head, queries, num_queries);
  score_tile<128, float>(job, b, kv_head, queries, num_queries);
}

// As max_score_avx512: NaN never wins, and the max's order cannot change exp(score - max).
GMLX_AVX2 float max_score_avx2(const float* score, int64_t num_seen) {
  __m256 best8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= num_seen; j += 8) best8 = _mm256_max_ps(_mm256_loadu_ps(score + j), best8);
  float lanes[8];
  _mm256_storeu_ps(lanes, best8);
  float best = -INFINITY;
  for (float lane : lanes) best = std::max(best, lane);
  for (; j < num_seen; ++j) best = std::max(best, score[j]);
  return best;
}

GMLX_AVX2_F16C void sum_values_avx2(const AttentionJob& job, int64_t b, int64_t kv_head, const TileQuery* queries,
                                    int num_queries) {
  if (job.is_half_kv) {
    if (job.num_d == 64) return sum_values<4, Half>(job, b, kv_head, queries, num_queries);
    return sum_values<8, Half>(job, b, kv_head, queries, num_queries);
  }
  if (job.num_d == 64) return sum_values<4, float>(job, b, kv_head, queries, num_queries);
  sum_values<8, float>(job, b, kv_head, queries, num_queries);
}

#endif

}  // namespace gmlx_kernels
