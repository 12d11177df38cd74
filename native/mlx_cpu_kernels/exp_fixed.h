// e^x from float multiplies and adds in one written order. libm's expf is a call per value
// (a decode step's softmaxes and SwiGLU made ~100k of them); this inlines and vectorizes, and
// any vector width gives the same bits, so each ISA's loop below agrees with the portable one.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "qmm_kernels.h"

namespace gmlx_kernels {

// Within a few float ulps of e^x over [-87, 88]; beyond, e^-87 and e^88 (a softmax weight
// or SiLU gate that small or large moves no float32 result here). NaN stays NaN.
inline float exp_fixed(float x) {
  const bool is_nan = x != x;
  float c = x >= -87.0f ? x : -87.0f;  // NaN takes -87 here so the int conversion is defined
  c = c <= 88.0f ? c : 88.0f;
  const float nf = std::rint(c * 1.44269504f);  // nearest integer to x / ln 2, in [-125, 127]
  const int32_t n = static_cast<int32_t>(nf);
  // x - n ln2 in two parts: ln2's high part has few enough bits that n times it is exact.
  const float r = (c - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  // e^r, |r| <= 0.35: Taylor to r^7 (truncation below 3e-9 relative).
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (n + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  return is_nan ? x : y;
}

// score[j] = e^(score[j] - max) for j < n.
void exp_shifted(float* score, int64_t n, float max, Isa isa);

// y = SiLU(gate) * up, value by value.
void swiglu_span(const float* gate, const float* up, float* y, int64_t n, Isa isa);

}  // namespace gmlx_kernels
