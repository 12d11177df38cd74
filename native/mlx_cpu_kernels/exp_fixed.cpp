// The loops over exp_fixed, compiled once per ISA: the same operations in the same order, so
// the same bits from each; the wider ISAs only run more values at a time.
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
GMLX_AVX2 void exp_shifted_avx2(float* score, int64_t n, float max) { exp_shifted_values(score, n, max); }
GMLX_AVX512 void swiglu_avx512(const float* gate, const float* up, float* y, int64_t n) { swiglu_values(gate, up, y, n); }
GMLX_AVX2 void swiglu_avx2(const float* gate, const float* up, float* y, int64_t n) { swiglu_values(gate, up, y, n); }
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
