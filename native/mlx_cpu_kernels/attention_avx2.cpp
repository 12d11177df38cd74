// The AVX2 pieces of a key-blocked attention tile (attention_tiles.cpp): a key's 16 lane
// sums are two registers (lanes 0-7, 8-15), whose add is the lane tree's first level; a
// block of 8 keys then runs the other levels together. Same operations and orders as the
// per-query code (attention.cpp), so the same bits.
#include <algorithm>
#include <cmath>

#include "attention_job.h"
#include "isa_target.h"

namespace gmlx_kernels {

#if GMLX_X86

namespace {

constexpr int kKeysPerBlock = 8;

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

// One query's value sum (key order from 0, then / denominator), with the probabilities'.
template <int kChunks>
GMLX_AVX2 inline __attribute__((always_inline)) void sum_values(const AttentionJob& job, int64_t b, int64_t kv_head,
                                                                const TileQuery& query) {
  __m256 acc[2 * kChunks];
  for (int c = 0; c < 2 * kChunks; ++c) acc[c] = _mm256_setzero_ps();
  float denominator = 0.0f;
  for (int64_t j = 0; j < query.num_seen; ++j) {
    const float* value = job.values.at(b, kv_head, j);
    denominator += query.score[j];
    const __m256 p = _mm256_set1_ps(query.score[j]);
    for (int c = 0; c < 2 * kChunks; ++c) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(p, _mm256_loadu_ps(value + 8 * c)));
  }
  const __m256 sum = _mm256_set1_ps(denominator);
  for (int c = 0; c < 2 * kChunks; ++c) _mm256_storeu_ps(query.out + 8 * c, _mm256_div_ps(acc[c], sum));
}

template <int kD>
GMLX_AVX2 void score_tile(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries, int num_queries) {
  const __m256 scale = _mm256_set1_ps(job.scale);
  const int64_t num_seen = queries[num_queries - 1].num_seen;  // the tile's most
  const float* key[kKeysPerBlock];
  for (int64_t j0 = 0; j0 < num_seen; j0 += kKeysPerBlock) {
    // Past the last visible key the block rereads it: those lanes are never used.
    for (int k = 0; k < kKeysPerBlock; ++k) key[k] = job.keys.at(b, kv_head, std::min(j0 + k, num_seen - 1));
    for (int n = 0; n < num_queries; ++n) {
      if (j0 >= queries[n].num_seen) continue;
      _mm256_storeu_ps(queries[n].score + j0, _mm256_mul_ps(dot_block<kD / 16>(queries[n].q, key), scale));
    }
  }
}

}  // namespace

GMLX_AVX2 void score_tile_avx2(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries,
                               int num_queries) {
  if (job.num_d == 64) return score_tile<64>(job, b, kv_head, queries, num_queries);
  score_tile<128>(job, b, kv_head, queries, num_queries);
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

GMLX_AVX2 void sum_values_avx2(const AttentionJob& job, int64_t b, int64_t kv_head, const TileQuery* queries,
                               int num_queries) {
  // One query at a time: at D 128 its accumulators alone fill the 16 registers.
  for (int n = 0; n < num_queries; ++n) {
    if (job.num_d == 64) {
      sum_values<4>(job, b, kv_head, queries[n]);
    } else {
      sum_values<8>(job, b, kv_head, queries[n]);
    }
  }
}

#endif

}  // namespace gmlx_kernels
