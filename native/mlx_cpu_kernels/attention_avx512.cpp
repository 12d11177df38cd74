// The AVX-512 pieces of a key-blocked attention tile (attention_tiles.cpp): a block of 16
// keys is read once for the tile's queries, its 16 dot products are reduced together, and
// the value sums of up to 4 queries run side by side. Every query keeps the per-query
// code's operations and orders (attention.cpp), so the bits are the same.
#include <algorithm>
#include <cmath>

#include "attention_job.h"
#include "isa_target.h"

namespace gmlx_kernels {

#if GMLX_X86

namespace {

constexpr int kKeysPerBlock = 16;
constexpr int kMaxChunks = 16;  // head dims up to 256 in 16-lane chunks

// A head dim known only at run time: its whole 16-lane chunks, then the lanes of a last
// partial one (none when D is a multiple of 16).
struct RuntimeDim {
  int num_whole;
  __mmask16 tail;
};

// One key's 16 lane sums over D, each lane's chain in d order from 0 (as dot()); dot()'s
// leftover d < D % 16 go to lanes 0..D % 16 - 1 last, as the masked add does here.
template <int kD>
GMLX_AVX512 inline __attribute__((always_inline)) __m512 lane_sums(const __m512* q, const float* key, RuntimeDim dim) {
  const int num_whole = kD > 0 ? kD / 16 : dim.num_whole;
  __m512 sums = _mm512_setzero_ps();
  for (int c = 0; c < num_whole; ++c) sums = _mm512_add_ps(sums, _mm512_mul_ps(q[c], _mm512_loadu_ps(key + 16 * c)));
  if (kD == 0 && dim.tail) {
    const __m512 products = _mm512_mul_ps(q[num_whole], _mm512_maskz_loadu_ps(dim.tail, key + 16 * num_whole));
    sums = _mm512_mask_add_ps(sums, dim.tail, sums, products);
  }
  return sums;
}

// The 16 keys' dot products, key k in lane k. The lane tree of dot() (width 8, 4, 2, 1)
// runs on all keys at once: each add pairs the same two lanes, only transposed.
template <int kD>
GMLX_AVX512 inline __attribute__((always_inline)) __m512 dot_block(const __m512* q, const float* const* key,
                                                                   RuntimeDim dim) {
  __m512 halves[8];  // keys 2i, 2i+1: lanes l + l+8 in lanes 0-7 and 8-15
  for (int i = 0; i < 8; ++i) {
    const __m512 a = lane_sums<kD>(q, key[2 * i], dim), b = lane_sums<kD>(q, key[2 * i + 1], dim);
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

template <int kD>
GMLX_AVX512 void score_tile(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries, int num_queries) {
  const RuntimeDim dim = {static_cast<int>(kD > 0 ? kD / 16 : job.num_d / 16),
                          static_cast<__mmask16>(kD > 0 ? 0 : (1u << job.num_d % 16) - 1)};
  const int num_chunks = dim.num_whole + (dim.tail != 0);
  __m512 q[kMaxAttentionTile][kD > 0 ? kD / 16 : kMaxChunks];
  for (int n = 0; n < num_queries; ++n) {
    for (int c = 0; c < num_chunks; ++c) {
      const float* chunk = queries[n].q + 16 * c;
      q[n][c] = c < dim.num_whole ? _mm512_loadu_ps(chunk) : _mm512_maskz_loadu_ps(dim.tail, chunk);
    }
  }
  const __m512 scale = _mm512_set1_ps(job.scale);
  const int64_t num_seen = queries[num_queries - 1].num_seen;  // the tile's most
  const float* key[kKeysPerBlock];
  for (int64_t j0 = 0; j0 < num_seen; j0 += kKeysPerBlock) {
    // Past the last visible key the block rereads it: those lanes are never used.
    for (int k = 0; k < kKeysPerBlock; ++k) key[k] = job.keys.at<float>(b, kv_head, std::min(j0 + k, num_seen - 1));
    for (int n = 0; n < num_queries; ++n) {
      if (j0 >= queries[n].num_seen) continue;
      _mm512_storeu_ps(queries[n].score + j0, _mm512_mul_ps(dot_block<kD>(q[n], key, dim), scale));
    }
  }
}

}  // namespace

GMLX_AVX512 void score_tile_avx512(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries,
                                   int num_queries) {
  if (job.num_d == 64) return score_tile<64>(job, b, kv_head, queries, num_queries);
  if (job.num_d == 128) return score_tile<128>(job, b, kv_head, queries, num_queries);
  score_tile<0>(job, b, kv_head, queries, num_queries);
}

// The running max of the per-query loop: NaN scores never win a comparison there, nor in
// max_ps(score, best), and which of +0 and -0 wins cannot change exp(score - max).
GMLX_AVX512 float max_score_avx512(const float* score, int64_t num_seen) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= num_seen; j += 16) best = _mm512_max_ps(_mm512_loadu_ps(score + j), best);
  const __mmask16 tail = static_cast<__mmask16>((1u << (num_seen - j)) - 1);
  best = _mm512_mask_max_ps(best, tail, _mm512_maskz_loadu_ps(tail, score + j), best);
  return _mm512_reduce_max_ps(best);
}

namespace {

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
    const float* value = job.values.at<float>(b, kv_head, j);
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
      const float* value = job.values.at<float>(b, kv_head, j);
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

// One query's value sum at any head dim: the accumulators live in memory, lanes past D
// are computed from zeros and never stored.
GMLX_AVX512 void sum_values_any_dim(const AttentionJob& job, int64_t b, int64_t kv_head, const TileQuery& query) {
  const int num_chunks = static_cast<int>((job.num_d + 15) / 16);
  const __mmask16 last = job.num_d % 16 ? static_cast<__mmask16>((1u << job.num_d % 16) - 1) : 0xFFFF;
  __m512 acc[kMaxChunks];
  for (int c = 0; c < num_chunks; ++c) acc[c] = _mm512_setzero_ps();
  float denominator = 0.0f;
  for (int64_t j = 0; j < query.num_seen; ++j) {
    const float* value = job.values.at<float>(b, kv_head, j);
    denominator += query.score[j];
    const __m512 p = _mm512_set1_ps(query.score[j]);
    for (int c = 0; c < num_chunks; ++c) {
      const __mmask16 lanes = c + 1 < num_chunks ? 0xFFFF : last;
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(p, _mm512_maskz_loadu_ps(lanes, value + 16 * c)));
    }
  }
  const __m512 sum = _mm512_set1_ps(denominator);
  for (int c = 0; c < num_chunks; ++c) {
    _mm512_mask_storeu_ps(query.out + 16 * c, c + 1 < num_chunks ? 0xFFFF : last, _mm512_div_ps(acc[c], sum));
  }
}

template <int kD>
GMLX_AVX512 void sum_tile_values(const AttentionJob& job, int64_t b, int64_t kv_head, const TileQuery* queries,
                                 int num_queries) {
  constexpr int kChunks = kD / 16, kGroup = kChunks <= 4 ? 4 : 2;  // accumulators: 16 registers
  int n = 0;
  for (; n + kGroup <= num_queries; n += kGroup) sum_values<kChunks, kGroup>(job, b, kv_head, queries + n);
  for (; n + 2 <= num_queries; n += 2) sum_values<kChunks, 2>(job, b, kv_head, queries + n);
  for (; n < num_queries; ++n) sum_values<kChunks, 1>(job, b, kv_head, queries + n);
}

}  // namespace

GMLX_AVX512 void sum_values_avx512(const AttentionJob& job, int64_t b, int64_t kv_head, const TileQuery* queries,
                                   int num_queries) {
  if (job.num_d == 64) return sum_tile_values<64>(job, b, kv_head, queries, num_queries);
  if (job.num_d == 128) return sum_tile_values<128>(job, b, kv_head, queries, num_queries);
  for (int n = 0; n < num_queries; ++n) sum_values_any_dim(job, b, kv_head, queries[n]);
}

#endif

}  // namespace gmlx_kernels
