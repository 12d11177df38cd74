// Few-row products with MLX's affine-quantized weights: y = x @ dequantize(w).T.
//
// Every output element is summed in one fixed order, whatever the row count, the
// thread count or the instruction set: sixteen lane sums, each taking its k in k order
// (acc = fma(x, fma(q, scale, bias), acc)), then a fixed pairwise tree over the lanes.
// 8 bits: lane l takes the k with k % 16 == l. 4 bits: lane l takes k = 32t + 2l and
// 32t + 2l + 1 (a byte's two nibbles), so x is stored even-then-odd per 32 in a block.
// The AVX-512 path holds the sixteen lanes in one register, the AVX2 path in two, the
// portable path in an array, so all three give the same bits.
#pragma once

#include <cstdint>
#include <string>

namespace gmlx_kernels {

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

struct QmmArgs {
  const float* x;  // (num_rows, num_inputs) row-major
  const uint32_t* w;  // (num_outputs, num_inputs * bits / 32) packed, low bits first
  const float* scales;  // (num_outputs, num_inputs / group_size)
  const float* biases;  // (num_outputs, num_inputs / group_size)
  // Half-precision scales and biases instead (int8-activation path only; null otherwise).
  const uint16_t* scales_f16 = nullptr;
  const uint16_t* biases_f16 = nullptr;
  // The int8 path's quad-interleaved layout instead of w, scales and biases (int8_dot_kernels.h).
  const uint8_t* quads = nullptr;
  float* y;  // (num_rows, num_outputs) row-major
  int64_t num_rows;
  int64_t num_inputs;
  int64_t num_outputs;
  int group_size;
  int bits;
};

// x is read in K blocks that stay in L1 while a chunk of outputs uses them, each block
// stored rows-contiguous (rows at a 4 KiB stride would share cache sets).
int64_t inputs_per_block(int64_t num_rows, int64_t num_inputs, int group_size);
// x_blocked[offset(b) + r * len(b) + p(i)] = x[r, b * block + i], offset(b) = b * block * rows,
// p(i) = i for 8 bits, i's place in its 32 even-then-odd for 4 bits.
void block_rows(const QmmArgs& args, int64_t block, float* x_blocked);

// Computes outputs [begin, end) (at most kMaxOutputsPerCall) of every row.
constexpr int64_t kMaxOutputsPerCall = 16;
void qmm_outputs(const QmmArgs& args, const float* x_blocked, int64_t block, int64_t begin, int64_t end, Isa isa);

// Many rows (prefill chunks, wide batches): the same sums, computed as a blocked product.
// A thread dequantizes a panel of outputs once into float32 (the very values the few-row
// path makes, laid out in its lane order) and every row block reuses it; a register tile
// of rows x outputs then runs each output's sixteen lane sums over K, block after block
// in k order, and reduces them with the canonical tree, so each row gets the bits it
// gets in a 1-row call. The chunking depends on K and the ISA only, never on threads.
// x_lanes: (num_padded_rows, num_inputs), each row in lane order (block_rows with one
// block), rows past num_rows zero; num_padded_rows a multiple of panel_row_multiple().
int64_t panel_row_multiple(Isa isa);
// Outputs a thread takes per chunk: a panel that stays in L2 (a multiple of the tile width).
int64_t panel_outputs_per_chunk(int64_t num_inputs, Isa isa);
// Computes outputs [begin, end) of every row; needs isa avx2 or avx512.
void qmm_panel_outputs(const QmmArgs& args, const float* x_lanes, int64_t num_padded_rows, int64_t begin,
                       int64_t end, Isa isa);

// Sums num_floats floats (a multiple of 64) with wide loads; for the DRAM read rate.
float sum_floats(const float* data, int64_t num_floats, Isa isa);

Isa best_isa();  // what this CPU runs
Isa kernels_isa();  // what the kernels run now (quantized_matmul.cpp's set_isa)
bool is_isa_supported(Isa isa);
// Software prefetch along the one-stream and panel walks paid on Intel cores and cost on Zen 4:
// their defaults follow the vendor.
bool is_intel_cpu();
const char* isa_name(Isa isa);

}  // namespace gmlx_kernels
