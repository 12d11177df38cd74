// The loops over exp_fixed: the portable one, compiled again for AVX-512 (where compilers vectorize
// it with masks), and for AVX2 a loop written eight values at a time, since compilers leave that
// one scalar (vroundss, vdivss). The same operations in the same order everywhere, so the same bits.
#include "exp_fixed.h"

#include "isa_target.h"

namespace gmlx_kernels {

namespace {

inline void exp_shifted_values(float* __restrict score, int64_t n, float max) {
  for (int64_t j = 0; j < n; ++j) score[j] = exp_fixed(score[j] - max);
}

inline void swiglu_values(const float* __restrict gate, const float* __restrict up, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = (g / (1.0f + exp_fixed(-g))) * up[i];
  }
}

#if GMLX_X86
GMLX_AVX512 void exp_shifted_avx512(float* score, int64_t n, float max) { exp_shifted_values(score, n, max); }
GMLX_AVX512 void swiglu_avx512(const float* gate, const float* up, float* y, int64_t n) { swiglu_values(gate, up, y, n); }

// exp_fixed of eight values: its operations one by one in its order (no FMA: the kernels build
// with -ffp-contract=off), so each lane has the scalar's bits.
GMLX_AVX2 inline __m256 exp_fixed8(__m256 x) {
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  // max and min return their second operand where one is NaN: NaN takes -87, as in exp_fixed.
  __m256 c = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  c = _mm256_min_ps(c, _mm256_set1_ps(88.0f));
  const __m256 nf = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i n = _mm256_cvtps_epi32(nf);  // nf is whole: exact
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(c, _mm256_mul_ps(nf, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(nf, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  for (const float term : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) {
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(term));
  }
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  return _mm256_blendv_ps(_mm256_mul_ps(p, scale), x, is_nan);
}

GMLX_AVX2 void exp_shifted_avx2(float* score, int64_t n, float max) {
  const __m256 shift = _mm256_set1_ps(max);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(score + j, exp_fixed8(_mm256_sub_ps(_mm256_loadu_ps(score + j), shift)));
  exp_shifted_values(score + j, n - j, max);
}

GMLX_AVX2 void swiglu_avx2(const float* gate, const float* up, float* y, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_fixed8(_mm256_xor_ps(g, sign));  // -g, exactly
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  swiglu_values(gate + i, up + i, y + i, n - i);
}
#endif

}  // namespace

void exp_shifted(float* score, int64_t n, float max, Isa isa) {
#if GMLX_X86
  if (isa == Isa::kAvx512) return exp_shifted_avx512(score, n, max);
  if (isa == Isa::kAvx2) return exp_shifted_avx2(score, n, max);
#endif
  (void)isa;
  exp_shifted_values(score, n, max);
}

void swiglu_span(const float* gate, const float* up, float* y, int64_t n, Isa isa) {
#if GMLX_X86
  if (isa == Isa::kAvx512) return swiglu_avx512(gate, up, y, n);
  if (isa == Isa::kAvx2) return swiglu_avx2(gate, up, y, n);
#endif
  (void)isa;
  swiglu_values(gate, up, y, n);
}

}  // namespace gmlx_kernels
