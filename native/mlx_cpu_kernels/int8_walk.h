// What the one-stream int8 kernels (the quad layout in int8_dot_kernels.cpp, the tile layout
// in int8_tiles.cpp) share: a call's rows of quantized x, the walk over row groups, and the
// software prefetch along the stream.
#pragma once

#include <algorithm>
#include <cstdint>

#include "int8_dot_kernels.h"
#include "isa_target.h"

namespace gmlx_kernels {

constexpr int kMaxRows = 4;  // rows per kernel call (weights unpacked once for them)

// A call's rows [r0, r0 + kRows) of x: each row's int8 inputs, block scales d and d * sum(q), and
// its blocks' half sums of q, as integers and times d.
template <int kRows>
struct RowsOf {
  const int8_t* q[kRows];
  const float* d[kRows];
  const float* xsd[kRows];
  const int32_t* half_sums[kRows];
  const float* half_xsd[kRows];
  RowsOf(const QuantizedRows& x, int64_t r0) {
    for (int r = 0; r < kRows; ++r) {
      q[r] = x.q_row(r0 + r), d[r] = x.d_row(r0 + r), xsd[r] = x.xsd_row(r0 + r);
      half_sums[r] = x.half_sums_row(r0 + r), half_xsd[r] = x.half_xsd_row(r0 + r);
    }
  }
};

// Rows [first_row, num_rows) of a one-stream product through Walk<kBits, kRows>::run, up to
// kMaxRows a call.
template <template <int, int> class Walk, int kBits>
void walk_by_rows(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t first_row = 0) {
  for (int64_t r0 = first_row; r0 < a.num_rows; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, a.num_rows - r0)) {
      case 1: Walk<kBits, 1>::run(a, x, begin, end, r0); break;
      case 2: Walk<kBits, 2>::run(a, x, begin, end, r0); break;
      case 3: Walk<kBits, 3>::run(a, x, begin, end, r0); break;
      default: Walk<kBits, 4>::run(a, x, begin, end, r0); break;
    }
  }
}

#if GMLX_X86
// The step prefetch_bytes ahead of the one a walk is at (0: none): step_bytes from there on.
inline void prefetch_ahead(const uint8_t* step, int64_t step_bytes, int64_t prefetch_bytes) {
  if (prefetch_bytes == 0) return;
  const char* ahead = reinterpret_cast<const char*>(step) + prefetch_bytes;
  for (int64_t b = 0; b < step_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
}
#endif

}  // namespace gmlx_kernels
