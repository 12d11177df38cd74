// 4-bit products over the quad layout for many rows on AVX2 (prefill chunks, wide batches).
//
// The quad kernels walk a product's weights once per four rows and unpack every nibble again
// on each walk. Here each eight outputs (two quads) are unpacked once per call into a panel:
// per 32-input block, eight vectors whose dword o holds output o's four weights paired with
// four of x's bytes, so a row's block is eight maddubs against x's bytes broadcast, summed as
// int16 and widened once, with no sums across lanes. Rows then pass over the panels in groups
// of 16, so their x stays in L1 (1.10-1.23x the walks at 256 rows on Zen 3). The float steps are
// the quad kernels' (per output and block: fma(s, d * isum, lane), then fma(b, xsd, lane), on
// lane j % 4; output (l0 + l1) + (l2 + l3)), so a row's bits are its one-row call's. 8-bit quads
// (the tied head) stay on the walks: as two nibbles a weight the panels ran them 0.88-1.15x at
// the head's 32-64 rows.
#pragma once

#include <cstdint>

#include "int8_dot_kernels.h"
#include "qmm_kernels.h"

namespace gmlx_kernels {

// Rows from which a 4-bit product over the quad layout takes this path on a CPU without VNNI
// (tiles and VNNI have their own); a setting under 1 restores the default. A knob for tests and
// benchmarks: the bits are the same either way.
int64_t many_rows_min();
void set_many_rows_min(int64_t num_rows);

// Outputs [begin, end) (begin a multiple of 4) of every row of x (quantized for 4-bit weights)
// over the 4-bit quad layout at a.quads, on AVX2 with F16C; built on x86 only.
void quads4_many_rows_avx2(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end);

}  // namespace gmlx_kernels
