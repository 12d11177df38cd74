#include "int8_dot_kernels.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "int8_many_rows.h"
#include "int8_walk.h"
#include "isa_target.h"

namespace gmlx_kernels {

namespace {

constexpr int kBlocksPerChunk = 4;
// Weight bytes of one output over one 128-input chunk: 64 at 4 bits, 128 at 8.
template <int kBits>
constexpr int64_t kChunkWeightBytes = kInt8ChunkInputs * kBits / 8;
constexpr int kQuadHalves = 16;
// The interleaved layout is one stream; the hardware prefetcher alone leaves the kernel
// waiting on its first loads of each chunk, so it fetches the chunk this many ahead (0: off).
constexpr int64_t kDefaultPrefetchChunks = 8;  // 1.1-1.2x on SmolLM2 shapes (scripts/bench_kernels.py)
std::atomic<int64_t> g_prefetch_chunks{-1};  // -1: each layout's default
int64_t quad_prefetch_chunks() {
  const int64_t setting = g_prefetch_chunks.load(std::memory_order_relaxed);
  return setting < 0 ? kDefaultPrefetchChunks : setting;
}
constexpr float kRoundingMagic = 12582912.0f;  // 1.5 * 2^23

// One output's scales or biases: float32, or half precision (f16 set: values a float32
// holds exactly, so either gives the same floats).
struct GroupRow {
  const float* f32 = nullptr;
  const uint16_t* f16 = nullptr;
  // Elements from one 128-input chunk's values to the next: 4 / blocks per group in a plain
  // row; a quad-interleaved layout (int8_dot_kernels.h) stores each chunk's beside its weights.
  int64_t chunk_stride = 0;
};

inline float group_value(const GroupRow& row, int64_t i) { return row.f16 ? half_to_float(row.f16[i]) : row.f32[i]; }

// One kernel call: four outputs (copies of the last one past the end) against rows
// [r0, r0 + kRows); writes each row's 16 lane sums, output i's lane k at 4i + k.
struct QuadArgs {
  const uint8_t* w[kQuadOutputs];  // each output's packed row
  int64_t w_chunk_stride;  // bytes from one chunk's weights of an output to the next chunk's
  GroupRow scales[kQuadOutputs];
  GroupRow biases[kQuadOutputs];
  int64_t num_blocks;  // K / 32
  int64_t num_chunks;  // padded K / 128
  int blocks_per_group;  // group_size / 32
  const QuantizedRows* x;
  int64_t r0;
  float* lanes;  // (kRows, 16)
};

// A group value (scale or bias) for each of the chunk's four blocks; 0 past K.
inline void group_values(const GroupRow& row, int64_t c, int64_t num_blocks, int blocks_per_group, float* out4) {
  for (int k = 0; k < kBlocksPerChunk; ++k) {
    const int64_t j = c * kBlocksPerChunk + k;
    out4[k] = j < num_blocks ? group_value(row, c * row.chunk_stride + k / blocks_per_group) : 0.0f;
  }
}

// ---------------------------------------------------------------- portable

template <int kBits>
void quad_portable(const QuadArgs& q, int num_rows) {
  for (int r = 0; r < num_rows; ++r) {
    const int8_t* xq = q.x->q_row(q.r0 + r);
    const float* d = q.x->d_row(q.r0 + r);
    const float* xsd = q.x->xsd_row(q.r0 + r);
    float lanes[kQuadOutputs * kBlocksPerChunk] = {};
    for (int64_t c = 0; c < q.num_chunks; ++c) {
      for (int i = 0; i < kQuadOutputs; ++i) {
        float s[kBlocksPerChunk], b[kBlocksPerChunk];
        group_values(q.scales[i], c, q.num_blocks, q.blocks_per_group, s);
        group_values(q.biases[i], c, q.num_blocks, q.blocks_per_group, b);
        for (int k = 0; k < kBlocksPerChunk; ++k) {
          const int64_t j = c * kBlocksPerChunk + k;
          int32_t isum = 0;
          if (j < q.num_blocks && kBits == 4) {
            const uint8_t* w = q.w[i] + c * q.w_chunk_stride + k * 16;
            const int8_t* x_even = xq + c * kInt8ChunkInputs + 16 * k;
            for (int t = 0; t < 16; ++t) isum += (w[t] & 0xF) * x_even[t] + (w[t] >> 4) * x_even[64 + t];
          } else if (j < q.num_blocks) {
            const uint8_t* w = q.w[i] + c * q.w_chunk_stride + k * 32;
            for (int t = 0; t < 32; ++t) isum += w[t] * xq[j * 32 + t];
          }
          const float p = d[j] * static_cast<float>(isum);
          float& lane = lanes[kBlocksPerChunk * i + k];
          lane = std::fma(s[k], p, lane);
          lane = std::fma(b[k], xsd[j], lane);
        }
      }
    }
    std::memcpy(q.lanes + r * 16, lanes, sizeof(lanes));
  }
}

// The quad layout, portable: every quad of [begin, end) for every row, whole chunks and a
// half one. Per lane the float operations of quad_portable (a half chunk's blocks 2-3 would
// add fma(0, 0, lane), which keeps the lane: they are skipped).
template <int kBits>
void quads_portable(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end) {
  const QuadLayout layout = quad_layout(a.num_inputs, kBits);
  const int64_t num_chunks = layout.num_whole_chunks + (layout.has_half_chunk ? 1 : 0);
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const int8_t* xq = x.q_row(r);
    const float* d = x.d_row(r);
    const float* xsd = x.xsd_row(r);
    for (int64_t n0 = begin; n0 < end; n0 += kQuadOutputs) {
      const uint8_t* chunk = a.quads + n0 / kQuadOutputs * layout.quad_bytes;
      float lanes[kQuadOutputs * kBlocksPerChunk] = {};
      for (int64_t c = 0; c < num_chunks; ++c) {
        const bool is_half = c == layout.num_whole_chunks;
        const int64_t weight_bytes = kChunkWeightBytes<kBits> / (is_half ? 2 : 1);
        const auto* halves = reinterpret_cast<const uint16_t*>(chunk + kQuadOutputs * weight_bytes);
        for (int i = 0; i < kQuadOutputs; ++i) {
          for (int k = 0; k < (is_half ? 2 : kBlocksPerChunk); ++k) {
            const int64_t j = c * kBlocksPerChunk + k;
            int32_t isum = 0;
            if constexpr (kBits == 4) {
              const uint8_t* w = chunk + i * weight_bytes + k * 16;
              const int8_t* x_even = xq + c * kInt8ChunkInputs + 16 * k;
              for (int t = 0; t < 16; ++t) isum += (w[t] & 0xF) * x_even[t] + (w[t] >> 4) * x_even[64 + t];
            } else {
              const uint8_t* w = chunk + i * weight_bytes + k * 32;
              for (int t = 0; t < 32; ++t) isum += w[t] * xq[j * 32 + t];
            }
            const float p = d[j] * static_cast<float>(isum);
            float& lane = lanes[kBlocksPerChunk * i + k];
            lane = std::fma(half_to_float(halves[kBlocksPerChunk * i + k]), p, lane);
            lane = std::fma(half_to_float(halves[kQuadHalves + kBlocksPerChunk * i + k]), xsd[j], lane);
          }
        }
        chunk += is_half ? layout.half_chunk_bytes : layout.chunk_bytes;
      }
      for (int i = 0; i < std::min<int64_t>(kQuadOutputs, end - n0); ++i) {
        const float* l = lanes + kBlocksPerChunk * i;
        a.y[r * a.num_outputs + n0 + i] = (l[0] + l[1]) + (l[2] + l[3]);
      }
    }
  }
}

#if GMLX_X86

// Four floats per output, one per block of a whole chunk c.
template <int kBlocksPerGroup>
__attribute__((target("f16c"))) inline __m128 group4(const GroupRow& row, int64_t c) {
  const int64_t j = c * row.chunk_stride;  // the chunk's first value: blocks per group 1, 2 or 4 blocks
  if (row.f16 != nullptr) {
    if constexpr (kBlocksPerGroup == 1) return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.f16 + j)));
    if constexpr (kBlocksPerGroup == 2) {
      uint32_t two;
      std::memcpy(&two, row.f16 + j, sizeof(two));
      const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)));
      return _mm_unpacklo_ps(v, v);
    }
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(row.f16[j]));
    return _mm_shuffle_ps(v, v, 0);
  }
  if constexpr (kBlocksPerGroup == 1) return _mm_loadu_ps(row.f32 + j);
  if constexpr (kBlocksPerGroup == 2) {
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(row.f32 + j)));
    return _mm_unpacklo_ps(two, two);
  }
  return _mm_set1_ps(row.f32[j]);
}

// The scale or bias of each of the last chunk's num_valid blocks (1-3, K not a multiple
// of 128), zero past K; nothing is read past the row. A group of 64 leaves two blocks (one
// group), one of 128 never a partial chunk.
template <int kBlocksPerGroup>
GMLX_AVX2_F16C inline __m128 tail_group4(const GroupRow& row, int64_t c, int num_valid) {
  const int64_t j = c * kBlocksPerChunk;
  const __m128i valid = _mm_cmpgt_epi32(_mm_set1_epi32(num_valid), _mm_setr_epi32(0, 1, 2, 3));
  if constexpr (kBlocksPerGroup == 1) {
    if (row.f32 != nullptr) return _mm_maskload_ps(row.f32 + j, valid);
    // Up to three halves, without a loop (a loop here becomes a memcpy call).
    const uint64_t packed = row.f16[j] | (num_valid > 1 ? static_cast<uint64_t>(row.f16[j + 1]) << 16 : 0) |
                            (num_valid > 2 ? static_cast<uint64_t>(row.f16[j + 2]) << 32 : 0);
    return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(packed)));
  }
  const int64_t g = j / kBlocksPerGroup;
  __m128 value;
  if (row.f32 != nullptr) {
    value = _mm_set1_ps(row.f32[g]);
  } else {
    value = _mm_cvtph_ps(_mm_cvtsi32_si128(row.f16[g]));
    value = _mm_shuffle_ps(value, value, 0);
  }
  return _mm_and_ps(value, _mm_castsi128_ps(valid));
}

// ---------------------------------------------------------------- AVX2

// Lanes 4i + k of outputs 0-1 in one register (y[r][0]), 2-3 in another.
// Chunk c for kRows rows; a tail chunk loads only its num_valid blocks' weight dwords.
// 4 bits: hadd leaves an output's blocks at [j0, j0, j2, j2 | j1, j1, j3, j3] (pairs of partials).
GMLX_AVX2_F16C inline __m256i pairs4_avx2(__m256i v01, __m256i v23, const __m256i* x) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // u8 nibbles x s8: pairs at most 2 * 15 * 127, so the int16 sums never saturate.
  const __m256i d01 = _mm256_add_epi16(
      _mm256_maddubs_epi16(_mm256_and_si256(v01, nibble), x[0]),
      _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v01, 4), nibble), x[2]));
  const __m256i d23 = _mm256_add_epi16(
      _mm256_maddubs_epi16(_mm256_and_si256(v23, nibble), x[1]),
      _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v23, 4), nibble), x[3]));
  return _mm256_hadd_epi32(_mm256_madd_epi16(d01, ones), _mm256_madd_epi16(d23, ones));
}

// 8 bits, one block (32 weights in v): its eight int32 partials. A byte splits into nibbles so
// maddubs's int16 pairs stay below 2 * 15 * 127 (whole bytes would saturate them).
GMLX_AVX2_F16C inline __m256i block8_avx2(__m256i v, __m256i x) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, nibble), x), ones);
  const __m256i high = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), x), ones);
  return _mm256_add_epi32(low, _mm256_slli_epi32(high, 4));
}

// 8 bits: an output's four block sums [j0, j1, j2, j3] from their partials.
GMLX_AVX2_F16C inline __m128i blocks8_avx2(const __m256i* d) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The float steps of every AVX2 int8 kernel, lane by lane (so they all give the same bits):
// fma(s, d * isum, lane), then fma(b, xsd, lane).
GMLX_AVX2_F16C inline __m256 lanes_plus(__m256 lanes, __m256i isum, __m256 s, __m256 b, __m256 d, __m256 xsd) {
  lanes = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum)), lanes);
  return _mm256_fmadd_ps(b, xsd, lanes);
}

template <int kRows, bool kTail, int kBits>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void chunk_avx2(const QuadArgs& q, int64_t c, int num_valid,
                                                               const __m256* s, const __m256* b, __m256 (*y)[2]) {
  const __m256i dword = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask01 = _mm256_cmpgt_epi32(_mm256_set1_epi32(4 * num_valid), dword);
  const __m256i mask23 = _mm256_cmpgt_epi32(_mm256_set1_epi32(4 * num_valid - 8), dword);
  // 4 bits: the hadd of two outputs' pairs leaves [o0 j0, o0 j2, o1 j0, o1 j2 | o0 j1, o0 j3, o1 j1, o1 j3].
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = 0; r < kRows; ++r) {
    const int8_t* xq = q.x->q_row(q.r0 + r) + c * kInt8ChunkInputs;
    __m256i x[4];  // 4 bits: evens of j0-1, j2-3, odds of j0-1, j2-3; 8 bits: block k
    for (int k = 0; k < 4; ++k) x[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * k));
    __m256i isum[2];  // lanes 4i + k of outputs 0-1, 2-3
    if constexpr (kBits == 4) {
      __m256i pair[kQuadOutputs];
      for (int i = 0; i < kQuadOutputs; ++i) {
        const uint8_t* w = q.w[i] + c * q.w_chunk_stride;
        __m256i v01, v23;
        if constexpr (kTail) {
          v01 = _mm256_maskload_epi32(reinterpret_cast<const int*>(w), mask01);
          v23 = _mm256_maskload_epi32(reinterpret_cast<const int*>(w + 32), mask23);
        } else {
          v01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
          v23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
        }
        pair[i] = pairs4_avx2(v01, v23, x);
      }
      for (int h = 0; h < 2; ++h) {
        isum[h] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(pair[2 * h], pair[2 * h + 1]), order);
      }
    } else {
      __m128i blocks[kQuadOutputs];
      for (int i = 0; i < kQuadOutputs; ++i) {
        const uint8_t* w = q.w[i] + c * q.w_chunk_stride;
        __m256i d[4];
        for (int k = 0; k < 4; ++k) {
          const bool is_valid = !kTail || k < num_valid;
          d[k] = is_valid ? block8_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * k)), x[k])
                          : _mm256_setzero_si256();
        }
        blocks[i] = blocks8_avx2(d);
      }
      for (int h = 0; h < 2; ++h) isum[h] = _mm256_set_m128i(blocks[2 * h + 1], blocks[2 * h]);
    }
    const __m128 d4 = _mm_loadu_ps(q.x->d_row(q.r0 + r) + c * kBlocksPerChunk);
    const __m128 xsd4 = _mm_loadu_ps(q.x->xsd_row(q.r0 + r) + c * kBlocksPerChunk);
    const __m256 d = _mm256_set_m128(d4, d4), xsd = _mm256_set_m128(xsd4, xsd4);
    for (int h = 0; h < 2; ++h) y[r][h] = lanes_plus(y[r][h], isum[h], s[h], b[h], d, xsd);
  }
}

template <int kRows, int kBlocksPerGroup, int kBits>
GMLX_AVX2_F16C void quad_avx2(const QuadArgs& q) {
  __m256 y[kRows][2];
  for (int r = 0; r < kRows; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  const int64_t num_whole = q.num_blocks / kBlocksPerChunk;
  for (int64_t c = 0; c < num_whole; ++c) {
    __m256 s[2], b[2];
    for (int h = 0; h < 2; ++h) {
      s[h] = _mm256_set_m128(group4<kBlocksPerGroup>(q.scales[2 * h + 1], c), group4<kBlocksPerGroup>(q.scales[2 * h], c));
      b[h] = _mm256_set_m128(group4<kBlocksPerGroup>(q.biases[2 * h + 1], c), group4<kBlocksPerGroup>(q.biases[2 * h], c));
    }
    chunk_avx2<kRows, false, kBits>(q, c, kBlocksPerChunk, s, b, y);
  }
  if constexpr (kBlocksPerGroup < kBlocksPerChunk) {
    if (num_whole < q.num_chunks) {
      const int num_valid = static_cast<int>(q.num_blocks - num_whole * kBlocksPerChunk);
      __m256 s[2], b[2];
      for (int h = 0; h < 2; ++h) {
        s[h] = _mm256_set_m128(tail_group4<kBlocksPerGroup>(q.scales[2 * h + 1], num_whole, num_valid),
                               tail_group4<kBlocksPerGroup>(q.scales[2 * h], num_whole, num_valid));
        b[h] = _mm256_set_m128(tail_group4<kBlocksPerGroup>(q.biases[2 * h + 1], num_whole, num_valid),
                               tail_group4<kBlocksPerGroup>(q.biases[2 * h], num_whole, num_valid));
      }
      chunk_avx2<kRows, true, kBits>(q, num_whole, num_valid, s, b, y);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(q.lanes + r * 16, y[r][0]);
    _mm256_storeu_ps(q.lanes + r * 16 + 8, y[r][1]);
  }
}

// Lanes 4i + k of two outputs plus block k's terms, with the row's d and xsd of the chunk's four
// blocks broadcast.
GMLX_AVX2_F16C inline __m256 lanes_plus(__m256 lanes, __m256i isum, __m256 s, __m256 b, const float* d4,
                                        const float* xsd4) {
  return lanes_plus(lanes, isum, s, b, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(d4)),
                    _mm256_broadcast_ps(reinterpret_cast<const __m128*>(xsd4)));
}

// 4 bits: one chunk of the quad layout on AVX2 for rows [r0, r0 + kRows), a whole chunk or a
// half one (blocks 0-1; blocks 2-3 count as zero weights, scales and biases). The integer
// steps leave outputs 2h and 2h + 1's block sums in "sum order", [o0 j0, o0 j2, o1 j0, o1 j2 |
// o0 j1, o0 j3, o1 j1, o1 j3], and y's lanes stay in that order through the chunks: the scales
// and biases (shared by the rows) and d and xsd come to it by shuffles within 128 bits, and
// the lanes go back to 4i + k once a quad. Per lane the float operations of quad_avx2, so the
// same bits, without a lane-crossing permute per row (vpermd, slow on Zen 3).
constexpr int kSumOrderToLanes[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // lane 4i + k's place in sum order
template <int kRows, bool kHalf>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void quad_chunk4_avx2(const uint8_t* chunk, int64_t c,
                                                                         const RowsOf<kRows>& x, __m256 (*y)[2]) {
  constexpr int64_t kWeightBytes = kChunkWeightBytes<4> / (kHalf ? 2 : 1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // Integers first, each output's nibbles unpacked once for all rows (its rows' partials held
  // for the next output), then the float steps: 1.15-1.3x a chunk over one loop doing both.
  alignas(32) int32_t isums[2][kRows][8];
  for (int h = 0; h < 2; ++h) {
    __m256i first[kRows];  // output 2h's partials per row
    for (int o = 0; o < 2; ++o) {
      const uint8_t* w = chunk + (2 * h + o) * kWeightBytes;
      const __m256i v01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i v23 = kHalf ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
      const __m256i lo01 = _mm256_and_si256(v01, nibble), hi01 = _mm256_and_si256(_mm256_srli_epi16(v01, 4), nibble);
      const __m256i lo23 = _mm256_and_si256(v23, nibble), hi23 = _mm256_and_si256(_mm256_srli_epi16(v23, 4), nibble);
      for (int r = 0; r < kRows; ++r) {
        const auto* xr = reinterpret_cast<const __m256i*>(x.q[r] + c * kInt8ChunkInputs);
        // u8 nibbles x s8: pairs at most 2 * 15 * 127, two of them 7620.
        const __m256i d01 = _mm256_add_epi16(_mm256_maddubs_epi16(lo01, _mm256_loadu_si256(xr)),
                                             _mm256_maddubs_epi16(hi01, _mm256_loadu_si256(xr + 2)));
        const __m256i d23 = _mm256_add_epi16(_mm256_maddubs_epi16(lo23, _mm256_loadu_si256(xr + 1)),
                                             _mm256_maddubs_epi16(hi23, _mm256_loadu_si256(xr + 3)));
        // A block's eight int16 partials to four (at most 15240): [j0, j2, j0, j2 | j1, j3, j1, j3] in pairs.
        const __m256i part = _mm256_add_epi16(_mm256_unpacklo_epi32(d01, d23), _mm256_unpackhi_epi32(d01, d23));
        if (o == 0) {
          first[r] = part;
          continue;
        }
        // Both outputs' to two (at most 30480), then one madd makes the int32 sums.
        const __m256i pairs =
            _mm256_add_epi16(_mm256_unpacklo_epi64(first[r], part), _mm256_unpackhi_epi64(first[r], part));
        _mm256_store_si256(reinterpret_cast<__m256i*>(isums[h][r]), _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  const __m256i block_of_lane = _mm256_setr_epi32(0, 2, 0, 2, 1, 3, 1, 3);  // in sum order
  const __m128i halves_to_sum_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  __m256 d[kRows], xsd[kRows];
  for (int r = 0; r < kRows; ++r) {
    d[r] = _mm256_permutevar_ps(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(x.d[r] + c * kBlocksPerChunk)),
                                block_of_lane);
    xsd[r] = _mm256_permutevar_ps(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(x.xsd[r] + c * kBlocksPerChunk)),
                                  block_of_lane);
  }
  const auto* halves = reinterpret_cast<const __m128i*>(chunk + kQuadOutputs * kWeightBytes);
  for (int h = 0; h < 2; ++h) {
    const __m256 s = _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128(halves + h), halves_to_sum_order));
    const __m256 b = _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128(halves + 2 + h), halves_to_sum_order));
    for (int r = 0; r < kRows; ++r) {
      const __m256i isum = _mm256_load_si256(reinterpret_cast<const __m256i*>(isums[h][r]));
      y[r][h] = lanes_plus(y[r][h], isum, s, b, d[r], xsd[r]);
    }
  }
}

// 8 bits: one chunk of the quad layout on AVX2 for rows [r0, r0 + kRows): a whole chunk, or a
// half one (blocks 0-1; its blocks 2-3 count as zero weights, scales and biases, which keeps the
// lanes as a padded whole chunk does). Per lane the float operations of quad_avx2 (so the
// same bits), with a chunk's 16 scales and 16 biases two float16 loads each (lane 4i + k is
// their order in the layout). Each output's weights are widened to int16 once for all rows;
// madd's int32 pair sums of byte x int8 products are exact (maddubs would need nibbles). As
// with 4 bits, the integer steps of all rows come first (1.06-1.15x a chunk on Zen 3).
template <int kRows, bool kHalf>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void quad_chunk8_avx2(const uint8_t* chunk, int64_t c,
                                                                         const RowsOf<kRows>& x, __m256 (*y)[2]) {
  constexpr int64_t kWeightBytes = kChunkWeightBytes<8> / (kHalf ? 2 : 1);
  constexpr int kNumBlocks = kHalf ? 2 : kBlocksPerChunk;
  // Each row's 128 int8 inputs of the chunk as int16, shared by the four outputs.
  __m256i x16[kRows][8];
  for (int r = 0; r < kRows; ++r) {
    const int8_t* xr = x.q[r] + c * kInt8ChunkInputs;
    for (int i = 0; i < 2 * kNumBlocks; ++i) {
      x16[r][i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + 16 * i)));
    }
  }
  alignas(32) int32_t isums[2][kRows][8];  // lanes 4i + k of outputs 2h, 2h + 1
  for (int h = 0; h < 2; ++h) {
    __m256i first[kRows];  // output 2h's four block sums per row, in two halves' partials
    for (int o = 0; o < 2; ++o) {
      const uint8_t* w = chunk + (2 * h + o) * kWeightBytes;
      __m256i w16[kNumBlocks][2];
      for (int k = 0; k < kNumBlocks; ++k) {
        for (int half = 0; half < 2; ++half) {
          const auto* bytes = reinterpret_cast<const __m128i*>(w + 32 * k + 16 * half);
          w16[k][half] = _mm256_cvtepu8_epi16(_mm_loadu_si128(bytes));
        }
      }
      for (int r = 0; r < kRows; ++r) {
        __m256i p[4];  // block k's eight int32 partials
        for (int k = 0; k < 4; ++k) {
          p[k] = k < kNumBlocks ? _mm256_add_epi32(_mm256_madd_epi16(w16[k][0], x16[r][2 * k]),
                                                   _mm256_madd_epi16(w16[k][1], x16[r][2 * k + 1]))
                                : _mm256_setzero_si256();
        }
        // Transposing adds, no hadd: [j0 j1 j0 j1], then [j0 j1 j2 j3] in each half.
        const __m256i p01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
        const __m256i p23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
        const __m256i sums = _mm256_add_epi32(_mm256_unpacklo_epi64(p01, p23), _mm256_unpackhi_epi64(p01, p23));
        if (o == 0) {
          first[r] = sums;
          continue;
        }
        const __m256i lows = _mm256_permute2x128_si256(first[r], sums, 0x20);
        const __m256i highs = _mm256_permute2x128_si256(first[r], sums, 0x31);
        _mm256_store_si256(reinterpret_cast<__m256i*>(isums[h][r]), _mm256_add_epi32(lows, highs));
      }
    }
  }
  const auto* halves = reinterpret_cast<const __m128i*>(chunk + kQuadOutputs * kWeightBytes);
  for (int h = 0; h < 2; ++h) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(halves + h));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(halves + 2 + h));
    for (int r = 0; r < kRows; ++r) {
      const __m256i isum = _mm256_load_si256(reinterpret_cast<const __m256i*>(isums[h][r]));
      y[r][h] = lanes_plus(y[r][h], isum, s, b, x.d[r] + c * kBlocksPerChunk, x.xsd[r] + c * kBlocksPerChunk);
    }
  }
}

template <int kBits, int kRows, bool kHalf>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void quad_chunk_avx2(const uint8_t* chunk, int64_t c,
                                                                        const RowsOf<kRows>& x, __m256 (*y)[2]) {
  if constexpr (kBits == 4) {
    quad_chunk4_avx2<kRows, kHalf>(chunk, c, x, y);
  } else {
    quad_chunk8_avx2<kRows, kHalf>(chunk, c, x, y);
  }
}

// The quad layout on AVX2: every quad of [begin, end) for rows [r0, r0 + kRows), outputs
// written. One pointer walks the stream and the lane sums stay in registers up to the outputs.
template <int kBits, int kRows>
GMLX_AVX2_F16C void quads_avx2(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
  const QuadLayout layout = quad_layout(a.num_inputs, kBits);
  constexpr int64_t kChunkBytes = kQuadOutputs * kChunkWeightBytes<kBits> + 2 * kQuadHalves * 2;
  assert(layout.chunk_bytes == kChunkBytes);
  const int64_t prefetch_bytes = quad_prefetch_chunks() * kChunkBytes;
  const RowsOf<kRows> rows(x, r0);
  const uint8_t* chunk = a.quads + begin / kQuadOutputs * layout.quad_bytes;
  for (int64_t n0 = begin; n0 < end; n0 += kQuadOutputs) {
    __m256 y[kRows][2];
    for (int r = 0; r < kRows; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < layout.num_whole_chunks; ++c, chunk += kChunkBytes) {
      prefetch_ahead(chunk, kChunkBytes, prefetch_bytes);
      quad_chunk_avx2<kBits, kRows, false>(chunk, c, rows, y);
    }
    if (layout.has_half_chunk) {
      quad_chunk_avx2<kBits, kRows, true>(chunk, layout.num_whole_chunks, rows, y);
      chunk += layout.half_chunk_bytes;
    }
    if constexpr (kBits == 4) {  // sum order back to lanes 4i + k
      const __m256i to_lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kSumOrderToLanes));
      for (int r = 0; r < kRows; ++r) {
        for (int h = 0; h < 2; ++h) y[r][h] = _mm256_permutevar8x32_ps(y[r][h], to_lanes);
      }
    }
    // Output i = (lane 4i + lane 4i+1) + (lane 4i+2 + lane 4i+3), as the scalar sum does.
    const int num_valid = static_cast<int>(std::min<int64_t>(kQuadOutputs, end - n0));
    for (int r = 0; r < kRows; ++r) {
      const __m256 pairs = _mm256_hadd_ps(y[r][0], y[r][1]);  // [o0 01, o0 23, o2 01, o2 23 | o1 .., o3 ..]
      const __m256 sums = _mm256_hadd_ps(pairs, pairs);  // [o0, o2, o0, o2 | o1, o3, o1, o3]
      const __m128 out = _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
      float* yr = a.y + (r0 + r) * a.num_outputs + n0;
      if (num_valid == kQuadOutputs) {
        _mm_storeu_ps(yr, out);
      } else {
        alignas(16) float values[kQuadOutputs];
        _mm_store_ps(values, out);
        for (int i = 0; i < num_valid; ++i) yr[i] = values[i];
      }
    }
  }
}

template <int kBits, int kRows>
struct Avx2QuadWalk {
  static void run(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
    quads_avx2<kBits, kRows>(a, x, begin, end, r0);
  }
};

// ---------------------------------------------------------------- AVX-512 VNNI

// The first num_bytes bytes of a 64-byte load (0-64).
inline __mmask64 first_bytes(int num_bytes) { return num_bytes >= 64 ? ~0ull : (1ull << num_bytes) - 1; }

// One row's lanes plus a chunk's terms with VNNI: the four outputs' integer block sums of the
// row's 128 inputs at xq (weights lo / hi as the chunk kernels unpack them; kHighIsZero: 8-bit
// blocks 2-3 hold no weights, so their products are skipped), then per lane
// fma(s, d * isum, lane) and fma(b, xsd, lane) with the row's d and xsd of the chunk's blocks.
template <int kBits, bool kHighIsZero>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) __m512 lanes_plus_avx512(
    const __m512i* lo, const __m512i* hi, const int8_t* xq, const float* d4, const float* xsd4, __m512 s, __m512 b,
    __m512 lanes) {
  // The transpose-add below leaves block k of output i at 4k + i; lanes want 4i + k.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i x_lo = _mm512_loadu_si512(xq), x_hi = _mm512_loadu_si512(xq + 64);
  __m512i acc[kQuadOutputs];  // 128-bit lane k: four partials of block k
  for (int i = 0; i < kQuadOutputs; ++i) {
    if constexpr (kBits == 4) {
      acc[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], x_lo), hi[i], x_hi);
    } else {  // whole bytes (u8 x s8: four products per dword stay far below 2^31)
      const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], x_lo);  // lanes j0, j0, j1, j1
      const __m512i h = kHighIsZero ? _mm512_setzero_si512()
                                    : _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[i], x_hi);  // j2, j2, j3, j3
      acc[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(a, h, 0x88), _mm512_shuffle_i64x2(a, h, 0xDD));
    }
  }
  // Sum each 128-bit lane's four partials, four outputs at once (exact integer adds).
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0], acc[1]), _mm512_unpackhi_epi32(acc[0], acc[1]));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2], acc[3]), _mm512_unpackhi_epi32(acc[2], acc[3]));
  const __m512i isum = _mm512_permutexvar_epi32(
      order, _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23)));
  const __m512 d = _mm512_broadcast_f32x4(_mm_loadu_ps(d4));
  const __m512 xsd = _mm512_broadcast_f32x4(_mm_loadu_ps(xsd4));
  lanes = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)), lanes);
  return _mm512_fmadd_ps(b, xsd, lanes);
}

// Chunk c for kRows rows over plain rows; a tail chunk loads only its num_valid blocks' bytes.
template <int kRows, bool kTail, int kBits>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void chunk_avx512(const QuadArgs& q, int64_t c, int num_valid,
                                                                        __m512 s, __m512 b, __m512* y) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // 4 bits: low and high nibbles, 128-bit lane k = block k. 8 bits: blocks 0-1, then 2-3 (two lanes each).
  __m512i lo[kQuadOutputs], hi[kQuadOutputs];
  for (int i = 0; i < kQuadOutputs; ++i) {
    const uint8_t* w = q.w[i] + c * q.w_chunk_stride;
    if constexpr (kBits == 4) {
      const __m512i v = kTail ? _mm512_maskz_loadu_epi8(first_bytes(16 * num_valid), w) : _mm512_loadu_si512(w);
      lo[i] = _mm512_and_si512(v, nibble);
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    } else {
      lo[i] = kTail ? _mm512_maskz_loadu_epi8(first_bytes(32 * num_valid), w) : _mm512_loadu_si512(w);
      hi[i] = kTail ? _mm512_maskz_loadu_epi8(first_bytes(std::max(0, 32 * num_valid - 64)), w + 64)
                    : _mm512_loadu_si512(w + 64);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    y[r] = lanes_plus_avx512<kBits, false>(lo, hi, q.x->q_row(q.r0 + r) + c * kInt8ChunkInputs,
                                           q.x->d_row(q.r0 + r) + c * kBlocksPerChunk,
                                           q.x->xsd_row(q.r0 + r) + c * kBlocksPerChunk, s, b, y[r]);
  }
}

template <int kBlocksPerGroup>
GMLX_AVX512_VNNI inline __m512 group16(const GroupRow* rows, int64_t c) {
  __m512 v = _mm512_castps128_ps512(group4<kBlocksPerGroup>(rows[0], c));
  v = _mm512_insertf32x4(v, group4<kBlocksPerGroup>(rows[1], c), 1);
  v = _mm512_insertf32x4(v, group4<kBlocksPerGroup>(rows[2], c), 2);
  return _mm512_insertf32x4(v, group4<kBlocksPerGroup>(rows[3], c), 3);
}

template <int kRows, int kBlocksPerGroup, int kBits>
GMLX_AVX512_VNNI void quad_avx512(const QuadArgs& q) {
  __m512 y[kRows];
  for (int r = 0; r < kRows; ++r) y[r] = _mm512_setzero_ps();
  const int64_t num_whole = q.num_blocks / kBlocksPerChunk;
  for (int64_t c = 0; c < num_whole; ++c) {
    chunk_avx512<kRows, false, kBits>(q, c, kBlocksPerChunk, group16<kBlocksPerGroup>(q.scales, c),
                               group16<kBlocksPerGroup>(q.biases, c), y);
  }
  if constexpr (kBlocksPerGroup < kBlocksPerChunk) {
    if (num_whole < q.num_chunks) {
      const int num_valid = static_cast<int>(q.num_blocks - num_whole * kBlocksPerChunk);
      __m512 s = _mm512_setzero_ps(), b = _mm512_setzero_ps();
      for (int i = 0; i < kQuadOutputs; ++i) {
        const __mmask16 lanes = static_cast<__mmask16>(0xF << (4 * i));
        s = _mm512_mask_broadcast_f32x4(s, lanes, tail_group4<kBlocksPerGroup>(q.scales[i], num_whole, num_valid));
        b = _mm512_mask_broadcast_f32x4(b, lanes, tail_group4<kBlocksPerGroup>(q.biases[i], num_whole, num_valid));
      }
      chunk_avx512<kRows, true, kBits>(q, num_whole, num_valid, s, b, y);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(q.lanes + r * 16, y[r]);
}

// One chunk of the quad layout with VNNI for a call's rows x: a whole chunk, or a half one (blocks
// 0-1, its blocks 2-3 zero weights, scales and biases, as on AVX2). Per lane the float
// operations of quad_avx512 over the plain rows, so the same bits; a chunk's 16 scales and 16
// biases are one float16 load each (lane 4i + k is their order in the layout).
template <int kBits, int kRows, bool kHalf>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void quad_chunk_avx512(const uint8_t* chunk, int64_t c,
                                                                            const RowsOf<kRows>& x, __m512* y) {
  constexpr int64_t kWeightBytes = kChunkWeightBytes<kBits> / (kHalf ? 2 : 1);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const auto* halves = reinterpret_cast<const __m256i*>(chunk + kQuadOutputs * kWeightBytes);
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
  const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1));
  // 4 bits: low and high nibbles, 128-bit lane k = block k. 8 bits: blocks 0-1, then 2-3.
  __m512i lo[kQuadOutputs], hi[kQuadOutputs];
  for (int i = 0; i < kQuadOutputs; ++i) {
    const uint8_t* w = chunk + i * kWeightBytes;
    if constexpr (kBits == 4) {
      const __m512i v = kHalf ? _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)))
                              : _mm512_loadu_si512(w);
      lo[i] = _mm512_and_si512(v, nibble);
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    } else {
      lo[i] = _mm512_loadu_si512(w);
      hi[i] = kHalf ? _mm512_setzero_si512() : _mm512_loadu_si512(w + 64);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    y[r] = lanes_plus_avx512<kBits, kBits == 8 && kHalf>(lo, hi, x.q[r] + c * kInt8ChunkInputs,
                                                         x.d[r] + c * kBlocksPerChunk,
                                                         x.xsd[r] + c * kBlocksPerChunk, s, b, y[r]);
  }
}

// The quad layout with VNNI: every quad of [begin, end) for rows [r0, r0 + kRows), outputs
// written; one pointer walks the stream, as quads_avx2 does.
template <int kBits, int kRows>
GMLX_AVX512_VNNI void quads_avx512(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
  const QuadLayout layout = quad_layout(a.num_inputs, kBits);
  constexpr int64_t kChunkBytes = kQuadOutputs * kChunkWeightBytes<kBits> + 2 * kQuadHalves * 2;
  assert(layout.chunk_bytes == kChunkBytes);
  const int64_t prefetch_bytes = quad_prefetch_chunks() * kChunkBytes;
  const RowsOf<kRows> rows(x, r0);
  const uint8_t* chunk = a.quads + begin / kQuadOutputs * layout.quad_bytes;
  for (int64_t n0 = begin; n0 < end; n0 += kQuadOutputs) {
    __m512 y[kRows];
    for (int r = 0; r < kRows; ++r) y[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < layout.num_whole_chunks; ++c, chunk += kChunkBytes) {
      prefetch_ahead(chunk, kChunkBytes, prefetch_bytes);
      quad_chunk_avx512<kBits, kRows, false>(chunk, c, rows, y);
    }
    if (layout.has_half_chunk) {
      quad_chunk_avx512<kBits, kRows, true>(chunk, layout.num_whole_chunks, rows, y);
      chunk += layout.half_chunk_bytes;
    }
    // Output i = (lane 4i + lane 4i+1) + (lane 4i+2 + lane 4i+3), as the scalar sum does.
    const int num_valid = static_cast<int>(std::min<int64_t>(kQuadOutputs, end - n0));
    for (int r = 0; r < kRows; ++r) {
      alignas(64) float l[16];
      _mm512_store_ps(l, y[r]);
      float* yr = a.y + (r0 + r) * a.num_outputs + n0;
      for (int i = 0; i < num_valid; ++i) yr[i] = (l[4 * i] + l[4 * i + 1]) + (l[4 * i + 2] + l[4 * i + 3]);
    }
  }
}

template <int kBits, int kRows>
struct Avx512QuadWalk {
  static void run(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
    quads_avx512<kBits, kRows>(a, x, begin, end, r0);
  }
};

#endif  // GMLX_X86

// Kernel<kRows, kBlocksPerGroup, kBits>::run for a row count of 1-4 and a group size.
template <template <int, int, int> class Kernel, int kBits, int kRows>
void run_group(const QuadArgs& q) {
  switch (q.blocks_per_group) {
    case 1: return Kernel<kRows, 1, kBits>::run(q);
    case 2: return Kernel<kRows, 2, kBits>::run(q);
    default: return Kernel<kRows, 4, kBits>::run(q);
  }
}

template <template <int, int, int> class Kernel, int kBits>
void run_rows(const QuadArgs& q, int num_rows) {
  switch (num_rows) {
    case 1: return run_group<Kernel, kBits, 1>(q);
    case 2: return run_group<Kernel, kBits, 2>(q);
    case 3: return run_group<Kernel, kBits, 3>(q);
    default: return run_group<Kernel, kBits, 4>(q);
  }
}

#if GMLX_X86
template <int kRows, int kBlocksPerGroup, int kBits>
struct Avx2Quad {
  static void run(const QuadArgs& q) { quad_avx2<kRows, kBlocksPerGroup, kBits>(q); }
};
template <int kRows, int kBlocksPerGroup, int kBits>
struct Avx512Quad {
  static void run(const QuadArgs& q) { quad_avx512<kRows, kBlocksPerGroup, kBits>(q); }
};
#endif

// One quad's rows [q.r0, q.r0 + num_rows) on an ISA, at kBits.
template <int kBits>
void run_quad(const QuadArgs& q, int num_rows, Isa isa) {
#if GMLX_X86
  if (isa == Isa::kAvx512 && has_avx512_vnni()) return run_rows<Avx512Quad, kBits>(q, num_rows);
  // AVX-512 without VNNI too: the same integers.
  if (isa != Isa::kPortable && has_f16c()) return run_rows<Avx2Quad, kBits>(q, num_rows);
#endif
  (void)isa;
  quad_portable<kBits>(q, num_rows);
}

}  // namespace

bool has_f16c() {
#if GMLX_X86
  static const bool is_supported = __builtin_cpu_supports("f16c");
  return is_supported;
#else
  return false;
#endif
}

bool has_avx512_vnni() {
#if GMLX_X86
  static const bool is_supported = is_isa_supported(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni");
  return is_supported;
#else
  return false;
#endif
}

bool has_gfni() {
#if GMLX_X86
  static const bool is_supported = has_avx512_vnni() && __builtin_cpu_supports("gfni");
  return is_supported;
#else
  return false;
#endif
}

namespace {
std::atomic<int> g_gfni{-1};  // set_gfni's setting; -1: on where has_gfni()
}  // namespace

void set_gfni(int setting) { g_gfni.store(setting < 0 ? -1 : setting > 0 ? 1 : 0); }
int gfni_setting() { return g_gfni.load(); }
bool is_gfni_enabled() { return g_gfni.load() != 0 && has_gfni(); }

void resize_quantized_rows(QuantizedRows& rows, int64_t num_rows, int64_t num_inputs) {
  rows.num_rows = num_rows;
  rows.padded_inputs = (num_inputs + kInt8ChunkInputs - 1) / kInt8ChunkInputs * kInt8ChunkInputs;
  rows.q.resize(num_rows * rows.padded_inputs);
  rows.d.resize(num_rows * rows.padded_inputs / kInt8BlockInputs);
  rows.xsd.resize(num_rows * rows.padded_inputs / kInt8BlockInputs);
  rows.half_sums.resize(num_rows * 2 * rows.padded_inputs / kInt8BlockInputs);
  rows.half_xsd.resize(num_rows * 2 * rows.padded_inputs / kInt8BlockInputs);
}

namespace {

#if GMLX_X86
GMLX_AVX2 inline int32_t sum_of_eight(__m256i eight) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

// One block of 32 inputs, quantize_rows's integers and floats with AVX2 (the same operations
// lane by lane: max ignores a NaN as std::max does when the running maximum is its second
// operand, the rounding is the same magic-number add). Returns sum(q); *amax_out = amax, *first_sum
// = sum(q) of the first 16 inputs.
GMLX_AVX2 int32_t quantize_block_avx2(const float* xb, int bits, int8_t* even, int8_t* block, float* amax_out,
                                      int32_t* first_sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), amax);  // a NaN lane keeps amax
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax_value = _mm_cvtss_f32(m4);
  *amax_out = amax_value;
  const __m256 inverse = _mm256_set1_ps(amax_value > 0.0f ? 127.0f / amax_value : 0.0f);
  const __m256 low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f), magic = _mm256_set1_ps(kRoundingMagic);
  __m256i q[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    __m256 t = _mm256_mul_ps(v[i], inverse);
    t = _mm256_and_ps(t, _mm256_cmp_ps(t, t, _CMP_ORD_Q));  // NaN becomes 0
    t = _mm256_min_ps(_mm256_max_ps(t, low), high);
    q[i] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(t, magic), magic));  // integral already
    sum = _mm256_add_epi32(sum, q[i]);
  }
  // int32 -> int8 in input order: the packs interleave 128-bit lanes, the permute undoes it.
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (bits == 4) {  // even inputs to even[0..15], odd ones to even[64..79]
    const __m256i split = _mm256_shuffle_epi8(
        packed, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
                                 5, 7, 9, 11, 13, 15));
    const __m256i halves = _mm256_permute4x64_epi64(split, 0xD8);  // evens 0-15, 16-31, odds 0-15, 16-31
    _mm_storeu_si128(reinterpret_cast<__m128i*>(even), _mm256_castsi256_si128(halves));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(even + 64), _mm256_extracti128_si256(halves, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(block), packed);
  }
  *first_sum = sum_of_eight(_mm256_add_epi32(q[0], q[1]));
  return sum_of_eight(sum);
}
#endif

// The same block, one input at a time.
int32_t quantize_block_scalar(const float* xb, int bits, int8_t* even, int8_t* block, float* amax_out,
                              int32_t* first_sum) {
  float amax = 0.0f;
  for (int t = 0; t < kInt8BlockInputs; ++t) amax = std::max(amax, std::fabs(xb[t]));
  *amax_out = amax;
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int t = 0; t < kInt8BlockInputs; ++t) {
    // Round half to even without a libm call: adding and removing 1.5 * 2^23 leaves the
    // nearest integer of any |v| <= 127 (v clamped first; NaN becomes 0).
    float v = xb[t] * inverse;
    v = v == v ? std::min(std::max(v, -127.0f), 127.0f) : 0.0f;
    const int32_t rounded = static_cast<int32_t>((v + kRoundingMagic) - kRoundingMagic);
    (bits == 4 ? even[t % 2 * 64 + t / 2] : block[t]) = static_cast<int8_t>(rounded);
    sum += rounded;
    if (t == kInt8BlockInputs / 2 - 1) *first_sum = sum;
  }
  return sum;
}

}  // namespace

void quantize_rows(const float* x, int64_t num_inputs, int64_t begin, int64_t end, int bits, QuantizedRows& rows) {
  // Scalar on the portable ISA, so the kernel tests compare the two quantizers bit for bit.
  int32_t (*quantize_block)(const float*, int, int8_t*, int8_t*, float*, int32_t*) = quantize_block_scalar;
#if GMLX_X86
  if (kernels_isa() != Isa::kPortable && is_isa_supported(Isa::kAvx2)) quantize_block = quantize_block_avx2;
#endif
  const int64_t num_blocks = num_inputs / kInt8BlockInputs;
  const int64_t padded_blocks = rows.padded_inputs / kInt8BlockInputs;
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = x + r * num_inputs;
    int8_t* q = rows.q.data() + r * rows.padded_inputs;
    float* d = rows.d.data() + r * padded_blocks;
    float* xsd = rows.xsd.data() + r * padded_blocks;
    int32_t* half_sums = rows.half_sums.data() + r * 2 * padded_blocks;
    float* half_xsd = rows.half_xsd.data() + r * 2 * padded_blocks;
    std::memset(q, 0, rows.padded_inputs);
    std::fill(d, d + padded_blocks, 0.0f);
    std::fill(xsd, xsd + padded_blocks, 0.0f);
    std::fill(half_sums, half_sums + 2 * padded_blocks, 0);
    std::fill(half_xsd, half_xsd + 2 * padded_blocks, 0.0f);
    for (int64_t j = 0; j < num_blocks; ++j) {
      const float* xb = xr + j * kInt8BlockInputs;
      int8_t* even = q + j / kBlocksPerChunk * kInt8ChunkInputs + j % kBlocksPerChunk * 16;  // 4 bits
      int8_t* block = q + j * kInt8BlockInputs;  // 8 bits
      float amax;
      int32_t first_sum;
      const int32_t sum = quantize_block(xb, bits, even, block, &amax, &first_sum);
      d[j] = amax / 127.0f;
      xsd[j] = d[j] * static_cast<float>(sum);
      half_sums[2 * j] = first_sum, half_sums[2 * j + 1] = sum - first_sum;
      half_xsd[2 * j] = d[j] * static_cast<float>(first_sum);
      half_xsd[2 * j + 1] = d[j] * static_cast<float>(sum - first_sum);
    }
  }
}

void set_prefetch_chunks(int64_t num_chunks) { g_prefetch_chunks.store(num_chunks < 0 ? -1 : num_chunks); }
int64_t prefetch_chunks() { return g_prefetch_chunks.load(); }

int64_t quad_chunk_bytes(int bits) { return kQuadOutputs * kInt8ChunkInputs * bits / 8 + 2 * kQuadHalves * 2; }

namespace {
std::atomic<bool> g_half_tails{true};
}  // namespace

void set_half_tails(bool is_enabled) { g_half_tails.store(is_enabled); }
bool half_tails() { return g_half_tails.load(); }

QuadLayout quad_layout(int64_t num_inputs, int bits) {
  QuadLayout layout;
  const int64_t rest = num_inputs % kInt8ChunkInputs;
  layout.has_half_chunk = half_tails() && rest != 0 && rest <= kInt8ChunkInputs / 2;
  layout.num_whole_chunks = num_inputs / kInt8ChunkInputs + (rest != 0 && !layout.has_half_chunk ? 1 : 0);
  layout.chunk_bytes = quad_chunk_bytes(bits);
  layout.half_chunk_bytes = kQuadOutputs * kInt8ChunkInputs / 2 * bits / 8 + 2 * kQuadHalves * 2;
  layout.quad_bytes =
      layout.num_whole_chunks * layout.chunk_bytes + (layout.has_half_chunk ? layout.half_chunk_bytes : 0);
  return layout;
}

bool is_layout_bits(int bits) {
  return bits == 4 || bits == 8 || ((bits == kFiveBits || bits == kIq4Bits || is_k_layout(bits)) && tile_layout());
}

void check_layout_bits(int bits) {
  if (!is_layout_bits(bits)) {
    throw std::invalid_argument("bits " + std::to_string(bits) + ": expected 4, 8 or (under the tile layout) 5, " +
                                std::to_string(kK2Bits) + ", " + std::to_string(kK3Bits) + ", " +
                                std::to_string(kK4Bits) + ", " + std::to_string(kK5Bits) + ", " +
                                std::to_string(kK6Bits) + " or " + std::to_string(kIq4Bits));
  }
}

int64_t quad_layout_bytes(int64_t num_outputs, int64_t num_inputs, int bits) {
  assert(is_layout_bits(bits));
  if (tile_layout()) {
    const int64_t num_tiles = (num_outputs + kTileOutputs - 1) / kTileOutputs;
    if (is_k_layout(bits)) return num_tiles * (num_inputs / kSuperBlockInputs) * k_super_bytes(bits);
    return num_tiles * (num_inputs / kInt8BlockInputs) * tile_block_bytes(bits);
  }
  const int64_t num_quads = (num_outputs + kQuadOutputs - 1) / kQuadOutputs;
  return num_quads * quad_layout(num_inputs, bits).quad_bytes;
}

namespace {

// Points q at the four outputs from n0 on, in their own rows.
void point_quad(const QmmArgs& a, int64_t n0, int num_valid, QuadArgs& q) {
  const int64_t num_groups = a.num_inputs / a.group_size;
  const int64_t row_bytes = a.num_inputs * a.bits / 8;
  const int64_t group_stride = kBlocksPerChunk / q.blocks_per_group;
  q.w_chunk_stride = kInt8ChunkInputs * a.bits / 8;
  for (int i = 0; i < kQuadOutputs; ++i) {
    const int64_t n = n0 + std::min(i, num_valid - 1);  // past the end: the last output again, dropped
    q.w[i] = reinterpret_cast<const uint8_t*>(a.w) + n * row_bytes;
    if (a.scales_f16 != nullptr) {
      q.scales[i] = GroupRow{nullptr, a.scales_f16 + n * num_groups, group_stride};
      q.biases[i] = GroupRow{nullptr, a.biases_f16 + n * num_groups, group_stride};
    } else {
      q.scales[i] = GroupRow{a.scales + n * num_groups, nullptr, group_stride};
      q.biases[i] = GroupRow{a.biases + n * num_groups, nullptr, group_stride};
    }
  }
}

}  // namespace

void int8_dot_outputs(const QmmArgs& a, const QuantizedRows& rows, int64_t begin, int64_t end, Isa isa) {
  if (a.quads != nullptr && tile_layout()) return tile_outputs(a, rows, begin, end, isa);
  assert(a.quads == nullptr || begin % kQuadOutputs == 0);
  if (a.quads != nullptr) {
    // VNNI where the CPU has it, AVX2 on every other x86 ISA (the same integers).
#if GMLX_X86
    if (isa == Isa::kAvx512 && has_avx512_vnni()) {
      return a.bits == 4 ? walk_by_rows<Avx512QuadWalk, 4>(a, rows, begin, end)
                          : walk_by_rows<Avx512QuadWalk, 8>(a, rows, begin, end);
    }
    if (isa != Isa::kPortable && has_f16c()) {
      if (a.bits == 4 && a.num_rows >= many_rows_min()) return quads4_many_rows_avx2(a, rows, begin, end);
      return a.bits == 4 ? walk_by_rows<Avx2QuadWalk, 4>(a, rows, begin, end)
                          : walk_by_rows<Avx2QuadWalk, 8>(a, rows, begin, end);
    }
#endif
    return a.bits == 4 ? quads_portable<4>(a, rows, begin, end) : quads_portable<8>(a, rows, begin, end);
  }
  float lanes[kMaxRows * 16];
  QuadArgs q{};
  q.num_chunks = rows.padded_inputs / kInt8ChunkInputs;
  q.num_blocks = a.num_inputs / kInt8BlockInputs;
  q.blocks_per_group = a.group_size / static_cast<int>(kInt8BlockInputs);
  q.x = &rows;
  q.lanes = lanes;
  for (int64_t n0 = begin; n0 < end; n0 += kQuadOutputs) {
    const int num_valid = static_cast<int>(std::min<int64_t>(kQuadOutputs, end - n0));
    point_quad(a, n0, num_valid, q);
    for (q.r0 = 0; q.r0 < a.num_rows; q.r0 += kMaxRows) {
      const int num_rows = static_cast<int>(std::min<int64_t>(kMaxRows, a.num_rows - q.r0));
      if (a.bits == 4) {
        run_quad<4>(q, num_rows, isa);
      } else {
        run_quad<8>(q, num_rows, isa);
      }
      for (int r = 0; r < num_rows; ++r) {
        const float* l = lanes + r * 16;
        for (int i = 0; i < num_valid; ++i) {
          a.y[(q.r0 + r) * a.num_outputs + n0 + i] = (l[4 * i] + l[4 * i + 1]) + (l[4 * i + 2] + l[4 * i + 3]);
        }
      }
    }
  }
}

}  // namespace gmlx_kernels
