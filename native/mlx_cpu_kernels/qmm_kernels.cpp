#include "qmm_kernels.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define GMLX_X86 1
#define GMLX_AVX2 __attribute__((target("avx2,fma")))
#define GMLX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#endif

namespace gmlx_kernels {

namespace {

constexpr int kLanes = 16;  // the canonical number of lane sums per output

// ---------------------------------------------------------------- portable

template <int kBits>
inline float unpack_portable(const uint32_t* w_row, int64_t e) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  return static_cast<float>((w_row[e / kPerWord] >> (kBits * (e % kPerWord))) & kMask);
}

inline float reduce_lanes(float* lanes) {
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] = lanes[i] + lanes[i + width];
  }
  return lanes[0];
}

template <int kBits>
void output_portable(const QmmArgs& a, int64_t n) {
  const int64_t words_per_row = a.num_inputs * kBits / 32;
  const int64_t num_groups = a.num_inputs / a.group_size;
  const uint32_t* w_row = a.w + n * words_per_row;
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const float* x = a.x + r * a.num_inputs;
    float lanes[kLanes] = {};
    for (int64_t g = 0; g < num_groups; ++g) {
      const float scale = a.scales[n * num_groups + g];
      const float bias = a.biases[n * num_groups + g];
      for (int64_t e = g * a.group_size; e < (g + 1) * a.group_size; ++e) {
        const float weight = std::fma(unpack_portable<kBits>(w_row, e), scale, bias);
        lanes[e % kLanes] = std::fma(x[e], weight, lanes[e % kLanes]);
      }
    }
    a.y[r * a.num_outputs + n] = reduce_lanes(lanes);
  }
}

#if GMLX_X86

// ---------------------------------------------------------------- AVX2

GMLX_AVX2 inline float reduce8_avx2(__m256 t8) {
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));  // lanes {0+2, 1+3}
  __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
  return _mm_cvtss_f32(t1);
}

// Eight weights starting at element e (a multiple of 8) as floats, dequantized.
template <int kBits>
GMLX_AVX2 inline __m256 weights8_avx2(const uint32_t* w_row, int64_t e, __m256 scale, __m256 bias) {
  __m256i q;
  if constexpr (kBits == 4) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w_row[e / 8])), shifts),
                         _mm256_set1_epi32(0xF));
  } else {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w_row) + e;
    q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, bias);
}

// kRows rows starting at row0, output n. Two registers hold the sixteen lanes.
template <int kBits, int kRows>
GMLX_AVX2 void block_avx2(const QmmArgs& a, int64_t n, int64_t row0) {
  const int64_t words_per_row = a.num_inputs * kBits / 32;
  const int64_t num_groups = a.num_inputs / a.group_size;
  const uint32_t* w_row = a.w + n * words_per_row;
  const float* x = a.x + row0 * a.num_inputs;
  __m256 lo[kRows], hi[kRows];
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256 scale = _mm256_set1_ps(a.scales[n * num_groups + g]);
    const __m256 bias = _mm256_set1_ps(a.biases[n * num_groups + g]);
    for (int64_t e = g * a.group_size; e < (g + 1) * a.group_size; e += kLanes) {
      const __m256 w_lo = weights8_avx2<kBits>(w_row, e, scale, bias);
      const __m256 w_hi = weights8_avx2<kBits>(w_row, e + 8, scale, bias);
      for (int r = 0; r < kRows; ++r) {
        const float* xr = x + r * a.num_inputs + e;
        lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w_hi, hi[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    a.y[(row0 + r) * a.num_outputs + n] = reduce8_avx2(_mm256_add_ps(lo[r], hi[r]));
  }
}

// ---------------------------------------------------------------- AVX-512

GMLX_AVX512 inline float reduce16_avx512(__m512 acc) {
  const __m256 lo = _mm512_castps512_ps256(acc);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  const __m256 t8 = _mm256_add_ps(lo, hi);
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
  return _mm_cvtss_f32(t1);
}

template <int kBits>
GMLX_AVX512 inline __m512 weights16_avx512(const uint32_t* w_row, int64_t e, __m512 scale, __m512 bias) {
  __m512i q;
  if constexpr (kBits == 4) {
    const __m512i word_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m128i two_words = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w_row + e / 8));
    q = _mm512_permutexvar_epi32(word_of_lane, _mm512_castsi128_si512(two_words));
    q = _mm512_and_si512(_mm512_srlv_epi32(q, shifts), _mm512_set1_epi32(0xF));
  } else {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w_row) + e;
    q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, bias);
}

template <int kBits, int kRows>
GMLX_AVX512 void block_avx512(const QmmArgs& a, int64_t n, int64_t row0) {
  const int64_t words_per_row = a.num_inputs * kBits / 32;
  const int64_t num_groups = a.num_inputs / a.group_size;
  const uint32_t* w_row = a.w + n * words_per_row;
  const float* x = a.x + row0 * a.num_inputs;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m512 scale = _mm512_set1_ps(a.scales[n * num_groups + g]);
    const __m512 bias = _mm512_set1_ps(a.biases[n * num_groups + g]);
    for (int64_t e = g * a.group_size; e < (g + 1) * a.group_size; e += kLanes) {
      const __m512 weights = weights16_avx512<kBits>(w_row, e, scale, bias);
      for (int r = 0; r < kRows; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * a.num_inputs + e), weights, acc[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) a.y[(row0 + r) * a.num_outputs + n] = reduce16_avx512(acc[r]);
}

GMLX_AVX2 float sum_floats_avx2(const float* data, int64_t num_floats) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < num_floats; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(data + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(data + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(data + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(data + i + 24));
  }
  return reduce8_avx2(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

GMLX_AVX512 float sum_floats_avx512(const float* data, int64_t num_floats) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < num_floats; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(data + i));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(data + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(data + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(data + i + 48));
  }
  return reduce16_avx512(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

// Runs rows [0, num_rows) of output n in blocks of up to kMaxRows.
template <int kBits, int kMaxRows, template <int, int> class Block>
void rows_of_output(const QmmArgs& a, int64_t n) {
  int64_t row0 = 0;
  for (; row0 + kMaxRows <= a.num_rows; row0 += kMaxRows) Block<kBits, kMaxRows>::run(a, n, row0);
  switch (a.num_rows - row0) {
    case 0: break;
#define GMLX_CASE(R) case R: if constexpr (R < kMaxRows) Block<kBits, R>::run(a, n, row0); break;
    GMLX_CASE(1) GMLX_CASE(2) GMLX_CASE(3) GMLX_CASE(4) GMLX_CASE(5) GMLX_CASE(6) GMLX_CASE(7)
#undef GMLX_CASE
  }
}

template <int kBits, int kRows>
struct Avx2Block {
  static void run(const QmmArgs& a, int64_t n, int64_t row0) { block_avx2<kBits, kRows>(a, n, row0); }
};
template <int kBits, int kRows>
struct Avx512Block {
  static void run(const QmmArgs& a, int64_t n, int64_t row0) { block_avx512<kBits, kRows>(a, n, row0); }
};

#endif  // GMLX_X86

template <int kBits>
void outputs_with_bits(const QmmArgs& a, int64_t begin, int64_t end, Isa isa) {
  for (int64_t n = begin; n < end; ++n) {
#if GMLX_X86
    // AVX2 keeps 4 rows (8 registers of sums) per pass, AVX-512 8 rows (8 of 32).
    if (isa == Isa::kAvx512) { rows_of_output<kBits, 8, Avx512Block>(a, n); continue; }
    if (isa == Isa::kAvx2) { rows_of_output<kBits, 4, Avx2Block>(a, n); continue; }
#endif
    output_portable<kBits>(a, n);
  }
}

}  // namespace

void qmm_outputs(const QmmArgs& args, int64_t begin, int64_t end, Isa isa) {
  if (args.bits == 4) {
    outputs_with_bits<4>(args, begin, end, isa);
  } else {
    outputs_with_bits<8>(args, begin, end, isa);
  }
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
