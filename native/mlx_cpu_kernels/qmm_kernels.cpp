#include "qmm_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "isa_target.h"

namespace gmlx_kernels {

namespace {

constexpr int kLanes = 16;  // the canonical number of lane sums per output
constexpr int64_t kBlockBytes = 16 << 10;  // x bytes of one K block: half of L1

// One kernel call: rows [0, kRows) of x block `x` (row stride x_stride, first element e0)
// against the weights of kCols consecutive outputs over elements [e0, e1); lane sums in
// and out at acc[c * acc_stride + r * 16].
struct Span {
  const uint32_t* w_row;  // the first output's packed row
  int64_t w_stride;  // words per output
  const float* scales;  // the first output's, per group
  const float* biases;
  int64_t group_stride;  // groups per output
  const float* x;
  int64_t x_stride;
  int64_t e0, e1;
  int group_size;
  float* acc;
  int64_t acc_stride;  // floats per output: rows * 16
};

// ---------------------------------------------------------------- portable

template <int kBits>
inline float unpack_portable(const uint32_t* w_row, int64_t e) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  return static_cast<float>((w_row[e / kPerWord] >> (kBits * (e % kPerWord))) & kMask);
}

// The canonical lane tree: 16 -> 8 (l + l+8) -> 4 -> 2 -> 1; the SIMD paths store their
// lanes and end here too.
inline float reduce_lanes(const float* lanes) {
  float t[kLanes];
  std::memcpy(t, lanes, sizeof(t));
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) t[i] = t[i] + t[i + width];
  }
  return t[0];
}

// Where element e's x sits in a block and which lane sums it (see qmm_kernels.h).
template <int kBits>
inline int64_t x_position(int64_t e) {
  if constexpr (kBits == 4) return e / 32 * 32 + e % 2 * 16 + e % 32 / 2;
  return e;
}
template <int kBits>
inline int lane_of(int64_t e) {
  if constexpr (kBits == 4) return static_cast<int>(e % 32 / 2);
  return static_cast<int>(e % kLanes);
}

template <int kBits>
void span_portable(const Span& s, int64_t num_rows) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* lanes = s.acc + r * kLanes;
    const float* x = s.x + r * s.x_stride;
    for (int64_t e = s.e0; e < s.e1; ++e) {
      const int64_t g = e / s.group_size;
      const float weight = std::fma(unpack_portable<kBits>(s.w_row, e), s.scales[g], s.biases[g]);
      const int lane = lane_of<kBits>(e);
      lanes[lane] = std::fma(x[x_position<kBits>(e - s.e0)], weight, lanes[lane]);
    }
  }
}

#if GMLX_X86

// ---------------------------------------------------------------- AVX2

// Eight 8-bit weights starting at element e (a multiple of 8) as floats, dequantized.
GMLX_AVX2 inline __m256 weights8_avx2(const uint32_t* w_row, int64_t e, __m256 scale, __m256 bias) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w_row) + e;
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, bias);
}

// Two registers hold a row's sixteen lanes: lo = lanes 0-7, hi = lanes 8-15. Several
// outputs at once give the fma chains (one per lane) independent neighbours.
template <int kBits, int kRows, int kCols>
GMLX_AVX2 void span_avx2(const Span& s) {
  __m256 lo[kCols][kRows], hi[kCols][kRows];
  for (int c = 0; c < kCols; ++c) {
    for (int r = 0; r < kRows; ++r) {
      lo[c][r] = _mm256_loadu_ps(s.acc + c * s.acc_stride + r * kLanes);
      hi[c][r] = _mm256_loadu_ps(s.acc + c * s.acc_stride + r * kLanes + 8);
    }
  }
  for (int64_t g = s.e0 / s.group_size; g < s.e1 / s.group_size; ++g) {
    __m256 scale[kCols], bias[kCols];
    for (int c = 0; c < kCols; ++c) {
      scale[c] = _mm256_set1_ps(s.scales[c * s.group_stride + g]);
      bias[c] = _mm256_set1_ps(s.biases[c * s.group_stride + g]);
    }
    if constexpr (kBits == 4) {
      // 32 weights from 16 bytes: low nibbles are the even elements, high the odd ones;
      // x comes even-then-odd per 32 (block_rows), lanes 0-7 from bytes 0-7.
      for (int64_t e = g * s.group_size; e < (g + 1) * s.group_size; e += 32) {
        const float* x = s.x + (e - s.e0);
        for (int c = 0; c < kCols; ++c) {
          const uint8_t* bytes = reinterpret_cast<const uint8_t*>(s.w_row + c * s.w_stride) + e / 2;
          const __m256i v_lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
          const __m256i v_hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)));
          const __m256i mask = _mm256_set1_epi32(0xF);
          const __m256 even_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v_lo, mask)), scale[c], bias[c]);
          const __m256 odd_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v_lo, 4)), scale[c], bias[c]);
          const __m256 even_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v_hi, mask)), scale[c], bias[c]);
          const __m256 odd_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v_hi, 4)), scale[c], bias[c]);
          for (int r = 0; r < kRows; ++r) {
            const float* xr = x + r * s.x_stride;
            lo[c][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), even_lo, lo[c][r]);
            lo[c][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), odd_lo, lo[c][r]);
            hi[c][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), even_hi, hi[c][r]);
            hi[c][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), odd_hi, hi[c][r]);
          }
        }
      }
    } else {
      for (int64_t e = g * s.group_size; e < (g + 1) * s.group_size; e += kLanes) {
        const float* x = s.x + (e - s.e0);
        for (int c = 0; c < kCols; ++c) {
          const __m256 w_lo = weights8_avx2(s.w_row + c * s.w_stride, e, scale[c], bias[c]);
          const __m256 w_hi = weights8_avx2(s.w_row + c * s.w_stride, e + 8, scale[c], bias[c]);
          for (int r = 0; r < kRows; ++r) {
            lo[c][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * s.x_stride), w_lo, lo[c][r]);
            hi[c][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * s.x_stride + 8), w_hi, hi[c][r]);
          }
        }
      }
    }
  }
  for (int c = 0; c < kCols; ++c) {
    for (int r = 0; r < kRows; ++r) {
      _mm256_storeu_ps(s.acc + c * s.acc_stride + r * kLanes, lo[c][r]);
      _mm256_storeu_ps(s.acc + c * s.acc_stride + r * kLanes + 8, hi[c][r]);
    }
  }
}

// ---------------------------------------------------------------- AVX-512

// Sixteen 8-bit weights starting at element e (a multiple of 16) as floats, dequantized.
GMLX_AVX512 inline __m512 weights16_avx512(const uint32_t* w_row, int64_t e, __m512 scale, __m512 bias) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w_row) + e;
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, bias);
}

template <int kBits, int kRows, int kCols>
GMLX_AVX512 void span_avx512(const Span& s) {
  __m512 acc[kCols][kRows];
  for (int c = 0; c < kCols; ++c) {
    for (int r = 0; r < kRows; ++r) acc[c][r] = _mm512_loadu_ps(s.acc + c * s.acc_stride + r * kLanes);
  }
  for (int64_t g = s.e0 / s.group_size; g < s.e1 / s.group_size; ++g) {
    __m512 scale[kCols], bias[kCols];
    for (int c = 0; c < kCols; ++c) {
      scale[c] = _mm512_set1_ps(s.scales[c * s.group_stride + g]);
      bias[c] = _mm512_set1_ps(s.biases[c * s.group_stride + g]);
    }
    if constexpr (kBits == 4) {
      // 32 weights from 16 bytes: low nibbles the even elements, high the odd ones.
      for (int64_t e = g * s.group_size; e < (g + 1) * s.group_size; e += 32) {
        const float* x = s.x + (e - s.e0);
        __m512 even[kCols], odd[kCols];
        for (int c = 0; c < kCols; ++c) {
          const uint8_t* bytes = reinterpret_cast<const uint8_t*>(s.w_row + c * s.w_stride) + e / 2;
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
          even[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))), scale[c], bias[c]);
          odd[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), scale[c], bias[c]);
        }
        for (int r = 0; r < kRows; ++r) {
          const __m512 x_even = _mm512_loadu_ps(x + r * s.x_stride);
          const __m512 x_odd = _mm512_loadu_ps(x + r * s.x_stride + 16);
          for (int c = 0; c < kCols; ++c) {
            acc[c][r] = _mm512_fmadd_ps(x_even, even[c], acc[c][r]);
            acc[c][r] = _mm512_fmadd_ps(x_odd, odd[c], acc[c][r]);
          }
        }
      }
    } else {
      for (int64_t e = g * s.group_size; e < (g + 1) * s.group_size; e += kLanes) {
        const float* x = s.x + (e - s.e0);
        __m512 weights[kCols];
        for (int c = 0; c < kCols; ++c) weights[c] = weights16_avx512(s.w_row + c * s.w_stride, e, scale[c], bias[c]);
        for (int r = 0; r < kRows; ++r) {
          const __m512 xr = _mm512_loadu_ps(x + r * s.x_stride);  // one load for every output
          for (int c = 0; c < kCols; ++c) acc[c][r] = _mm512_fmadd_ps(xr, weights[c], acc[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < kCols; ++c) {
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(s.acc + c * s.acc_stride + r * kLanes, acc[c][r]);
  }
}

// ---------------------------------------------------------------- many rows: panels

// One tile call: kRows rows of x_lanes against a panel of kCols outputs over vectors
// [v0, v1) of K (16 inputs each). Lane sums start at zero when v0 is 0, else come from
// sums[(r * kCols + c) * 16]; when v1 ends K they are reduced into y (rows < num_rows,
// outputs < num_cols), else stored back to sums.
struct TileArgs {
  const float* x;
  int64_t num_inputs;  // x's row stride
  const float* panel;
  int64_t v0, v1;
  float* sums;
  float* y;
  int64_t y_stride;
  int num_rows, num_cols;
};

// The canonical lane tree (reduce_lanes) on sixteen lanes held as lo = 0-7, hi = 8-15:
// t[i] + t[i+8], then t[i] + t[i+4], t[i] + t[i+2], t[0] + t[1].
GMLX_AVX2 inline float reduce_halves_avx2(__m256 lo, __m256 hi) {
  const __m256 eight = _mm256_add_ps(lo, hi);
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  four = _mm_add_ss(four, _mm_shuffle_ps(four, four, 1));
  return _mm_cvtss_f32(four);
}

// A panel holds kCols outputs over all of K in lane order: panel[(v * kCols + c) * 16 + j]
// is the weight that lane j of output c multiplies with x_lanes[v * 16 + j]. Its values
// are the few-row kernels' own, fma(q, scale, bias); columns past num_cols are zero.
template <int kBits>
GMLX_AVX512 void dequantize_panel_avx512(const QmmArgs& a, int64_t n, int num_cols, int panel_cols, float* panel) {
  const int64_t words_per_row = a.num_inputs * kBits / 32;
  const int64_t num_groups = a.num_inputs / a.group_size;
  const int64_t vector_stride = static_cast<int64_t>(panel_cols) * kLanes;
  for (int c = 0; c < panel_cols; ++c) {
    float* out = panel + c * kLanes;
    if (c >= num_cols) {
      for (int64_t v = 0; v < a.num_inputs / kLanes; ++v) _mm512_storeu_ps(out + v * vector_stride, _mm512_setzero_ps());
      continue;
    }
    const uint32_t* w_row = a.w + (n + c) * words_per_row;
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m512 scale = _mm512_set1_ps(a.scales[(n + c) * num_groups + g]);
      const __m512 bias = _mm512_set1_ps(a.biases[(n + c) * num_groups + g]);
      for (int64_t e = g * a.group_size; e < (g + 1) * a.group_size; e += 32) {
        if constexpr (kBits == 4) {
          const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w_row) + e / 2;
          const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
          const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF))), scale, bias);
          const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), scale, bias);
          _mm512_storeu_ps(out + e / kLanes * vector_stride, even);  // x_lanes: evens, then odds
          _mm512_storeu_ps(out + (e / kLanes + 1) * vector_stride, odd);
        } else {
          _mm512_storeu_ps(out + e / kLanes * vector_stride, weights16_avx512(w_row, e, scale, bias));
          _mm512_storeu_ps(out + (e / kLanes + 1) * vector_stride, weights16_avx512(w_row, e + 16, scale, bias));
        }
      }
    }
  }
}

// Each (row, output)'s sixteen lane sums stay in one register over the block, taking
// their k in order.
template <int kRows, int kCols>
GMLX_AVX512 void tile_avx512(const TileArgs& t) {
  const bool is_first = t.v0 == 0, is_last = t.v1 == t.num_inputs / kLanes;
  __m512 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) acc[r][c] = is_first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.sums + (r * kCols + c) * kLanes);
  }
  for (int64_t v = t.v0; v < t.v1; ++v) {
    const float* w = t.panel + v * kCols * kLanes;
    __m512 weights[kCols];
    for (int c = 0; c < kCols; ++c) weights[c] = _mm512_loadu_ps(w + c * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const __m512 xr = _mm512_loadu_ps(t.x + r * t.num_inputs + v * kLanes);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(xr, weights[c], acc[r][c]);
    }
  }
  if (!is_last) {
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kCols; ++c) _mm512_storeu_ps(t.sums + (r * kCols + c) * kLanes, acc[r][c]);
    }
    return;
  }
  for (int r = 0; r < t.num_rows; ++r) {
    for (int c = 0; c < t.num_cols; ++c) {
      const __m512 lanes = acc[r][c];
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1));
      t.y[r * t.y_stride + c] = reduce_halves_avx2(_mm512_castps512_ps256(lanes), hi);
    }
  }
}

template <int kBits>
GMLX_AVX2 void dequantize_panel_avx2(const QmmArgs& a, int64_t n, int num_cols, int panel_cols, float* panel) {
  const int64_t words_per_row = a.num_inputs * kBits / 32;
  const int64_t num_groups = a.num_inputs / a.group_size;
  const int64_t vector_stride = static_cast<int64_t>(panel_cols) * kLanes;
  for (int c = 0; c < panel_cols; ++c) {
    float* out = panel + c * kLanes;
    if (c >= num_cols) {
      for (int64_t v = 0; v < a.num_inputs / kLanes; ++v) {
        _mm256_storeu_ps(out + v * vector_stride, _mm256_setzero_ps());
        _mm256_storeu_ps(out + v * vector_stride + 8, _mm256_setzero_ps());
      }
      continue;
    }
    const uint32_t* w_row = a.w + (n + c) * words_per_row;
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m256 scale = _mm256_set1_ps(a.scales[(n + c) * num_groups + g]);
      const __m256 bias = _mm256_set1_ps(a.biases[(n + c) * num_groups + g]);
      for (int64_t e = g * a.group_size; e < (g + 1) * a.group_size; e += 32) {
        float* dst = out + e / kLanes * vector_stride;  // two vectors: e..e+15 in lanes, then the next 16
        if constexpr (kBits == 4) {
          // 16 bytes = 32 weights; bytes 0-7 give lanes 0-7 (evens, odds), bytes 8-15 lanes 8-15.
          const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w_row) + e / 2;
          const __m256i mask = _mm256_set1_epi32(0xF);
          for (int half = 0; half < 2; ++half) {
            const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * half)));
            _mm256_storeu_ps(dst + 8 * half, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mask)), scale, bias));
            _mm256_storeu_ps(dst + vector_stride + 8 * half,
                             _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), scale, bias));
          }
        } else {
          for (int half = 0; half < 4; ++half) {
            _mm256_storeu_ps(dst + half / 2 * vector_stride + half % 2 * 8, weights8_avx2(w_row, e + 8 * half, scale, bias));
          }
        }
      }
    }
  }
}

// Keeps v in a register: without it the compiler folds the load into every fma that
// uses it, and the AVX2 tile becomes load-bound.
#define GMLX_IN_REGISTER(v) __asm__("" : "+x"(v))

// The AVX2 tile: a (row, output)'s lanes 0-7 and 8-15 as two sums, as span_avx2. Lanes
// 0-7 run over the block first, then lanes 8-15 (each lane's order is unchanged), so a
// pass holds kRows x kCols sums, the weights and one x vector in 16 registers.
template <int kRows, int kCols>
GMLX_AVX2 void tile_avx2(const TileArgs& t) {
  const bool is_first = t.v0 == 0, is_last = t.v1 == t.num_inputs / kLanes;
  __m256 halves[2][kRows][kCols];
  for (int half = 0; half < 2; ++half) {
    __m256 acc[kRows][kCols];
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kCols; ++c) {
        acc[r][c] = is_first ? _mm256_setzero_ps() : _mm256_loadu_ps(t.sums + (r * kCols + c) * kLanes + 8 * half);
      }
    }
    for (int64_t v = t.v0; v < t.v1; ++v) {
      const float* w = t.panel + v * kCols * kLanes + 8 * half;
      const float* xv = t.x + v * kLanes + 8 * half;
      __m256 weights[kCols];
      for (int c = 0; c < kCols; ++c) weights[c] = _mm256_loadu_ps(w + c * kLanes);
      for (int r = 0; r < kRows; ++r) {
        __m256 xr = _mm256_loadu_ps(xv + r * t.num_inputs);
        GMLX_IN_REGISTER(xr);
        for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_fmadd_ps(xr, weights[c], acc[r][c]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kCols; ++c) {
        if (is_last) {
          halves[half][r][c] = acc[r][c];
        } else {
          _mm256_storeu_ps(t.sums + (r * kCols + c) * kLanes + 8 * half, acc[r][c]);
        }
      }
    }
  }
  if (!is_last) return;
  for (int r = 0; r < t.num_rows; ++r) {
    for (int c = 0; c < t.num_cols; ++c) t.y[r * t.y_stride + c] = reduce_halves_avx2(halves[0][r][c], halves[1][r][c]);
  }
}

GMLX_AVX2 float sum_floats_avx2(const float* data, int64_t num_floats) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < num_floats; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(data + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(data + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(data + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(data + i + 24));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}

GMLX_AVX512 float sum_floats_avx512(const float* data, int64_t num_floats) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < num_floats; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(data + i));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(data + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(data + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(data + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

#endif  // GMLX_X86

// Rows [0, num_rows) of a span of kCols outputs, in blocks of up to kMaxRows rows.
template <int kBits, int kMaxRows, int kCols, template <int, int, int> class Kernel>
void span_rows(Span s, int64_t num_rows) {
  int64_t row = 0;
  for (; row + kMaxRows <= num_rows; row += kMaxRows) {
    Kernel<kBits, kMaxRows, kCols>::run(s);
    s.x += kMaxRows * s.x_stride;
    s.acc += kMaxRows * kLanes;
  }
  switch (num_rows - row) {
    case 0: break;
#define GMLX_CASE(R) case R: if constexpr (R < kMaxRows) Kernel<kBits, R, kCols>::run(s); break;
    GMLX_CASE(1) GMLX_CASE(2) GMLX_CASE(3) GMLX_CASE(4) GMLX_CASE(5) GMLX_CASE(6) GMLX_CASE(7)
#undef GMLX_CASE
  }
}

#if GMLX_X86
template <int kBits, int kRows, int kCols>
struct Avx2Kernel {
  static void run(const Span& s) { span_avx2<kBits, kRows, kCols>(s); }
};
template <int kBits, int kRows, int kCols>
struct Avx512Kernel {
  static void run(const Span& s) { span_avx512<kBits, kRows, kCols>(s); }
};
#endif

// Outputs taken together per kernel call for a row count: enough independent fma chains
// to cover the fma latency, few enough sums to stay in registers.
int columns_per_span(Isa isa, int64_t num_rows) {
  if (isa == Isa::kAvx512) return num_rows <= 2 ? 4 : 2;
  if (isa == Isa::kAvx2) return num_rows == 1 ? 4 : num_rows == 2 ? 2 : 1;
  return 1;
}

// Runs a span of `num_cols` (1, 2 or 4) outputs.
template <int kBits>
void run_span(const Span& s, int64_t num_rows, int num_cols, Isa isa) {
#if GMLX_X86
  // AVX-512 keeps up to 8 rows per pass (16 of 32 registers at 2 outputs), AVX2 4 rows.
  if (isa == Isa::kAvx512) {
    if (num_cols == 4) return span_rows<kBits, 2, 4, Avx512Kernel>(s, num_rows);
    if (num_cols == 2) return span_rows<kBits, 8, 2, Avx512Kernel>(s, num_rows);
    return span_rows<kBits, 8, 1, Avx512Kernel>(s, num_rows);
  }
  if (isa == Isa::kAvx2) {
    if (num_cols == 4) return span_rows<kBits, 1, 4, Avx2Kernel>(s, num_rows);
    if (num_cols == 2) return span_rows<kBits, 2, 2, Avx2Kernel>(s, num_rows);
    return span_rows<kBits, 4, 1, Avx2Kernel>(s, num_rows);
  }
#endif
  for (int c = 0; c < num_cols; ++c) {
    Span one = s;
    one.w_row += c * s.w_stride;
    one.scales += c * s.group_stride;
    one.biases += c * s.group_stride;
    one.acc += c * s.acc_stride;
    span_portable<kBits>(one, num_rows);
  }
}

// Tile shapes: rows x outputs sums held in registers, with room left for the weights
// and one x vector (AVX-512: 24 of 32 registers; AVX2: 12 of 16, a half of the lanes at a time).
constexpr int kAvx512TileRows = 4, kAvx512TileCols = 6;
constexpr int kAvx2TileRows = 4, kAvx2TileCols = 3;
// A chunk's panel (kPanelBytes) and a pass of rows of x (kRowPassBytes) stay in L2. For
// each column block the rows of the pass run K block by K block, so the block's weights
// stay in L1 for all of them; AVX-512's tile reads few enough bytes per fma to take all
// of K at once, AVX2's (half the sums per register file) takes blocks of 768 inputs
// (measured best of 128-1536 on the SmolLM2 shapes).
constexpr int64_t kPanelBytes = 128 << 10;
constexpr int64_t kRowPassBytes = 256 << 10;
constexpr int64_t kAvx512VectorsPerBlock = 1 << 20, kAvx2VectorsPerBlock = 48;

#if GMLX_X86
template <int kRows, int kCols, int64_t kVectorsPerBlock, class Dequantize, class Tile>
void panel_outputs(const QmmArgs& a, const float* x_lanes, int64_t num_padded_rows, int64_t begin, int64_t end,
                   Dequantize dequantize, Tile tile) {
  thread_local std::vector<float> panel;  // the chunk's outputs, kCols at a time
  thread_local std::vector<float> sums;  // (rows of a pass, kCols, 16) lane sums between K blocks
  const int64_t num_blocks = (end - begin + kCols - 1) / kCols;
  const int64_t block_floats = kCols * a.num_inputs;
  panel.resize(num_blocks * block_floats);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = begin + b * kCols;
    dequantize(a, n, static_cast<int>(std::min<int64_t>(kCols, end - n)), kCols, panel.data() + b * block_floats);
  }
  const int64_t num_vectors = a.num_inputs / kLanes;
  const int64_t row_bytes = a.num_inputs * static_cast<int64_t>(sizeof(float));
  const int64_t rows_per_pass = std::max<int64_t>(kRows, kRowPassBytes / row_bytes / kRows * kRows);
  for (int64_t r0 = 0; r0 < num_padded_rows; r0 += rows_per_pass) {
    const int64_t r1 = std::min(r0 + rows_per_pass, num_padded_rows);
    if (num_vectors > kVectorsPerBlock) sums.resize((r1 - r0) * kCols * kLanes);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t n = begin + b * kCols;
      TileArgs t{nullptr, a.num_inputs, panel.data() + b * block_floats, 0, 0, nullptr, nullptr, a.num_outputs, 0,
                 static_cast<int>(std::min<int64_t>(kCols, end - n))};
      for (t.v0 = 0; t.v0 < num_vectors; t.v0 += kVectorsPerBlock) {
        t.v1 = std::min(t.v0 + kVectorsPerBlock, num_vectors);
        for (int64_t r = r0; r < r1; r += kRows) {
          t.x = x_lanes + r * a.num_inputs;
          t.sums = sums.data() + (r - r0) * kCols * kLanes;
          t.y = a.y + r * a.num_outputs + n;
          t.num_rows = static_cast<int>(std::min<int64_t>(kRows, a.num_rows - r));
          tile(t);
        }
      }
    }
  }
}
#endif

}  // namespace

int64_t inputs_per_block(int64_t num_rows, int64_t num_inputs, int group_size) {
  int64_t fit = kBlockBytes / static_cast<int64_t>(sizeof(float)) / std::max<int64_t>(1, num_rows);
  int64_t block = std::max<int64_t>(group_size, fit / group_size * group_size);
  return std::min(block, num_inputs);
}

void block_rows(const QmmArgs& a, int64_t block, float* x_blocked) {
  for (int64_t start = 0; start < a.num_inputs; start += block) {
    const int64_t len = std::min(block, a.num_inputs - start);
    for (int64_t r = 0; r < a.num_rows; ++r) {
      float* dst = x_blocked + start * a.num_rows + r * len;
      const float* src = a.x + r * a.num_inputs + start;
      if (a.bits == 4) {
        // x_position<4> per 32: evens then odds (len is a multiple of 32); written as a
        // fixed deinterleave so the compiler vectorizes it (prefill copies MBs of x).
        for (int64_t i = 0; i < len; i += 32) {
          for (int j = 0; j < 16; ++j) {
            dst[i + j] = src[i + 2 * j];
            dst[i + 16 + j] = src[i + 2 * j + 1];
          }
        }
      } else {
        std::memcpy(dst, src, len * sizeof(float));
      }
    }
  }
}

void qmm_outputs(const QmmArgs& a, const float* x_blocked, int64_t block, int64_t begin, int64_t end, Isa isa) {
  const int64_t num_groups = a.num_inputs / a.group_size;
  const int64_t words_per_row = a.num_inputs * a.bits / 32;
  const int64_t lanes_per_output = a.num_rows * kLanes;
  thread_local std::vector<float> acc;  // (outputs, rows, 16) lane sums across K blocks
  acc.assign((end - begin) * lanes_per_output, 0.0f);
  const int wide = columns_per_span(isa, a.num_rows);
  for (int64_t start = 0; start < a.num_inputs; start += block) {
    const int64_t len = std::min(block, a.num_inputs - start);
    for (int64_t n = begin; n < end;) {
      const int num_cols = n + wide <= end ? wide : 1;
      Span s{a.w + n * words_per_row, words_per_row, a.scales + n * num_groups, a.biases + n * num_groups,
             num_groups, x_blocked + start * a.num_rows, len, start, start + len, a.group_size,
             acc.data() + (n - begin) * lanes_per_output, lanes_per_output};
      if (a.bits == 4) {
        run_span<4>(s, a.num_rows, num_cols, isa);
      } else {
        run_span<8>(s, a.num_rows, num_cols, isa);
      }
      n += num_cols;
    }
  }
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t r = 0; r < a.num_rows; ++r) {
      a.y[r * a.num_outputs + n] = reduce_lanes(acc.data() + (n - begin) * lanes_per_output + r * kLanes);
    }
  }
}

int64_t panel_row_multiple(Isa isa) { return isa == Isa::kAvx512 ? kAvx512TileRows : kAvx2TileRows; }

int64_t panel_outputs_per_chunk(int64_t num_inputs, Isa isa) {
  const int64_t cols = isa == Isa::kAvx512 ? kAvx512TileCols : kAvx2TileCols;
  const int64_t fit = kPanelBytes / (num_inputs * static_cast<int64_t>(sizeof(float)));
  return std::max(cols, fit / cols * cols);
}

void qmm_panel_outputs(const QmmArgs& a, const float* x_lanes, int64_t num_padded_rows, int64_t begin, int64_t end,
                       Isa isa) {
#if GMLX_X86
  if (isa == Isa::kAvx512) {
    auto tile = tile_avx512<kAvx512TileRows, kAvx512TileCols>;
    auto dequantize = a.bits == 4 ? dequantize_panel_avx512<4> : dequantize_panel_avx512<8>;
    return panel_outputs<kAvx512TileRows, kAvx512TileCols, kAvx512VectorsPerBlock>(a, x_lanes, num_padded_rows, begin, end, dequantize, tile);
  }
  if (isa == Isa::kAvx2) {
    auto tile = tile_avx2<kAvx2TileRows, kAvx2TileCols>;
    auto dequantize = a.bits == 4 ? dequantize_panel_avx2<4> : dequantize_panel_avx2<8>;
    return panel_outputs<kAvx2TileRows, kAvx2TileCols, kAvx2VectorsPerBlock>(a, x_lanes, num_padded_rows, begin, end, dequantize, tile);
  }
#endif
  (void)a, (void)x_lanes, (void)num_padded_rows, (void)begin, (void)end, (void)isa;
  throw std::logic_error("qmm_panel_outputs: needs avx2 or avx512");
}

float sum_floats(const float* data, int64_t num_floats, Isa isa) {
#if GMLX_X86
  if (isa == Isa::kAvx512) return sum_floats_avx512(data, num_floats);
  if (isa == Isa::kAvx2) return sum_floats_avx2(data, num_floats);
#endif
  float lanes[kLanes] = {};
  for (int64_t i = 0; i < num_floats; ++i) lanes[i % kLanes] += data[i];
  return reduce_lanes(lanes);
}

bool is_isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kPortable: return true;
#if GMLX_X86
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && is_isa_supported(Isa::kAvx2);
#endif
    default: return false;
  }
}

bool is_intel_cpu() {
#if GMLX_X86
  static const bool is_intel = __builtin_cpu_is("intel");
  return is_intel;
#else
  return false;
#endif
}

Isa best_isa() {
  if (is_isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (is_isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kPortable;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

}  // namespace gmlx_kernels
