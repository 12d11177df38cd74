// What attention.cpp hands its kernels: one call's arrays and shape, shared with the
// key-blocked AVX-512 kernel in attention_avx512.cpp.
#pragma once

#include <cstdint>

#include "qmm_kernels.h"

namespace gmlx_kernels {

struct Strided4 {  // a (B, H, S, D) array with unit stride along D
  const float* data;
  int64_t b, h, s;
  const float* at(int64_t i, int64_t j, int64_t k) const { return data + i * b + j * h + k * s; }
};

struct AttentionJob {
  Strided4 q, keys, values;
  const int32_t* offsets;
  int64_t offset_stride;  // 0: one offset for every row
  float* out;  // (B, T, Hq, D)
  int64_t num_b, num_q_heads, num_t, num_d, num_keys, group;  // group: q heads per kv head
  float scale;
  Isa isa;
  // The blocked kernel's work items: each (row, kv head)'s group * T queries, ordered
  // (t, head in group), cut into tiles of tile_size that share key and value reads.
  int64_t tile_size, num_tiles_per_kv_head;
};

// Queries of one (row, kv head) the blocked kernel takes at once: their scores sit in a
// buffer of tile * S floats, and a key block read once serves all of them.
constexpr int64_t kMaxAttentionTile = 8;

// Does the AVX-512 key-blocked kernel take this job (head dims 64 and 128)?
bool can_attend_blocked(const AttentionJob& job);
// Tiles [begin, end) of the job, numbered (row, kv head, tile); each query's bits equal
// the per-query code's.
void attend_tiles_avx512(const AttentionJob& job, int64_t begin, int64_t end);

}  // namespace gmlx_kernels
