// What attention.cpp hands its kernels: one call's arrays and shape, shared with the
// key-blocked tiles (attention_tiles.cpp and each ISA's pieces).
#pragma once

#include <cstdint>

#include "mlx/types/half_types.h"
#include "qmm_kernels.h"

namespace gmlx_kernels {

struct Strided4 {  // a (B, H, S, D) array with unit stride along D
  const float* data;
  int64_t b, h, s;
  const float* at(int64_t i, int64_t j, int64_t k) const { return data + i * b + j * h + k * s; }
};

// A KV cache's float16 entries: mlx's own half type, so a writer rounds as mlx's astype does
// (to nearest even), and every reader widens the same halves to the same floats.
using Half = mlx::core::float16_t;

// A (B, H, S, D) key or value buffer with unit stride along D, of float (float32 KV) or Half.
struct StridedKV {
  const void* data;
  int64_t b, h, s;
  template <typename T>
  const T* at(int64_t i, int64_t j, int64_t k) const {
    return static_cast<const T*>(data) + i * b + j * h + k * s;
  }
};

struct AttentionJob {
  Strided4 q;
  StridedKV keys, values;
  bool is_half_kv;  // keys and values are Half (a float16 KV cache), else float
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
// Each query's score room is whole blocks of this many keys (the widest ISA's block).
constexpr int64_t kScoreBlock = 16;

struct TileQuery {
  const float* q;  // (D,)
  float* out;  // (D,)
  int64_t num_seen;  // keys [0, num_seen) are visible; it grows along a tile
  float* score;  // scores, then probabilities, of keys [0, num_seen)
};

// Runs every query of a filled-in job (isa set): on the caller when it is small, else on the pool.
void run_attention_job(AttentionJob& job);

// Does the key-blocked kernel take this job (AVX-512: head dims up to 256; AVX2: 64, 128)?
bool can_attend_blocked(const AttentionJob& job);
// Tiles [begin, end) of the job, numbered (row, kv head, tile); each query's bits equal
// the per-query code's (attention.cpp).
void attend_tiles(const AttentionJob& job, int64_t begin, int64_t end);

// Each ISA's pieces of a tile, for the head dims it takes (attention_avx512.cpp, attention_avx2.cpp):
// the scores (scaled) of every query's visible keys, the running max of a query's
// scores, and the value sums (with the probabilities' sum) divided, into out.
void score_tile_avx512(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries, int num_queries);
float max_score_avx512(const float* score, int64_t num_seen);
void sum_values_avx512(const AttentionJob& job, int64_t b, int64_t kv_head, const TileQuery* queries, int num_queries);
void score_tile_avx2(const AttentionJob& job, int64_t b, int64_t kv_head, TileQuery* queries, int num_queries);
float max_score_avx2(const float* score, int64_t num_seen);
void sum_values_avx2(const AttentionJob& job, int64_t b, int64_t kv_head, const TileQuery* queries, int num_queries);

}  // namespace gmlx_kernels
